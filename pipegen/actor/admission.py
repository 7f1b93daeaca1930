"""Admission: how many of an actor's units run at once, and how long each of their requests may take.

The one owner of the actor's concurrency policy. The actor's loop asks it which units to start
(`Admission.run`); the server pool (attempts.py) asks it, through `Admission`'s small interface, for a request's
clock deadline on a server (attempts.py looks at the engine's evidence every look_s; the clock alone judges only a
server that reports no load, and how long a request later ones overtook may wait) and whether the tail has begun,
when a request may be hedged. Nothing else decides either.

- `TokenClock`: what one server has shown - seconds per output token, as the ratio of sums of recent
  request latencies over their output tokens (queue wait included, so a busy server earns longer
  deadlines), and the recent latencies for the tail's hedging threshold.
- the clock deadline, from what a request asks for and what its server has shown: `floor + margin *
  max_new_tokens * seconds_per_token`, doubled for each stall the request already had. Before a server has
  answered anything, a slow prior stands in. Only a server that reports no load has its requests judged by this
  clock alone; elsewhere the engine's evidence decides (attempts.py).
- `ConcurrencyControl` (concurrency.py): how many units may wait on the servers at once.
- `Slots` (the hold): which units count against that number (those waiting on a server: a unit frees its
  slot when answered) and the order after an answer (the replacement's request goes out before the
  answered unit builds its record, at most answer_hold_s later).
- hedging: in the tail (nothing left to admit and capacity idle), a request older than the recent p90 latency
  (`hedge_after`) may get a copy; attempts.py sends it only to a measurably faster server, and aborts the loser.

Owns: these estimates, the slot counts, the controller's polling (through engines/, read-only), the
admission loop, and when the tail starts.
Must never: send, abort or resend a request (attempts.py does), write a shard (the worker does), or hold a
unit longer than answer_hold_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator, Protocol

import aiohttp

from pipegen.actor.concurrency import ConcurrencyControl
from pipegen.actor.supervision import SUPERVISION
from pipegen.config.schema import Actors, Servers
from pipegen.engines import Engine

log = logging.getLogger("pipegen.actor")


@dataclass
class WatchdogLimits:
    stall_floor_s: float = Servers.stall_floor_s  # fixed part of every deadline: prefill, a short queue, the network
    stall_margin: float = Servers.stall_margin  # x the expected decode time (max_new_tokens x observed s/token)
    prior_s_per_token: float = 0.1  # before a server answered anything: a slow GPU under a full batch
    hedge: bool = Actors.hedge  # in the tail, copy a request on a slow server to a faster one (attempts.py)
    hedge_factor: float = 1.0  # in the tail, a request older than the recent p90 latency may be hedged
    hedge_min_s: float = 1.0


class TokenClock:
    """Recent (latency, output tokens) of one server's answers."""

    def __init__(self, window: int = 512):
        self.window: deque[tuple[float, int]] = deque(maxlen=window)
        self.latency_sum = 0.0
        self.token_sum = 0
        self.observed = 0
        self._p90: tuple[int, float | None] = (-1, None)  # (observed when computed, value)

    def observe(self, latency_s: float, tokens: int) -> None:
        if len(self.window) == self.window.maxlen:
            old_lat, old_tok = self.window[0]
            self.latency_sum -= old_lat
            self.token_sum -= old_tok
        tokens = max(1, tokens)
        self.window.append((latency_s, tokens))
        self.latency_sum += latency_s
        self.token_sum += tokens
        self.observed += 1

    def seconds_per_token(self) -> float | None:
        if len(self.window) < SUPERVISION.min_observations or self.token_sum <= 0:
            return None
        return max(0.0, self.latency_sum) / self.token_sum

    def latency_p90(self) -> float | None:
        if len(self.window) < SUPERVISION.min_observations:
            return None
        # asked on every wake of every request in the tail: sort the window again only once a few answers
        # have changed it (a sort of 512 costs ~50 us; the p90 of a full window barely moves per answer)
        seen, value = self._p90
        if value is None or self.observed - seen >= max(1, len(self.window) // SUPERVISION.p90_refresh):
            lat = sorted(x for x, _ in self.window)
            value = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
            self._p90 = (self.observed, value)
        return value


def stall_deadline(clock: TokenClock, max_new_tokens: int, limits: WatchdogLimits, stalls: int = 0) -> float:
    """The clock's seconds for a request on this server: past them a request on a server that reports no load counts
    as stalled (elsewhere the engine's evidence decides: attempts.py)."""
    spt = clock.seconds_per_token()
    if spt is None:
        spt = limits.prior_s_per_token
    return (limits.stall_floor_s + limits.stall_margin * max(1, max_new_tokens) * spt) * (2 ** stalls)


class Slots:
    """Which of an actor's units hold a concurrency slot, and what runs first after a server answers.

    A unit holds a slot from its start until the server answers it; it frees it then, not when its record
    is written. And an answered unit builds its record (verl's output, the score, the line) only once the
    units admitted in its place have sent their requests (at most answer_hold_s later): when a burst of
    answers arrives together, the server gets the next burst of requests right away and works on it while
    the actor builds records, instead of idling until every record of the burst is written. A multi-turn
    loop that asks again takes a slot again at once. Units past their answer count towards `held_cap`, so
    a slow scorer on this machine cannot make them pile up; a unit waiting on a remote verifier does not,
    up to what the verifier checks at once (`verifier_room`): those units cost memory only, and holding
    them back would let a 100 ms verifier cut the actor's rate by more than half."""

    def __init__(self, wake: asyncio.Event):
        self.wake = wake  # the admission loop's event (the controller's `changed`)
        self.answered_units = 0  # units whose last request was answered
        self.unsent = 0  # units admitted that have not asked for their first answer yet
        self.admitting = False  # an answer woke the admission loop, which has not finished its round
        self.closed = False  # every unit has been admitted
        self._settled = asyncio.Event()
        self._settled.set()
        self._hold_timer: asyncio.TimerHandle | None = None  # one per round, not one per waiting unit
        self.at_verifier = 0  # answered units waiting on a remote verifier's score
        self.verifier_room = 0  # of those, how many may stay out of `held_cap`: what the verifier checks at once

    def holding(self, running: int) -> int:
        """Of `running` units in the actor, those that hold a slot."""
        return running - self.answered_units

    @staticmethod
    def held_cap(limit: int, memory_cap: int) -> int:
        """Units the actor may hold at once, answered or not: twice the limit, within the memory bound."""
        return max(limit, min(2 * limit, memory_cap))

    def held(self, running: int) -> int:
        """Of `running` units in the actor, those that count towards `held_cap`."""
        return running - min(self.at_verifier, self.verifier_room)

    def admitted(self) -> "UnitSlot":
        self.unsent += 1
        self._unsettle()
        return UnitSlot(self)

    def _unsettle(self) -> None:
        self._settled.clear()
        if self._hold_timer is None:
            self._hold_timer = asyncio.get_running_loop().call_later(SUPERVISION.answer_hold_s, self._release_hold)

    def _release_hold(self) -> None:
        """answer_hold_s passed: answered units build their records even if a replacement has not asked."""
        self._hold_timer = None
        self._settled.set()

    def round_done(self, closed: bool = False) -> None:
        """The admission loop admitted what it could and now waits (or has nothing left to admit)."""
        self.admitting = False
        self.closed = self.closed or closed
        self._settle()

    def _settle(self) -> None:
        if not self.admitting and self.unsent == 0:
            self._settled.set()
            if self._hold_timer is not None:
                self._hold_timer.cancel()
                self._hold_timer = None

    async def settled(self) -> None:
        if not self._settled.is_set():
            await self._settled.wait()


class UnitSlot:
    """One unit's side of `Slots`."""

    __slots__ = ("slots", "sent", "is_answered")

    def __init__(self, slots: Slots):
        self.slots = slots
        self.sent = False
        self.is_answered = False

    def ask(self) -> None:
        """The unit's agent loop asks a server (again): it holds a slot."""
        slots = self.slots
        if not self.sent:
            self.sent = True
            slots.unsent -= 1
            slots._settle()
        if self.is_answered:
            self.is_answered = False
            slots.answered_units -= 1

    async def answered(self) -> None:
        """The server answered: free the slot, let the admission loop refill it, build the record after."""
        slots = self.slots
        if not self.is_answered:
            self.is_answered = True
            slots.answered_units += 1
            if not slots.closed:
                slots.admitting = True
                slots._unsettle()
            slots.wake.set()
        await slots.settled()

    @contextlib.contextmanager
    def awaiting_verifier(self, capacity: int) -> Iterator[None]:
        """While its score is checked by a remote verifier that checks `capacity` samples at once (0: the
        score is computed on this machine), the unit leaves room under `held_cap` for another."""
        if capacity <= 0:
            yield
            return
        slots = self.slots
        slots.verifier_room = max(slots.verifier_room, capacity)
        slots.at_verifier += 1
        slots.wake.set()
        try:
            yield
        finally:
            slots.at_verifier -= 1

    def release(self) -> None:
        """The unit ends, whatever happened to it."""
        self.ask()


class UnitSource(Protocol):
    """Where the admission loop takes units from (actor/units.py: a fixed share, or node leases)."""

    async def next(self, free: int) -> tuple[int, int] | None: ...


StartUnit = Callable[[int, int, UnitSlot], Awaitable[None]]


class Admission:
    """The actor's admission policy, and the small interface the server pool asks it through.

    Without a controller (a pool used on its own, e.g. as verl's `llm_client`) it only sets stall deadlines:
    nothing is admitted through it and nothing is hedged."""

    def __init__(self, watchdog: WatchdogLimits, control: ConcurrencyControl | None = None):
        self.watchdog = watchdog
        self.control = control
        # one event for "a slot freed up" and "the limit changed" (the controller sets it): waiting on it costs
        # a future, where waiting on two events would cost two tasks and an asyncio.wait per unit
        self.slots = Slots(control.changed if control is not None else asyncio.Event())
        self.running: set[asyncio.Task] = set()
        self.answers = TokenClock(window=1024)  # every server's answers: the tail's hedging threshold
        self.draining = False  # nothing left to admit
        self.round = 1  # units a refill waits for (round where a server takes grouped requests; the actor sets it)
        self._tail: asyncio.Future | None = None  # resolved when draining starts: wakes watched requests

    # ---- asked by the server pool (attempts.py) ----
    def stall_deadline(self, server_clock: TokenClock, max_new_tokens: int, stalls: int = 0) -> float:
        """Seconds a request may take on a server before it counts as stalled."""
        return stall_deadline(server_clock, max_new_tokens, self.watchdog, stalls)

    def answered(self, latency_s: float, tokens: int) -> None:
        """A server answered a request (any server): the hedging threshold follows recent latencies."""
        self.answers.observe(latency_s, tokens)

    def hedge_after(self) -> float | None:
        """Age past which a request may be hedged now, or None while hedging is off or not worth it (not in
        the tail, or no capacity idle)."""
        wd = self.watchdog
        if not (wd.hedge and self.draining and self.control is not None
                and self.waiting_on_servers() < self.control.total()):
            return None
        p90 = self.answers.latency_p90()
        return None if p90 is None else max(wd.hedge_min_s, wd.hedge_factor * p90)

    def may_hedge_later(self) -> bool:
        """In the tail with hedging on: capacity may free up, so a watched request should look again soon."""
        return self.watchdog.hedge and self.draining

    def tail_started(self) -> asyncio.Future | None:
        """Before the tail, with hedging on: a future that resolves when the tail starts (a watched request
        then considers a hedge at once); None when there is nothing to wait for."""
        if not self.watchdog.hedge or self.draining:
            return None
        if self._tail is None:
            self._tail = asyncio.get_running_loop().create_future()
        return self._tail

    # ---- the actor's admission loop ----
    def waiting_on_servers(self) -> int:
        """Units that hold a slot now (admitted, not yet answered)."""
        return self.slots.holding(len(self.running))

    def _start_draining(self) -> None:
        self.draining = True
        if self._tail is not None and not self._tail.done():
            self._tail.set_result(None)

    async def run(self, units: UnitSource, start_unit: StartUnit, session: aiohttp.ClientSession,
                  engine: Engine) -> None:
        """Start units from `units` (each as `start_unit(pos, sample, slot)`) while the controller allows,
        follow the servers' load meanwhile, and return when every started unit has ended. A unit's task that
        raises (its shard write failed: a unit's own failure is a record) stops admission and is re-raised."""
        control = self.control
        assert control is not None, "Admission.run needs a ConcurrencyControl"
        slots, running, wake = self.slots, self.running, control.changed
        follower = asyncio.create_task(control.follow(session, engine, self.waiting_on_servers, lambda: self.draining))
        lost_writes: list[BaseException] = []

        def finished(task: asyncio.Task) -> None:
            running.discard(task)
            if not task.cancelled() and task.exception() is not None:
                lost_writes.append(task.exception())
            wake.set()

        loop = asyncio.get_running_loop()
        in_round = 0  # units admitted since the loop last waited: one round, whose requests go out together
        hold_since: float | None = None
        try:
            while True:
                while (self.waiting_on_servers() >= control.total()
                       or slots.held(len(running)) >= Slots.held_cap(control.total(), control.memory_cap)
                       or len(running) >= max(control.total(), control.memory_cap)):
                    slots.round_done()
                    wake.clear()
                    in_round = 0
                    await wake.wait()
                if lost_writes:
                    raise lost_writes[0]
                free = control.total() - self.waiting_on_servers()
                if in_round == 0 and free < self.round and running and control.queued():
                    # a round of one would be a request of its own: wait for more slots to free (the servers have
                    # work queued meanwhile, so they do not idle), up to round_hold_s
                    hold_since = hold_since or loop.time()
                    if loop.time() - hold_since < SUPERVISION.round_hold_s:
                        slots.round_done()
                        wake.clear()
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(wake.wait(), SUPERVISION.round_hold_s - (loop.time() - hold_since))
                        continue
                hold_since = None
                in_round += 1
                unit = await units.next(free)
                if unit is None:
                    break
                pos, sample = unit
                task = asyncio.create_task(start_unit(pos, sample, slots.admitted()))
                running.add(task)
                task.add_done_callback(finished)
            slots.round_done(closed=True)
            self._start_draining()  # the tail: nothing left to start, hedging may use idle capacity
            while running:
                await asyncio.gather(*list(running))
            control.end_tail(loop.time())  # the last answer is in: each server's tail ends here
            if lost_writes:
                raise lost_writes[0]
        finally:
            follower.cancel()
