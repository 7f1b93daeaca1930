"""An actor's start-up: when it became ready, when a server first answered, when its first request went
out and its first unit reached a shard; and the wait for the first server.

The launcher starts actors right after the servers, so an actor's own start-up (almost all of it
importing verl, torch and transformers: ~6 s on an idle 2-core CPU box, ~17 s on a GPU box) overlaps
the servers' load and the launcher's read of the dataset (the actor waits for the unit manifest only
after its imports). An actor then polls every server's health route (its engine's: SGLang's
`/health_generate`, vLLM's `/health`; with `llm.protocol=auto` it first asks the server which engine
it is) and starts sending the moment one answers 200; servers that come up later join the rotation as
they answer.

Owns: the actor's start-up clock (wall-clock times, written into its stats lines under `startup/...`,
the names pipegen/observe/startup.py reads), the wait for the manifest and for the first server, and
handing servers that are still loading to the pool's readiness probe (out of rotation until they answer).
Must never: send a generation request, or give up on a server that is still loading (only the launcher's
`llm.ready_timeout_s` decides that).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

from pipegen.engines import detect_protocol, engine, is_ready
from pipegen.run.stats_line import ACTOR_PHASES, ActorStartup

log = logging.getLogger("pipegen.actor")


def process_start_time() -> float:
    """When this process started (wall clock): from /proc on Linux, else now (this module loads early)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in ticks since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


PROCESS_STARTED = process_start_time()

HEALTH_POLL_S = 0.2  # how often an actor asks the servers whether they are ready; costs nothing measurable


@dataclass
class StartupClock:
    """Wall-clock times (time.time()) of an actor's start-up phases; None until reached."""

    process_started: float = PROCESS_STARTED
    times: dict[str, float] = field(default_factory=dict)
    server_answered_first_poll: bool = False  # True: the server was up before this actor (the actor was the wait)

    def mark(self, phase: str) -> float:
        """Record `phase` now (the first time only); returns its time."""
        assert phase in ACTOR_PHASES, phase
        return self.times.setdefault(phase, time.time())

    def since(self, phase: str, start: str | None = None) -> float:
        """Seconds from `start` (the process start when None) to `phase`."""
        origin = self.process_started if start is None else self.times[start]
        return self.times[phase] - origin

    def as_stats(self) -> ActorStartup:
        return ActorStartup(process_started=self.process_started,
                            server_answered_first_poll=self.server_answered_first_poll,
                            **{phase: self.times.get(phase) for phase in ACTOR_PHASES})

    def unit_written(self) -> None:
        if "first_unit" not in self.times:
            self.mark("first_unit")
            log.info("first unit in a shard %.2fs after a server was ready (first request %.2fs after it)",
                     self.since("first_unit", "server_ready"),
                     self.since("first_request", "server_ready") if "first_request" in self.times else float("nan"))


async def _answers(session, pool, url: str) -> bool:
    """The engine's health route answered 200 (refused connections, 503 and timeouts mean "still
    loading"). With `llm.protocol=auto`, the first server that answers names the pool's engine."""
    if pool.engine is None:
        protocol = await asyncio.to_thread(detect_protocol, url)  # UnknownEngine propagates: a wrong URL
        if protocol is None:
            return False
        if pool.engine is None:
            pool.engine = engine(protocol)
            log.info("%s speaks the %s protocol (llm.protocol=auto)", url, protocol)
    return await is_ready(session, url, pool.engine.health_path)


async def wait_for_first_server(session, pool, clock: StartupClock, poll_s: float = HEALTH_POLL_S) -> None:
    """Poll every server of `pool` (the actor's client.ServerPool) until one answers its health route; mark
    `server_ready`. Servers still loading then stay out of rotation until they answer (so no unit is
    retried against a server that is not up yet); background tasks bring them in as they answer.

    There is no deadline here: the launcher stops the run when a server misses `llm.ready_timeout_s` or dies.
    """
    started = time.monotonic()
    waiting_logged = False
    clock.server_answered_first_poll = True
    while True:
        results = await asyncio.gather(*(_answers(session, pool, s.url) for s in pool.servers))
        if any(results):
            break
        clock.server_answered_first_poll = False
        if not waiting_logged:
            log.info("waiting for a server to answer (%s)", ", ".join(s.url for s in pool.servers))
            waiting_logged = True
        await asyncio.sleep(poll_s)
    clock.mark("server_ready")
    late = [s for s, ok in zip(pool.servers, results) if not ok]
    log.info("server %s ready after waiting %.1fs (%d of %d answering); sending requests",
             next(s.url for s, ok in zip(pool.servers, results) if ok), time.monotonic() - started,
             len(pool.servers) - len(late), len(pool.servers))
    for server in late:
        pool.hold_out(server, max(poll_s, 0.5))  # its readiness probe brings it into rotation when it answers
