"""Scenario `gpu`: on one GPU, at three model sizes, the same prompts through three clients of SGLang.

Sizes (`SIZES`; random weights with SGLang's `--load-format dummy`, so nothing is downloaded): SmolLM2-135M
with 16-token answers, a Qwen3-0.6B-class shape with 256, a Qwen3-8B-class shape with 1,024 (SmolLM2's
tokenizer beside a Qwen3 config.json: `size_folder`). Every arm has the same sampling (temperature 1, log-probs
on) and fixed answer lengths (`ignore_eos`, through SGLang's `--preferred-sampling-params`), and the same server
flags: the launcher's settings for the model's size (launch/servers.py `sglang_size_flags`) plus
PIPEGEN_BENCH_SGLANG_ARGS. Per size:
1. pipegen with its default config: the real launcher attached to one SGLang server (`llm=external`),
   writer and merge included. Rate = output tokens ÷ (last shard line − the actors' first request), so
   the server's own load time is out and pipegen's start-up phases are reported beside it.
2. a raw aiohttp loop (`common.post_all`) sending the very /generate bodies pipegen sent (rebuilt by
   `end_to_end.raw_bodies` from the records), all in flight at once up to RAW_IN_FLIGHT.
3. SGLang's engine offline (`sglang_engine_offline.py`: `sglang.Engine.generate` on the whole list, log-probs
   on; `sglang.bench_offline_throughput` cannot ask for log-probs), the server stopped first to free the GPU.
Rows: pipegen ÷ raw loop and pipegen ÷ offline (targets ≥ 0.95), with requests/s, output tok/s, GPU busy
(`nvidia-smi` every 500 ms) and each timed window (≥ 30 s wanted) in the raw figures. Runs where `nvidia-smi -L`
lists a GPU and SGLang is importable by `llm.python` (./launch.sh's .venv-sglang, exported as
PIPEGEN_SGLANG_PYTHON); otherwise the table says why it was skipped. pipegen/bench/gpu_windows/ holds one
script per size for a lent GPU box (15 minutes, server start included).

Knobs (environment): PIPEGEN_BENCH_GPU_SIZES (default small,medium,large), PIPEGEN_BENCH_TRAIN_FILES
(default the 96 demo prompts), PIPEGEN_BENCH_SGLANG_ARGS (extra server flags, e.g. the GPU kit's SGL_FLAGS),
PIPEGEN_BENCH_GPU_DIR (keep the run folders and server logs there instead of a scratch folder).

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
TITLE = "8. GPU: pipegen vs a raw loop vs SGLang's engine offline, three model sizes (one server, same prompts)"


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


@dataclass(frozen=True)
class Size:
    """One model size of the bench: random weights (`--load-format dummy`) on a published shape."""

    name: str
    answer: int  # tokens per answer: every arm runs with ignore_eos, so every answer has exactly this many
    n: int  # samples per demo prompt: enough units for a timed window of 30 s or more on an H100
    shape: dict | None  # config.json keys of a Qwen3 shape; None: the embedded SmolLM2-135M's own folder


SIZES = {
    "small": Size("SmolLM2-135M", 16, 384, None),
    "medium": Size("Qwen3-0.6B-class", 256, 24, dict(
        hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True)),
    "large": Size("Qwen3-8B-class", 1024, 4, dict(
        hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=False)),
}
RAW_IN_FLIGHT = 4096  # the raw loop's connections at most (the small size has ~37k requests): SGLang's running limit
MIN_WINDOW_S = 30.0  # a timed window shorter than this moves +-10-20% between sittings (row 8's lesson)
# every arm: the same sampling (pipegen's defaults: temperature 1, top_p 1, top_k -1, log-probs on) and fixed
# answer lengths: SGLang's server-side default sampling params give pipegen's and the raw loop's requests
# ignore_eos, and the offline arm gets the same flags
IGNORE_EOS = ["--preferred-sampling-params", '{"ignore_eos": true}']


def size_folder(size: Size, dest: Path) -> str:
    """The model folder of a size, offline: SmolLM2-135M's own (pipegen/inputs/models.py converts the carried
    GGUF), or its tokenizer beside a Qwen3 config.json of the size's shape (random weights need nothing else;
    SmolLM2's 49,152 ids lie inside Qwen3's vocabulary)."""
    import json
    import shutil

    from pipegen.inputs.models import resolve_model_path

    smol = Path(resolve_model_path("smollm2-135m"))
    if size.shape is None:
        return str(smol)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smol / name).exists():
            shutil.copy(smol / name, dest / name)
    eos = json.loads((smol / "config.json").read_text()).get("eos_token_id", 2)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
              "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": eos,
              "use_cache": True, "max_window_layers": size.shape["num_hidden_layers"], "use_sliding_window": False,
              **size.shape}
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return str(dest)


def sizes_wanted() -> list[str]:
    """PIPEGEN_BENCH_GPU_SIZES (comma-separated names of SIZES; one per device window), default all three."""
    names = [x.strip() for x in os.environ.get("PIPEGEN_BENCH_GPU_SIZES", ",".join(SIZES)).split(",") if x.strip()]
    unknown = [x for x in names if x not in SIZES]
    if unknown:
        raise ValueError(f"PIPEGEN_BENCH_GPU_SIZES: unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    return names


def run_offline_engine(python: str, model: str, bodies: list[dict], server_flags: list[str], folder: Path) -> dict:
    """sglang_engine_offline.py under SGLang's python: the same bodies in one Engine.generate call."""
    prompts = folder / "offline_prompts.json"
    prompts.write_bytes(orjson.dumps({"input_ids": [b["input_ids"] for b in bodies],
                                      "sampling_params": [{**b["sampling_params"], "ignore_eos": True} for b in bodies]}))
    out = folder / "offline_result.json"
    script = Path(__file__).with_name("sglang_engine_offline.py")
    cmd = [python, str(script), "--prompts", str(prompts), "--out", str(out), "--", "--model-path", model,
           *server_flags]
    with open(folder / "sglang_offline.log", "wb") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=1800, check=False)
    if not out.exists():
        raise RuntimeError(f"the offline engine arm wrote no result; see {folder / 'sglang_offline.log'}")
    return orjson.loads(out.read_bytes())


