"""Leases of units (cluster=ray): what is left to hand out, what each node holds, what was leased again.

A lease is a list of unit keys (records.UnitKeys) in prompt-major order, handed to one node runner.
A node asks for about `lease_seconds` of its own recent pace (units its actors took per second), so a
fast node gets big leases and a slow one small ones; and never more than what is left ÷ (2 × nodes)
(guided self-scheduling), so leases shrink toward the tail and a slow node holds little when the others
run dry.

When a lease is lost to a Ray infrastructure error (its node died, its runner is unreachable), the units
of it that are neither committed nor in a complete shard line (the same scan an actor does on start) go
back to the front of the queue; with a store, those its segments do not commit (a lost node's disk is gone). Units that were written after all are then run twice at worst: the
writer keeps the first complete record and counts the rest as duplicates.

Owns: the launcher's in-memory lease state (rebuilt from the run directory on a relaunch: nothing here
is durable) and the scan that says which units of a run are still open.
Must never: import ray, talk to a node, or write under the run directory.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.layout import RunDir
from pipegen.run.medium import ROLLOUTS, open_medium
from pipegen.run.stream import UnitKeys


@dataclass
class Lease:
    id: int
    node: str
    units: list[int]
    issued_at: float = field(default_factory=time.time)


@dataclass
class Release:
    """Units of a lost lease put back in the queue, and when the last of them was leased again."""

    node: str
    units: int
    lost_at: float
    left: int = 0  # of them still waiting in the queue
    all_leased_at: float | None = None


def open_units(run: RunDir, n: int, units: Iterable[int] | None = None,
               settled: set[int] | None = None) -> list[int]:
    """Unit keys (all of the run's, or `units`) that are neither committed nor in a complete shard line,
    in the order given (the whole run: prompt-major, in manifest order). With a store, `settled` (the units its
    segments commit, and those a node listed failed) replaces the run directory's view: no node's disk is read."""
    keys = UnitKeys(n)
    if units is None:
        units = (keys.key(index, s) for index in run.read_manifest() for s in range(n))
    if settled is not None:
        return [u for u in units if u not in settled]
    ckpt = load_checkpoint(run.checkpoint)
    written = {keys.key(i, s) for i, s in open_medium(run).units(ROLLOUTS, ckpt)}
    return [u for u in units if u not in ckpt.committed and u not in written]


class LeaseBook:
    """The queue of units not leased yet and the leases out, by node."""

    def __init__(self, units: list[int], min_units: int, max_units: int):
        self.queue: deque[int] = deque(units)
        self.min_units = max(1, min_units)
        self.max_units = max(self.min_units, max_units)
        self.out: dict[int, Lease] = {}
        self.releases: list[Release] = []
        self._ids = itertools.count()
        self._front: list[tuple[Release, set[int]]] = []  # releases whose units still wait in the queue

    @property
    def done(self) -> bool:
        return not self.queue and not self.out

    def lease_size(self, nodes: int, wanted: float | None = None) -> int:
        """`wanted` units (a node's pace x lease_seconds; the upper bound when unknown), within the bounds
        and at most the queue's share per node."""
        share = math.ceil(len(self.queue) / (2 * max(1, nodes)))
        size = self.max_units if wanted is None else math.ceil(wanted)
        return max(self.min_units, min(self.max_units, size, share))

    def issue(self, node: str, nodes: int, wanted: float | None = None) -> Lease | None:
        """The next lease for `node` (one of `nodes` taking work), or None when the queue is empty."""
        if not self.queue:
            return None
        size = min(self.lease_size(nodes, wanted), len(self.queue))
        lease = Lease(next(self._ids), node, [self.queue.popleft() for _ in range(size)])
        self.out[lease.id] = lease
        if self._front:
            self._mark_leased_again(set(lease.units))
        return lease

    def finish(self, lease_id: int) -> Lease | None:
        return self.out.pop(lease_id, None)

    def lose(self, lease_id: int, still_open: Callable[[list[int]], list[int]]) -> Release | None:
        """The lease's node is gone: its still-open units go to the front of the queue."""
        lease = self.out.pop(lease_id, None)
        if lease is None:
            return None
        units = still_open(lease.units)
        release = Release(lease.node, len(units), time.time(), left=len(units))
        self.releases.append(release)
        if units:
            self.queue.extendleft(reversed(units))
            self._front.append((release, set(units)))
        else:
            release.all_leased_at = release.lost_at
        return release

    def take_back(self, node: str, units: list[int]) -> None:
        """Units of `node`'s leases that its actors had not started: out of those leases, to the queue's
        front (for a node that ran dry while this one still had a backlog)."""
        back = set(units)
        for lease in self.outstanding(node):
            lease.units = [u for u in lease.units if u not in back]
        self.queue.extendleft(reversed(units))

    def _mark_leased_again(self, leased: set[int]) -> None:
        for release, waiting in self._front:
            hit = waiting & leased
            if hit:
                waiting -= hit
                release.left = len(waiting)
                if not waiting:
                    release.all_leased_at = time.time()
        self._front = [(r, w) for r, w in self._front if w]

    def outstanding(self, node: str) -> list[Lease]:
        return [lease for lease in self.out.values() if lease.node == node]

    def units_released(self) -> int:
        return sum(r.units for r in self.releases)
