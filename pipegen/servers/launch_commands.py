"""Command lines for LLM servers, and readiness probing.

Owns: the exact argv + environment of a CPU reference server or an SGLang server for one ServerPlan,
and waiting until `/health_generate` answers 200 while the process is alive.
Must never: start a process (the launcher's supervisor does) or treat a bound port as ready.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Mapping

from pipegen.world import ServerPlan


def cpu_server_command(plan: ServerPlan, model_path: str, llm: Mapping, seed: int) -> tuple[list[str], dict[str, str]]:
    argv = [
        sys.executable, "-m", "pipegen.servers.reference_server",
        "--model-path", str(model_path),
        "--host", plan.host,
        "--port", str(plan.port),
        "--engine", str(llm.get("engine", "hf")),
        "--threads", str(llm.get("threads", 1)),
        "--dtype", str(llm.get("dtype", "auto")),
        "--max-batch", str(llm.get("max_batch", 8)),
        "--seed", str(seed),
        *[str(a) for a in (llm.get("engine_args") or [])],
    ]
    return argv, {"OMP_NUM_THREADS": str(llm.get("threads", 1))}


def sglang_server_command(plan: ServerPlan, model_path: str, llm: Mapping, seed: int) -> tuple[list[str], dict[str, str]]:
    """`python -m sglang.launch_server` for one tensor-parallel group, token ids in and out."""
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", plan.host,
        "--port", str(plan.port),
        "--tp-size", str(len(plan.gpus) or int(llm.get("tp", 1))),
        "--mem-fraction-static", str(llm.get("mem_fraction_static", 0.85)),
        "--random-seed", str(seed),
        "--skip-tokenizer-init",
    ]
    if int(llm.get("dp", 1)) > 1:
        argv += ["--dp-size", str(llm["dp"])]
    if llm.get("context_length"):
        argv += ["--context-length", str(llm["context_length"])]
    if llm.get("deterministic_inference"):
        argv.append("--enable-deterministic-inference")
    if llm.get("max_running_requests"):
        argv += ["--max-running-requests", str(llm["max_running_requests"])]
    argv += [str(a) for a in (llm.get("extra_args") or [])]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in plan.gpus)} if plan.gpus else {}
    return argv, env


class ServerNotReady(RuntimeError):
    pass


def log_tail(path: Path | None, lines: int = 15) -> str:
    if path is None or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    return "\n".join("    " + t for t in text)


def wait_ready(
    url: str,
    deadline_s: float,
    is_alive: Callable[[], bool] = lambda: True,
    log_path: Path | None = None,
    poll_s: float = 0.5,
) -> float:
    """Poll GET /health_generate until 200; connection refused and 503 mean 'still loading'.

    Returns seconds waited. Raises ServerNotReady quoting the server log's tail on death or deadline.
    """
    started = time.monotonic()
    while True:
        if not is_alive():
            raise ServerNotReady(f"LLM server {url} exited during startup; its log ({log_path}) ends with:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health_generate", timeout=30) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - started > deadline_s:
            raise ServerNotReady(
                f"LLM server {url} not ready after {deadline_s:.0f}s (llm.ready_timeout_s); "
                f"its log ({log_path}) ends with:\n{log_tail(log_path)}"
            )
        time.sleep(poll_s)