def warmup_bodies(answer: int, count: int = 512) -> list[dict]:
    """Short random prompts, answered at the size's length: SGLang's kernels (flashinfer's JIT, CUDA graphs up
    to the batch sizes the arms reach) are built before the first timed window."""
    import random

    rng = random.Random(1)
    return [{"input_ids": [rng.randrange(c.TOKEN_LO, c.TOKEN_HI) for _ in range(64)], "return_logprob": True,
             "sampling_params": {"max_new_tokens": answer, "temperature": 1.0, "sampling_seed": i}}
            for i in range(count)]


def measure_size(res: c.ScenarioResult, tmp: Path, python: str, key: str, quick: bool) -> None:
    """One size: pipegen (default config), a raw loop of pipegen's own bodies with every one in flight, and
    SGLang's engine offline with log-probs; requests/s, output tok/s and GPU busy of each."""
    from pipegen.bench.end_to_end import raw_bodies
    from pipegen.inputs.demo import resolve_train_files
    from pipegen.launch.world import ServerPlan, free_port
    from pipegen.run.layout import RunDir

    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the raw loop's thousands of connections
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    size = SIZES[key]
    model = size_folder(size, tmp / f"model-{key}")
    train = resolve_train_files(os.environ.get("PIPEGEN_BENCH_TRAIN_FILES", "demo"))[0]
    extra = [*shlex.split(os.environ.get("PIPEGEN_BENCH_SGLANG_ARGS", "")), "--load-format", "dummy", *IGNORE_EOS]
    n = max(1, size.n // 8) if quick else size.n
    overrides = [f"train_files={train}", f"n={n}", "max_samples=-1", f"max_response_length={size.answer}",
                 "generation.show_progress=false"]
    plan = ServerPlan("bench", "127.0.0.1", free_port(), (int(os.environ.get("PIPEGEN_BENCH_GPU", "0")),))
    argv, env = sglang_server_command(plan, model, {"python": python, "tp": 1}, 0)
    server_flags = argv[argv.index("--model-path") + 2:] + extra  # what every arm runs with (size flags included)
    server_flags = [f for i, f in enumerate(server_flags)
                    if f not in ("--host", "--port") and (i == 0 or server_flags[i - 1] not in ("--host", "--port"))]
    server = ServerProcess(argv + extra, tmp / f"sglang_server_{key}.log", port=plan.port, env=env).start()
    try:
        loaded = time.monotonic()
        server.wait_ready(1200)
        load_s = time.monotonic() - loaded
        with UtilSampler() as util:
            c.post_all(server.url, warmup_bodies(size.answer), 64)  # kernels built before anything is timed
            pg = run_pipegen(tmp / f"pipegen-{key}", server.url, model, overrides)
            bodies = raw_bodies(RunDir(pg.root))
            raw_in_flight = min(len(bodies), RAW_IN_FLIGHT)
            raw_all, s2, e2 = run_raw(server.url, bodies, raw_in_flight)
        pg_util, raw_util = util.between(pg.first_request, pg.last_line), util.between(s2, e2)
    finally:
        server.stop(30)
    with UtilSampler() as util:
        t0 = time.time()
        offline = run_offline_engine(python, model, bodies, server_flags, tmp)
        off_util = util.between(t0, time.time())
    units = len(bodies)
    pg_window = pg.last_line - pg.first_request
    raw_window = e2 - s2
    windows = f"windows {pg_window:.0f} / {raw_window:.0f} / {offline['seconds']:.0f} s"
    if min(pg_window, raw_window, offline["seconds"]) < MIN_WINDOW_S:
        windows += f" (under {MIN_WINDOW_S:.0f} s: noisy)"
    off = float(offline["output_tok_per_s"])
    common = (f"{units} requests ({n} per demo prompt), {size.answer} tokens each (ignore_eos), log-probs on; "
              f"{Path(model).name if size.shape is None else size.name} with random weights; {windows}")
    res.add(c.Row(what=f"{size.name}, {size.answer}-token answers: pipegen vs raw loop ({raw_in_flight} in flight)",
                  ratio=pg.tok_per_s / raw_all, label="pipegen ÷ raw aiohttp loop (output tok/s)", target="≥ 0.95",
                  raw=(f"pipegen {c.fmt_rate(pg.tok_per_s, ' tok/s')} ({pg.tok_per_s / size.answer:,.0f} req/s, "
                       f"{pg.in_flight} in flight, {pg_util}), raw {c.fmt_rate(raw_all, ' tok/s')} "
                       f"({raw_all / size.answer:,.0f} req/s, {raw_util}); {common}")))
    res.add(c.Row(what=f"{size.name}: pipegen vs SGLang's engine offline (log-probs on)", ratio=pg.tok_per_s / off,
                  label="pipegen ÷ sglang.Engine.generate, one call (output tok/s)", target="≥ 0.95",
                  raw=(f"offline {c.fmt_rate(off, ' tok/s')} ({offline['requests_per_s']:,.0f} req/s, {off_util}, "
                       f"finish {offline['finish']}); server ready in {load_s:.0f} s; server flags "
                       f"{' '.join(server_flags)}")))
    res.notes.append(f"gpu ({size.name}): {gpu_names()[0] if gpu_names() else 'GPU'}; pipegen's launch took "
                     f"{pg.wall_s:.0f} s wall; start-up: {pg.startup}")


def measure(res: c.ScenarioResult, tmp: Path, python: str, quick: bool) -> None:
    for key in sizes_wanted():
        try:
            measure_size(res, tmp, python, key, quick)
        except Exception as e:  # one size that fails must not hide the others' rows
            res.add(c.Row(what=f"{SIZES[key].name}: error", ratio=None, label="", raw=f"{type(e).__name__}: {e}"))


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
    keep = os.environ.get("PIPEGEN_BENCH_GPU_DIR")  # a folder to keep the servers' and arms' logs in
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        measure(res, Path(keep), python, quick)
        return res
    with c.scratch("gpu") as tmp:
        measure(res, tmp, python, quick)
    return res

