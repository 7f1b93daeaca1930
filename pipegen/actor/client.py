"""HTTP server manager: what verl agent loops call `server_manager.generate(...)` on, over the servers'
engine protocol (engines/: SGLang's /generate, vLLM's /v1/completions).

Owns:
- sending: the body the engine builds (a fresh request id per attempt), its answer parsed by the engine;
- routing: every request of one sticky key (the prompt's index: its n samples and every turn of a unit)
  goes to one server, chosen by least in-flight requests when the key is new or its server is out of
  rotation;
- failure handling: a stall watchdog on every request (the deadline is admission.py's, from its
  max_new_tokens and the server's observed time per token; on expiry the request is aborted on that server
  (SGLang: `POST /abort_request {rid}`; every engine: its connection is closed) and re-sent elsewhere with a
  new id), `llm.request_timeout_s` as the outer bound; when admission.py says a request may be hedged (the
  tail), it is sent once more, first answer wins, the other is aborted; connection errors, 5xx/408/429,
  stalls, aborts and unreadable answers are retried with exponential backoff and jitter on another server
  when there is one; a server that fails `quarantine_after` times in a row leaves rotation and is probed
  (the engine's health route) until it answers 200 (a server still loading at start-up is probed the same
  way until it first answers); when no server is in rotation, requests wait for one
  to come back (bounded by the request timeout).
Must never: re-tokenize anything (ids in, ids out), retry a 4xx other than 408/429 (a client bug would
retry forever), send an id outside the vocabulary, or fabricate an output when the retry budget is spent
(it raises `RetriesExhausted`; the actor records the unit as failed).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import orjson

from pipegen.run.pictures import image_data_url
from pipegen.engines import AUTO, Engine, EngineRequest, engine, is_ready
from pipegen.actor.admission import Admission, TokenClock, WatchdogLimits
from pipegen.actor.limits import ClientLimits
from pipegen.engines.request import RequestRejected

__all__ = ["ClientLimits", "RequestRejected", "RetriesExhausted", "ServerPool"]

log = logging.getLogger("pipegen.client")

STICKY_CACHE_SIZE = 10000
MAX_COPIES = 3  # a request and its hedges in flight at once (the tail only)
RETRYABLE_4XX = (408, 429)  # request timeout / too many requests (routers): transient, not a client bug
NO_TIMEOUT = aiohttp.ClientTimeout()  # no total, no socket timeouts (the session default would be 300 s)


class RetriesExhausted(Exception):
    """Every attempt failed with a transient error (connection, 5xx, timeout, abort)."""


@dataclass
class ServerState:
    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    healthy: bool = True
    requests: int = 0
    successes: int = 0
    quarantines: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    clock: TokenClock = field(default_factory=TokenClock)
    stalled: int = 0  # requests past their deadline here (then aborted here and re-sent)


class ServerPool:
    """Routes requests over a fixed list of servers. One per actor process, used from one event loop.

    Also usable directly as verl's `llm_client` / `server_manager`: without a sticky key, the
    request_id is the key (verl's ToolAgentLoop reuses one request_id for every turn).
    """

    def __init__(self, urls: list[str], limits: ClientLimits, session: aiohttp.ClientSession,
                 protocol: str = "sglang", admission: Admission | None = None,
                 on_first_request: Callable[[], None] | None = None):
        if not urls:
            raise ValueError("no LLM server URLs to send requests to")
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        self.limits = limits
        self.session = session
        # the servers' engine (llm.protocol); with `auto`, None until readiness.py recognised the first server
        self.engine: Engine | None = None if protocol == AUTO else engine(protocol)
        self._sticky: OrderedDict[Any, ServerState] = OrderedDict()
        self._recovered = asyncio.Event()
        self._probes: dict[str, asyncio.Task] = {}
        self.requests_sent = 0
        self.retries = 0
        self.output_tokens = 0
        self.latencies: deque[float] = deque(maxlen=4096)
        self.finish_reasons: dict[str, int] = {}
        self.stalled = 0  # requests past their stall deadline
        self.aborts_sent = 0  # requests aborted by this client (stalls and hedge losers)
        self.hedges = 0  # tail requests sent a second time
        self.hedge_wins = 0  # ...whose second copy answered first
        # stall deadlines and hedging are the actor's admission policy's; on its own, a pool only has deadlines
        self.admission = admission if admission is not None else Admission(WatchdogLimits())
        self._superseded: set[str] = set()  # rids being aborted by this client (their abort answer is no failure)
        self._json_headers = {"Content-Type": "application/json"}
        self._on_first_request = on_first_request  # called as the first request is sent (the start-up clock)

    # ---- routing ----
    def pick(self, sticky_key: Any, exclude: set[str] = frozenset()) -> ServerState | None:
        """The key's server if it is in rotation and not excluded; else the least loaded one.

        A key is re-pinned only when its server left rotation (or it had none): a one-off retry
        elsewhere keeps the pin, so the prefix cache of the prompt stays on one server.
        """
        healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            return None
        pinned = self._sticky.get(sticky_key)
        if pinned is not None and pinned.healthy:
            self._sticky.move_to_end(sticky_key)
            if pinned.url not in exclude:
                return pinned
            candidates = [s for s in healthy if s.url not in exclude] or healthy
            return self._least_loaded(candidates)
        candidates = [s for s in healthy if s.url not in exclude] or healthy
        chosen = self._least_loaded(candidates)
        self._sticky[sticky_key] = chosen
        self._sticky.move_to_end(sticky_key)
        while len(self._sticky) > STICKY_CACHE_SIZE:
            self._sticky.popitem(last=False)
        return chosen

    @staticmethod
    def _least_loaded(candidates: list[ServerState]) -> ServerState:
        # ties (e.g. all idle at start) go to the server that has had fewer requests, not always the first
        return min(candidates, key=lambda s: (s.in_flight, s.requests))

    def _record_failure(self, server: ServerState, kind: str) -> None:
        server.errors[kind] = server.errors.get(kind, 0) + 1
        server.consecutive_failures += 1
        if server.healthy and server.consecutive_failures >= self.limits.quarantine_after:
            server.healthy = False
            server.quarantines += 1
            log.warning("server %s left rotation after %d failures in a row (last: %s); probing it", server.url,
                        server.consecutive_failures, kind)
            if not any(s.healthy for s in self.servers):
                self._recovered.clear()
            self._start_probe(server, self.limits.probe_interval_s)

    def _record_success(self, server: ServerState) -> None:
        server.consecutive_failures = 0
        server.successes += 1

    async def _probe(self, server: ServerState, interval_s: float, first_time: bool) -> None:
        """Poll the engine's health route until 200, then put the server (back) into rotation."""
        while True:
            await asyncio.sleep(interval_s)
            if await is_ready(self.session, server.url, self.engine.health_path,
                              min(self.limits.probe_timeout_s, self.limits.request_timeout_s)):
                if first_time:  # a server that was still loading: the normal course of a start-up
                    log.info("server %s ready: joins the rotation", server.url)
                else:
                    log.warning("server %s answers %s again: back in rotation", server.url, self.engine.health_path)
                self.admit(server)
                return

    def _start_probe(self, server: ServerState, interval_s: float, first_time: bool = False) -> None:
        task = self._probes.get(server.url)
        if task is None or task.done():
            self._probes[server.url] = asyncio.get_running_loop().create_task(
                self._probe(server, interval_s, first_time))

    def hold_out(self, server: ServerState, interval_s: float) -> None:
        """A server still loading at start-up: out of rotation (no unit is retried against it) until its
        readiness probe first answers."""
        server.healthy = False
        self._start_probe(server, interval_s, first_time=True)

    def admit(self, server: ServerState) -> None:
        """Put a server that answers its readiness probe into rotation, and wake the requests that wait
        while no server is in rotation."""
        server.healthy = True
        server.consecutive_failures = 0
        self._recovered.set()

    async def _wait_for_a_server(self, sticky_key: Any, exclude: set[str]) -> ServerState:
        server = self.pick(sticky_key, exclude)
        deadline = time.monotonic() + self.limits.request_timeout_s
        while server is None:  # every server is out of rotation: wait for a probe to bring one back
            self._recovered.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RetriesExhausted(
                    f"no LLM server in rotation for {self.limits.request_timeout_s:.0f}s (llm.request_timeout_s); "
                    f"errors: {self.error_summary()}")
            try:
                await asyncio.wait_for(self._recovered.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass
            server = self.pick(sticky_key, exclude)
        return server

    def _backoff(self, attempt: int) -> float:
        delay = min(self.limits.backoff_max_s, self.limits.backoff_base_s * 2 ** (attempt - 1))
        return delay * (0.5 + random.random())  # jitter: retries of many units do not arrive in lockstep

    # ---- the verl server-manager contract ----
    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        sticky_key: Any = None,
        sampling_seed: int | None = None,
        image_data: list[Any] | None = None,
        **_: Any,
    ):
        if image_data:  # verl's loops hand PIL images; the engines take PNG data URLs (run/pictures.py)
            image_data = [i if isinstance(i, str) else image_data_url(i) for i in image_data]
        request = self.engine.build(prompt_ids, sampling_params, self.limits, sampling_seed, image_data)
        key = sticky_key if sticky_key is not None else request_id
        tried: set[str] = set()
        errors: list[str] = []
        stalls = 0
        for attempt in range(self.limits.max_attempts):
            if attempt:
                self.retries += 1
                await asyncio.sleep(self._backoff(attempt))
                request = self.engine.renewed(request)
            server = await self._wait_for_a_server(key, tried)
            tried.add(server.url)
            if len(tried) >= len(self.servers):
                tried.clear()  # every server had a go: the next attempt may return to any of them
                tried.add(server.url)
            result = await self._watched(server, request, key, stalls)
            if isinstance(result, str):
                errors.append(result)
                stalls += result.startswith("stalled")
                continue
            return result
        raise RetriesExhausted(f"gave up after {self.limits.max_attempts} attempts: " + "; ".join(errors[-4:]))

    async def _watched(self, server: ServerState, request: EngineRequest, key: Any, stalls: int):
        """One attempt under the stall watchdog (and, in the tail, with one hedge): the TokenOutput, or a
        string naming a transient failure. RequestRejected propagates."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        max_new = request.max_new_tokens or self.limits.response_length
        admission = self.admission
        deadline = started + min(admission.stall_deadline(server.clock, max_new, stalls), self.limits.request_timeout_s)
        primary = self._start(server, request)
        copies = {primary: (server, request)}
        last_sent = started
        failures: list[str] = []
        try:
            while copies:
                now = loop.time()
                hedge_after = admission.hedge_after() if len(copies) < MAX_COPIES else None
                wake = deadline - now
                if hedge_after is not None:
                    if now - last_sent >= hedge_after:
                        # a copy may hang too: the newest one gets the same grace before the next copy
                        hedge_server = self.pick(key, {srv.url for srv, _ in copies.values()}) or server
                        hedge = self.engine.renewed(request)
                        copies[self._start(hedge_server, hedge)] = (hedge_server, hedge)
                        self.hedges += 1
                        last_sent = now
                        continue
                    wake = min(wake, max(0.05, last_sent + hedge_after - now), 1.0)
                elif admission.may_hedge_later() and len(copies) < MAX_COPIES:
                    wake = min(wake, 1.0)  # re-check: capacity may free up in the tail
                if wake <= 0:
                    for task, (srv, b) in copies.items():
                        srv.stalled += 1
                        self.stalled += 1
                        self._record_failure(srv, "stalled")
                    waited = loop.time() - started
                    await self._cancel_copies(copies)
                    return (f"stalled: no answer from {server.url} in {waited:.0f}s (watchdog deadline from "
                            f"max_new_tokens={max_new}); aborted there")
                waiting_on = set(copies)
                tail = admission.tail_started()
                if tail is not None:
                    waiting_on.add(tail)  # wake when the tail starts, to consider a hedge
                done, _ = await asyncio.wait(waiting_on, timeout=wake, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task not in copies:
                        continue
                    copies.pop(task)
                    result = task.result()  # RequestRejected propagates
                    if isinstance(result, str):
                        failures.append(result)
                        continue
                    if task is not primary:
                        self.hedge_wins += 1
                    return result
            return "; ".join(failures)
        finally:
            if copies:
                await self._cancel_copies(copies)

    async def _cancel_copies(self, copies: dict) -> None:
        """Abort each copy on its server (the engine's abort), then drop its connection (which is
        vLLM's abort)."""
        items = list(copies.items())
        copies.clear()
        self._superseded.update(r.rid for _, (_, r) in items)
        self.aborts_sent += len(items)
        await asyncio.gather(*(self.engine.abort(self.session, srv.url, r, self.limits.abort_timeout_s)
                               for _, (srv, r) in items), return_exceptions=True)
        for task, _ in items:
            task.cancel()
        await asyncio.gather(*(t for t, _ in items), return_exceptions=True)
        self._superseded.difference_update(r.rid for _, (_, r) in items)

    def _start(self, server: ServerState, request: EngineRequest) -> asyncio.Task:
        """Count the request against its server now (the next pick sees it), then send it in a task."""
        if not self.requests_sent and self._on_first_request is not None:
            self._on_first_request()
        server.in_flight += 1
        server.requests += 1
        self.requests_sent += 1
        return asyncio.get_running_loop().create_task(self._attempt(server, request))

    async def _attempt(self, server: ServerState, request: EngineRequest):
        """One POST (counted by _start): the TokenOutput, or a string describing a transient failure
        (already recorded)."""
        started = time.monotonic()
        try:
            async with self.session.post(
                f"{server.url}{self.engine.generate_path}",
                data=orjson.dumps(request.body),
                headers=self._json_headers,
                # no aiohttp timer: _watched bounds every attempt (stall deadline <= llm.request_timeout_s)
                # and cancels it, so a second timer per request would only cost time
                timeout=NO_TIMEOUT,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError) as e:  # no aiohttp timer runs, so no timeout error either
            self._record_failure(server, "connection")
            return f"{type(e).__name__} from {server.url}: {e}"
        finally:
            server.in_flight -= 1
        if status >= 500 or status in RETRYABLE_4XX:
            self._record_failure(server, f"http_{status}")
            return f"HTTP {status} from {server.url}: {raw[:200].decode(errors='replace')}"
        if status != 200:
            raise RequestRejected(f"HTTP {status} from {server.url}: {raw[:300].decode(errors='replace')}")
        try:
            answer = orjson.loads(raw)
            if not isinstance(answer, dict):
                raise ValueError(f"expected a JSON object, got {type(answer).__name__}")
            finish_type = self.engine.finish_type(answer)
            if finish_type == "abort":
                # engines answer 200 for aborted requests; the partial output is dropped and the request re-sent
                if request.rid in self._superseded:  # our own abort of a stalled copy or a hedge loser
                    return f"request {request.rid} aborted by the client"
                self._record_failure(server, "abort")
                return f"request aborted by {server.url}"
            out = self.engine.parse(answer, request)
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # pydantic's ValidationError is a ValueError
            self._record_failure(server, "bad_response")
            return f"unreadable answer from {server.url}: {e}"
        self._record_success(server)
        latency = time.monotonic() - started
        self.latencies.append(latency)
        server.clock.observe(latency, len(out.token_ids))
        self.admission.answered(latency, len(out.token_ids))
        self.output_tokens += len(out.token_ids)
        reason = finish_type or "none"
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        return out

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    def error_summary(self) -> dict[str, int]:
        return {f"{s.url} {k}": v for s in self.servers for k, v in s.errors.items()}

    def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
