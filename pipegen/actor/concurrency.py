"""The actor's concurrency controller: how many units an actor keeps waiting on each server.

`ConcurrencyControl`: a fixed number when `actors.concurrency` is one; with `auto` (the default) it reads each
server's limit on running requests from its engine (SGLang's `/get_server_info`; vLLM reports none, so
`llm.max_running_requests` the launcher gave it), starts at HEADROOM times that (a batch running and a batch queued
behind it, split over the node's actors, which share the servers), then follows the engine's running and waiting
counts once a second (SGLang's `/get_load`, vLLM's `/metrics`): grow while the server's waiting queue is empty and
its running batch has room, shrink when more than a batch queues. Units are counted as the engine schedules them, one
sequence each, whether they travel alone or inside a grouped request (sending.py). Bounded by `actors.max_memory_mb`
over a conservative per-unit size (`unit_memory_bytes`). admission.py asks it how many units may wait.

Owns: the limit per server and its polling (through engines/, read-only). Must never: start a unit (admission.py
does) or send a request.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
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


def unit_memory_bytes(prompt_length: int, response_length: int) -> int:
    """A conservative size of one unit in flight: Python ints and floats for every token id and log-prob
    (about 100 bytes a token with the lists around them), the agent loop, the request and the record."""
    return (prompt_length + response_length) * 100 + 64 * 1024


@dataclass
class ServerPace:
    url: str
    max_running: int = DEFAULT_MAX_RUNNING
    limit: int = 1  # units this actor keeps in flight towards this server
    running: int | None = None  # from the engine's load signal (None: the server does not report it)
    waiting: int | None = None


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
        self.servers = [ServerPace(u.rstrip("/"), configured_max_running or DEFAULT_MAX_RUNNING) for u in urls]
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
                    s.max_running = reported
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

    async def follow(self, session: aiohttp.ClientSession, engine: Engine, units_in_flight: Callable[[], int]) -> None:
        """Poll the engine's load and adapt, until cancelled. A server without one keeps its start limit."""
        if not self.auto:
            return
        silent: set[str] = set()
        while True:
            await asyncio.sleep(self.interval_s)
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
