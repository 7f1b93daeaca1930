"""Sending: one attempt at a generation on one server, alone, as a member of a grouped request, or streamed, and
its typed outcome: verl's `TokenOutput`, or a `Failure` whose `reason` is one of a closed set.

- alone: one POST, streamed (`stream: true`) wherever the engine streams: its first token's chunk is the evidence
  the engine started it (attempts.py), and a generation that keeps its tokens as they come (`on_tokens`) gets a
  chunk about every keep_every_s, its tokens so far handed on with the attempt's id (a re-sent attempt starts
  again; a hedge copy sends none); the last chunk is read as the answer.
- grouped: requests to one server that are ready together (within group_window_s; a prompt's n samples first of
  all, and any other units admitted in the same round) go as one grouped request where the server's engine takes
  one (`Engine.group_limit`: SGLang's streamed batch `/generate`; not vLLM, not pipegen's CPU server). Every member
  streams: a member that keeps its tokens gets a chunk about every keep_every_s of generation, the others their
  first token's chunk and their last. Each member stays its own attempt: its own future, abort (by its own id) and
  outcome, settled as its own last chunk arrives. A group that fails as a whole (connection, 5xx) fails each member;
  one the server refuses as a whole (4xx, an in-stream error) is sent again member by member, so only a faulty
  member is refused. The group's connection is closed only once none of its members is waited for.
- what each attempt in flight has shown (`Live`): when it was sent, when its last chunk came, its tokens so far
  (attempts.py's evidence that the engine is making progress, and where a hedge copy continues from).

Owns: the HTTP of a generation, the grouping window, each attempt's `Live`, the answer counters. Must never:
re-tokenize anything (ids in, ids out), retry or re-send (attempts.py does), retry a 4xx other than 408/429 (it
raises `RequestRejected`), or fabricate an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Union

import aiohttp
import orjson

from pipegen.actor.admission import Admission
from pipegen.actor.routing import Routing, ServerState
from pipegen.actor.supervision import SUPERVISION
from pipegen.engines import EngineRequest, GroupRefused, StreamError
from pipegen.engines.request import RequestRejected
from pipegen.engines.sglang import STREAM_MIN_TOKENS

if TYPE_CHECKING:
    from verl.workers.rollout.replica import TokenOutput

    from pipegen.engines.base import StreamedAnswer

log = logging.getLogger("pipegen.client")

NO_TIMEOUT = aiohttp.ClientTimeout()  # no total, no socket timeouts (the session default would be 300 s)


class Reason(enum.Enum):
    """Why an attempt failed without an answer (a closed set: retries, rotation and the stats read it)."""
    CONNECTION = "connection"  # refused, reset, gone mid-answer
    HTTP = "http"  # a 5xx, 408 or 429 (the kind names the status)
    BAD_RESPONSE = "bad_response"  # an answer that cannot be read
    ABORTED = "abort"  # the server aborted it
    SUPERSEDED = "superseded"  # this client aborted it (a stalled attempt or a hedge that lost)
    STALLED = "stalled"  # the engine's evidence showed it stopped (attempts.py)


@dataclass(frozen=True)
class Failure:
    """An attempt that ended without an answer."""
    reason: Reason
    text: str
    kind: str = ""  # the server's error counter it was recorded under (e.g. "http_503"); "" when not recorded


Outcome = Union["TokenOutput", Failure]


class ProgressLost(RuntimeError):
    """A streamed answer's tokens could not be handed on (its `on_tokens` raised OSError): never retried."""


@dataclass(eq=False)
class Live:
    """What one attempt in flight has shown."""
    server: ServerState
    request: EngineRequest
    sent_at: float
    last_chunk_at: float | None = None  # None: no chunk yet (queued, or not streamed): the engine has not started it
    answer: "StreamedAnswer | None" = None  # its tokens so far, when streamed


@dataclass(eq=False)
class Member:
    """One generation inside a grouped request: its request and the future its outcome settles."""
    request: EngineRequest
    future: asyncio.Future
    group: "Group | None" = None


