"""The stats-line contract: what one line of DIR/streams/stats/<role>.jsonl holds, per role.

Every process appends a line every few seconds (observe/stats.py's StatsAppender adds the identity
head and the `<counter>_per_s` rates); users `tail -f` these files, `python -m pipegen.status`, the
launcher's progress bar and metric tracking read them back. Each role's line is one dataclass here,
so a key is spelled once, by its field name:

- `ActorStats` (`actor_<rank>`): units, requests, latency, outputs, the watchdog's and admission's
  state, and the start-up phases (`ActorStartup`, flat on disk as `startup/<field>`).
- `WriterStats` (`writer`): what the writer committed, buffered and dropped; a writer that refused a
  damaged file writes one line with `final` and `refused` only.
- `ClusterStats` (`cluster`, cluster=ray): each node runner's leases and the units leased again.
- `LaunchStats` (`launch`): the launcher's aggregated metrics (observe/tracking.py names them), flat.

On disk a line is one flat JSON object (the field names are its keys, unchanged since before these
types: older runs read the same). `parse_stats_line(role, raw)` reads any line into its role's type:
unknown keys (a newer pipegen's, the appender's rates) are dropped, missing ones (an older pipegen's)
take their defaults, so `pipegen.status` reads every run directory.

Owns: every stats-line key and each role's line type.
Must never: touch files, know about processes, or import a role or pipegen.observe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from functools import cache
from typing import Any, ClassVar

from pipegen.run.layout import is_actor_role

STARTUP_PREFIX = "startup/"
RATE_SUFFIX = "_per_s"  # the appender's `<counter>_per_s` beside each rated counter
RATED = {"rated": True}  # a field's metadata: a cumulative counter that gets a rate


@cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@cache
def _rated(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.metadata.get("rated"))


def _known(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    names = _names(cls)
    return {k: v for k, v in raw.items() if k in names}


@dataclass
class StatsHead:
    """What every line starts with: the appender (observe/stats.py) writes it."""

    time: float | None = None
    role: str | None = None
    pid: int | None = None
    host: str | None = None
    seq: int | None = None
    uptime_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in HEAD}


HEAD = _names(StatsHead)


@dataclass
class StatsLine(StatsHead):
    """A line: the head, `final` (the process's last line), and the role's own fields (subclasses)."""

    final: bool = False

    def body(self) -> dict[str, Any]:
        """The role's own keys (not the head: the appender adds it), in declaration order."""
        return {name: getattr(self, name) for name in _names(type(self)) if name not in HEAD}

    def rated_counters(self) -> dict[str, float]:
        """The cumulative counters that get a rate (fields with RATED metadata), where set."""
        return {name: float(value) for name in _rated(type(self)) if (value := getattr(self, name)) is not None}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "StatsLine":
        return cls(**_known(cls, raw))


@dataclass
class ActorStartup:
    """Wall-clock times (time.time()) of an actor's start-up phases; None until reached."""

    process_started: float | None = None  # the process's own start (from /proc)
    server_answered_first_poll: bool = False  # True: the server was up before this actor (the actor was the wait)
    ready: float | None = None
    server_ready: float | None = None
    first_request: float | None = None
    first_unit: float | None = None

    def phase(self, name: str) -> float | None:
        """The time of one of ACTOR_PHASES."""
        return getattr(self, name)


# The actor's start-up phases (ActorStartup's fields after the two about the process), in the order a
# healthy launch reaches them (ready may come after server_ready: then the server waited).
ACTOR_PHASES = _names(ActorStartup)[2:]


@dataclass
class ActorStats(StatsLine):
    """One actor process's counters, cumulative over the process (a restart starts again from zero)."""

    units_total: int = 0  # units this actor was given (its share, or leased so far)
    completed: int = field(default=0, metadata=RATED)
    failed: int = 0
    in_flight: int = 0
    trajectories: int = 0  # rows: a multi-trajectory agent loop returns several per unit
    requests: int = field(default=0, metadata=RATED)
    retries: int = 0
    requests_in_flight: int = 0
    output_tokens: int = field(default=0, metadata=RATED)
    latency_p50_s: float | None = None  # over the process's newest requests
    latency_p95_s: float | None = None
    finish_reasons: dict[str, int] = field(default_factory=dict)
    mean_turns: float | None = None  # the model's turns (stream.assistant_turns), over the newest trajectories
    mean_response_length: float | None = None
    mean_reward: float | None = None
    errors: dict[str, int] = field(default_factory=dict)  # by kind
    servers_out_of_rotation: list[str] = field(default_factory=list)
    stalled: int = 0  # attempts the engine's evidence showed stalled (aborted and re-sent)
    aborts_sent: int = 0
    hedges: int = 0  # tail copies sent to a faster server
    hedge_wins: int = 0
    hedge_tokens: int = 0  # tokens the losing copies had streamed: the tail's extra work
    http_requests: int = 0  # generation POSTs (a grouped request counts once)
    concurrency: int | None = None  # units admission allows at once (None: before it started)
    concurrency_by_server: dict[str, int] = field(default_factory=dict)  # concurrency=auto only
    server_load: dict[str, dict[str, int]] = field(default_factory=dict)  # url -> {"running", "waiting"}
    requests_by_server: dict[str, int] = field(default_factory=dict)
    # url -> {"seconds", "idle_s", "max_running"}: once the actor had nothing left to admit, the seconds the server
    # reported fewer answers than its running limit, and the idle slots over them as GPU-seconds (actor/concurrency.py)
    tail: dict[str, dict[str, float]] = field(default_factory=dict)
    longest_request_s: float = 0.0  # the longest request, sent to answered: no run ends sooner than it
    cpu_busy: float | None = None  # CPU time / wall time over the last interval (near 1.0: the actor limits)
    startup: ActorStartup = field(default_factory=ActorStartup)

    def body(self) -> dict[str, Any]:
        out = super().body()
        startup = out.pop("startup")
        out.update({STARTUP_PREFIX + name: value for name, value in vars(startup).items()})
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ActorStats":
        line = cls(**_known(cls, raw))
        line.startup = ActorStartup(**{name: raw[STARTUP_PREFIX + name] for name in _names(ActorStartup)
                                       if STARTUP_PREFIX + name in raw})
        return line


@dataclass
class WriterStats(StatsLine):
    """The writer's counters; None (left out of the line): not known, as in a refusal's line."""

    ROLE: ClassVar[str] = "writer"

    committed: int | None = field(default=None, metadata=RATED)  # units in batch files, every launch's
    # the head's writer with a store: units the store held at its first look, before this launch's nodes committed
    # (what this launch committed is committed minus it; a lost node's commits counted, its stats are not)
    committed_before: int | None = None
    units_total: int | None = None
    batches: int | None = None
    buffered: int | None = None  # units read from the shards, not yet in a batch file
    failed: int | None = None
    duplicates: int | None = None  # a unit's second complete record, dropped
    unknown_units: int | None = None  # a record for no unit of this run, dropped
    torn_lines: int | None = None  # a crash's partial last line, skipped
    lines: int | None = field(default=None, metadata=RATED)  # rollout lines read
    refused: str | None = None  # the damaged file the writer refused to go on with (its one line)

    def body(self) -> dict[str, Any]:
        return {k: v for k, v in super().body().items() if v is not None}


@dataclass
class NodeStats:
    """One node runner, as the cluster line shows it."""

    state: str = "?"
    rejoined: bool = False  # started again after a loss (a new incarnation), and alive
    host: str | None = None
    incarnation: str | None = None
    incarnations: int = 0
    leases_out: int = 0
    units_out: int = 0
    units_leased: int = 0
    leases_done: int = 0
    leases_lost: int = 0
    units_taken_back: int = 0  # unstarted units given back for idle nodes
    error: str | None = None
    # its actors' counts when it stopped, read by the runner from its own folder's stats (None: not stopped cleanly);
    # with a store that folder is on the node, so the launcher learns them only this way
    completed: int | None = None
    output_tokens: int | None = None


@dataclass
class ReleaseStats:
    """The open units of one lost lease, and how soon they were all leased again."""

    node: str = ""
    units: int = 0
    left: int = 0  # still waiting for a node
    lost_at: float | None = None
    all_leased_again_after_s: float | None = None


@dataclass
class ClusterStats(StatsLine):
    """cluster=ray: the launcher's lease book (launch/ray_placement.py)."""

    ROLE: ClassVar[str] = "cluster"

    nodes: dict[str, NodeStats] = field(default_factory=dict)
    units_queued: int = 0  # not leased yet
    units_released: int = 0  # leased again after a loss
    releases: list[ReleaseStats] = field(default_factory=list)  # the newest 20

    def body(self) -> dict[str, Any]:
        return {"final": self.final, "nodes": {name: asdict(node) for name, node in self.nodes.items()},
                "units_queued": self.units_queued, "units_released": self.units_released,
                "releases": [asdict(r) for r in self.releases]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ClusterStats":
        line = cls(**_known(cls, raw))
        line.nodes = {name: NodeStats(**_known(NodeStats, node)) for name, node in (line.nodes or {}).items()}
        line.releases = [ReleaseStats(**_known(ReleaseStats, r)) for r in line.releases or []]
        return line


@dataclass
class LaunchStats(StatsLine):
    """The launcher's metrics as it logged them to the trackers (step N), flat: their names are
    observe/tracking.py's."""

    ROLE: ClassVar[str] = "launch"

    step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"step": self.step, **self.metrics}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LaunchStats":
        line = cls(**_known(StatsHead, raw))
        line.step = int(raw.get("step") or 0)
        line.metrics = {k: v for k, v in raw.items() if k not in _names(cls)}
        return line


def parse_stats_line(role: str, raw: dict[str, Any]) -> StatsLine:
    """One line of `role`'s stats file as its role's type (StatsLine, head only, for a role it does not know)."""
    if is_actor_role(role):
        return ActorStats.from_dict(raw)
    kind = {c.ROLE: c for c in (WriterStats, ClusterStats, LaunchStats)}.get(role, StatsLine)
    return kind.from_dict(raw)
