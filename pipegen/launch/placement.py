"""Where a run's generation happens: the one interface every placement has, and the one choice among them.

A placement starts the servers and actors that generate (on this node, or on the nodes of a cluster) and
says how they are doing; the launcher asks nothing else of it, in this order:
`plan` (before any process starts: what the launch record lists), `place` (start generating), `begin` (the
unit manifest is written: hand out work), then `check` and `done` while the run goes, and `stop`.
`local_placement.py` runs on this node alone; `ray_placement.py` places a node runner on every node of a
Ray cluster. Each is named in PLACEMENTS by its dotted path and imported only when its kind is chosen, so
this module imports neither. Another scheme (Slurm, Kubernetes) is one more file and one more row there.

Owns: the choice of placement by `cluster.kind`.
Must never: import an implementation at module level (the local placement's run needs nothing of Ray's, and
the Ray placement imports Ray only when it connects), or start the writer (the launcher does, beside every
placement).
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol

from omegaconf import DictConfig

from pipegen.launch.world import WorldPlan
from pipegen.run.layout import RunDir


class Placement(Protocol):
    def plan(self) -> WorldPlan:
        """The servers and actors this node runs (ports picked), before any process starts; PlanError names
        the fix."""

    def place(self) -> None:
        """Start generating: servers first (they take longest), then the actors, which import verl while the
        servers load and the launcher reads the dataset. Returns at once."""

    def begin(self) -> None:
        """The unit manifest is written: hand the units out (actors that take their own share need nothing)."""

    def check(self) -> None:
        """Raise when generation cannot go on (no server ever answers, a crash loop, every node failed)."""

    def done(self) -> bool:
        """Every unit this placement was given is settled (what a launch without a writer waits for)."""

    def stop(self) -> None:
        """Stop every process it started; nothing of it is left running."""


# cluster.kind -> its placement as "module:class" (config/schema.py's CLUSTER_KINDS names the kinds and their keys)
PLACEMENTS: dict[str, str] = {
    "local": "pipegen.launch.local_placement:LocalPlacement",
    "ray": "pipegen.launch.ray_placement:RayPlacement",
}


def placement_class(kind: str) -> Callable[[DictConfig, RunDir], Placement]:
    """The class PLACEMENTS names for this kind, imported now."""
    module, _, name = PLACEMENTS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def placement_for(cfg: DictConfig, run: RunDir) -> Placement:
    """The placement `cluster.kind` names. Its constructor writes nothing and starts nothing; one that cannot
    run here says so (PlanError, one line)."""
    return placement_class(str(cfg.cluster.kind))(cfg, run)
