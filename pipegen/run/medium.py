"""The stream medium: where the actors' lines travel to the writer. One interface, two media, chosen in one place.

`streams=files` (the default): each actor's shard files under DIR/streams/<topic>/ (run/stream.py's
ShardAppender and ShardTailer, positions as byte offsets in checkpoint.json). `streams=redis`: one Redis stream
per run and topic (transport/redis_medium.py), read by the writer as a consumer group. The line is the line either
way: the exact bytes of a RolloutRecord or FailureRecord line (run/stream.py), so every reader parses it the same.
Each medium is named in MEDIA by its dotted path and imported only when its kind is chosen (as
launch/placement.py chooses placements), so this module imports no network client.

What each role asks of a medium, and nothing else:
- an actor: an `Appender` per topic (`append` returns once the line is durable in the medium: a shard write, or
  a Redis XADD that returned);
- the writer: a `Reader` per topic, from the checkpoint's position: `lines()` yields what it has not consumed,
  `save(ckpt)` records its position in the checkpoint the writer is about to write and returns what must run
  once that checkpoint is durable (Redis: the XACK of the entries it covers; files: nothing);
- every other reader (the resume scan, leases, status, --follow, verify, the report's outcomes, rescore): a
  read-only `Tail` from the start or from a checkpoint's position, and `units` (complete lines past a checkpoint,
  per unit);
- the launcher: `refusal()` (one line when the medium cannot hold the run: an unreachable Redis, one without
  AOF), and `holds_lines()` / `drop()` / `where()` for the resume guard, tidy and messages.

Owns: the medium's interface, choosing the medium from the run's config (`open_medium`, the one place that reads
`streams.kind`), the launch's check of it (`medium_refusal`), the files medium's wiring of run/stream.py, and the
topics' names.
Must never: import a medium's client (Redis) at any level, parse a record beyond its head, decide what is
committed, or hold a line the medium has not made durable as if it were written.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import Counter
from typing import Any, Callable, Iterator, Mapping, Protocol

from omegaconf import DictConfig

from pipegen.run.checkpoint import Checkpoint, load_checkpoint
from pipegen.run.integrity import DamagedFile
from pipegen.run.layout import RunDir, actor_role, list_shards
from pipegen.run.stream import ShardAppender, ShardTailer, TailStats, UnitKeys, next_free_seq, units_in

ROLLOUTS = "rollouts"
FAILURES = "failures"
TOPICS = (ROLLOUTS, FAILURES)
WAIT_S = 120.0  # how long a read-only read (an actor's start, status) waits for an unreachable Redis by default
# the checkpoint's fields for a files topic: (byte offsets, sealed watermarks)
_FILE_FIELDS = {ROLLOUTS: ("rollout_offsets", "rollout_sealed"), FAILURES: ("failure_offsets", "failure_sealed")}


class Appender(Protocol):
    """An actor's writer of one topic."""

    async def append(self, line: bytes) -> None:
        """Returns once the line is durable in the medium (the unit counts as finished only then)."""

    def sync(self) -> None:
        """Make every line appended so far durable (a caller about to report them finished)."""

    def close(self) -> None: ...


class Tail(Protocol):
    """A read-only cursor over one topic: each `lines()` call yields the complete lines added since the last."""

    stats: TailStats

    def lines(self) -> Iterator[tuple[str, int, bytes]]:
        """(where, position, line) for every complete line not yet yielded."""


class Reader(Tail, Protocol):
    """The writer's consuming cursor over one topic."""

    def save(self, ckpt: Checkpoint) -> Callable[[], None] | None:
        """Record the position of every line yielded so far in `ckpt`; returns what to run once that checkpoint
        is durable (None: nothing)."""

    def settle(self) -> None:
        """Finish what earlier `save`s left to do (acknowledgements a Redis outage held back); the writer's end."""


class StreamMedium(ABC):
    """Where a run's lines go: the files medium below, or transport/redis_medium.py's RedisMedium."""

    kind: str

    @classmethod
    def open(cls, run: RunDir, streams: Mapping[str, Any], wait_s: float) -> "StreamMedium":
        """The medium of `run` from the config's `streams` keys; `wait_s`: how long a read waits for an unreachable
        server before it raises OSError."""
        return cls(run)  # type: ignore[call-arg]  # the files medium needs only the run directory

    @abstractmethod
    def where(self, topic: str) -> str:
        """A topic's place as a person types it: a folder, or a Redis stream key."""

    @abstractmethod
    def appender(self, topic: str, rank: int | str, ckpt: Checkpoint, max_bytes: int,
                 fsync_interval_s: float) -> Appender: ...

    @abstractmethod
    def reader(self, topic: str, ckpt: Checkpoint) -> Reader: ...

    @abstractmethod
    def tail(self, topic: str, since: Checkpoint | None = None) -> Tail:
        """From the first line, or (`since`) from the first line that checkpoint has not consumed."""

    @abstractmethod
    def holds_lines(self) -> bool:
        """Whether any topic holds a line (the resume guard binds the directory then)."""

    @abstractmethod
    def drop(self, topic: str) -> str:
        """Delete a topic's lines (generation.keep_streams=false, once the run verified); what was freed, in words."""

    def refusal(self) -> str:
        """One line when this medium cannot carry the run, naming the fix; '' when it can."""
        return ""

    def close(self) -> None:
        pass

    def units(self, topic: str, since: Checkpoint | None = None) -> Counter[tuple[int, int]]:
        """How many complete lines (past `since`'s position, else all) name each (index, sample)."""
        return units_in(line for _, _, line in self.tail(topic, since).lines())

    def lines(self, topic: str) -> Iterator[bytes]:
        """Every complete line of a topic, oldest first."""
        for _, _, line in self.tail(topic).lines():
            yield line


