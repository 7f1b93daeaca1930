"""Scenario `gpu`: on one GPU, the same model and prompts through three clients of SGLang, side by side.

1. pipegen with its default config: the real launcher attached to one SGLang server (`llm=external`),
   writer and merge included. Rate = output tokens ÷ (last shard line − the actors' first request), so
   the server's own load time is out and pipegen's start-up phases are reported beside it.
2. a raw aiohttp loop (`common.post_all`) sending the very /generate bodies pipegen sent (rebuilt by
   `end_to_end.raw_bodies` from the records), once at pipegen's units in flight and once all at once.
3. SGLang's own `python -m sglang.bench_offline_throughput` (its engine in-process, its own concurrency)
   on the same prompt texts (a ShareGPT-format file), the server stopped first to free the GPU.
GPU utilisation (`nvidia-smi`, every 500 ms) is sampled while pipegen generates and while the raw loop
runs. Runs where `nvidia-smi -L` lists a GPU and SGLang is importable by `llm.python` (./launch.sh's
.venv-sglang, exported as PIPEGEN_SGLANG_PYTHON); otherwise the table says why it was skipped.

Knobs (environment): PIPEGEN_BENCH_MODEL (default the embedded smollm2-135m), PIPEGEN_BENCH_TRAIN_FILES
(default the 96 demo prompts), PIPEGEN_BENCH_SGLANG_ARGS (extra server flags, e.g. the GPU kit's SGL_FLAGS).

Owns: the check for a GPU and SGLang, the three runs, and this scenario's rows.
Must never: judge a timing, or run without a GPU.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from pipegen.bench import common as c
from pipegen.launch.servers import ServerProcess, check_server_python, server_python, sglang_server_command

KEY = "gpu"
TITLE = "8. GPU: pipegen vs a raw loop vs SGLang's offline benchmark (one server, same prompts)"
TARGET_RAW = "≥ 0.9"  # at the same units in flight pipegen should keep up with a bare client


def gpu_names() -> list[str]:
    """What `nvidia-smi -L` lists (the same test ./launch.sh makes); empty without a usable GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")] if out.returncode == 0 else []


@dataclass
class UtilSampler:
    """`nvidia-smi` utilisation every 500 ms, each sample stamped with time.time() as it arrives."""

    samples: list[tuple[float, float]] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    def __enter__(self) -> "UtilSampler":
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      "-lms", "500"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.split(",")[0])))
            except ValueError:
                pass

    def __exit__(self, *exc: object) -> None:
        c.stop_process(self.proc, 5)

    def between(self, start: float, end: float) -> str:
        xs = [u for t, u in self.samples if start <= t <= end]
        return f"GPU busy {sum(xs) / len(xs):.0f}% mean, {max(xs):.0f}% max" if xs else "GPU busy: no samples"


def sglang_server(python: str, model: str, folder: Path, extra: list[str]) -> ServerProcess:
    from pipegen.launch.world import ServerPlan, free_port

    plan = ServerPlan("bench", "127.0.0.1", free_port(), (int(os.environ.get("PIPEGEN_BENCH_GPU", "0")),))
    argv, env = sglang_server_command(plan, model, {"python": python, "tp": 1}, 0)
    return ServerProcess(argv + extra, folder / "sglang_server.log", port=plan.port, env=env)


@dataclass
class PipegenRun:
    root: Path
    tokens: int
    first_request: float
    last_line: float
    wall_s: float
    in_flight: int
    startup: str

    @property
    def tok_per_s(self) -> float:
        return self.tokens / (self.last_line - self.first_request)


