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
  to come back (bounded by the request timeout);
- grouping: requests to one server that are ready together (within GROUP_WINDOW_S; a prompt's n samples
  first of all, and any other units admitted in the same round) go as one grouped request where the server's
  engine takes one (`Engine.group_limit`: SGLang's streamed batch `/generate`; not vLLM, not pipegen's CPU
  server). Each member stays its own request for everything above: its own future, deadline, hedge copies,
  abort (by its own id) and retries; each is answered as its own answer arrives in the stream. A grouped
  request that fails as a whole (connection, 5xx) fails each member, which each retries on its own; one the
  server refuses as a whole (4xx, an in-stream error) is sent again member by member, so only a faulty
  member is refused. The group's connection is closed only once none of its members is waited for;
- streaming: a request given `on_tokens` (a long answer whose unit keeps its tokens, actor/continuation.py) goes
  alone and streamed where the engine streams (`Engine.streams`); each unfinished chunk's tokens so far go to
  `on_tokens` with the attempt's id (a re-sent attempt starts again; a hedge copy sends none), and the last chunk is
  read as an answer. An in-stream error is treated as its status would be; a failure to keep the tokens
  (`ProgressLost`) fails the unit, never the server.
Must never: re-tokenize anything (ids in, ids out), retry a 4xx other than 408/429 (a client bug would
retry forever), send an id outside the vocabulary, or fabricate an output when the retry budget is spent
(it raises `RetriesExhausted`; the actor records the unit as failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import aiohttp
import orjson

from pipegen.run.pictures import image_data_url
from pipegen.engines import AUTO, Engine, EngineRequest, GroupRefused, StreamError, engine, is_ready
from pipegen.actor.admission import Admission, TokenClock, WatchdogLimits
from pipegen.actor.limits import ClientLimits
from pipegen.engines.request import RequestRejected

__all__ = ["ClientLimits", "RequestRejected", "RetriesExhausted", "ServerPool"]

log = logging.getLogger("pipegen.client")

STICKY_CACHE_SIZE = 10000
MAX_COPIES = 3  # a request and its hedges in flight at once (the tail only)
RETRYABLE_4XX = (408, 429)  # request timeout / too many requests (routers): transient, not a client bug
NO_TIMEOUT = aiohttp.ClientTimeout()  # no total, no socket timeouts (the session default would be 300 s)
# how long a request waits for others to the same server to share its grouped request: the units of one
# admission round (a prompt's n samples among them) reach here within a few event-loop turns of each other
GROUP_WINDOW_S = 0.002
GROUP_GIVE_UP = 3  # grouped requests to one server failing as a whole in a row: it gets one request each from then


class ProgressLost(RuntimeError):
    """A streamed answer's tokens could not be handed on (EngineRequest.progress raised OSError): never retried."""


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
    group_limit: int | None = None  # generations it takes in one grouped request (None: not asked yet)
    pending: dict[Hashable, list["Member"]] = field(default_factory=dict)  # waiting for GROUP_WINDOW_S
    flush: asyncio.TimerHandle | None = None
    http_requests: int = 0  # POSTs (a grouped request counts once)
    group_failures: int = 0  # grouped requests in a row that failed as a whole (GROUP_GIVE_UP: one by one)


@dataclass(eq=False)
class Member:
    """One generation inside a grouped request: its request and the future its answer settles."""

    request: EngineRequest
    future: asyncio.Future
    group: "Group | None" = None


@dataclass(eq=False)
class Group:
    """Generations sent as one grouped request, and the task that reads its answers."""

    members: list[Member]
    task: asyncio.Task | None = None


class ServerPool:
    """Routes requests over a fixed list of servers. One per actor process, used from one event loop.

    Also usable directly as verl's `llm_client` / `server_manager`: without a sticky key, the
    request_id is the key (verl's ToolAgentLoop reuses one request_id for every turn).
    """

    def __init__(self, urls: list[str], limits: ClientLimits, session: aiohttp.ClientSession,
                 protocol: str = "sglang", admission: Admission | None = None,
                 on_first_request: Callable[[], None] | None = None, group: bool = True):
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
        self.group = group  # actors.group_requests: send requests that are ready together as one where possible
        self.http_requests = 0  # POSTs of generations (a grouped request counts once)
        self.grouped = 0  # generations that went inside a grouped request
        self._group_asks: dict[str, asyncio.Task] = {}

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
        if self.group and server.url not in self._group_asks:  # its group limit was not known: ask on next use
            server.group_limit = None
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
        on_tokens: Callable[[str, list[int], list[float] | None], None] | None = None,
        **_: Any,
    ):
        """One generation, re-sent on transient failures. `on_tokens`: where the answer so far goes while it
        is generated, on an engine that streams (EngineRequest.progress); each attempt starts it afresh."""
        if image_data:  # verl's loops hand PIL images; the engines take PNG data URLs (run/pictures.py)
            image_data = [i if isinstance(i, str) else image_data_url(i) for i in image_data]
        request = self.engine.build(prompt_ids, sampling_params, self.limits, sampling_seed, image_data)
        if on_tokens is not None and self.engine.streams:
            request.progress = on_tokens
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
                        # a hedge copy streams nothing to the unit: two attempts would supersede each other's
                        # tokens at every chunk; the answer that wins is kept whole either way
                        hedge = dataclasses.replace(self.engine.renewed(request), progress=None)
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

    def _start(self, server: ServerState, request: EngineRequest) -> asyncio.Future:
        """Count the request against its server now (the next pick sees it), then send it: alone in a task,
        or as a member of the server's next grouped request. Either way the returned future settles with its
        own answer (a TokenOutput, or a string naming a transient failure); cancelling it abandons only it."""
        if not self.requests_sent and self._on_first_request is not None:
            self._on_first_request()
        server.in_flight += 1
        server.requests += 1
        self.requests_sent += 1
        loop = asyncio.get_running_loop()
        key = None
        if self.group:
            if server.group_limit is None:
                self._ask_group_limit(server)
            elif server.group_limit > 1:
                key = self.engine.group_key(request)
        if key is None:
            return self._send_alone(server, request)
        member = Member(request, loop.create_future())
        member.future.add_done_callback(lambda f, m=member: self._member_done(server, m))
        pending = server.pending.setdefault(key, [])
        pending.append(member)
        if len(pending) >= server.group_limit:
            self._flush(server, key)
        elif server.flush is None:
            server.flush = loop.call_later(GROUP_WINDOW_S, self._flush_all, server)
        return member.future

    def _send_alone(self, server: ServerState, request: EngineRequest) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self._attempt(server, request))
        task.add_done_callback(lambda _t: self._left(server))
        return task

    def _left(self, server: ServerState) -> None:
        server.in_flight -= 1

    def _member_done(self, server: ServerState, member: Member) -> None:
        """A member was answered or abandoned: it leaves its server's count; a group none of whose members is
        waited for any more is cancelled, which closes its connection (the server aborts what is left)."""
        server.in_flight -= 1
        group = member.group
        if (member.future.cancelled() and group is not None and group.task is not None and not group.task.done()
                and all(m.future.done() for m in group.members)):
            group.task.cancel()

    def _ask_group_limit(self, server: ServerState) -> None:
        task = self._group_asks.get(server.url)
        if task is None:
            self._group_asks[server.url] = asyncio.get_running_loop().create_task(self.learn_group_limit(server))

    async def learn_group_limit(self, server: ServerState) -> int:
        """Ask the server's engine how many generations one grouped request may carry (1 on any failure:
        one request each, as before grouping)."""
        try:
            limit = await self.engine.group_limit(self.session, server.url)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            # still loading, or no such route: one request each until it joins the rotation (admit asks again)
            log.info("%s: no grouped requests for now (%s): one request per generation", server.url, e)
            server.group_limit = 1
            if not server.healthy:
                self._group_asks.pop(server.url, None)
            return 1
        server.group_limit = limit
        log.info("%s: %s", server.url, f"up to {limit} generations per grouped request" if limit > 1
                 else "one request per generation (its engine takes no grouped request)")
        return limit

    async def learn_group_limits(self) -> None:
        """Every server's group limit, before the first burst of requests (the actor calls it once)."""
        if self.group and self.engine is not None:
            await asyncio.gather(*(self.learn_group_limit(s) for s in self.servers if s.group_limit is None))

    def _flush_all(self, server: ServerState) -> None:
        server.flush = None
        for key in list(server.pending):
            self._flush(server, key)

    def _flush(self, server: ServerState, key: Hashable) -> None:
        members = [m for m in server.pending.pop(key, ()) if not m.future.done()]
        if not members:
            return
        if len(members) == 1:
            self._resend_alone(server, members)
            return
        group = Group(members)
        for m in members:
            m.group = group
        self.grouped += len(members)
        group.task = asyncio.get_running_loop().create_task(self._send_group(server, group))

    def _resend_alone(self, server: ServerState, members: list[Member]) -> None:
        """Each member in a request of its own, its future settled by that request."""
        for m in members:
            if m.future.done():
                continue
            task = asyncio.get_running_loop().create_task(self._attempt(server, m.request))
            task.add_done_callback(lambda t, f=m.future: _settle_from(f, t))
            m.future.add_done_callback(lambda f, t=task: t.cancel() if f.cancelled() else None)

    async def _send_group(self, server: ServerState, group: Group) -> None:
        """One grouped request: each member's future settles as its own answer arrives."""
        members = group.members
        started = time.monotonic()
        server.http_requests += 1
        self.http_requests += 1
        body = self.engine.group_body([m.request for m in members])
        try:
            async with self.session.post(f"{server.url}{self.engine.generate_path}", data=orjson.dumps(body),
                                         headers=self._json_headers, timeout=NO_TIMEOUT) as resp:
                if resp.status != 200:
                    raw = await resp.read()
                    self._group_failed(server, f"HTTP {resp.status}")
                    if resp.status >= 500 or resp.status in RETRYABLE_4XX:
                        self._record_failure(server, f"http_{resp.status}")
                        _fail(members, f"HTTP {resp.status} from {server.url}: {raw[:200].decode(errors='replace')}")
                    else:  # refused as a whole, maybe for one member's sake: each goes alone and answers for itself
                        self._resend_alone(server, members)
                    return
                async with contextlib.aclosing(self.engine.group_answers(resp)) as answers:
                    async for index, answer in answers:
                        member = members[index]
                        if not member.future.done():
                            member.future.set_result(self._read_answer(server, member.request, answer, started))
                        if all(m.future.done() for m in members):
                            break
        except GroupRefused:
            self._resend_alone(server, members)
            return
        except (aiohttp.ClientError, OSError) as e:  # the server went away mid-answer: each member retries
            self._record_failure(server, "connection")
            _fail(members, f"{type(e).__name__} from {server.url}: {e}")
            return
        except (ValueError, TypeError, KeyError, IndexError) as e:
            self._record_failure(server, "bad_response")
            self._group_failed(server, f"an unreadable answer ({e})")
            _fail(members, f"unreadable grouped answer from {server.url}: {e}")
            return
        if not all(m.future.done() for m in members):
            self._record_failure(server, "bad_response")
            self._group_failed(server, "an answer without every member")
            _fail(members, f"grouped answer from {server.url} ended without this member's answer")
            return
        server.group_failures = 0

    def _group_failed(self, server: ServerState, what: str) -> None:
        """A grouped request failed as a whole; after GROUP_GIVE_UP in a row the server (a router or another
        server that speaks /generate but not its batched, streamed form) gets one request per generation."""
        server.group_failures += 1
        if server.group_failures >= GROUP_GIVE_UP and (server.group_limit or 1) > 1:
            server.group_limit = 1
            log.warning("%s: %d grouped requests in a row failed (last: %s): one request per generation from now",
                        server.url, server.group_failures, what)

    async def _attempt(self, server: ServerState, request: EngineRequest):
        """One POST (counted by _start): the TokenOutput, or a string describing a transient failure
        (already recorded)."""
        started = time.monotonic()
        server.http_requests += 1
        self.http_requests += 1
        streamed = request.progress is not None
        try:
            async with self.session.post(
                f"{server.url}{self.engine.generate_path}",
                data=orjson.dumps(self.engine.stream_body(request) if streamed else request.body),
                headers=self._json_headers,
                # no aiohttp timer: _watched bounds every attempt (stall deadline <= llm.request_timeout_s)
                # and cancels it, so a second timer per request would only cost time
                timeout=NO_TIMEOUT,
            ) as resp:
                if streamed and resp.status == 200:
                    return await self._read_stream(server, request, resp, started)
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError) as e:  # no aiohttp timer runs, so no timeout error either
            self._record_failure(server, "connection")
            return f"{type(e).__name__} from {server.url}: {e}"
        if status >= 500 or status in RETRYABLE_4XX:
            self._record_failure(server, f"http_{status}")
            return f"HTTP {status} from {server.url}: {raw[:200].decode(errors='replace')}"
        if status != 200:
            raise RequestRejected(f"HTTP {status} from {server.url}: {raw[:300].decode(errors='replace')}")
        try:
            answer = orjson.loads(raw)
        except ValueError as e:
            self._record_failure(server, "bad_response")
            return f"unreadable answer from {server.url}: {e}"
        return self._read_answer(server, request, answer, started)

    async def _read_stream(self, server: ServerState, request: EngineRequest, resp: aiohttp.ClientResponse,
                           started: float):
        """A streamed answer: each unfinished chunk's tokens to `request.progress`, the last read as an answer."""
        answer = self.engine.streamed(request)
        try:
            async with contextlib.aclosing(self.engine.stream_chunks(resp)) as chunks:
                async for chunk in chunks:
                    if self.engine.finish_type(chunk) is not None:
                        return self._read_answer(server, request, answer.whole(chunk), started)
                    answer.add(chunk)
                    try:
                        request.progress(request.rid, answer.ids, answer.logprobs)
                    except OSError as e:  # keeping the tokens failed (the disk): the unit's failure, not the server's
                        raise ProgressLost(f"the answer's tokens could not be kept: {e}") from e
        except StreamError as e:  # SGLang's in-stream refusal (HTTP 200): as the status it names
            if e.status >= 500 or e.status in RETRYABLE_4XX:
                self._record_failure(server, f"http_{e.status}")
                return f"HTTP {e.status} (in the stream) from {server.url}: {str(e)[:200]}"
            raise RequestRejected(f"HTTP {e.status} (in the stream) from {server.url}: {str(e)[:300]}") from e
        except (ValueError, TypeError, KeyError) as e:
            self._record_failure(server, "bad_response")
            return f"unreadable streamed answer from {server.url}: {e}"
        self._record_failure(server, "bad_response")
        return f"streamed answer from {server.url} ended before its last chunk"

    def _read_answer(self, server: ServerState, request: EngineRequest, answer: Any, started: float):
        """One generation's answer (alone, or a member's from a grouped request): the TokenOutput, or a string
        naming a transient failure (recorded)."""
        try:
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
        for task in [*self._probes.values(), *self._group_asks.values()]:
            task.cancel()
        for server in self.servers:
            if server.flush is not None:
                server.flush.cancel()


def _settle_from(future: asyncio.Future, task: asyncio.Task) -> None:
    """A member sent alone: its request's outcome (an answer, a failure string, RequestRejected) is its own."""
    if task.cancelled():
        if not future.done():
            future.cancel()
        return
    error = task.exception()
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(task.result())


def _fail(members: list[Member], reason: str) -> None:
    """Each member still waited for fails with `reason` (a transient failure: its unit retries it)."""
    for m in members:
        if not m.future.done():
            m.future.set_result(reason)