class FileMedium(StreamMedium):
    """streams=files: shard files under DIR/streams/<topic>/actor_<k>/ (run/stream.py)."""

    kind = "files"

    def __init__(self, run: RunDir):
        self.run = run

    def _dir(self, topic: str):
        return {ROLLOUTS: self.run.rollouts, FAILURES: self.run.failures}[topic]

    def where(self, topic: str) -> str:
        return str(self._dir(topic))

    def appender(self, topic: str, rank: int | str, ckpt: Checkpoint, max_bytes: int,
                 fsync_interval_s: float) -> Appender:
        offsets, sealed = (getattr(ckpt, name) for name in _FILE_FIELDS[topic])
        return FileAppender(ShardAppender(self._dir(topic), rank, max_bytes, fsync_interval_s,
                                          next_free_seq(offsets, sealed, actor_role(rank))))

    def reader(self, topic: str, ckpt: Checkpoint) -> Reader:
        return FileReader(topic, self.tail(topic, ckpt))

    def tail(self, topic: str, since: Checkpoint | None = None) -> ShardTailer:
        if since is None:
            return ShardTailer(self._dir(topic))
        offsets, sealed = (getattr(since, name) for name in _FILE_FIELDS[topic])
        return ShardTailer(self._dir(topic), dict(offsets), dict(sealed))

    def holds_lines(self) -> bool:
        return any(shard.stat().st_size > 0 for topic in TOPICS
                   for shards in list_shards(self._dir(topic)).values() for shard in shards)

    def drop(self, topic: str) -> str:
        shards = [path for paths in list_shards(self._dir(topic)).values() for path in paths]
        freed = 0
        for path in shards:
            freed += path.stat().st_size
            path.unlink()
        return f"deleted {len(shards)} {topic} shard(s) ({freed / 2**20:.1f} MiB) under {self._dir(topic)}"


class FileAppender:
    """An actor's shards of one topic (a ShardAppender): a line is written when its write() returned."""

    def __init__(self, shards: ShardAppender):
        self.shards = shards

    async def append(self, line: bytes) -> None:
        self.shards.append(line)

    def sync(self) -> None:
        self.shards.sync()

    def close(self) -> None:
        self.shards.close()


class FileReader:
    """The writer's tail of one topic's shards; its position is the checkpoint's offsets and sealed watermarks."""

    def __init__(self, topic: str, tailer: ShardTailer):
        self.topic = topic
        self.tailer = tailer
        self.stats = tailer.stats

    def lines(self) -> Iterator[tuple[str, int, bytes]]:
        return self.tailer.lines()

    def save(self, ckpt: Checkpoint) -> None:
        offsets, sealed = _FILE_FIELDS[self.topic]
        setattr(ckpt, offsets, dict(self.tailer.offsets))
        setattr(ckpt, sealed, dict(self.tailer.sealed))
        return None  # a shard line needs nothing after the checkpoint: the offsets are the acknowledgement

    def settle(self) -> None:
        pass


# streams.kind -> its medium as "module:class" (config/schema.py's STREAM_KINDS names the kinds)
MEDIA: dict[str, str] = {
    "files": "pipegen.run.medium:FileMedium",
    "redis": "pipegen.transport.redis_medium:RedisMedium",
}


def medium_class(kind: str) -> type[StreamMedium]:
    """The class MEDIA names for this kind, imported now."""
    module, _, name = MEDIA[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def open_medium(run: RunDir, cfg: DictConfig | None = None, wait_s: float = WAIT_S) -> StreamMedium:
    """The run's medium, by `streams.kind` of `cfg` (else the run's saved config; files when it has none). `wait_s`:
    how long a read waits for an unreachable Redis before it raises OSError (0: a console that must not stall)."""
    if cfg is None:
        if not run.config_file.exists():
            return FileMedium(run)
        from pipegen.run.config import load_run_config

        cfg = load_run_config(run)
    streams = cfg.get("streams") or {}
    return medium_class(str(streams.get("kind", "files"))).open(run, streams, wait_s)


def medium_refusal(run: RunDir, cfg: DictConfig) -> str:
    """The launch's check of its medium: one line when `cfg`'s medium cannot carry the run (an unreachable Redis,
    one without AOF), or when the run's saved config names another medium that still holds uncommitted lines
    (they would never reach the writer); '' when the launch may go on."""
    medium = open_medium(run, cfg)
    problem = medium.refusal()
    if problem or not run.config_file.exists():
        return problem
    try:
        before = open_medium(run)
    except (DamagedFile, SystemExit):  # the saved config is damaged: the launch's own check of it names the fix
        return ""
    if before.kind == medium.kind:
        return ""
    ckpt = load_checkpoint(run.checkpoint)
    keys = UnitKeys(int(cfg.actor_rollout_ref.rollout.n))
    left = [unit for unit in before.units(ROLLOUTS, ckpt) if keys.key(*unit) not in ckpt.committed]
    if left:
        return (f"streams={medium.kind}: this run's last launch used streams={before.kind}, and {len(left)} finished "
                f"unit(s) in {before.where(ROLLOUTS)} are not committed yet; finish with streams={before.kind} "
                "(the writer commits them), then switch")
    return ""
