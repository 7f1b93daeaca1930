"""What every benchmark scenario shares: result rows, side-by-side timing, scratch folders, prepared run
folders, realistic records, and the server and launcher processes the scenarios measure against.

Owns: the rule that every reported figure is a ratio of two things measured side by side (interleaved
in one process, or within the same minute), and the helpers that make that easy: one way to prepare a
run folder, to make, write and read records, to start the CPU server, to drive /generate with a bare
aiohttp loop, to start the launcher, and to read a finished run back (the actors' last stats lines and log
lines, the merged output's response tokens).
Must never: assert on timings (benchmarks report, tests do not judge speed), write outside the
temporary folders it is given, or spell a record key, a unit-key formula or a run path itself (run/stream.py
and layout.py own those).
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson

from pipegen.launch.servers import ServerProcess
from pipegen.run.layout import LaunchRecord, RunDir, list_shards
from pipegen.run.stream import RolloutRecord, ShardAppender, ShardTailer, UnitKeys, prompt_uid, unit_seed

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------
# results


@dataclass
class Row:
    """One line of the table: a ratio, what it divides, its target, and the raw figures behind it."""

    what: str
    ratio: float | None
    label: str  # e.g. "pipegen ÷ bare orjson (rec/s)"
    target: str = ""  # e.g. "≥ 0.6"; empty when the figure has no target
    met: bool | None = None  # left out: judged from ratio and target
    raw: str = ""
    unit: str = "×"

    def __post_init__(self) -> None:
        if self.met is None:
            self.met = check_target(self.ratio, self.target)


@dataclass
class ScenarioResult:
    key: str
    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    seconds: float = 0.0
    error: str | None = None
    skipped: str | None = None

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row


def check_target(value: float | None, target: str) -> bool | None:
    """'≥ 0.6' / '≤ 1.5' -> whether value meets it (None when there is no target or value)."""
    if value is None or not target:
        return None
    op, _, num = target.partition(" ")
    limit = float(num.rstrip("×x"))
    return value >= limit if op == "≥" else value <= limit


# ---------------------------------------------------------------------------------------------------
# timing


def interleave(fns: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """Run each function reps times, alternating A B / B A so slow drift on a shared machine hits both.

    Each function returns the seconds of the part it measures (set-up stays outside the timing).
    """
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(fns[name]())
    return out


def paired_ratio(numerator_s: list[float], denominator_s: list[float]) -> float:
    """Median over repetitions of denominator_time / numerator_time: the rate of the numerator relative
    to the denominator's, each pair taken in the same minute."""
    return statistics.median(d / n for n, d in zip(numerator_s, denominator_s))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt_rate(x: float, unit: str = "/s") -> str:
    if x >= 10000:
        return f"{x / 1000:,.1f}k{unit}"
    if x >= 100:
        return f"{x:,.0f}{unit}"
    return f"{x:,.1f}{unit}"


