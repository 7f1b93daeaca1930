"""JSONL stream shards: the append side (actors) and the tail side (writer, resume scans).

Layout (named in layout.py): `streams/<topic>/actor_<k>/<seq>.jsonl`; what a line holds is
records.py's. Exactly one process appends to a shard; an actor opens a new shard on every start and
when a shard passes its size limit, so every shard but the newest of each actor is *sealed* and
immutable.

Line rules (the whole crash-safety story of the stream layer):
- one record = one line = one `write()` of orjson bytes ending in `\n`, so `tail -f` shows it at once;
- a reader uses a line only when its `\n` is there; in a live shard it waits for the rest;
- in a sealed shard an unterminated last line is a torn write from a crash: skipped and counted.
- `index` and `sample` lead every line so a resume scan can read them without parsing the record.

fsync: rollout shards on a timer and at seal, never per record (30-40x slower); the failures stream is
opened with a zero interval, so each of its (rare) lines is fsynced as it is written.

Must never: rewrite or truncate a shard, or parse lines the caller did not ask for.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from pipegen.run.layout import actor_shard_dir, list_shards, shard_key, shard_path, shard_seq
from pipegen.run.records import read_head


class ShardAppender:
    """Appends records to this actor's shards; opens a new shard at start and past max_bytes."""

    def __init__(self, topic_dir: Path, actor_rank: int | str, max_bytes: int, fsync_interval_s: float,
                 min_seq: int = 0):
        self.dir = actor_shard_dir(topic_dir, actor_rank)
        self.min_seq = min_seq  # never below a sequence number a reader has state for (next_free_seq)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fsync_interval_s = fsync_interval_s
        self._fd: int | None = None
        self._size = 0
        self._last_fsync = time.monotonic()
        self.path: Path | None = None
        self._open_next()

    def _open_next(self) -> None:
        existing = list_shards(self.dir.parent).get(self.dir.name, [])
        seq = max(shard_seq(existing[-1]) + 1 if existing else 0, self.min_seq)
        self.path = shard_path(self.dir, seq)
        # O_EXCL: two processes can never append to one shard, even if misconfigured with one rank.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._size = 0

    def append(self, line: bytes) -> None:
        assert self._fd is not None and line.endswith(b"\n")
        if self._size and self._size + len(line) > self.max_bytes:
            self._seal()
            self._open_next()
        view = memoryview(line)
        while view:  # a regular-file write is complete unless interrupted; loop for the rare short write
            view = view[os.write(self._fd, view):]
        self._size += len(line)
        now = time.monotonic()
        if now - self._last_fsync >= self.fsync_interval_s:
            os.fsync(self._fd)
            self._last_fsync = now

    def sync(self) -> None:
        """fsync what was appended so far (a caller about to say these lines exist: a lease report)."""
        if self._fd is not None:
            os.fsync(self._fd)
            self._last_fsync = time.monotonic()

    def _seal(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._seal()


@dataclass
class TailStats:
    lines: int = 0
    torn_lines: int = 0


@dataclass
class ShardTailer:
    """Reads complete new lines from every shard of a topic, from saved byte offsets.

    offsets maps a shard's path relative to the topic folder to the byte offset of the first
    unconsumed line. sealed maps an actor folder to a shard sequence number below which every shard
    is sealed and fully consumed: those are skipped and their offsets dropped, so the saved state
    stays O(actors) however many shards a long run rotates through. The caller advances an offset
    only by consuming lines (see `lines()`).
    """

    topic_dir: Path
    offsets: dict[str, int] = field(default_factory=dict)
    sealed: dict[str, int] = field(default_factory=dict)
    stats: TailStats = field(default_factory=TailStats)
    chunk_bytes: int = 8 << 20

    def lines(self) -> Iterator[tuple[str, int, bytes]]:
        """Yield (shard, offset_after_line, line) for every complete line not yet consumed.

        The offset is recorded as consumed as soon as the line is yielded; a caller that stops
        iterating early leaves later lines for the next call.
        """
        for actor, shards in list_shards(self.topic_dir).items():
            done_below = self.sealed.get(actor, 0)
            for i, path in enumerate(shards):
                seq = shard_seq(path)
                if seq < done_below:
                    continue
                sealed = i < len(shards) - 1  # listed before reading: a newer shard means this one is final
                rel = shard_key(path)
                yield from self._read_shard(rel, path, sealed)
                if sealed and seq == self.sealed.get(actor, 0) and self._consumed(rel, path):
                    self.sealed[actor] = seq + 1  # everything up to here is final and read
                    self.offsets.pop(rel, None)

    def _consumed(self, rel: str, path: Path) -> bool:
        try:
            return self.offsets.get(rel, 0) >= path.stat().st_size
        except FileNotFoundError:
            return True

    def _read_shard(self, rel: str, path: Path, sealed: bool) -> Iterator[tuple[str, int, bytes]]:
        offset = self.offsets.get(rel, 0)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return
        if size <= offset:
            return
        with open(path, "rb") as f:
            while offset < size:
                f.seek(offset)
                chunk = f.read(min(self.chunk_bytes, size - offset))
                if not chunk:
                    break
                end = chunk.rfind(b"\n")
                if end < 0 and len(chunk) < size - offset:
                    chunk += f.read(size - offset - len(chunk))  # one line longer than a chunk
                    end = chunk.rfind(b"\n")
                if end < 0:
                    break
                start = 0
                while start <= end:
                    nl = chunk.index(b"\n", start)
                    line = chunk[start : nl + 1]
                    start = nl + 1
                    self.offsets[rel] = offset + start
                    self.stats.lines += 1
                    yield rel, offset + start, line
                offset += start
            if sealed and offset < size:
                # The actor moved on to a newer shard: these bytes can never be completed.
                self.stats.torn_lines += 1
                self.offsets[rel] = size


def next_free_seq(offsets: dict[str, int], sealed: dict[str, int], actor: str) -> int:
    """The lowest shard sequence number of an actor folder that a tailer with this state knows nothing
    of: a new shard must start there, even when a known shard is gone from disk (deleted, lost in a
    copy), or the tailer would skip the new file's first bytes as already read."""
    known = [shard_seq(Path(key)) + 1 for key in offsets if key.startswith(f"{actor}/")]
    return max([sealed.get(actor, 0), *known])


def scan_units(topic_dir: Path, offsets: dict[str, int], sealed: dict[str, int] | None = None) -> set[tuple[int, int]]:
    """(index, sample) of every complete line past the given offsets (resume: work already done)."""
    return set(count_units(topic_dir, offsets, sealed))


def count_units(topic_dir: Path, offsets: dict[str, int] | None = None,
                sealed: dict[str, int] | None = None) -> Counter[tuple[int, int]]:
    """How many complete lines past the given offsets (default: all of them) name each (index, sample)."""
    tailer = ShardTailer(Path(topic_dir), dict(offsets or {}), dict(sealed or {}))
    found: Counter[tuple[int, int]] = Counter()
    for _, _, line in tailer.lines():
        head = read_head(line)
        if head is not None:
            found[head] += 1
    return found
