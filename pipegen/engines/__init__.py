"""The inference engines pipegen speaks, one module per protocol, behind one small interface.

`Engine` is what the actor's request path (routing.py, sending.py, attempts.py), admission.py and readiness.py
(and the launcher's readiness wait) ask of a server: build the body for one generation (token ids in, a per-unit seed, stop ids, the request's own
id), read the answer back as verl's `TokenOutput` (ids and one log-prob per id, never re-tokenized) with
its finish reason as `stop` / `length` / `abort`, abort a stalled request, report readiness, the
engine's own limit on running requests and its load (running, waiting). Everything after the answer
(records, the writer, the DataProto) is the same whatever the engine.

- sglang.py: SGLang's native `/generate` (also pipegen's CPU reference server, with any model backend).
- vllm.py: vLLM's OpenAI `/v1/completions` with token ids.

`llm.protocol` names the engine (`sglang`, `vllm`), or `auto` for servers someone else runs:
`detect_protocol` then asks the URL which one it speaks.

The interface itself (`Engine`, `EngineRequest`, `LoadUnavailable`) is base.py's, which
sglang.py and vllm.py import: this module imports them, never the reverse.

Owns: the registry of engines, how a URL's engine is recognised, and the one readiness probe (a server is
ready when its engine's health route answers 200): blocking for the launcher's watches, async for the actor.
Must never: hold per-request state (an `EngineRequest` carries it) or decide retries (actor/attempts.py does).
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from pipegen.engines.base import Engine, EngineRequest, GroupRefused, LoadUnavailable, NotStreamed, StreamError

if TYPE_CHECKING:
    import aiohttp

__all__ = ["AUTO", "PROTOCOLS", "Engine", "EngineRequest", "GroupRefused", "LoadUnavailable", "NotStreamed",
           "StreamError",
           "UnknownEngine", "detect_protocol",
           "engine", "is_ready", "ready_problem"]

PROTOCOLS = ("sglang", "vllm")
AUTO = "auto"


class UnknownEngine(ValueError):
    """A URL that answers, but as no engine pipegen knows."""


def engine(protocol: str) -> Engine:
    """The engine speaking `protocol` (`sglang` or `vllm`), imported when asked for: the launcher's
    readiness probe needs neither (nor aiohttp, which both pull in)."""
    if protocol == "sglang":
        from pipegen.engines.sglang import SGLang

        return SGLang()
    if protocol == "vllm":
        from pipegen.engines.vllm import VLLM

        return VLLM()
    raise ValueError(f"llm.protocol={protocol!r} is unknown; choose one of {', '.join(PROTOCOLS)} or {AUTO}")


def _get(url: str, timeout_s: float) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None, b""


# What a server reports of itself that decides its numerics (SGLang's /get_server_info names; the CPU server's too)
SERVER_FACTS = ("version", "dtype", "enable_deterministic_inference", "attention_backend", "disable_radix_cache",
                "tp_size", "pipegen_reference_server", "pipegen_not_reproducible")


def server_facts(url: str, protocol: str, timeout_s: float = 10.0) -> dict:
    """The engine's own account of what decides its numerics (version, dtype, deterministic mode as it resolved it),
    for the run's record (conf/engines.json); {} where the server says nothing. Blocking: the launcher's watch."""
    route = "/get_server_info" if protocol == "sglang" else "/version"
    status, body = _get(f"{url}{route}", timeout_s)
    if status != 200:
        return {}
    try:
        info = json.loads(body)
    except ValueError:
        return {}
    facts = {k: info[k] for k in SERVER_FACTS if isinstance(info, dict) and k in info}
    return {"protocol": protocol, **facts}


def detect_protocol(url: str, timeout_s: float = 30.0) -> str | None:
    """Which engine serves `url`: `sglang` when it has SGLang's `/health_generate` (200, or 503 while
    loading), `vllm` when that route is missing and `/version` names a version (vLLM's API server);
    None while nothing answers (still loading, or not there). Raises UnknownEngine when something answers
    that is neither. Blocking: the actor runs it in a thread."""
    status, _ = _get(f"{url}/health_generate", timeout_s)
    if status in (200, 503):
        return "sglang"
    if status != 404:
        return None
    status, raw = _get(f"{url}/version", timeout_s)
    if status == 200:
        try:
            if "version" in json.loads(raw):
                return "vllm"
        except (ValueError, TypeError):
            pass
    raise UnknownEngine(f"{url} answers HTTP but speaks neither SGLang's /generate (no /health_generate) nor "
                        f"vLLM's API (no /version); set llm.protocol=sglang or llm.protocol=vllm if it does")


# ---- the one readiness probe: the launcher's watches, the actor's start-up and re-admission, the tests ----

READY_TIMEOUT_S = 30.0  # SGLang's /health_generate runs one token through the engine: give it time under load
UNREACHABLE = ("connection refused", "unknown host", "no route to host", "network unreachable")


def ready_problem(url: str, health_path: str, timeout_s: float = READY_TIMEOUT_S) -> str | None:
    """The readiness probe, blocking (the launcher's watches): None when GET url + health_path answers
    200 within timeout_s, else what happened, in words."""
    try:
        with urllib.request.urlopen(f"{url}{health_path}", timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused"
        if isinstance(reason, socket.gaierror):
            return "unknown host"
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return f"no answer within {timeout_s:.0f}s"
        text = str(getattr(reason, "strerror", None) or reason).lower()
        for kind in UNREACHABLE:
            if kind in text:
                return kind
        return text or type(reason).__name__


async def is_ready(session: "aiohttp.ClientSession", url: str, health_path: str,
                   timeout_s: float = READY_TIMEOUT_S) -> bool:
    """The readiness probe, async (the actor's): GET url + health_path answered 200 within timeout_s.
    A refused connection, a 503 or a timeout all mean "not ready yet"."""
    import aiohttp

    try:
        async with session.get(f"{url}{health_path}", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