def run_pipegen(root: Path, url: str, model: str, overrides: list[str], timeout_s: float = 1800) -> PipegenRun:
    """The launcher with its default config (only the data, model and sampling lengths set)."""
    from pipegen.observe.startup import startup_phases
    from pipegen.observe.stats import actor_lines, latest_stats
    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir
    from pipegen.run.stream import RolloutRecord, TrajectoryKeys

    run = RunDir(root)
    started = time.time()
    with open(root.parent / f"{root.name}.launch.log", "wb") as log:
        proc = subprocess.Popen(c.launcher_command(root, url, *overrides, model=model), cwd=c.REPO, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout_s)
        finally:
            c.stop_process(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"the launcher exited {proc.returncode}; see {root.parent / f'{root.name}.launch.log'}")
    wall = time.time() - started
    cfg = load_run_config(run)
    total = run.total_units(int(cfg.actor_rollout_ref.rollout.n))
    lines = c.shard_lines(run.rollouts)
    if len(lines) < total:
        raise RuntimeError(f"pipegen wrote {len(lines)} of {total} units; see {run.root}")
    tokens = sum(len(t[TrajectoryKeys.RESPONSE_IDS]) for line in lines
                 for t in RolloutRecord.from_line(line).trajectories)
    last = max(p.stat().st_mtime for p in c.shard_files(run.rollouts))
    roles = latest_stats(run.stats)
    actors = actor_lines(roles).values()
    first = min(float(line.startup.first_request) for line in actors if line.startup.first_request)
    phases = startup_phases(roles, run.read_launch().started)
    # what the actors drove (auto concurrency and actor count by default): their last stats lines say
    in_flight = sum(line.concurrency or 0 for line in actors)
    return PipegenRun(root, tokens, first, last, wall, max(1, in_flight),
                      phases.render() if phases else "no start-up phases")


def run_raw(url: str, bodies: list[dict], concurrency: int) -> tuple[float, float, float]:
    """(output tok/s, start, end) of a bare aiohttp loop over `bodies`."""
    start = time.time()
    t0 = time.perf_counter()
    done = c.post_all(url, bodies, concurrency)
    elapsed = max(t for t, _ in done) - t0
    tokens = sum(int(answer["meta_info"]["completion_tokens"]) for _, answer in done)
    return tokens / elapsed, start, start + elapsed