@dataclass(eq=False)
class Group:
    """Generations sent as one grouped request, and the task that reads their chunks."""
    members: list[Member]
    task: asyncio.Task | None = None


@dataclass
class Pending:
    """A server's members waiting for the grouping window."""
    by_key: dict[Hashable, list[Member]] = field(default_factory=dict)
    flush: asyncio.TimerHandle | None = None


class Sender:
    """Sends attempts for one actor's pool and reads their answers."""

    def __init__(self, routing: Routing, admission: Admission, group: bool,
                 on_first_request: Callable[[], None] | None = None):
        self.routing = routing
        self.admission = admission
        self.group = group  # actors.group_requests: send requests that are ready together as one where possible
        self._on_first_request = on_first_request  # called as the first request is sent (the start-up clock)
        self._json_headers = {"Content-Type": "application/json"}
        self._pending: dict[str, Pending] = {}
        self._group_asks: dict[str, asyncio.Task] = {}
        self.live: dict[str, Live] = {}  # rid -> its attempt, while in flight
        self.superseded: set[str] = set()  # rids being aborted by this client (their abort answer is no failure)
        self.requests_sent = 0
        self.http_requests = 0  # POSTs of generations (a grouped request counts once)
        self.grouped = 0  # generations that went inside a grouped request
        self.chunks = 0  # streamed chunks read before the last one (tokens handed on as they came)
        self.output_tokens = 0
        self.latencies: deque[float] = deque(maxlen=4096)
        self.longest_s = 0.0  # the longest request, sent to answered (the tail's bound: no batch ends before it)
        self.finish_reasons: dict[str, int] = {}
        routing.on_admit.append(self._forget_group_limit)

    @property
    def engine(self):
        return self.routing.engine

    # ---- starting an attempt ----
    def start(self, server: ServerState, request: EngineRequest) -> asyncio.Future:
        """Count the attempt against its server now (the next pick sees it), then send it: alone in a task, or as a
        member of the server's next grouped request. Either way the returned future settles with its own outcome
        (RequestRejected and ProgressLost as exceptions); cancelling it abandons only it."""
        if not self.requests_sent and self._on_first_request is not None:
            self._on_first_request()
        now = time.monotonic()
        server.in_flight += 1
        server.requests += 1
        server.sent_at[request.rid] = now
        self.requests_sent += 1
        self.live[request.rid] = Live(server, request, now)
        loop = asyncio.get_running_loop()
        key = None
        if self.group:
            if server.group_limit is None:
                self._ask_group_limit(server)
            elif server.group_limit > 1:
                key = self.engine.group_key(request)
        if key is None:
            task = loop.create_task(self._attempt(server, request))
            task.add_done_callback(lambda _t: self._left(server, request))
            return task
        member = Member(request, loop.create_future())
        member.future.add_done_callback(lambda f, m=member: self._member_done(server, m))
        pending = self._pending.setdefault(server.url, Pending())
        waiting = pending.by_key.setdefault(key, [])
        waiting.append(member)
        if len(waiting) >= server.group_limit:
            self._flush(server, key)
        elif pending.flush is None:
            pending.flush = loop.call_later(SUPERVISION.group_window_s, self._flush_all, server)
        return member.future

    def _left(self, server: ServerState, request: EngineRequest) -> None:  # the attempt settled
        server.in_flight -= 1
        server.sent_at.pop(request.rid, None)
        self.live.pop(request.rid, None)

    def interval(self, server: ServerState, request: EngineRequest) -> int:
        """Tokens between a streamed attempt's chunks: about keep_every_s of this server's generation for an answer
        whose tokens are kept, else past its budget (its first token's chunk and its last only)."""
        if request.progress is None:
            return request.max_new_tokens + 2
        spt = server.clock.seconds_per_token() or SUPERVISION.prior_s_per_token
        return max(STREAM_MIN_TOKENS, int(SUPERVISION.keep_every_s / max(spt, 1e-6)))

    # ---- grouping ----
    def _forget_group_limit(self, server: ServerState) -> None:
        if self.group and server.url not in self._group_asks:  # its group limit was not known: ask on next use
            server.group_limit = None

    def _ask_group_limit(self, server: ServerState) -> None:
        if server.url not in self._group_asks:
            self._group_asks[server.url] = asyncio.get_running_loop().create_task(self.learn_group_limit(server))

    async def learn_group_limit(self, server: ServerState) -> int:
        """How many generations one grouped request to `server` may carry (1 on any failure: one request each)."""
        try:
            limit = await self.engine.group_limit(self.routing.session, server.url)
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

    def _flush_all(self, server: ServerState) -> None:
        pending = self._pending[server.url]
        pending.flush = None
        for key in list(pending.by_key):
            self._flush(server, key)

    def _flush(self, server: ServerState, key: Hashable) -> None:
        members = [m for m in self._pending[server.url].by_key.pop(key, ()) if not m.future.done()]
        if not members:
            return
        if len(members) == 1:
            self._send_each(server, members)
            return
        group = Group(members)
        for m in members:
            m.group = group
        self.grouped += len(members)
        group.task = asyncio.get_running_loop().create_task(self._send_group(server, group))

    def _send_each(self, server: ServerState, members: list[Member]) -> None:
        """Each member in a request of its own, its future settled by that request."""
        for m in members:
            if m.future.done():
                continue
            task = asyncio.get_running_loop().create_task(self._attempt(server, m.request))
            task.add_done_callback(lambda t, f=m.future: _settle_from(f, t))
            m.future.add_done_callback(lambda f, t=task: t.cancel() if f.cancelled() else None)

    def _member_done(self, server: ServerState, member: Member) -> None:
        """A member settled: it leaves its server's count; a group none of whose members is waited for any more is
        cancelled, which closes its connection (the server aborts what is left)."""
        self._left(server, member.request)
        group = member.group
        if (member.future.cancelled() and group is not None and group.task is not None and not group.task.done()
                and all(m.future.done() for m in group.members)):
            group.task.cancel()

    async def _send_group(self, server: ServerState, group: Group) -> None:
        """One grouped request: each member's future settles as its own last chunk arrives."""
        members = group.members
        started = time.monotonic()
        server.http_requests += 1
        self.http_requests += 1
        body = self.engine.group_body([m.request for m in members], [self.interval(server, m.request)
                                                                       for m in members])
        readers: dict[int, tuple[StreamedAnswer, Callable[[dict[str, Any]], None]]] = {}
        try:
            async with self.routing.session.post(f"{server.url}{self.engine.generate_path}", data=orjson.dumps(body),
                                                 headers=self._json_headers, timeout=NO_TIMEOUT) as resp:
                if resp.status != 200:
                    raw = (await resp.read())[:200].decode(errors="replace")
                    if resp.status >= 500 or resp.status in SUPERVISION.retryable_4xx:
                        return self._group_lost(server, members, Reason.HTTP,
                                                f"HTTP {resp.status} from {server.url}: {raw}", f"http_{resp.status}")
                    # refused as a whole, maybe for one member's sake: each goes alone and answers for itself
                    self._group_failed(server, f"HTTP {resp.status}")
                    return self._send_each(server, members)
                async with contextlib.aclosing(self.engine.group_chunks(resp)) as chunks:
                    async for index, chunk in chunks:
                        member = members[index]
                        if member.future.done():
                            continue
                        if index not in readers:
                            answer = self.engine.streamed(member.request)
                            readers[index] = (answer, self._chunk(member.request, answer))
                        answer, take = readers[index]
                        if self.engine.finish_type(chunk) is not None:
                            member.future.set_result(self.read_answer(server, member.request, answer.whole(chunk),
                                                                      started))
                            if all(m.future.done() for m in members):
                                break
                            continue
                        try:
                            take(chunk)
                        except ProgressLost as e:
                            member.future.set_exception(e)
                            await self.engine.abort(self.routing.session, server.url, member.request,
                                                    self.routing.limits.abort_timeout_s)
        except GroupRefused:
            self._send_each(server, members)
            return
        except (aiohttp.ClientError, OSError) as e:  # the server went away mid-answer: each member retries
            return self._group_lost(server, members, Reason.CONNECTION, f"{type(e).__name__} from {server.url}: {e}")
        except (ValueError, TypeError, KeyError, IndexError) as e:
            return self._group_lost(server, members, Reason.BAD_RESPONSE, f"unreadable grouped answer from "
                                                                          f"{server.url}: {e}")
        if not all(m.future.done() for m in members):
            return self._group_lost(server, members, Reason.BAD_RESPONSE, f"grouped answer from {server.url} ended "
                                                                          f"without this member's answer")
        server.group_failures = 0

    def _group_lost(self, server: ServerState, members: list[Member], reason: Reason, text: str,
                    kind: str = "") -> None:
        """The group failed as a whole: the server's failure, and each member's (it retries)."""
        self.routing.record_failure(server, kind or reason.value)
        if reason is not Reason.CONNECTION:
            self._group_failed(server, text)
        _fail(members, Failure(reason, text, kind or reason.value))

    def _group_failed(self, server: ServerState, what: str) -> None:
        """A grouped request failed as a whole; after group_give_up in a row the server (a router, a server that speaks
        /generate but not its batched, streamed form) gets one request per generation."""
        server.group_failures += 1
        if server.group_failures >= SUPERVISION.group_give_up and (server.group_limit or 1) > 1:
            server.group_limit = 1
            log.warning("%s: %d grouped requests in a row failed (last: %s): one request per generation from now",
                        server.url, server.group_failures, what)

    # ---- one attempt alone ----
    async def _attempt(self, server: ServerState, request: EngineRequest) -> Outcome:
        """One POST (counted by start): its outcome. RequestRejected and ProgressLost propagate."""
        started = time.monotonic()
        server.http_requests += 1
        self.http_requests += 1
        streamed = self.engine.streams  # its first token's chunk says the engine started it (attempts.py)
        body = self.engine.stream_body(request, self.interval(server, request)) if streamed else request.body
        try:
            async with self.routing.session.post(
                f"{server.url}{self.engine.generate_path}", data=orjson.dumps(body), headers=self._json_headers,
                # no aiohttp timer: attempts.py bounds every attempt (its evidence, llm.request_timeout_s) and
                # cancels it, so a second timer per request would only cost time
                timeout=NO_TIMEOUT,
            ) as resp:
                if streamed and resp.status == 200:
                    return await self._read_stream(server, request, resp, started)
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError) as e:  # no aiohttp timer runs, so no timeout error either
            self.routing.record_failure(server, "connection")
            return Failure(Reason.CONNECTION, f"{type(e).__name__} from {server.url}: {e}", "connection")
        if status >= 500 or status in SUPERVISION.retryable_4xx:
            self.routing.record_failure(server, f"http_{status}")
            return Failure(Reason.HTTP, f"HTTP {status} from {server.url}: {raw[:200].decode(errors='replace')}",
                           f"http_{status}")
        if status != 200:
            raise RequestRejected(f"HTTP {status} from {server.url}: {raw[:300].decode(errors='replace')}")
        try:
            answer = orjson.loads(raw)
        except ValueError as e:
            self.routing.record_failure(server, "bad_response")
            return Failure(Reason.BAD_RESPONSE, f"unreadable answer from {server.url}: {e}", "bad_response")
        return self.read_answer(server, request, answer, started)

    def _chunk(self, request: EngineRequest, answer: "StreamedAnswer") -> Callable[[dict[str, Any]], None]:
        """An unfinished chunk of `request`: joins the answer, shows progress, hands the tokens so far on."""
        def take(chunk: dict[str, Any]) -> None:
            answer.add(chunk)
            self.chunks += 1
            live = self.live.get(request.rid)
            if live is not None:
                live.last_chunk_at = now = time.monotonic()
                live.answer = answer
                live.server.mark_started(live.sent_at, now)
            if request.progress is not None:
                try:
                    request.progress(request.rid, answer.ids, answer.logprobs)
                except OSError as e:  # keeping the tokens failed (the disk): the unit's failure, not the server's
                    raise ProgressLost(f"the answer's tokens could not be kept: {e}") from e

        return take

    async def _read_stream(self, server: ServerState, request: EngineRequest, resp: aiohttp.ClientResponse,
                           started: float) -> Outcome:
        """A streamed answer: each unfinished chunk through `_chunk`, the last read as an answer."""
        answer = self.engine.streamed(request)
        take = self._chunk(request, answer)
        try:
            async with contextlib.aclosing(self.engine.stream_chunks(resp)) as chunks:
                async for chunk in chunks:
                    if self.engine.finish_type(chunk) is not None:
                        return self.read_answer(server, request, answer.whole(chunk), started)
                    take(chunk)
        except StreamError as e:  # SGLang's in-stream refusal (HTTP 200): as the status it names
            if e.status >= 500 or e.status in SUPERVISION.retryable_4xx:
                self.routing.record_failure(server, f"http_{e.status}")
                return Failure(Reason.HTTP, f"HTTP {e.status} (in the stream) from {server.url}: {str(e)[:200]}",
                               f"http_{e.status}")
            raise RequestRejected(f"HTTP {e.status} (in the stream) from {server.url}: {str(e)[:300]}") from e
        except (ValueError, TypeError, KeyError) as e:
            self.routing.record_failure(server, "bad_response")
            return Failure(Reason.BAD_RESPONSE, f"unreadable streamed answer from {server.url}: {e}", "bad_response")
        self.routing.record_failure(server, "bad_response")
        return Failure(Reason.BAD_RESPONSE, f"streamed answer from {server.url} ended before its last chunk",
                       "bad_response")

    def read_answer(self, server: ServerState, request: EngineRequest, answer: Any, started: float) -> Outcome:
        """One generation's answer (alone, or a member's from a grouped request): its outcome."""
        try:
            if not isinstance(answer, dict):
                raise ValueError(f"expected a JSON object, got {type(answer).__name__}")
            finish_type = self.engine.finish_type(answer)
            if finish_type == "abort":
                # engines answer 200 for aborted requests; the partial output is dropped and the request re-sent
                if request.rid in self.superseded:  # our own abort of a stalled attempt or a hedge that lost
                    return Failure(Reason.SUPERSEDED, f"request {request.rid} aborted by the client")
                self.routing.record_failure(server, "abort")
                return Failure(Reason.ABORTED, f"request aborted by {server.url}", "abort")
            out = self.engine.parse(answer, request)
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # pydantic's ValidationError is a ValueError
            self.routing.record_failure(server, "bad_response")
            return Failure(Reason.BAD_RESPONSE, f"unreadable answer from {server.url}: {e}", "bad_response")
        self.routing.record_success(server)
        server.mark_started(started, time.monotonic())
        latency = time.monotonic() - started
        self.latencies.append(latency)
        self.longest_s = max(self.longest_s, latency)
        server.clock.observe(latency, len(out.token_ids))
        self.admission.answered(latency, len(out.token_ids))
        self.output_tokens += len(out.token_ids)
        reason = finish_type or "none"
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        return out

    def close(self) -> None:
        for task in [*self._group_asks.values(), *(p.flush for p in self._pending.values() if p.flush)]:
            task.cancel()


def _settle_from(future: asyncio.Future, task: asyncio.Task) -> None:
    """A member sent alone: its attempt's outcome (an answer, a Failure, RequestRejected) is its own."""
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


def _fail(members: list[Member], failure: Failure) -> None:  # a transient failure: each member's unit retries it
    for m in members:
        if not m.future.done():
            m.future.set_result(failure)
