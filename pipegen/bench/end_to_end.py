"""Scenario `e2e`: end to end against an instant fake SGLang-protocol server (the CPU server with the
fake model backend, no latency).

- pipegen: the real actor (`pipegen.actor.worker.Actor.main`: verl's single_turn_agent, pipegen's HTTP
  client, one RolloutRecord appended per unit) in this process, against the CPU server with the fake
  engine in a subprocess. Rate = lines appended ÷ time from the first line's arrival to the last's
  (each append is timestamped by a thin ShardAppender subclass swapped in for the run).
- raw: an aiohttp loop in this process sending the very same /generate bodies (built by the engine's
  `build` from the prompt ids and seeds the actor recorded) at the same concurrency, parsing
  each answer with orjson; rate measured the same way, from first to last completion.
- Ray: the same records (the actor's shard lines, parsed to JSON objects) through a
  `ray.util.queue.Queue`: one producer task puts them, the driver drains with one blocking `get` per
  record; local Ray with 2 CPUs. Beside it, pipegen's own transport on the same records (shard append,
  then tail read).
- full mode adds the real launcher (`python -m pipegen.launch ... llm=external`, writer included), with
  line arrival seen by polling the shard files every 20 ms.
pipegen and raw runs alternate (A B B A) so both see the same load. Beside the rates, the row gives CPU
per unit of each client (this process) and of the server (from /proc): the ratio is a race for the same
cores, and these say who used them.

Owns: this scenario's run shapes, the actor/launcher/Ray runs it times, and its rows in the table.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from pipegen.bench import common as c

KEY = "e2e"
TITLE = "3. End to end, instant fake server (actor vs raw aiohttp loop vs Ray queue)"
TARGET_RAW = "≥ 0.8"  # issue 11 (was 0.7)
TARGET_RAY = "≥ 5"


@dataclass
class RunSpec:
    response_tokens: int
    n: int
    concurrency: int
    scoring: bool = True

    def overrides(self) -> list[str]:
        return [f"n={self.n}", "max_samples=-1", "max_prompt_length=256",
                f"max_response_length={self.response_tokens}", "actors.num_actors=1",
                f"actors.concurrency={self.concurrency}", f"actors.scoring={str(self.scoring).lower()}",
                "actors.stats_interval_s=2.0", "generation.show_progress=false"]


def steady_rate(times: list[float]) -> float:
    """Items per second from the first completion to the last (start-up and ramp excluded)."""
    times = sorted(times)
    return (len(times) - 1) / (times[-1] - times[0])


# ---------------------------------------------------------------------------------------------------
# the three clients


def run_actor(root: Path, url: str, spec: RunSpec) -> tuple[list[float], object, float]:
    """The real actor in this process: the arrival time of every appended rollout line, the run, and the
    process CPU seconds per unit between the first and the last line (start-up excluded)."""
    import uvloop

    import pipegen.actor.worker as worker
    import pipegen.run.medium as medium  # the files medium builds each actor's ShardAppender

    cfg, run = c.prepare_run(root, *spec.overrides(), servers=[url])
    total = run.total_units(spec.n)
    arrivals: list[float] = []
    cpu: list[float] = []
    rollouts = run.rollouts

    class TimedAppender(medium.ShardAppender):
        def __init__(self, topic_dir: Path, *args) -> None:
            super().__init__(topic_dir, *args)
            self.timed = topic_dir == rollouts  # decided once: a path comparison per line costs the actor ~2%

        def append(self, line: bytes) -> None:
            super().append(line)
            if self.timed:
                arrivals.append(time.perf_counter())
                if len(arrivals) in (1, total):  # process_time is a real syscall here (~0.1 ms): twice only
                    cpu.append(time.process_time())

    actor = worker.Actor(cfg, run, 0, 1)
    original = medium.ShardAppender
    medium.ShardAppender = TimedAppender
    try:
        uvloop.run(actor.main())
    finally:
        medium.ShardAppender = original
    if len(arrivals) != total:
        raise RuntimeError(f"the actor wrote {len(arrivals)} of {total} units; see {run.root}")
    return arrivals, run, (cpu[-1] - cpu[0]) / (total - 1)


def raw_bodies(run, protocol: str = "sglang") -> list[dict]:
    """The bodies the actor sent for the units in its shard (SGLang's /generate, or another engine's), built
    by the same function from the prompt ids and seeds it recorded (a fresh request id each)."""
    from pipegen.engines import engine
    from pipegen.engines.request import Generation
    from pipegen.actor.limits import ClientLimits
    from pipegen.run.config import load_run_config
    from pipegen.run.stream import RolloutRecord, TrajectoryKeys

    rollout = load_run_config(run).actor_rollout_ref.rollout
    limits = ClientLimits(prompt_length=int(rollout.prompt_length), response_length=int(rollout.response_length),
                          max_model_len=8192)
    params = dict(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                  repetition_penalty=1.0, logprobs=rollout.calculate_log_probs)
    records = [RolloutRecord.from_line(line) for line in c.shard_lines(run.rollouts)]
    build = engine(protocol).build
    return [build(Generation.of(r.trajectories[0][TrajectoryKeys.PROMPT_IDS], params, limits, r.seed)).body
            for r in records]


def run_raw(url: str, bodies: list[dict], concurrency: int) -> list[float]:
    return [t for t, _ in c.post_all(url, bodies, concurrency)]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc (0.0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


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


def pipegen_transport(folder: Path, records) -> float:
    """records/s through pipegen's own transport: `write_records` (to_line + ShardAppender), then
    `tail_records` (ShardTailer + RolloutRecord.from_line); written first, then read: no overlap, so a
    conservative figure."""
    t0 = time.perf_counter()
    c.write_records(folder, records)
    got = c.tail_records(folder)
    dt = time.perf_counter() - t0
    assert got == len(records), (got, len(records))
    return len(records) / dt


def run_launcher(root: Path, url: str, spec: RunSpec, total: int, timeout_s: float = 600) -> tuple[float, float]:
    """The real launcher attached to the server (writer and all); (steady line rate, wall seconds)."""
    from pipegen.run.layout import RunDir

    rollouts = RunDir(root).rollouts
    log = open(root.parent / f"{root.name}.launch.log", "wb")
    t0 = time.perf_counter()
    proc = subprocess.Popen(c.launcher_command(root, url, *spec.overrides()), cwd=c.REPO, stdout=log,
                            stderr=subprocess.STDOUT)
    arrivals: list[float] = []
    sizes: dict[Path, int] = {}
    try:
        while proc.poll() is None and len(arrivals) < total:
            now = time.perf_counter()
            for path in c.shard_files(rollouts):
                size, seen = path.stat().st_size, sizes.get(path, 0)
                if size > seen:
                    with open(path, "rb") as f:
                        f.seek(seen)
                        new = f.read(size - seen)
                    arrivals.extend([now] * new.count(b"\n"))
                    sizes[path] = seen + new.rfind(b"\n") + 1
            if now - t0 > timeout_s:
                raise RuntimeError("the launcher did not finish in time")
            time.sleep(0.02)
        proc.wait(timeout_s)
    finally:
        c.stop_process(proc)
        log.close()
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or len(arrivals) < total:
        raise RuntimeError(f"launcher exited {proc.returncode} with {len(arrivals)}/{total} lines; log {log.name}")
    return steady_rate(arrivals), wall


# ---------------------------------------------------------------------------------------------------
# measurements


@dataclass
class ActorFigures:
    actor_rates: list[float]
    raw_rates: list[float]
    bodies: list[dict]
    run: object  # the first actor run's RunDir: its shard holds the records the Ray rows reuse


def actor_vs_raw(res: c.ScenarioResult, server, tmp: Path, spec: RunSpec, reps: int, label: str) -> ActorFigures:
    rates: dict[str, list[float]] = {"pipegen": [], "raw": []}
    tokens: dict[str, list[float]] = {"pipegen": [], "raw": []}
    client_cpu: dict[str, list[float]] = {"pipegen": [], "raw": []}  # seconds per unit, this process
    server_cpu: list[float] = []  # seconds per request, the server process
    bodies, first_run = None, None
    order = (["pipegen", "raw", "raw", "pipegen"] * ((reps + 1) // 2))[: 2 * reps]  # starts with pipegen
    for i, kind in enumerate(order):
        before = c.server_stats(server.url)["tokens_generated"]
        server_before = process_cpu_s(server.proc.pid)
        if kind == "pipegen":
            arrivals, run, cpu = run_actor(tmp / f"run{spec.response_tokens}_{i}", server.url, spec)
            rates[kind].append(steady_rate(arrivals))
            client_cpu[kind].append(cpu)
            if bodies is None:
                bodies, first_run = raw_bodies(run), run
        else:
            started = time.process_time()
            rates[kind].append(steady_rate(run_raw(server.url, bodies, spec.concurrency)))
            client_cpu[kind].append((time.process_time() - started) / len(bodies))
        server_cpu.append((process_cpu_s(server.proc.pid) - server_before) / len(bodies))
        tokens[kind].append(c.server_stats(server.url)["tokens_generated"] - before)
    pairs = list(zip(rates["pipegen"], rates["raw"]))
    res.add(c.Row(
        what=f"{label}: actor vs raw aiohttp loop", ratio=c.median([p / r for p, r in pairs]),
        label="pipegen actor ÷ raw loop (samples/s)", target=TARGET_RAW,
        raw=(f"actor {c.fmt_rate(c.median(rates['pipegen']), ' samples/s')}, raw "
             f"{c.fmt_rate(c.median(rates['raw']), ' req/s')}; {len(bodies)} units, concurrency {spec.concurrency}, "
             f"scoring {'on' if spec.scoring else 'off'}, server tokens per run {c.median(tokens['pipegen']):,.0f} "
             f"vs {c.median(tokens['raw']):,.0f}; {len(pairs)} pairs; CPU per unit: actor "
             f"{c.median(client_cpu['pipegen']) * 1e3:.2f} ms, raw loop {c.median(client_cpu['raw']) * 1e3:.2f} ms, "
             f"server {c.median(server_cpu) * 1e3:.2f} ms (a client above the server's figure is the bottleneck "
             f"even on idle cores; on busy ones the figures add up)"),
    ))
    return ActorFigures(rates["pipegen"], rates["raw"], bodies, first_run)


def launcher_vs_raw(res: c.ScenarioResult, server, tmp: Path, spec: RunSpec, reps: int, label: str,
                    bodies: list[dict]) -> None:
    runs = []
    for i in range(max(1, reps // 2)):
        rate, wall = run_launcher(tmp / f"launch{spec.response_tokens}_{i}", server.url, spec, len(bodies))
        runs.append((rate, steady_rate(run_raw(server.url, bodies, spec.concurrency)), wall))
    res.add(c.Row(
        what=f"{label}: whole launcher (actor + writer) vs raw loop", ratio=c.median([a / b for a, b, _ in runs]),
        label="launcher ÷ raw loop (samples/s)", target=TARGET_RAW,
        raw=(f"launcher {c.fmt_rate(c.median([a for a, _, _ in runs]), ' samples/s')} (line arrival; "
             f"{c.median([w for _, _, w in runs]):.0f} s wall incl. start-up and merge), raw "
             f"{c.fmt_rate(c.median([b for _, b, _ in runs]), ' req/s')}; {len(runs)} pair(s)"),
    ))


def actor_vs_ray(res: c.ScenarioResult, tmp: Path, spec: RunSpec, label: str, figures: ActorFigures) -> None:
    from pipegen.run.stream import RolloutRecord

    lines = c.shard_lines(figures.run.rollouts)
    records = [RolloutRecord.from_line(line) for line in lines]
    rec_kib = sum(len(line) for line in lines[:20]) / min(20, len(lines)) / 1024
    transport = [pipegen_transport(tmp / f"transport{spec.response_tokens}_a", records)]
    ray_rate = run_ray_queue([orjson.loads(line) for line in lines])
    transport.append(pipegen_transport(tmp / f"transport{spec.response_tokens}_b", records))
    actor_rate = c.median(figures.actor_rates)
    res.add(c.Row(
        what=f"{label}: actor vs Ray queue", ratio=actor_rate / ray_rate,
        label="pipegen actor ÷ Ray util.queue (records/s)", target=TARGET_RAY,
        raw=(f"actor {c.fmt_rate(actor_rate, ' samples/s')} (end to end), Ray queue "
             f"{c.fmt_rate(ray_rate, ' rec/s')} (transport only, {len(records)} records of {rec_kib:.1f} KiB as "
             f"JSON), raw loop ÷ Ray {c.median(figures.raw_rates) / ray_rate:.2f}×"),
    ))
    res.add(c.Row(
        what=f"{label}: transport only, same records", ratio=c.median(transport) / ray_rate,
        label="shard append + tail read ÷ Ray util.queue (records/s)", target=TARGET_RAY,
        raw=(f"pipegen streams {c.fmt_rate(c.median(transport), ' rec/s')} (write all, then read all; measured "
             f"just before and after Ray), Ray queue {c.fmt_rate(ray_rate, ' rec/s')}"),
    ))


def measure(res: c.ScenarioResult, tmp: Path, spec: RunSpec, reps: int, with_ray: bool, with_launcher: bool) -> None:
    label = f"{spec.response_tokens}-token responses"
    with c.reference_server(tmp / f"srv{spec.response_tokens}", c.fake_backend_args(slots=4096, eos_prob=0)) as server:
        figures = actor_vs_raw(res, server, tmp, spec, reps, label)
        if with_launcher:
            launcher_vs_raw(res, server, tmp, spec, reps, label, figures.bodies)
    if with_ray:
        actor_vs_ray(res, tmp, spec, label, figures)


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    with c.scratch("e2e") as tmp:
        if quick:
            # three pairs: on a shared 2-core box one pair can land in another process's burst; the median
            # of three is the row, where the mean of two moved by ±0.1 between identical runs
            measure(res, tmp, RunSpec(256, n=8, concurrency=64), reps=3, with_ray=True, with_launcher=False)
        else:
            measure(res, tmp, RunSpec(256, n=8, concurrency=64), reps=3, with_ray=True, with_launcher=True)
            measure(res, tmp, RunSpec(1024, n=4, concurrency=64), reps=2, with_ray=True, with_launcher=False)
    res.notes.append(
        "e2e: the Ray queue figure is transport only (records already exist), while the actor's figure includes "
        "generating them with a fake server that shares the same cores; the raw aiohttp loop is the ceiling of any "
        "client on this machine, so raw loop ÷ Ray bounds what the end-to-end ratio can show. The transport-only row "
        "compares like with like. The actor takes its start-up heap out of the garbage collector (gc.freeze) and "
        "raises the young-generation threshold; the raw loop runs in the same process after it and keeps both, so "
        "it no longer pays full collections over torch and verl (~0.9 ms a request before, when it kept every "
        "answer in a heap of ~500k objects). This server answers a burst of requests together (one event-loop "
        "pass each for parsing, generating and answering), so a client that wrote every record of a burst before "
        "sending the next requests left it idle meanwhile: the ratio then tended to (server + raw) ÷ (server + "
        "actor) CPU per unit. The actor frees a unit's slot when the server answers and builds the record once "
        "the replacement's request is out (actor/admission.py, Slots), so the server works while records are built.")
    return res
