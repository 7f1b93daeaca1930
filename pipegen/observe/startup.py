"""A launch's start-up phases, read from the actors' stats lines: when the actors were ready, when a server
first answered its engine's health route, when the first request went out and when the first unit reached a
shard.

Each actor writes its wall-clock phase times into its stats line (`startup/<phase>`, pipegen/actor/
readiness.py); this module turns the latest lines of one launch into seconds since the launch started,
for the launcher's log and `python -m pipegen.status`.

Owns: the summary of the phases (their names are the stats-line contract's, pipegen/run/stats_line.py).
Must never: import verl or torch, or read anything but the stats lines and launch record it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pipegen.run.stats_line import ActorStats, StatsLine


@dataclass
class StartupPhases:
    """Seconds since the launch started (None: not reached yet)."""

    actors: int  # actors of this launch that have reported
    actors_ready_first: float | None = None
    actors_ready_last: float | None = None
    server_ready: float | None = None  # the first time any actor saw a server answer its health route
    first_request: float | None = None
    first_unit: float | None = None
    server_was_first: bool = False  # a server answered the actors' very first poll: the actors were the wait

    @property
    def request_after_server_s(self) -> float | None:
        if self.first_request is None or self.server_ready is None:
            return None
        return self.first_request - self.server_ready

    @property
    def unit_after_server_s(self) -> float | None:
        if self.first_unit is None or self.server_ready is None:
            return None
        return self.first_unit - self.server_ready

    @property
    def complete(self) -> bool:
        return self.first_unit is not None and self.actors_ready_last is not None

    def as_dict(self) -> dict[str, Any]:
        return {"actors": self.actors, "actors_ready_first_s": self.actors_ready_first,
                "actors_ready_last_s": self.actors_ready_last, "server_ready_s": self.server_ready,
                "first_request_s": self.first_request, "first_unit_s": self.first_unit,
                "first_request_after_server_ready_s": self.request_after_server_s,
                "first_unit_after_server_ready_s": self.unit_after_server_s,
                "server_answered_first_poll": self.server_was_first}

    def render(self) -> str:
        def at(t: float | None) -> str:
            return "not yet" if t is None else f"+{t:.1f}s"

        ready = at(self.actors_ready_last)
        if self.actors > 1 and self.actors_ready_first is not None:
            ready = f"{at(self.actors_ready_first)}..{at(self.actors_ready_last)} ({self.actors} actors)"
        server = at(self.server_ready)
        if self.server_was_first and self.server_ready is not None:
            server = f"≤{server} (up before the actors: they were the wait)"
        parts = [f"server ready {server}", f"actors ready {ready}",
                 f"first request {at(self.first_request)}"]
        if self.request_after_server_s is not None:
            parts[-1] += f" ({self.request_after_server_s:.2f}s after server ready)"
        parts.append(f"first unit in a shard {at(self.first_unit)}")
        if self.unit_after_server_s is not None:
            parts[-1] += f" ({self.unit_after_server_s:.2f}s after server ready)"
        return " | ".join(parts)


def startup_phases(roles: Mapping[str, StatsLine], launch_started: float) -> StartupPhases | None:
    """The phases of the launch that started at `launch_started` (wall clock), from each role's latest
    stats line; lines of an earlier launch are ignored. None when no actor of this launch has reported."""
    clocks = [line.startup for line in roles.values() if isinstance(line, ActorStats)
              and float(line.startup.process_started or 0) >= launch_started - 1.0]
    if not clocks:
        return None

    def times(phase: str) -> list[float]:
        return [float(t) - launch_started for t in (clock.phase(phase) for clock in clocks) if t is not None]

    ready = times("ready")
    first = {phase: min(times(phase), default=None) for phase in ("server_ready", "first_request", "first_unit")}
    return StartupPhases(
        actors=len(clocks),
        actors_ready_first=min(ready, default=None),
        actors_ready_last=max(ready) if len(ready) == len(clocks) else None,
        server_ready=first["server_ready"], first_request=first["first_request"], first_unit=first["first_unit"],
        server_was_first=any(clock.server_answered_first_poll for clock in clocks if clock.server_ready is not None
                             and float(clock.server_ready) - launch_started == first["server_ready"]),
    )
