"""The actor's concurrency controller: how many units an actor keeps waiting on each server.

`ConcurrencyControl`: a fixed number when `actors.concurrency` is one; with `auto` (the default) it reads each
server's limit on running requests from its engine (SGLang's `/get_server_info`; vLLM reports none, so
`llm.max_running_requests` the launcher gave it), starts at HEADROOM times that (a batch running and a batch queued
behind it, split over the node's actors, which share the servers), then follows the engine's running and waiting
counts once a second (SGLang's `/get_load`, vLLM's `/metrics`): grow while the server's waiting queue is empty and
its running batch has room, shrink when more than a batch queues. Units are counted as the engine schedules them, one
sequence each, whether they travel alone or inside a grouped request (sending.py). Bounded by `actors.max_memory_mb`
over a conservative per-unit size (`unit_memory_bytes`). admission.py asks it how many units may wait.

The same readings measure the tail (`TailMeter`, one per server): once this actor has nothing left to admit, the
seconds its server reported fewer answers than a full batch (running + waiting < its running limit) and, over them,
the slots it left empty as a share of the limit (idle GPU-seconds, a server counted as one GPU). Only a server whose
limit the engine reported, or the user configured, is measured; in the tail the load is read every TAIL_LOOK_S.

Owns: the limit per server, its polling (through engines/, read-only) and the tail measured from it. Must never:
start a unit (admission.py does) or send a request.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from pipegen.engines import Engine, LoadUnavailable

log = logging.getLogger("pipegen.actor")

DEFAULT_MAX_RUNNING = 256  # a server that reports no limit, and none is configured (llm.max_running_requests)
# in flight per server over its running slots: a whole batch waits behind the running one. An engine ends its
# answers in waves (one decode step finishes every sequence that reached its length; grouped requests and fixed
# lengths make the waves larger), and the next wave must already be queued while the actor builds the records
# of the last: with 1.1 the fake SGLang of `python -m pipegen.bench --only grouping` ran at 0.62 of its
# ceiling, with 2.0 at 1.0
HEADROOM = 2.0
TAIL_LOOK_S = 0.25  # the load's polling interval in the tail, where the idle slots are measured


def unit_memory_bytes(prompt_length: int, response_length: int) -> int:
    """A conservative size of one unit in flight: Python ints and floats for every token id and log-prob
    (about 100 bytes a token with the lists around them), the agent loop, the request and the record."""
    return (prompt_length + response_length) * 100 + 64 * 1024


@dataclass
class TailMeter:
    """One server's tail: seconds with fewer answers left there than a full batch (after this actor admitted its
    last unit), and the share of its running limit left idle over them, integrated (left Riemann sum over the
    load readings: a reading's counts hold until the next one, or until the actor's units have all ended)."""

    seconds: float = 0.0
    idle_s: float = 0.0  # idle GPU-seconds: sum of (limit - running) / limit x the reading's interval
    _last: tuple[float, int, int] | None = None  # (when, running, limit) of the previous reading in the tail

    def reading(self, now: float, running: int, waiting: int, limit: int, in_tail: bool) -> None:
        """A load reading; `in_tail`: nothing is left to admit."""
        self.close(now)
        if in_tail and limit > 0 and running + waiting < limit:
            self._last = (now, min(running, limit), limit)

    def close(self, now: float) -> None:
        """Count the interval since the previous tail reading."""
        if self._last is not None:
            at, running, limit = self._last
            self._last = None
            dt = max(0.0, now - at)
            self.seconds += dt
            self.idle_s += dt * (limit - running) / limit

    def as_stats(self, limit: int) -> dict[str, float]:
        return {"seconds": round(self.seconds, 3), "idle_s": round(self.idle_s, 3), "max_running": limit}


@dataclass
class ServerPace:
    url: str
    max_running: int = DEFAULT_MAX_RUNNING
    limit: int = 1  # units this actor keeps in flight towards this server
    running: int | None = None  # from the engine's load signal (None: the server does not report it)
    waiting: int | None = None
    measured: bool = False  # its running limit is the engine's own (or configured): its tail is measured
    tail: TailMeter = field(default_factory=TailMeter)


class ConcurrencyControl:
    """Units in flight for one actor: fixed, or following each server's limits and load."""

    def __init__(self, urls: list[str], setting: Any, sharing: int, memory_cap_units: int,
                 interval_s: float = 1.0, configured_max_running: int | None = None):
        self.auto = str(setting).strip().lower() == "auto"
        self.fixed = None if self.auto else int(setting)
        if self.fixed is not None and self.fixed < 1:
            raise ValueError(f"actors.concurrency must be 'auto' or at least 1, got {setting}")
        self.sharing = max(1, sharing)
        self.memory_cap = max(1, memory_cap_units)
        self.interval_s = interval_s
        self.servers = [ServerPace(u.rstrip("/"), configured_max_running or DEFAULT_MAX_RUNNING,
                                   measured=bool(configured_max_running)) for u in urls]
        self.changed = asyncio.Event()  # set when a limit changes (the actor also sets it when a unit ends)

    def total(self) -> int:
        if self.fixed is not None:
            return self.fixed
        return max(1, min(self.memory_cap, sum(s.limit for s in self.servers)))

    def queued(self) -> bool:
        """Whether a server may have requests waiting (its last reported queue was not empty, or it reports none)."""
        return any(s.waiting is None or s.waiting > 0 for s in self.servers)

    def by_server(self) -> dict[str, int]:
        if self.fixed is not None:
            return {}
        return {s.url: s.limit for s in self.servers}

    def _start_limit(self, s: ServerPace) -> int:
        return max(1, math.ceil(s.max_running * HEADROOM / self.sharing))

    async def discover(self, session: aiohttp.ClientSession, engine: Engine) -> None:
        """Read each server's running-request limit from its engine (else the configured or default one)."""
        if not self.auto:
            return
        for s in self.servers:
            try:
                reported = await engine.max_running(session, s.url)
                if reported:
                    s.max_running, s.measured = reported, True
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                log.warning("no running-request limit from %s (%s): assuming %d running requests", s.url, e,
                            s.max_running)
            s.limit = self._start_limit(s)
        log.info("concurrency auto: %s (memory bound %d units)",
                 ", ".join(f"{s.url} max_running_requests={s.max_running} -> {s.limit}" for s in self.servers),
                 self.memory_cap)
        self.changed.set()

    def adapt(self, s: ServerPace, running: int, waiting: int, binding: bool) -> None:
        """One control step for one server from its load."""
        s.running, s.waiting = running, waiting
        # the batch queued on purpose is the batch the engine really runs: a server told (or assumed, 256 for
        # vLLM) to run more than it does would otherwise let its queue grow to the told size unanswered
        batch = min(running, s.max_running) if running > 0 else s.max_running
        target_queue = max(2, math.ceil((HEADROOM - 1) * batch))
        old = s.limit
        if waiting > target_queue:
            s.limit = max(1, s.limit - max(1, (waiting - target_queue) // self.sharing))
        elif waiting == 0 and running < s.max_running and binding:
            s.limit = s.limit + max(1, (s.max_running - running) // self.sharing)
        cap = max(1, 4 * s.max_running // self.sharing)  # never far past what the server can hold
        s.limit = min(s.limit, cap)
        if s.limit != old:
            self.changed.set()

    def tail_by_server(self) -> dict[str, dict[str, float]]:
        """Each measured server's tail so far: {"seconds", "idle_s", "max_running"} (the stats line's `tail`)."""
        return {s.url: s.tail.as_stats(s.max_running) for s in self.servers if s.measured and s.tail.seconds > 0}

    def end_tail(self, now: float) -> None:
        """The actor's units have all ended: each server's last tail reading holds until `now`."""
        for s in self.servers:
            s.tail.close(now)

    async def follow(self, session: aiohttp.ClientSession, engine: Engine, units_in_flight: Callable[[], int],
                     in_tail: Callable[[], bool] = lambda: False) -> None:
        """Poll the engine's load and adapt, until cancelled. A server without one keeps its start limit. Once
        `in_tail()` (nothing left to admit), poll every TAIL_LOOK_S and measure each server's tail."""
        if not self.auto:
            return
        silent: set[str] = set()
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            # looks every TAIL_LOOK_S whether the tail began; reads the load every interval_s before it
            await asyncio.sleep(min(self.interval_s, TAIL_LOOK_S))
            if not in_tail() and loop.time() - last < self.interval_s:
                continue
            last = loop.time()
            binding = units_in_flight() >= self.total()
            for s in self.servers:
                if s.url in silent:
                    continue
                try:
                    running, waiting, _ = await engine.load(session, s.url)
                except LoadUnavailable as e:
                    silent.add(s.url)
                    log.info("%s: its concurrency stays at %d", e, s.limit)
                    continue
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                    continue
                self.adapt(s, running, waiting, binding)
                if s.measured:
                    s.tail.reading(loop.time(), running, waiting, s.max_running, in_tail())
