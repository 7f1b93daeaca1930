"""Routing: which server a request goes to, which servers are in rotation, and what each server has shown.

- `ServerState`: one server as this actor sees it: requests in flight there (and when each was sent), its answers'
  token clock (admission.py's `TokenClock`), its failures, whether it is in rotation, its group limit, and its last
  load reading (`Evidence`: the engine's own running and waiting counts, supervision's evidence; attempts.py asks).
- `Routing.pick`: every request of one sticky key (the prompt's index: its n samples and every turn of a unit) goes to
  one server, chosen by least in-flight requests when the key is new or its server is out of rotation. The sticky
  map is a `cachetools.LRUCache`: the keys of units long finished fall out.
- rotation: a server that fails `quarantine_after` times in a row (errors, refused connections, a hang the engine's
  evidence shows: never a long queue) leaves rotation and is probed (the engine's health route) until it answers
  200; a server still loading at start-up is probed the same way until it first answers. When no server is in
  rotation, requests wait for one to come back (bounded by the request timeout).

Owns: the servers' states, the sticky map, rotation and its probes, the load readings. Must never: send a
generation (sending.py does), or decide a retry, an abort or a hedge (attempts.py does).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import aiohttp
from cachetools import LRUCache

from pipegen.actor.admission import TokenClock
from pipegen.actor.limits import ClientLimits
from pipegen.actor.supervision import SUPERVISION
from pipegen.engines import Engine, LoadUnavailable, is_ready

log = logging.getLogger("pipegen.client")


class RetriesExhausted(Exception):
    """Every attempt failed with a transient error (connection, 5xx, timeout, abort), or no server came back."""


@dataclass
class Evidence:
    """A server's own account of its requests (its engine's load route), read at `at` (time.monotonic())."""

    running: int
    waiting: int
    at: float
    counted_before: float  # an attempt sent before this is surely counted in the reading (`ServerState.note_reading`)
    ours: int  # this actor's attempts there sent before counted_before
    sent: int  # ...and those sent transit_s before `at` (counted unless the engine lost one, or lags)
    asked: int  # ...and all of them when asked (the newest may still be on their way)
    by_steps: bool = False  # the counts are those of the engine's last recorded step (vLLM), not of `at`

    @property
    def known(self) -> int:
        """Requests the engine holds, from every client: running or queued."""
        return self.running + self.waiting


@dataclass
class ServerState:
    url: str
    in_flight: int = 0  # generations of this actor waiting on it (a grouped request's members each count)
    consecutive_failures: int = 0
    healthy: bool = True
    requests: int = 0
    successes: int = 0
    quarantines: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    clock: TokenClock = field(default_factory=TokenClock)
    stalled: int = 0  # requests the evidence showed stalled here (then aborted here and re-sent)
    group_limit: int | None = None  # generations it takes in one grouped request (None: not asked yet)
    http_requests: int = 0  # POSTs (a grouped request counts once)
    group_failures: int = 0  # grouped requests in a row that failed as a whole (sending.group_give_up: one by one)
    sent_at: dict[str, float] = field(default_factory=dict)  # rid -> when sent, for each attempt in flight here
    # each time the engine started an attempt sent later than any it had started before (a first chunk, or an
    # answer): (that attempt's send time, when its start was seen), both increasing. A request sent before such an
    # attempt and not started is not waiting its turn (the engines schedule in arrival order: SGLang's default
    # --schedule-policy fcfs, vLLM's, the CPU server's). `overtaken_since` asks it.
    starts: list[tuple[float, float]] = field(default_factory=list)
    evidence: Evidence | None = None  # its last load reading
    load_reported: bool = True  # False once the engine said it has no load route: the clock alone judges
    reading: asyncio.Task | None = None  # a load reading under way (one at a time per server)
    # (when asked, steps recorded) of its recent load readings, for an engine whose counts are its last step's
    step_readings: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=SUPERVISION.step_readings_kept))

    def note_reading(self, asked: float, steps: int | None) -> float:
        """A load reading asked at `asked`: attempts sent before the returned time are surely counted in it. Counts
        read live (steps None): lag_s before it. Counts of the engine's last recorded step (vLLM): an attempt that
        reached the engine before a reading is counted by the second step recorded after that reading (the first may
        have begun before it arrived), however long a step takes (a prefill on a busy CPU: seconds)."""
        live = asked - SUPERVISION.lag_s
        if steps is None:
            return live
        self.step_readings.append((asked, steps))
        seen = [at for at, n in self.step_readings if steps - n >= 2]
        return min(live, max(seen) - SUPERVISION.transit_s) if seen else -math.inf

    def sent_before(self, t: float) -> int:
        """Attempts of this actor in flight here that were sent before `t`."""
        return sum(1 for s in self.sent_at.values() if s < t)

    def mark_started(self, sent_at: float, now: float) -> None:
        """The engine started an attempt sent at `sent_at`, seen at `now`."""
        if not self.starts or sent_at > self.starts[-1][0]:
            self.starts.append((sent_at, now))
            if len(self.starts) > SUPERVISION.starts_kept:
                # the oldest go: a request older than what is kept reads the oldest kept start, seen later than the
                # first that overtook it, so it is judged later, never sooner
                del self.starts[:SUPERVISION.starts_kept // 2]

    def overtaken_since(self, sent_at: float) -> float | None:
        """When the engine was first seen to start an attempt sent after `sent_at` (None: not yet). Measured from
        that first start, not the latest: on a busy engine new starts come every step."""
        i = bisect.bisect_right(self.starts, (sent_at, math.inf))
        return self.starts[i][1] if i < len(self.starts) else None


class Routing:
    """The servers of one actor and the choice among them. Used from one event loop."""

    def __init__(self, urls: list[str], limits: ClientLimits, session: "aiohttp.ClientSession",
                 engine: Engine | None):
        if not urls:
            raise ValueError("no LLM server URLs to send requests to")
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        self.limits = limits
        self.session = session
        self.engine = engine  # None until readiness.py recognised the first server (llm.protocol=auto)
        self.sticky: LRUCache[Hashable, ServerState] = LRUCache(maxsize=SUPERVISION.sticky_cache_size)
        self._recovered = asyncio.Event()
        self._probes: dict[str, asyncio.Task] = {}
        # called with a server that (re)joins the rotation (sending.py asks its group limit again)
        self.on_admit: list[Callable[[ServerState], None]] = []

    # ---- the choice ----
    def pick(self, sticky_key: Any, exclude: set[str] = frozenset()) -> ServerState | None:
        """The key's server if it is in rotation and not excluded; else the least loaded one.

        A key is re-pinned only when its server left rotation (or it had none): a one-off retry
        elsewhere keeps the pin, so the prefix cache of the prompt stays on one server.
        """
        healthy = [s for s in self.servers if s.healthy]
        if not healthy:
            return None
        pinned = self.sticky.get(sticky_key)
        candidates = [s for s in healthy if s.url not in exclude] or healthy
        if pinned is not None and pinned.healthy:
            return pinned if pinned.url not in exclude else self.least_loaded(candidates)
        chosen = self.least_loaded(candidates)
        self.sticky[sticky_key] = chosen
        return chosen

    @staticmethod
    def least_loaded(candidates: list[ServerState]) -> ServerState:
        # ties (e.g. all idle at start) go to the server that has had fewer requests, not always the first
        return min(candidates, key=lambda s: (s.in_flight, s.requests))

    async def wait_for_a_server(self, sticky_key: Any, exclude: set[str]) -> ServerState:
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

    # ---- rotation ----
    def record_failure(self, server: ServerState, kind: str) -> None:
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

    def record_lost(self, server: ServerState, kind: str) -> None:
        """A request the server lost while it kept working on later ones: counted, but not a failure in a row (taking
        a working server out of rotation would leave its other requests waiting on a probe)."""
        server.errors[kind] = server.errors.get(kind, 0) + 1

    def record_success(self, server: ServerState) -> None:
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
        for hook in self.on_admit:
            hook(server)
        self._recovered.set()

    # ---- the servers' own account ----
    async def evidence(self, server: ServerState) -> Evidence | None:
        """The server's load read now (or within load_fresh_s); None when its engine reports none."""
        if not server.load_reported:
            return None
        now = time.monotonic()
        if server.evidence is not None and now - server.evidence.at < SUPERVISION.load_fresh_s:
            return server.evidence
        if server.reading is None or server.reading.done():
            server.reading = asyncio.get_running_loop().create_task(self._read_load(server))
        return await asyncio.shield(server.reading)

    async def _read_load(self, server: ServerState) -> Evidence | None:
        asked = time.monotonic()
        try:
            running, waiting, steps = await self.engine.load(self.session, server.url)
        except LoadUnavailable:
            server.load_reported = False
            log.info("%s reports no load: its requests are judged by the clock alone (llm.stall_floor_s, "
                     "llm.stall_margin)", server.url)
            return None
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
            log.info("%s: no load reading (%s)", server.url, e)
            return None
        # stamped when asked: what was sent before it counts
        counted_before = server.note_reading(asked, steps)
        server.evidence = Evidence(running, waiting, asked, counted_before, server.sent_before(counted_before),
                                   server.sent_before(asked - SUPERVISION.transit_s), server.sent_before(asked),
                                   by_steps=steps is not None)
        return server.evidence

    # ---- reports ----
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    def error_summary(self) -> dict[str, int]:
        return {f"{s.url} {k}": v for s in self.servers for k, v in s.errors.items()}

    def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
        for server in self.servers:
            if server.reading is not None:
                server.reading.cancel()
