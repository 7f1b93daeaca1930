"""What every benchmark scenario shares: result rows, side-by-side timing, machine facts, realistic
records, run configs and a reference server in a subprocess.

Owns: the rule that every reported figure is a ratio of two things measured side by side (interleaved
in one process, or within the same minute), and the helpers that make that easy.
Must never: assert on timings (benchmarks report, tests do not judge speed), or write outside the
temporary folders it is given.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson

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
    met: bool | None = None
    raw: str = ""
    unit: str = "×"


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


def loadavg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


# ---------------------------------------------------------------------------------------------------
# machine and versions


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f", {int(line.split()[1]) / 1024 ** 2:.0f} GiB RAM"
    except OSError:
        pass
    return f"{cpu_model()}, {cores} cores{mem}, {platform.system()} {platform.release()}"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "verl", "orjson", "aiohttp", "uvloop", "ray", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


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
# realistic records, built the way the actor builds them


PROMPT_TOKENS = 256
TOKEN_LO, TOKEN_HI = 100, 1900  # ordinary ids of the tiny test model's vocabulary (2048)


def bench_config(run_root: Path, *overrides: str):
    """The resolved run config for a run folder (tiny test model, demo data), as the launcher saves it."""
    from omegaconf import open_dict

    from pipegen.config import compose, resolved
    from pipegen.data import resolve_train_files
    from pipegen.testing.tiny_models import tiny_model_path

    model = tiny_model_path()
    cfg = compose([f"output_dir={run_root}", f"model_path={model}", *overrides])
    with open_dict(cfg):
        cfg.model_path = model
        cfg.actor_rollout_ref.model.path = model
        files = resolve_train_files(cfg.data.train_files)
        cfg.train_files = files[0]
        cfg.data.train_files = files[0]
    return resolved(cfg)


class RecordFactory:
    """Stream records with the actor's exact shape: encode_record(index, sample, body), where body holds
    uid/priority/seed/agent_name/launch/row and trajectories made by the actor's `_trajectory_json` from a
    verl AgentLoopOutput (float32 logprobs). Rows are real dataset rows of the demo set."""

    def __init__(self, cfg, n: int):
        from pipegen.dataset import load_dataset, load_tokenizer, row_fields

        self.cfg = cfg
        self.n = n
        tokenizer = load_tokenizer(cfg)
        dataset = load_dataset(cfg, tokenizer)
        from pipegen.dataset import dataset_indices

        self.indices = dataset_indices(dataset)
        self.rows = [row_fields(dataset, pos) for pos in range(len(self.indices))]

    def units(self, count: int) -> list[tuple[int, int, int]]:
        """(position, index, sample) of the first `count` units, prompt-major like the actor's."""
        out = []
        for pos, index in enumerate(self.indices):
            for s in range(self.n):
                out.append((pos, index, s))
                if len(out) == count:
                    return out
        raise ValueError(f"the dataset has only {len(out)} units; asked for {count}")

    def bodies(self, count: int, response_tokens: int, seed: int = 0) -> list[tuple[int, int, dict[str, Any]]]:
        import numpy as np
        from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

        from pipegen.actor import _trajectory_json
        from pipegen.units import prompt_uid, unit_seed

        rng = np.random.default_rng(seed)
        out = []
        for pos, index, sample in self.units(count):
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
            body = {
                "uid": prompt_uid("bench", index),
                "priority": pos * self.n + sample,
                "seed": unit_seed(0, index, sample),
                "agent_name": "single_turn_agent",
                "launch": "bench",
                "row": self.rows[pos],
                "trajectories": [_trajectory_json(output)],
            }
            out.append((index, sample, body))
        return out


# ---------------------------------------------------------------------------------------------------
# a reference server in a subprocess


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path):
        self.proc = proc
        self.url = url
        self.log_path = log_path

    def get_json(self, path: str, timeout: float = 30) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as resp:
            return orjson.loads(resp.read())

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@contextmanager
def reference_server(folder: Path, args: list[str], name: str = "server", ready_timeout_s: float = 300,
                     threads: int = 1) -> Iterator[Server]:
    """`python -m pipegen.servers.reference_server ARGS` on a free loopback port, ready on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    port_file = folder / f"{name}.port"
    log_path = folder / f"{name}.log"
    port_file.unlink(missing_ok=True)  # a stale port file would point at a server that is gone
    argv = [sys.executable, "-m", "pipegen.servers.reference_server", "--host", "127.0.0.1", "--port", "0",
            "--port-file", str(port_file), "--stats-interval", "0", "--log-level", "warning", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not port_file.exists():
            _check_alive(proc, log_path, deadline)
            time.sleep(0.02)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        while True:
            _check_alive(proc, log_path, deadline)
            try:
                with urllib.request.urlopen(f"{url}/health_generate", timeout=30) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        yield Server(proc, url, log_path)
    finally:
        stop_process(proc)


def _check_alive(proc: subprocess.Popen, log_path: Path, deadline: float) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"reference server exited ({proc.returncode}); log {log_path}:\n"
                           + log_path.read_text(errors="replace")[-2000:])
    if time.monotonic() > deadline:
        raise RuntimeError(f"reference server not ready in time; log {log_path}")


def stop_process(proc: subprocess.Popen, grace_s: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
