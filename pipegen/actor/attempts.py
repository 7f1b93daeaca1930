"""Attempts: what verl's agent loops call `server_manager.generate(...)` on (`ServerPool`), and the attempts it makes
for each generation: retries, the stall watchdog, hedges.

The stall rule: a generation is judged by what its engine says it is doing, never by the clock alone (the numbers
are actor/supervision.py's). An attempt is looked at every look_s; evidence against it must hold in every reading
for suspect_for_s (each plus the engine's `load_trails_s`: vLLM's gauges are its last recorded step's, routing.py's
`note_reading`) before it counts as **stalled**:
  - started (a chunk came), then no chunk for `llm.stall_floor_s` while the server's queue (`Engine.load`) is empty;
  - not started and not held by the engine (`routing.Evidence`): nothing waits there and the server counts fewer than
    this actor's attempts surely there (sent lag_s before the reading), or an attempt sent after it started over lag_s
    ago (engines schedule in arrival order) and the server holds fewer than reached it (transit_s of slack);
  - past the clock's deadline (admission.py's `stall_deadline`): an overtaken attempt, however many the server holds;
    a server that reports no load (LoadUnavailable) is judged by the clock alone, at that deadline.
  Queued is never stalled. A stalled attempt is aborted on its server and re-sent elsewhere with a new id, and counts
  as its server's failure unless the engine works on later ones; `llm.request_timeout_s` is the outer bound.
- **hedges that can win**: a copy with the same seed on the same server reproduces the same tokens at the same
  speed, so it can only lose. In the tail (admission.py: nothing left to admit, capacity idle) an attempt older than
  admission's threshold may be copied only to *another* server in rotation, and only when its own server is
  measurably slower (its seconds per token at least slower_by times the copy's server's). The copy continues from
  the tokens the attempt has streamed so far (prompt plus those ids, the budget less them, a seed of its own), not
  from token 0; the first answer wins and the other is aborted. The tail's extra work is capped (hedge_budget of the
  tokens answered) and reported (`hedge_tokens`).
- **retries**: connection errors, 5xx/408/429, stalls, aborts and unreadable answers are retried with exponential
  backoff and jitter on another server when there is one (routing.py takes a failing server out of rotation).

Owns: the generation's attempts and their supervision. Must never: re-tokenize anything, abort an attempt the
evidence shows making progress or queued, retry a 4xx other than 408/429, or fabricate an output when the retry
budget is spent (it raises `RetriesExhausted`; the actor records the unit as failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Callable

import aiohttp

from pipegen.actor.admission import Admission, WatchdogLimits
from pipegen.actor.limits import ClientLimits
from pipegen.actor.routing import RetriesExhausted, Routing, ServerState
from pipegen.actor.sending import Failure, Live, ProgressLost, Reason, Sender
from pipegen.actor.supervision import SUPERVISION
from pipegen.engines import AUTO, Engine, EngineRequest, engine
from pipegen.engines.request import Generation, Keep, RequestRejected
from pipegen.run.pictures import image_data_url

if TYPE_CHECKING:
    from verl.workers.rollout.replica import TokenOutput

__all__ = ["ClientLimits", "ProgressLost", "RequestRejected", "RetriesExhausted", "ServerPool"]

log = logging.getLogger("pipegen.client")


@dataclasses.dataclass(frozen=True)
class Look:
    """What the evidence says of an attempt: why it is stalled (None: queued, running or unknown yet), and when to
    look again."""

    stalled: str | None
    again_s: float
    # the engine kept starting later requests meanwhile: it lost this one but works, so the loss does not count
    # toward taking it out of rotation (routing.record_lost)
    working: bool = False
    # the reading fits both a lost attempt and a healthy one (the count is short only by attempts that may still be
    # on their way): it neither clears nor confirms a suspicion
    unsure: bool = False


@dataclasses.dataclass(eq=False)
class Copy:
    """One attempt of a generation in flight: where, which request, and the tokens it continues after."""

    server: ServerState
    request: EngineRequest
    prefix_ids: list[int] = dataclasses.field(default_factory=list)
    prefix_logprobs: list[float] | None = None


class ServerPool:
    """An actor's servers and the attempts of its generations. One per actor process, used from one event loop.

    Also usable directly as verl's `llm_client` / `server_manager`: without a sticky key, the request_id is the key
    (verl's ToolAgentLoop reuses one request_id for every turn)."""

    def __init__(self, urls: list[str], limits: ClientLimits, session: aiohttp.ClientSession,
                 protocol: str = "sglang", admission: Admission | None = None,
                 on_first_request: Callable[[], None] | None = None, group: bool = True):
        # the servers' engine (llm.protocol); with `auto`, None until readiness.py recognised the first server
        self.routing = Routing(urls, limits, session, None if protocol == AUTO else engine(protocol))
        self.limits = limits
        # stall looks and hedging are the actor's admission policy's; on its own, a pool only has looks
        self.admission = admission if admission is not None else Admission(WatchdogLimits())
        self.sender = Sender(self.routing, self.admission, group, on_first_request)
        self.retries = 0
        self.stalled = 0  # attempts the evidence showed stalled
        self.aborts_sent = 0  # attempts aborted by this client (stalls and hedge losers)
        self.hedges = 0  # copies sent to another server
        self.hedge_wins = 0  # ...that answered first
        self.hedge_tokens = 0  # tokens generated by the copies that lost, and by the attempts a copy beat

    # ---- what the actor reads and sets ----
    @property
    def engine(self) -> Engine | None:
        return self.routing.engine

    @engine.setter
    def engine(self, value: Engine) -> None:
        self.routing.engine = value

    @property
    def servers(self) -> list[ServerState]:
        return self.routing.servers

    @property
    def _sticky(self):
        return self.routing.sticky

    # the sender's counters, read as the pool's (the actor's stats line)
    requests_sent = property(lambda self: self.sender.requests_sent)
    http_requests = property(lambda self: self.sender.http_requests)
    grouped = property(lambda self: self.sender.grouped)
    chunks = property(lambda self: self.sender.chunks)
    output_tokens = property(lambda self: self.sender.output_tokens)
    latencies = property(lambda self: self.sender.latencies)
    longest_request_s = property(lambda self: self.sender.longest_s)
    finish_reasons = property(lambda self: self.sender.finish_reasons)

    def hold_out(self, server: ServerState, interval_s: float) -> None:
        self.routing.hold_out(server, interval_s)

    def admit(self, server: ServerState) -> None:
        self.routing.admit(server)

    async def learn_group_limits(self) -> None:
        """Every server's group limit, before the first burst of requests (the actor calls it once)."""
        if self.sender.group and self.engine is not None:
            await asyncio.gather(*(self.sender.learn_group_limit(s) for s in self.servers if s.group_limit is None))

    def in_flight(self) -> int:
        return self.routing.in_flight()

    def error_summary(self) -> dict[str, int]:
        return self.routing.error_summary()

    def close(self) -> None:
        self.routing.close()
        self.sender.close()

    # ---- the verl server-manager contract ----
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       sticky_key: Any = None, sampling_seed: int | None = None, image_data: list[Any] | None = None,
                       on_tokens: Keep | None = None, **_: Any) -> "TokenOutput":
        """One generation as verl asks it. `on_tokens`: where the answer so far goes while it is generated, on an
        engine that streams (Generation.on_tokens); each attempt starts it afresh."""
        if image_data:  # verl's loops hand PIL images; the engines take PNG data URLs (run/pictures.py)
            image_data = [i if isinstance(i, str) else image_data_url(i) for i in image_data]
        generation = Generation.of(prompt_ids, sampling_params, self.limits, sampling_seed, image_data, on_tokens)
        return await self.send(generation, sticky_key if sticky_key is not None else request_id)

    async def send(self, generation: Generation, sticky_key: Any) -> "TokenOutput":
        """One generation, re-sent on transient failures."""
        if generation.on_tokens is not None and not self.engine.streams:
            generation = dataclasses.replace(generation, on_tokens=None)
        request = self.engine.build(generation)
        tried: set[str] = set()
        errors: list[str] = []
        stalls = 0
        for attempt in range(self.limits.max_attempts):
            if attempt:
                self.retries += 1
                await asyncio.sleep(self._backoff(attempt))
                request = self.engine.renewed(request)
            server = await self.routing.wait_for_a_server(sticky_key, tried)
            tried.add(server.url)
            if len(tried) >= len(self.servers):
                tried.clear()  # every server had a go: the next attempt may return to any of them
                tried.add(server.url)
            result = await self._watched(server, request, sticky_key, stalls)
            if isinstance(result, Failure):
                errors.append(result.text)
                stalls += result.reason is Reason.STALLED
                continue
            return result
        raise RetriesExhausted(f"gave up after {self.limits.max_attempts} attempts: " + "; ".join(errors[-4:]))

    def _backoff(self, attempt: int) -> float:
        delay = min(self.limits.backoff_max_s, self.limits.backoff_base_s * 2 ** (attempt - 1))
        return delay * (0.5 + random.random())  # jitter: retries of many units do not arrive in lockstep

    # ---- one attempt under supervision ----
    async def _watched(self, server: ServerState, request: EngineRequest, key: Any, stalls: int):
        """One attempt (and, in the tail, its hedge copies): the TokenOutput, or a Failure. RequestRejected and
        ProgressLost propagate."""
        started = time.monotonic()
        admission = self.admission
        # the clock's deadline: the look that judges a server with no load route, and the patience for an order the
        # engine broke (see _judge)
        deadline = started + min(admission.stall_deadline(server.clock, request.max_new_tokens, stalls),
                                 self.limits.request_timeout_s)
        look_at = min(started + self._look_s(), deadline)
        give_up = started + self.limits.request_timeout_s
        primary = self.sender.start(server, request)
        copies: dict[asyncio.Future, Copy] = {primary: Copy(server, request)}
        failures: list[Failure] = []
        suspect_since: float | None = None
        try:
            while copies:
                now = time.monotonic()
                hedge_at = self._hedge_time(started, copies)
                if hedge_at is not None and now >= hedge_at:
                    self._hedge(key, copies)
                    continue
                wake = min(look_at, give_up) - now
                if hedge_at is not None:
                    wake = min(wake, max(0.05, hedge_at - now))
                elif admission.may_hedge_later() and len(copies) < SUPERVISION.max_copies:
                    wake = min(wake, 1.0)  # re-check: capacity may free up in the tail
                if wake <= 0:
                    working = False
                    if now >= give_up:
                        verdict = f"no answer within llm.request_timeout_s={self.limits.request_timeout_s:.0f}s"
                    else:
                        look = await self._judge(server, request, deadline)
                        if look.unsure:  # read again soon; a suspicion stands until a clear reading
                            look_at = time.monotonic() + look.again_s
                            continue
                        held = SUPERVISION.suspect_for_s + self.engine.load_trails_s
                        if look.stalled is None or suspect_since is None or now - suspect_since < held:
                            # nothing against it, or seen once: read again before calling it stalled
                            suspect_since = (suspect_since or now) if look.stalled is not None else None
                            again = SUPERVISION.load_confirm_s if look.stalled is not None else look.again_s
                            look_at = time.monotonic() + again
                            continue
                        verdict = look.stalled
                        working = look.working
                    return await self._stall(copies, verdict, working)
                waiting_on: set[asyncio.Future] = set(copies)
                tail = admission.tail_started()
                if tail is not None:
                    waiting_on.add(tail)  # wake when the tail starts, to consider a hedge
                done, _ = await asyncio.wait(waiting_on, timeout=wake, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    copy = copies.pop(task, None)
                    if copy is None:
                        continue
                    result = task.result()  # RequestRejected and ProgressLost propagate
                    if isinstance(result, Failure):
                        failures.append(result)
                        continue
                    if task is not primary:
                        self.hedge_wins += 1
                    return self._whole(copy, result)
            return failures[-1] if len(failures) == 1 else Failure(failures[-1].reason,
                                                                    "; ".join(f.text for f in failures))
        finally:
            if copies:  # the copies that lost to an answer (or all of them, cancelled)
                await self._cancel(copies, lost=True)

    async def _judge(self, server: ServerState, request: EngineRequest, deadline: float) -> "Look":
        """What the engine's evidence says of an attempt now (see the header)."""
        stall_floor = self.admission.watchdog.stall_floor_s
        now = time.monotonic()
        live = self.sender.live.get(request.rid)
        if live is None:
            return Look(None, self._look_s())  # settled meanwhile
        if live.last_chunk_at is not None and now - live.last_chunk_at < stall_floor:
            return Look(None, live.last_chunk_at + stall_floor - now)  # chunks are coming: the engine generates it
        evidence = await self.routing.evidence(server)
        age = f"unanswered for {now - live.sent_at:.0f}s"
        if evidence is None:
            if server.load_reported:  # a reading failed: no evidence either way yet
                return Look(None, SUPERVISION.load_confirm_s)
            if now < deadline:
                return Look(None, deadline - now)
            return Look(f"stalled: no answer from {server.url}, {age} (watchdog deadline from max_new_tokens="
                        f"{request.max_new_tokens}; the server reports no load, so the clock alone judges)", 0)
        ours = evidence.ours
        held = (f"{server.url} holds {evidence.known} request(s) (running {evidence.running}, waiting "
                f"{evidence.waiting}) while this actor has {ours} there")
        if live.last_chunk_at is not None:  # started, then silent for stall_floor_s: unless put back in its queue
            if evidence.waiting == 0:
                return Look(f"stalled: no token for {now - live.last_chunk_at:.0f}s; {held}; {age}; aborted there", 0)
            return Look(None, self._look_s())
        if live.sent_at >= evidence.counted_before:  # the reading may not count it yet
            if evidence.by_steps and now >= deadline:  # the engine recorded under two steps since it was sent
                return Look(f"stalled: no answer from {server.url}, {age}, and {server.url} recorded no step that "
                            f"counts it (watchdog deadline from max_new_tokens={request.max_new_tokens})", 0)
            return Look(None, self._look_s())
        if not self.engine.streams and now >= deadline and evidence.waiting == 0:
            # an answer read whole shows no progress of its own: past the clock's deadline with nothing queued there,
            # it is running far past its budget (or lost)
            return Look(f"stalled: no answer from {server.url} past the watchdog deadline from max_new_tokens="
                        f"{request.max_new_tokens} while nothing waits; {held}; {age}; aborted there", 0)
        missing = evidence.known < ours  # some of this actor's attempts there are surely unknown to the engine
        short = evidence.known < evidence.sent  # ...or, on a busy engine, likely: fewer held than reached it
        # the engine started an attempt sent after this one, a while ago: this one is not waiting its turn
        overtaken = server.overtaken_since(live.sent_at + SUPERVISION.order_slack_s)
        passed = overtaken is not None and now - overtaken >= SUPERVISION.lag_s
        if (missing and evidence.waiting == 0) or (passed and (short or now >= deadline)):
            return Look(f"stalled: not started while {'nothing waits' if evidence.waiting == 0 else 'later ones ran'}"
                        f"; {held}; {age}; aborted there", 0, working=passed)
        if passed and evidence.known < evidence.asked:  # an attempt sent just before the reading may count for it
            return Look(None, SUPERVISION.load_confirm_s, unsure=True)
        return Look(None, self._look_s())  # queued or running: the engine holds it

    def _look_s(self) -> float:
        return SUPERVISION.look_s + self.engine.load_trails_s

    async def _stall(self, copies: dict[asyncio.Future, Copy], verdict: str, working: bool = False) -> Failure:
        log.warning("%s", verdict)
        for copy in copies.values():
            copy.server.stalled += 1
            self.stalled += 1
            if working:
                self.routing.record_lost(copy.server, "stalled")
            else:
                self.routing.record_failure(copy.server, "stalled")
        await self._cancel(copies)
        return Failure(Reason.STALLED, verdict, "stalled")

    # ---- hedges ----
    def _hedge_time(self, started: float, copies: dict[asyncio.Future, Copy]) -> float | None:
        """When this attempt may get a copy on another server, or None (see the header)."""
        budget = SUPERVISION.hedge_budget * max(self.sender.output_tokens, 1000)
        if len(copies) >= SUPERVISION.max_copies or self.hedge_tokens > budget:
            return None
        after = self.admission.hedge_after()
        if after is None or self._faster_server(copies) is None:
            return None
        return started + after * len(copies)

    def _faster_server(self, copies: dict[asyncio.Future, Copy]) -> ServerState | None:
        """Another server in rotation, measurably faster per token than every server the attempt is on."""
        busy = {c.server.url for c in copies.values()}
        slowest = [c.server.clock.seconds_per_token() for c in copies.values()]
        if any(s is None for s in slowest):
            return None
        others = [(s.clock.seconds_per_token(), s) for s in self.servers if s.healthy and s.url not in busy]
        others = [(spt, s) for spt, s in others if spt is not None and spt * SUPERVISION.slower_by <= min(slowest)]
        return min(others, key=lambda x: (x[0], x[1].in_flight))[1] if others else None

    def _hedge(self, key: Any, copies: dict[asyncio.Future, Copy]) -> None:
        """A copy of the first attempt on a faster server, continuing from the tokens it streamed so far."""
        first = next(iter(copies.values()))
        target = self._faster_server(copies)
        live: Live | None = self.sender.live.get(first.request.rid)
        ids = list(live.answer.ids) if live is not None and live.answer is not None else []
        logprobs = list(live.answer.logprobs) if ids and live.answer.logprobs is not None else None
        generation = first.request.generation
        # a copy streams nothing to the unit: two attempts would supersede each other's kept tokens at every chunk
        if ids:
            rest = generation.continued(ids)
        else:
            rest = dataclasses.replace(generation, on_tokens=None)
        request = self.engine.build(rest)
        copies[self.sender.start(target, request)] = Copy(target, request, ids, logprobs)
        self.hedges += 1

    def _whole(self, copy: Copy, out: "TokenOutput") -> "TokenOutput":
        """The answer of the copy that won, after the tokens it continued from."""
        if not copy.prefix_ids:
            return out
        from pipegen.actor.continuation import token_output

        logprobs = None if out.log_probs is None else (copy.prefix_logprobs or []) + list(out.log_probs)
        return token_output(copy.prefix_ids + list(out.token_ids), logprobs, out.stop_reason, out.extra_fields)

    async def _cancel(self, copies: dict[asyncio.Future, Copy], lost: bool = False) -> None:
        """Abort each copy on its server (the engine's abort), then drop its connection (which is vLLM's abort).
        `lost`: they lost to another copy's answer, and the tokens they streamed count as the tail's extra work."""
        items = list(copies.items())
        copies.clear()
        if lost:
            for _, copy in items:
                live = self.sender.live.get(copy.request.rid)
                if live is not None and live.answer is not None:
                    self.hedge_tokens += len(live.answer.ids)
        self.sender.superseded.update(c.request.rid for _, c in items)
        self.aborts_sent += len(items)
        await asyncio.gather(*(self.engine.abort(self.routing.session, c.server.url, c.request,
                                                 self.limits.abort_timeout_s) for _, c in items),
                             return_exceptions=True)
        for task, _ in items:
            task.cancel()
        await asyncio.gather(*(t for t, _ in items), return_exceptions=True)
        self.sender.superseded.difference_update(c.request.rid for _, c in items)