def sharegpt_file(path: Path, bodies: list[dict], tokenizer_path: str) -> Path:
    """The prompts pipegen sent, as text in ShareGPT's format (what bench_offline_throughput reads)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    rows = [{"conversations": [{"from": "human", "value": tok.decode(b["input_ids"])},
                               {"from": "gpt", "value": "-"}]} for b in bodies]
    path.write_bytes(orjson.dumps(rows))
    return path


def run_sglang_offline(python: str, model: str, dataset: Path, prompts: int, max_new: int, extra: list[str],
                       folder: Path) -> dict:
    """`python -m sglang.bench_offline_throughput` on the same prompts; its result line (output_throughput...)."""
    result = folder / "sglang_offline.jsonl"
    cmd = [python, "-m", "sglang.bench_offline_throughput", "--model-path", model, "--dataset-name", "sharegpt",
           "--dataset-path", str(dataset), "--num-prompts", str(prompts), "--sharegpt-output-len", str(max_new),
           "--result-filename", str(result), "--random-seed", "0",
           # stop at EOS as pipegen and the raw loop do (its default ignore_eos generates every token, a different
           # workload); and no grammar backend: the offline engine imports xgrammar for it, which the server's
           # --skip-tokenizer-init spares, and a GPU box need not have it
           "--disable-ignore-eos", "--grammar-backend", "none", *extra]
    with open(folder / "sglang_offline.log", "wb") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1800, check=False)
    if not result.exists():
        raise RuntimeError(f"bench_offline_throughput wrote no result; see {folder / 'sglang_offline.log'}")
    return orjson.loads(result.read_bytes().splitlines()[-1])


def measure(res: c.ScenarioResult, tmp: Path, python: str, quick: bool) -> None:
    from pipegen.bench.end_to_end import raw_bodies
    from pipegen.inputs.demo import resolve_train_files
    from pipegen.inputs.models import resolve_model_path
    from pipegen.run.layout import RunDir

    model = resolve_model_path(os.environ.get("PIPEGEN_BENCH_MODEL", "smollm2-135m"))
    train = resolve_train_files(os.environ.get("PIPEGEN_BENCH_TRAIN_FILES", "demo"))[0]
    extra = shlex.split(os.environ.get("PIPEGEN_BENCH_SGLANG_ARGS", ""))
    n, max_new = (4, 256) if quick else (16, 256)
    overrides = [f"train_files={train}", f"n={n}", "max_samples=-1", f"max_response_length={max_new}",
                 "generation.show_progress=false"]
    server = sglang_server(python, model, tmp, extra).start()
    try:
        loaded = time.monotonic()
        server.wait_ready(1200)
        load_s = time.monotonic() - loaded
        with UtilSampler() as util:
            # a warm-up pass so CUDA graphs and kernels are built before anything is timed
            warm = run_pipegen(tmp / "warmup", server.url, model, [*overrides, "n=1", "max_samples=16"])
            bodies = raw_bodies(RunDir(warm.root))
            c.post_all(server.url, bodies, len(bodies))
            pg = run_pipegen(tmp / "pipegen", server.url, model, overrides)
            bodies = raw_bodies(RunDir(pg.root))
            raw_same, s1, e1 = run_raw(server.url, bodies, pg.in_flight)
            raw_all, s2, e2 = run_raw(server.url, bodies, len(bodies))
        pg_util, raw_util = util.between(pg.first_request, pg.last_line), util.between(s2, e2)
    finally:
        server.stop(30)
    offline = run_sglang_offline(python, model, sharegpt_file(tmp / "prompts.json", bodies, model), len(bodies),
                                 max_new, extra, tmp)
    sgl = float(offline["output_throughput"])
    common = f"{len(bodies)} requests ({n} per prompt), ≤ {max_new} new tokens, {Path(model).name}"
    res.add(c.Row(what="pipegen (default config) vs raw loop at the same units in flight", ratio=pg.tok_per_s / raw_same,
                  label="pipegen ÷ raw aiohttp loop (output tok/s)", target=TARGET_RAW,
                  raw=f"pipegen {c.fmt_rate(pg.tok_per_s, ' tok/s')}, raw {c.fmt_rate(raw_same, ' tok/s')} at "
                      f"{pg.in_flight} in flight; {common}; {pg_util} while pipegen generated"))
    res.add(c.Row(what="pipegen (default config) vs raw loop with every request in flight",
                  ratio=pg.tok_per_s / raw_all, label="pipegen ÷ raw loop, all in flight (output tok/s)",
                  raw=f"raw {c.fmt_rate(raw_all, ' tok/s')} with {len(bodies)} in flight; {raw_util} meanwhile"))
    res.add(c.Row(what="pipegen (default config) vs SGLang's bench_offline_throughput", ratio=pg.tok_per_s / sgl,
                  label="pipegen ÷ sglang.bench_offline_throughput (output tok/s)",
                  raw=f"SGLang offline {c.fmt_rate(sgl, ' tok/s')} ({offline.get('total_output_tokens')} tokens in "
                      f"{float(offline.get('total_latency', 0)):.1f} s, its own concurrency, stopping at EOS); "
                      f"raw all-in-flight ÷ SGLang offline {raw_all / sgl:.2f}×"))
    res.notes.append(
        f"gpu: {gpu_names()[0] if gpu_names() else 'GPU'}; server ready in {load_s:.0f} s; pipegen's launch took "
        f"{pg.wall_s:.0f} s wall ({pg.tokens:,} output tokens); start-up: {pg.startup}. pipegen's rate runs from its "
        "first request to its last shard line; the raw loop replays pipegen's own /generate bodies; SGLang's offline "
        "benchmark reads the same prompts as text and stops at EOS like the other two.")


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    if not gpu_names():
        res.skipped = "no GPU"
        print("gpu: skipped: no GPU")
        return res
    python = server_python({"python": os.environ.get("PIPEGEN_SGLANG_PYTHON")})
    problem = check_server_python("sglang", python)
    if problem:
        res.skipped = problem
        print(f"gpu: skipped: {problem}")
        return res
    with c.scratch("gpu") as tmp:
        measure(res, tmp, python, quick)
    return res

