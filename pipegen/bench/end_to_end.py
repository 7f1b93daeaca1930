"""Scenario `e2e`: end to end against an instant fake SGLang-protocol server (`--engine fake`, no latency).

- pipegen: the real actor (`pipegen.actor.Actor.main`: verl's single_turn_agent, pipegen's HTTP client,
  per-unit records appended to its shard) in this process, against a reference server with the fake engine
  in a subprocess. Rate = lines appended ÷ time from the first line's arrival to the last's (each append is
  timestamped by a thin ShardAppender subclass swapped in for the run).
- raw: an aiohttp loop in this process sending the very same /generate bodies (built by pipegen's
  `build_request` from the prompt ids and seeds the actor recorded) at the same concurrency, parsing each
  answer with orjson; rate measured the same way, from first to last completion.
- Ray: the same records (parsed from the actor's shard) through a `ray.util.queue.Queue`: one producer task
  puts them, the driver drains with one blocking `get` per record; local Ray with 2 CPUs.
- full mode adds the real launcher (`python -m pipegen.launch ... llm=external`, writer included), with line
  arrival seen by polling the shard files every 20 ms.
pipegen and raw runs alternate (A B B A) so both see the same load.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

from pipegen.bench.common import (
    REPO,
    Row,
    ScenarioResult,
    bench_config,
    check_target,
    fmt_rate,
    median,
    reference_server,
    scratch,
    stop_process,
)

KEY = "e2e"
TITLE = "3. End to end, instant fake server (actor vs raw aiohttp loop vs Ray queue)"
TARGET_RAW = "≥ 0.7"
TARGET_RAY = "≥ 5"


class RunSpec:
    def __init__(self, response_tokens: int, n: int, concurrency: int, scoring: bool = True):
        self.response_tokens = response_tokens
        self.n = n
        self.concurrency = concurrency
        self.scoring = scoring

    def overrides(self) -> list[str]:
        return [f"n={self.n}", "max_samples=-1", "max_prompt_length=256",
                f"max_response_length={self.response_tokens}", "actors.num_actors=1",
                f"actors.concurrency={self.concurrency}", f"actors.scoring={str(self.scoring).lower()}",
                "actors.stats_interval_s=2.0", "generation.show_progress=false"]


def prepare_run(root: Path, url: str, spec: RunSpec):
    """A run folder as the launcher leaves it for its actors (config, unit manifest, launch record)."""
    from pipegen.config import RunDir, save_run_config
    from pipegen.dataset import dataset_indices, load_dataset, load_tokenizer, write_manifest

    cfg = bench_config(root, *spec.overrides())
    run = RunDir(root)
    save_run_config(run, cfg)
    indices = dataset_indices(load_dataset(cfg, load_tokenizer(cfg)))
    write_manifest(run.units_file, indices)
    run.launch_file.write_bytes(orjson.dumps({"launch": "bench", "run_key": "bench", "servers": [url],
                                              "started": time.time(), "node_rank": 0}))
    return cfg, run, len(indices) * spec.n


def run_actor(root: Path, url: str, spec: RunSpec) -> tuple[list[float], object]:
    """The real actor in this process; returns the arrival time of every appended line."""
    import uvloop

    import pipegen.actor as actor_mod
    from pipegen.streams import ShardAppender

    cfg, run, total = prepare_run(root, url, spec)
    arrivals: list[float] = []

    class TimedAppender(ShardAppender):
        def append(self, line: bytes) -> None:
            super().append(line)
            if "rollouts" in self.dir.parts:
                arrivals.append(time.perf_counter())

    actor = actor_mod.Actor(cfg, run, 0, 1)
    original = actor_mod.ShardAppender
    actor_mod.ShardAppender = TimedAppender
    try:
        uvloop.run(actor.main())
    finally:
        actor_mod.ShardAppender = original
    if len(arrivals) != total:
        raise RuntimeError(f"the actor wrote {len(arrivals)} of {total} units; see {run.root}")
    return arrivals, run


def recorded_requests(run) -> list[tuple[list[int], int]]:
    """(prompt ids, seed) of every unit the actor ran, from its shard."""
    out = []
    for path in sorted(run.rollouts.glob("actor_*/*.jsonl")):
        with open(path, "rb") as f:
            for line in f:
                rec = orjson.loads(line)
                out.append((rec["trajectories"][0]["prompt_ids"], rec["seed"]))
    return out


def raw_bodies(cfg, requests: list[tuple[list[int], int]]) -> list[dict]:
    """The /generate bodies the actor sent, built by the same function (a fresh rid each)."""
    from pipegen.client import ClientLimits, build_request

    rollout = cfg.actor_rollout_ref.rollout
    limits = ClientLimits(prompt_length=int(rollout.prompt_length), response_length=int(rollout.response_length),
                          max_model_len=8192)
    params = dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                  repetition_penalty=1.0, logprobs=rollout.calculate_log_probs)
    return [build_request(ids, params, limits, seed) for ids, seed in requests]


def run_raw(url: str, bodies: list[dict], concurrency: int) -> list[float]:
    import aiohttp
    import uvloop

    done: list[float] = []

    async def main() -> None:
        queue = list(reversed(bodies))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def worker() -> None:
                while queue:
                    body = queue.pop()
                    async with session.post(f"{url}/generate", data=orjson.dumps(body),
                                            headers={"Content-Type": "application/json"}) as resp:
                        raw = await resp.read()
                        if resp.status != 200:
                            raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
                    orjson.loads(raw)
                    done.append(time.perf_counter())

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    uvloop.run(main())
    return done


def steady_rate(times: list[float]) -> float:
    """Items per second from the first completion to the last (start-up and ramp excluded)."""
    times = sorted(times)
    return (len(times) - 1) / (times[-1] - times[0])


def run_ray_queue(records: list[dict]) -> float:
    """records/s through ray.util.queue.Queue: one producer task, one blocking get per record."""
    import ray
    from ray.util.queue import Queue

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             configure_logging=False)
    try:
        @ray.remote
        def produce(queue, items) -> int:
            for item in items:
                queue.put(item)
            return len(items)

        queue = Queue()
        ray.get(produce.remote(queue, [{"warm": 1}]))  # start the worker and the queue actor first
        queue.get(block=True)
        ref = ray.put(records)
        times = []
        task = produce.remote(queue, ref)
        for _ in range(len(records)):
            queue.get(block=True)
            times.append(time.perf_counter())
        ray.get(task)
        return steady_rate(times)
    finally:
        ray.shutdown()


def pipegen_transport(folder: Path, records: list[dict]) -> float:
    """records/s through pipegen's own transport: encode_record + ShardAppender, then ShardTailer + orjson.loads
    (written first, then read: no overlap, so a conservative figure)."""
    from pipegen.streams import ShardAppender, ShardTailer, encode_record

    items = [(r["index"], r["sample"], {k: v for k, v in r.items() if k not in ("index", "sample")}) for r in records]
    t0 = time.perf_counter()
    app = ShardAppender(folder, 0, max_bytes=64 << 20, fsync_interval_s=1.0)
    for index, sample, body in items:
        app.append(encode_record(index, sample, body))
    app.close()
    got = 0
    for _, _, line in ShardTailer(folder).lines():
        orjson.loads(line)
        got += 1
    dt = time.perf_counter() - t0
    assert got == len(records)
    return len(records) / dt


def run_launcher(root: Path, url: str, spec: RunSpec, total: int, timeout_s: float = 600) -> tuple[float, float]:
    """The real launcher attached to the server (writer and all); (steady line rate, wall seconds)."""
    argv = [sys.executable, "-m", "pipegen.launch", f"output_dir={root}", "llm=external", f"llm.urls=[{url}]",
            "model_path=" + bench_config_model(), *spec.overrides()]
    log = open(root.parent / f"{root.name}.launch.log", "wb")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    arrivals: list[float] = []
    sizes: dict[Path, int] = {}
    rollouts = root / "streams" / "rollouts"
    try:
        while proc.poll() is None and len(arrivals) < total:
            now = time.perf_counter()
            for path in rollouts.glob("actor_*/*.jsonl"):
                size = path.stat().st_size
                if size > sizes.get(path, 0):
                    with open(path, "rb") as f:
                        f.seek(sizes.get(path, 0))
                        new = f.read(size - sizes.get(path, 0))
                    arrivals.extend([now] * new.count(b"\n"))
                    sizes[path] = sizes.get(path, 0) + new.rfind(b"\n") + 1
            if now - t0 > timeout_s:
                raise RuntimeError("the launcher did not finish in time")
            time.sleep(0.02)
        proc.wait(timeout_s)
    finally:
        stop_process(proc)
        log.close()
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or len(arrivals) < total:
        raise RuntimeError(f"launcher exited {proc.returncode} with {len(arrivals)}/{total} lines; "
                           f"log {log.name}")
    return steady_rate(arrivals), wall


def bench_config_model() -> str:
    from pipegen.testing.tiny_models import tiny_model_path

    return tiny_model_path()


def measure(res: ScenarioResult, tmp: Path, spec: RunSpec, reps: int, with_ray: bool, with_launcher: bool) -> None:
    label = f"{spec.response_tokens}-token responses"
    server_args = ["--engine", "fake", "--model-path", bench_config_model(), "--slots", "4096", "--eos-prob", "0"]
    with reference_server(tmp / f"srv{spec.response_tokens}", server_args) as server:
        pg_rates, raw_rates, pg_tokens, raw_tokens = [], [], [], []
        bodies = None
        records_run = None
        order = ["pipegen", "raw", "raw", "pipegen"] * ((reps + 1) // 2)
        order = order[: 2 * reps]
        for i, kind in enumerate(order):
            before = server.get_json("/pipegen_stats")["tokens_generated"]
            if kind == "pipegen":
                arrivals, run = run_actor(tmp / f"run{spec.response_tokens}_{i}", server.url, spec)
                pg_rates.append(steady_rate(arrivals))
                if bodies is None:
                    from pipegen.config import load_run_config

                    bodies = raw_bodies(load_run_config(run), recorded_requests(run))
                    records_run = run
                pg_tokens.append(server.get_json("/pipegen_stats")["tokens_generated"] - before)
            else:
                if bodies is None:  # the order always starts with pipegen
                    raise AssertionError
                raw_rates.append(steady_rate(run_raw(server.url, bodies, spec.concurrency)))
                raw_tokens.append(server.get_json("/pipegen_stats")["tokens_generated"] - before)
        units = len(bodies)
        pairs = list(zip(pg_rates, raw_rates))
        ratio = median([p / r for p, r in pairs])
        res.add(Row(
            what=f"{label}: actor vs raw aiohttp loop", ratio=ratio,
            label="pipegen actor ÷ raw loop (samples/s)", target=TARGET_RAW, met=check_target(ratio, TARGET_RAW),
            raw=(f"actor {fmt_rate(median(pg_rates), ' samples/s')}, raw {fmt_rate(median(raw_rates), ' req/s')}; "
                 f"{units} units, concurrency {spec.concurrency}, scoring {'on' if spec.scoring else 'off'}, "
                 f"server tokens per run {median(pg_tokens):,.0f} vs {median(raw_tokens):,.0f}; {len(pairs)} pairs"),
        ))
        if with_launcher:
            lrates = []
            for i in range(max(1, reps // 2)):
                lr, wall = run_launcher(tmp / f"launch{spec.response_tokens}_{i}", server.url, spec, units)
                rr = steady_rate(run_raw(server.url, bodies, spec.concurrency))
                lrates.append((lr, rr, wall))
            ratio_l = median([a / b for a, b, _ in lrates])
            res.add(Row(
                what=f"{label}: whole launcher (actor + writer) vs raw loop", ratio=ratio_l,
                label="launcher ÷ raw loop (samples/s)", target=TARGET_RAW, met=check_target(ratio_l, TARGET_RAW),
                raw=(f"launcher {fmt_rate(median([a for a, _, _ in lrates]), ' samples/s')} (line arrival; "
                     f"{median([w for _, _, w in lrates]):.0f} s wall incl. start-up and merge), raw "
                     f"{fmt_rate(median([b for _, b, _ in lrates]), ' req/s')}; {len(lrates)} pair(s)"),
            ))
    if with_ray:
        records = []
        for path in sorted(records_run.rollouts.glob("actor_*/*.jsonl")):
            with open(path, "rb") as f:
                records.extend(orjson.loads(line) for line in f)
        rec_kib = sum(len(orjson.dumps(r)) for r in records[:20]) / 20 / 1024
        transport = [pipegen_transport(tmp / f"transport{spec.response_tokens}_a", records)]
        ray_rate = run_ray_queue(records)
        transport.append(pipegen_transport(tmp / f"transport{spec.response_tokens}_b", records))
        actor_rate = median(pg_rates)
        ratio = actor_rate / ray_rate
        res.add(Row(
            what=f"{label}: actor vs Ray queue", ratio=ratio, label="pipegen actor ÷ Ray util.queue (records/s)",
            target=TARGET_RAY, met=check_target(ratio, TARGET_RAY),
            raw=(f"actor {fmt_rate(actor_rate, ' samples/s')} (end to end), Ray queue "
                 f"{fmt_rate(ray_rate, ' rec/s')} (transport only, {len(records)} records of {rec_kib:.1f} KiB as "
                 f"JSON), raw loop ÷ Ray {median(raw_rates) / ray_rate:.2f}×"),
        ))
        t_ratio = median(transport) / ray_rate
        res.add(Row(
            what=f"{label}: transport only, same records", ratio=t_ratio,
            label="shard append + tail read ÷ Ray util.queue (records/s)", target=TARGET_RAY,
            met=check_target(t_ratio, TARGET_RAY),
            raw=(f"pipegen streams {fmt_rate(median(transport), ' rec/s')} (write all, then read all; measured just "
                 f"before and after Ray), Ray queue {fmt_rate(ray_rate, ' rec/s')}"),
        ))


def run(quick: bool) -> ScenarioResult:
    res = ScenarioResult(KEY, TITLE)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    with scratch("e2e") as tmp:
        if quick:
            measure(res, tmp, RunSpec(256, n=4, concurrency=64), reps=2, with_ray=True, with_launcher=False)
        else:
            measure(res, tmp, RunSpec(256, n=8, concurrency=64), reps=3, with_ray=True, with_launcher=True)
            measure(res, tmp, RunSpec(1024, n=4, concurrency=64), reps=2, with_ray=True, with_launcher=False)
    res.notes.append(
        "e2e: the Ray queue figure is transport only (records already exist), while the actor's figure includes "
        "generating them with a fake server that shares the same cores; the raw aiohttp loop is the ceiling of any "
        "client on this machine, so raw loop ÷ Ray bounds what the end-to-end ratio can show. The transport-only row "
        "compares like with like.")
    return res
