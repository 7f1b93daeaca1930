"""HTTP server manager: what verl agent loops call `server_manager.generate(...)` on, over SGLang's /generate.

Owns: mapping verl's sampling params to SGLang's native request exactly as verl's SGLang adapter does
(max_new_tokens rule, `logprobs` popped to top-level `return_logprob`), parsing SGLang's answer into
verl's `TokenOutput`, routing (least in-flight, sticky per prompt), timeouts, retries with backoff on
another server, and taking failing servers out of rotation until a health probe passes.
Must never: re-tokenize anything (ids in, ids out), retry a 400 (a client bug retries forever), or
fabricate an output when the retry budget is spent (it raises; the actor records a failure).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

log = logging.getLogger("pipegen.client")

STICKY_CACHE_SIZE = 10000
FAILURES_BEFORE_QUARANTINE = 3


class RequestRejected(Exception):
    """The server refused the request itself (HTTP 4xx): retrying cannot help."""


class RetriesExhausted(Exception):
    """Every attempt failed with a transient error (connection, 5xx, timeout, abort)."""


@dataclass
class ServerState:
    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    healthy: bool = True
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class ClientLimits:
    prompt_length: int
    response_length: int
    max_model_len: int
    request_timeout_s: float = 600.0
    max_attempts: int = 4
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    probe_interval_s: float = 1.0


def max_new_tokens_for(sampling_params: dict[str, Any], prompt_len: int, limits: ClientLimits) -> int:
    """verl's SGLang rule (async_sglang_server.generate): caller's value, else the remaining budget, clamped."""
    max_possible = limits.max_model_len - prompt_len - 1
    if max_possible < 0:
        raise RequestRejected(
            f"prompt of {prompt_len} tokens exceeds the model's maximum context length ({limits.max_model_len})"
        )
    if "max_new_tokens" in sampling_params:
        wanted = sampling_params.pop("max_new_tokens")
        sampling_params.pop("max_tokens", None)
    elif "max_tokens" in sampling_params:
        wanted = sampling_params.pop("max_tokens")
    else:
        wanted = min(limits.response_length, limits.prompt_length + limits.response_length - prompt_len)
    return max(0, min(int(wanted), max_possible))


def build_request(
    prompt_ids: list[int], sampling_params: dict[str, Any], limits: ClientLimits, sampling_seed: int | None
) -> dict[str, Any]:
    """The JSON body for SGLang's POST /generate (single form)."""
    params = dict(sampling_params)
    max_new = max_new_tokens_for(params, len(prompt_ids), limits)
    return_logprob = bool(params.pop("logprobs", False))
    params.pop("prompt_logprobs", None)
    params["max_new_tokens"] = max_new
    if sampling_seed is not None:
        params["sampling_seed"] = sampling_seed
    return {
        "rid": uuid.uuid4().hex,  # fresh per attempt: re-sending an in-flight rid is a 400 in SGLang
        "input_ids": list(prompt_ids),
        "sampling_params": params,
        "return_logprob": return_logprob,
    }


def parse_response(body: dict[str, Any], return_logprob: bool):
    """SGLang /generate answer -> verl TokenOutput, the way verl's SGLang server builds it."""
    from verl.workers.rollout.replica import TokenOutput

    meta = body.get("meta_info", {})
    finish = meta.get("finish_reason")
    stop_reason = finish.get("type") if finish else None
    token_ids = list(body.get("output_ids", []))
    if return_logprob:
        triples = meta.get("output_token_logprobs") or []
        if triples and len(triples) == len(token_ids):
            log_probs = [float(t[0]) for t in triples]
        else:  # the max_new_tokens=0 phantom entry, or an abort with no logprobs: verl keeps nothing
            token_ids, log_probs = [], []
    else:
        log_probs = None
    extra = {"global_steps": None, "min_global_steps": None, "max_global_steps": None}
    return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason, extra_fields=extra)