def fmt_s(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


# ---------------------------------------------------------------------------------------------------
# scratch space


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A temporary folder on the default temp filesystem, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"pipegen-bench-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------
# run folders and realistic records, built the way the launcher and the actor build them


PROMPT_TOKENS = 256
TOKEN_LO, TOKEN_HI = 100, 1900  # ordinary ids of the tiny test model's vocabulary (2048)
LAUNCH = "bench"  # the launch id and run key of every prepared run folder
FAKE_BACKEND = "pipegen.bench.doubles.fake_backend:FakeBackend"


def tiny_model() -> str:
    from pipegen.bench.doubles.tiny_models import tiny_model_path

    return tiny_model_path()


def bench_config(run_root: Path, *overrides: str):
    """The resolved run config for a run folder (tiny test model, demo data), as the launcher saves it."""
    from omegaconf import open_dict

    from pipegen.inputs.demo import resolve_train_files
    from pipegen.config.compose import compose, resolved

    model = tiny_model()
    cfg = compose([f"output_dir={run_root}", f"model_path={model}", *overrides])
    with open_dict(cfg):
        cfg.model_path = model
        cfg.actor_rollout_ref.model.path = model
        files = resolve_train_files(cfg.data.train_files)
        cfg.train_files = files[0]
        cfg.data.train_files = files[0]
    return resolved(cfg)


def prepare_run(root: Path, *overrides: str, servers: list[str] | None = None) -> tuple[Any, RunDir]:
    """A run folder as the launcher leaves it for actors and writer: config, unit manifest, launch record."""
    from pipegen.inputs.dataset import dataset_indices, load_dataset, load_tokenizer
    from pipegen.run.config import save_run_config

    cfg = bench_config(root, *overrides)
    run = RunDir(Path(root))
    save_run_config(run, cfg)
    run.write_manifest(dataset_indices(load_dataset(cfg, load_tokenizer(cfg))))
    run.write_launch(LaunchRecord(launch=LAUNCH, run_key=LAUNCH, servers=list(servers or [])))
    return cfg, run


# what the actor puts up front for a person watching: the start of the response, at its longest (120 characters)
PEEK_TEXT = ("Step 1: 17 + 25 = 42. Step 2: 42 x 3 = 126. Step 3: 126 - 6 = 120, so the answer is 120. #### 120 "
             "(checked twice, once by adding the parts again and once by working backwards from the total)")[:120]


class RecordFactory:
    """RolloutRecords with the actor's exact shape: real rows of the demo set, trajectories made by the
    actor's `trajectory_json` from a verl AgentLoopOutput (float32 logprobs), uid, priority and seed
    derived as the actor derives them."""

    def __init__(self, cfg):
        from pipegen.inputs.dataset import dataset_indices, load_dataset, load_tokenizer
        from pipegen.actor.rollout import row_fields

        self.keys = UnitKeys(int(cfg.actor_rollout_ref.rollout.n))
        dataset = load_dataset(cfg, load_tokenizer(cfg))
        self.indices = dataset_indices(dataset)
        self.rows = [row_fields(dataset, pos) for pos in range(len(self.indices))]

    def units(self, count: int, first: int = 0) -> list[tuple[int, int, int]]:
        """(position, index, sample) of `count` units from the `first`-th on, prompt-major like the actor's."""
        out = []
        for pos, index in enumerate(self.indices):
            for sample in range(self.keys.n):
                if pos * self.keys.n + sample >= first:
                    out.append((pos, index, sample))
                if len(out) == count:
                    return out
        raise ValueError(f"the dataset has only {len(self.indices) * self.keys.n} units; asked for {first} + {count}")

    def records(self, count: int, response_tokens: int, seed: int = 0, first: int = 0) -> list[RolloutRecord]:
        import numpy as np
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

        from pipegen.actor.rollout import trajectory_json

        rng = np.random.default_rng(seed)
        out = []
        for pos, index, sample in self.units(count, first):
            prompt = rng.integers(TOKEN_LO, TOKEN_HI, PROMPT_TOKENS).tolist()
            response = rng.integers(TOKEN_LO, TOKEN_HI, response_tokens).tolist()
            # logprobs as an engine reports them: python floats (float64) of float32-ish values
            logprobs = (-rng.exponential(1.0, response_tokens)).astype(np.float32).astype(float).tolist()
            output = AgentLoopOutput(
                prompt_ids=prompt, response_ids=response, response_mask=[1] * response_tokens,
                response_logprobs=logprobs, num_turns=2, reward_score=float(rng.integers(0, 2)),
                metrics=AgentLoopMetrics(generate_sequences=0.5, tool_calls=0.0),
                extra_fields={"turn_scores": [], "tool_rewards": [], "reward_extra_info": {"acc": 1.0}},
            )
            out.append(RolloutRecord(
                index=index, sample=sample, reward=output.reward_score, finish="stop", text=PEEK_TEXT, uid=prompt_uid(LAUNCH, index), priority=self.keys.priority(pos, sample),
                seed=unit_seed(0, index, sample), agent_name="single_turn_agent", launch=LAUNCH,
                row=self.rows[pos], trajectories=[trajectory_json(output)],
            ))
        return out


# ---------------------------------------------------------------------------------------------------
# stream shards: write and read records as the actor and the writer do, and the bare orjson baseline


def write_records(topic: Path, records: list[RolloutRecord], max_bytes: int = 64 << 20,
                  fsync_interval_s: float = 1.0) -> None:
    """One actor's shards of `records` (`RolloutRecord.to_line` + `ShardAppender.append`, fsync on the
    actor's timer and at seal)."""
    app = ShardAppender(topic, 0, max_bytes=max_bytes, fsync_interval_s=fsync_interval_s)
    for record in records:
        app.append(record.to_line())
    app.close()


def shard_files(topic: Path) -> list[Path]:
    """Every shard of a topic, actor by actor, oldest first."""
    return [path for shards in list_shards(topic).values() for path in shards]


def shard_bytes(topic: Path) -> int:
    return sum(path.stat().st_size for path in shard_files(topic))


def shard_lines(topic: Path) -> list[bytes]:
    """Every complete line of a topic's shards, as the writer's tailer reads them."""
    return [line for _, _, line in ShardTailer(Path(topic)).lines()]


def tail_records(topic: Path) -> int:
    """The writer's read: `ShardTailer.lines()` + `RolloutRecord.from_line` per line; returns the count."""
    got = 0
    for _, _, line in ShardTailer(Path(topic)).lines():
        RolloutRecord.from_line(line)
        got += 1
    return got


def bare_read(paths: list[Path]) -> int:
    """The baseline read: `for line in open(path, 'rb'): orjson.loads(line)`; returns the count."""
    got = 0
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                orjson.loads(line)
                got += 1
    return got


def timed(fn: Callable[..., int], *args: Any, expect: int) -> float:
    """Seconds `fn(*args)` takes; it must return `expect` (records read, lines found...)."""
    t0 = time.perf_counter()
    got = fn(*args)
    dt = time.perf_counter() - t0
    if got != expect:
        raise AssertionError(f"{getattr(fn, '__name__', fn)} gave {got}, expected {expect}")
    return dt


# ---------------------------------------------------------------------------------------------------
# processes: the CPU server, a bare /generate client, and the launcher


def get_json(url: str, timeout: float = 30) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return orjson.loads(resp.read())


def server_stats(url: str, timeout: float = 30) -> dict[str, Any]:
    """The CPU server's own counters (`GET /pipegen_stats`)."""
    return get_json(f"{url}/pipegen_stats", timeout)


def fake_backend_args(*, slots: int, eos_prob: float, token_latency: float = 0.0, seed: int = 0,
                     model: str | None = None, step_time: float = 0.0, step_time_per_request: float = 0.0,
                     hang_rate: float = 0.0) -> list[str]:
    """CPU server arguments for the fake model backend: `slots` requests run at once (the rest wait, FIFO), each
    token takes `token_latency` seconds (or, GPU-like, one batched step of `step_time +
    step_time_per_request * running` seconds gives every running request a token), each token ends the
    answer with chance `eos_prob`; `hang_rate` of the requests are never answered."""
    args = ["--engine", FAKE_BACKEND, "--model-path", model or tiny_model(), "--slots", str(slots),
            "--token-latency", str(token_latency), "--eos-prob", str(eos_prob), "--seed", str(seed)]
    if step_time or step_time_per_request:
        args += ["--step-time", str(step_time), "--step-time-per-request", str(step_time_per_request)]
    if hang_rate:
        args += ["--hang-rate", str(hang_rate)]
    return args


@contextmanager
def reference_server(folder: Path, args: list[str], name: str = "server", ready_timeout_s: float = 300,
                     threads: int = 1) -> Iterator[ServerProcess]:
    """`python -m pipegen.cpu_server ARGS` on a free loopback port, answering when the block starts."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    port_file = folder / f"{name}.port"
    argv = [sys.executable, "-m", "pipegen.cpu_server", "--host", "127.0.0.1", "--port", "0",
            "--port-file", str(port_file), "--stats-interval", "0", "--log-level", "warning",
            "--incremental-streaming-output", *args]  # as the launcher starts it (launch/servers.py)
    server = ServerProcess(argv, folder / f"{name}.log", port_file=port_file,
                           env={"OMP_NUM_THREADS": str(threads)}, cwd=REPO)
    try:
        yield server.start().wait_ready(ready_timeout_s)
    finally:
        server.stop()


def post_all(url: str, bodies: list[dict], concurrency: int, path: str = "/generate") -> list[tuple[float, dict[str, Any]]]:
    """POST every body to `path` (SGLang's /generate, vLLM's /v1/completions) from `concurrency` workers of
    one aiohttp session (uvloop), each answer parsed with orjson: (completion time, answer) per body, in
    completion order."""
    import asyncio

    import aiohttp
    import uvloop

    done: list[tuple[float, dict[str, Any]]] = []

    async def main() -> None:
        queue = list(reversed(bodies))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def worker() -> None:
                while queue:
                    body = queue.pop()
                    async with session.post(f"{url}{path}", data=orjson.dumps(body),
                                            headers={"Content-Type": "application/json"}) as resp:
                        raw = await resp.read()
                        if resp.status != 200:
                            raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
                    done.append((time.perf_counter(), orjson.loads(raw)))

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    uvloop.run(main())
    return done


def launcher_command(run_root: Path, url: str, *overrides: str, model: str | None = None) -> list[str]:
    """`python -m pipegen.launch` attached to one running server (`llm=external`), writer and merge included."""
    return [sys.executable, "-m", "pipegen.launch", f"output_dir={run_root}", f"model_path={model or tiny_model()}",
            "llm=external", f"llm.urls=[{url}]", *overrides]


def stop_process(proc: subprocess.Popen, grace_s: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def actor_stats(run_root: Path) -> list[Any]:
    """Each actor's last stats line (its counters at its end) as run/stats_line.py's ActorStats, by role."""
    from pipegen.run.layout import is_actor_role, stats_files
    from pipegen.run.stats_line import parse_stats_line

    out = []
    for path in stats_files(RunDir(Path(run_root)).stats):
        role = path.stem
        lines = [line for line in path.read_bytes().splitlines() if line.strip()]
        if is_actor_role(role) and lines:
            out.append(parse_stats_line(role, orjson.loads(lines[-1])))
    return out


def actor_log_lines(run_root: Path, needle: str) -> list[str]:
    """The lines of the run's actor logs that contain `needle` (e.g. "left rotation")."""
    from pipegen.run.layout import is_actor_role, role_logs

    return [line for path in role_logs(RunDir(Path(run_root)).logs) if is_actor_role(path.stem)
            for line in path.read_text(errors="replace").splitlines() if needle in line]


def kept_response_tokens(run_root: Path) -> tuple[int, int, int]:
    """(units, response tokens, the longest response) of the merged trajectories.pkl, read with verl's DataProto."""
    from verl import DataProto

    data = DataProto.load_from_disk(str(RunDir(Path(run_root)).trajectories))
    per_row = data.batch["response_mask"].sum(dim=-1)
    return len(data), int(per_row.sum()), int(per_row.max()) if len(data) else 0