class ServerPool:
    """Routes requests over a fixed list of servers. One per actor process, used from one event loop."""

    def __init__(self, urls: list[str], limits: ClientLimits, session: aiohttp.ClientSession):
        if not urls:
            raise ValueError("no LLM server URLs to send requests to")
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        self.limits = limits
        self.session = session
        self._sticky: OrderedDict[Any, ServerState] = OrderedDict()
        self._recovered = asyncio.Event()
        self._probes: dict[str, asyncio.Task] = {}
        self.requests_sent = 0
        self.output_tokens = 0
        self.latencies: list[float] = []
        self.finish_reasons: dict[str, int] = {}

    # ---- routing ----
    def pick(self, sticky_key: Any, exclude: set[str]) -> ServerState | None:
        healthy = [s for s in self.servers if s.healthy and s.url not in exclude]
        if not healthy:
            healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            return None
        chosen = self._sticky.get(sticky_key)
        if chosen is None or chosen not in healthy:
            chosen = min(healthy, key=lambda s: s.in_flight)
            self._sticky[sticky_key] = chosen
        self._sticky.move_to_end(sticky_key)
        while len(self._sticky) > STICKY_CACHE_SIZE:
            self._sticky.popitem(last=False)
        return chosen

    def _record_failure(self, server: ServerState, kind: str) -> None:
        server.errors[kind] = server.errors.get(kind, 0) + 1
        server.consecutive_failures += 1
        if server.healthy and server.consecutive_failures >= FAILURES_BEFORE_QUARANTINE:
            server.healthy = False
            log.warning("server %s left rotation after %d failures in a row; probing it", server.url,
                        server.consecutive_failures)
            self._recovered.clear()
            self._probes[server.url] = asyncio.get_running_loop().create_task(self._probe(server))

    async def _probe(self, server: ServerState) -> None:
        while True:
            await asyncio.sleep(self.limits.probe_interval_s)
            try:
                async with self.session.get(
                    f"{server.url}/health_generate", timeout=aiohttp.ClientTimeout(total=30)
                ) as resp:
                    if resp.status == 200:
                        server.healthy = True
                        server.consecutive_failures = 0
                        log.warning("server %s is healthy again", server.url)
                        self._recovered.set()
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass

    # ---- the verl server-manager contract ----
    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        sticky_key: Any = None,
        sampling_seed: int | None = None,
        **_: Any,
    ):
        body = build_request(prompt_ids, sampling_params, self.limits, sampling_seed)
        payload = orjson.dumps(body)
        tried: set[str] = set()
        last_error = "no attempt made"
        for attempt in range(self.limits.max_attempts):
            if attempt:
                delay = min(self.limits.backoff_max_s, self.limits.backoff_base_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * (0.5 + random.random()))
                body["rid"] = uuid.uuid4().hex
                payload = orjson.dumps(body)
            server = self.pick(sticky_key if sticky_key is not None else request_id, tried)
            while server is None:  # every server quarantined: wait for a probe to bring one back
                try:
                    await asyncio.wait_for(self._recovered.wait(), timeout=self.limits.request_timeout_s)
                except asyncio.TimeoutError:
                    raise RetriesExhausted("no healthy LLM server for the whole request timeout") from None
                server = self.pick(sticky_key, tried)
            tried.add(server.url)
            server.in_flight += 1
            server.requests += 1
            self.requests_sent += 1
            started = time.monotonic()
            try:
                async with self.session.post(
                    f"{server.url}/generate",
                    data=payload,
                    headers={"Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=self.limits.request_timeout_s),
                ) as resp:
                    raw = await resp.read()
                    status = resp.status
            except asyncio.TimeoutError:
                last_error = f"timeout after {self.limits.request_timeout_s:.0f}s from {server.url}"
                self._record_failure(server, "timeout")
                continue
            except aiohttp.ClientError as e:
                last_error = f"{type(e).__name__} from {server.url}: {e}"
                self._record_failure(server, "connection")
                continue
            finally:
                server.in_flight -= 1
            if status >= 500:
                last_error = f"HTTP {status} from {server.url}: {raw[:200]!r}"
                self._record_failure(server, f"http_{status}")
                continue
            if status != 200:
                raise RequestRejected(f"HTTP {status} from {server.url}: {raw[:300].decode(errors='replace')}")
            answer = orjson.loads(raw)
            finish = (answer.get("meta_info", {}).get("finish_reason") or {}).get("type")
            if finish == "abort":
                last_error = f"request aborted by {server.url}"
                self._record_failure(server, "abort")
                continue
            server.consecutive_failures = 0
            out = parse_response(answer, body["return_logprob"])
            self.latencies.append(time.monotonic() - started)
            self.output_tokens += len(out.token_ids)
            self.finish_reasons[finish or "none"] = self.finish_reasons.get(finish or "none", 0) + 1
            return out
        raise RetriesExhausted(f"gave up after {self.limits.max_attempts} attempts; last error: {last_error}")

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    def close(self) -> None:
        for task in self._probes.values():
            task.cancel()


class UnitServerManager:
    """The object handed to one verl agent loop: pins the unit's prompt to one server and its seed."""

    def __init__(self, pool: ServerPool, sticky_key: Any, sampling_seed: int | None):
        self.pool = pool
        self.sticky_key = sticky_key
        self.sampling_seed = sampling_seed

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kw: Any):
        return await self.pool.generate(
            request_id,
            prompt_ids=prompt_ids,
            sampling_params=sampling_params,
            sticky_key=self.sticky_key,
            sampling_seed=self.sampling_seed,
        )
