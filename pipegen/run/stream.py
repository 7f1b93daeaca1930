"""The rollout stream: the line on disk. What one line of a shard is, how a unit is named, how lines are
appended and tailed, and how the writer reads a line into arrays.

A unit is `(index, sample)`: the dataset row's `extra_info.index` and the sample number 0..n-1. Every
finished unit becomes one `RolloutRecord` (all the trajectories its agent loop returned, together) and
every unit that gave up becomes one `FailureRecord`; each is one JSON line in an actor's shard.

Records:
- `UnitKeys` turns `(index, sample)` into one integer `index * n + sample` (so sets of units compress
  into ranges in the checkpoint) and back, and names a unit as the text `"index:sample"` where a human
  reads it (the checkpoint's failed units, status, logs).
- `attempt` numbers a unit's tries from 0: how many earlier tries of it ended in a FailureRecord (a
  unit retried by a later launch carries 1, 2, ...). Requests re-sent inside one try (5xx retries,
  stall resends, hedges) are counted in the actor's stats, not here. A reader keeps the first complete
  record of a unit and drops any later one as a duplicate, whatever its attempt: the late answer of a
  superseded try never becomes a second row.
- `TrajectoryKeys` names the keys of one trajectory in a record: verl `AgentLoopOutput`'s fields,
  which pipegen reads back by name (the actor's checks and counters, the writer's parse and padding);
  `assistant_turns`, a trajectory's turns as its loop had them (verl's `num_turns` counts messages).
- `unit_seed` and `prompt_uid` derive the per-unit sampling seed and the prompt's uid, so a rerun of
  the same setup reproduces both; `session_id` names the sample (its pieces' one session).
- `PieceKeys` names the fields that keep a multi-trajectory unit's pieces one sample in every row (verl
  DataProto, Parquet, ATIF): its session, its weight and which reward rule scored it.

Wire format: orjson of the dataclass, fields in declaration order, so `index` and `sample` lead the
line and `read_head` can read them without parsing the rest. Dataclasses + orjson were measured
against pydantic and msgspec on 1k-token records (ARCHITECTURE.md, "Stream lines"): orjson serialises a
dataclass natively and decoding is one `orjson.loads` plus a constructor call, with no extra
dependency and no validation cost on the hot path.

Reading a line fast (`LineParser`, the writer's): `RolloutRecord.from_line` (orjson) builds a Python int
or float for every token id, mask bit and log-prob, and the writer then turns those lists back into
arrays: together about twice the cost of the parse alone. simdjson (pysimdjson) parses the line once in
C++ and hands each numeric array out as one contiguous buffer (`as_buffer`), so the writer reads a
1k-token record in ~0.7x the time of a bare `orjson.loads`. Integers come out as int64 and floats as
float64, exactly the values orjson gives (both parsers round decimal text correctly), so verl parity is
unchanged. Records with the same dataset row text share one row dict (the n samples of a prompt), as
verl's `DataProto.repeat` shares them. Anything unusual (a non-numeric entry in a token list, a missing
key, a line orjson would refuse) goes through `RolloutRecord.from_line`, which decides.

Shards: `streams/<topic>/actor_<k>/<seq>.jsonl` (named in layout.py). Exactly one process appends to a
shard; an actor opens a new shard on every start and when a shard passes its size limit, so every shard
but the newest of each actor is *sealed* and immutable. The line rules (the whole crash-safety story of
the stream):
- one record = one line = one `write()` of orjson bytes ending in `\n`, so `tail -f` shows it at once;
- a reader uses a line only when its `\n` is there; in a live shard it waits for the rest;
- in a sealed shard an unterminated last line is a torn write from a crash: skipped and counted.
- `index` and `sample` lead every line so a resume scan can read them without parsing the record.

fsync: rollout shards on a timer and at seal, never per record (30-40x slower); the failures stream is
opened with a zero interval, so each of its (rare) lines is fsynced as it is written.

Owns: every record key (a trajectory's included), the unit-key arithmetic, seed and uid derivation, the
shard files' append and tail rules.
Must never: rewrite or truncate a shard, parse lines the caller did not ask for, or accept a line that
`RolloutRecord.from_line` would reject.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from collections import Counter
from dataclasses import KW_ONLY, dataclass, field, fields
from pathlib import Path
from typing import Any, Final, Iterable, Iterator, TypeVar

import numpy as np
import orjson
import simdjson

from pipegen.run.layout import actor_shard_dir, list_shards, shard_key, shard_path, shard_seq

_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY  # numpy float32 log-prob arrays: shortest exact repr
_HEAD = re.compile(rb'^\{"index":(-?\d+),"sample":(\d+)')


@dataclass(frozen=True)
class UnitKeys:
    """Unit <-> integer key for a run with n samples per prompt."""

    n: int

    def key(self, index: int, sample: int) -> int:
        return index * self.n + sample

    def unit(self, key: int) -> tuple[int, int]:
        return divmod(key, self.n)

    def priority(self, position: int, sample: int) -> int:
        """verl's `priority` for a unit: its place in dataset order (position, not index)."""
        return position * self.n + sample

    def valid_sample(self, sample: int) -> bool:
        return 0 <= sample < self.n


def unit_label(index: int, sample: int) -> str:
    """How a human reads a unit: `"index:sample"` (checkpoint's failed units, status, logs)."""
    return f"{index}:{sample}"


def parse_unit_label(label: str) -> tuple[int, int]:
    index, sample = label.split(":")
    return int(index), int(sample)


MASK63 = (1 << 63) - 1
INDEX_BITS, SAMPLE_BITS = 42, 20  # a run's units are distinct below 2^42 indices and 2^20 samples per prompt


def unit_seed(base_seed: int, index: int, sample: int, attempt: int = 0) -> int:
    """The sampling seed of a unit, in [0, 2^63) (SGLang's sampling_seed and vLLM's seed are int64): a bijection of
    (index, sample) for a given (base seed, attempt), so no two units of a run share a seed and a prompt's samples
    never collapse into copies (an engine draws from its seed). A retry (attempt > 0) mixes its attempt in, so a
    failure that depends on the draw is not drawn again; the first try's seed is the unit's own."""
    text = f"{base_seed}" + (f":{attempt}" if attempt else "")
    salt = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & MASK63
    x = (((index & ((1 << INDEX_BITS) - 1)) << SAMPLE_BITS) | (sample & ((1 << SAMPLE_BITS) - 1))) ^ salt
    # xor-shifts and odd multiplications mod 2^63 are each invertible: distinct units, distinct seeds
    x = (x * 0x1F3F1D4E6C9A5B7D) & MASK63
    x ^= x >> 29
    x = (x * 0x2C1B3C6D5E4F7A19) & MASK63
    return x ^ (x >> 32)


def prompt_uid(run_key: str, index: int) -> str:
    """verl gives the n samples of one prompt one shared uid; pipegen derives it so reruns match."""
    return str(uuid.uuid5(uuid.NAMESPACE_OID, f"{run_key}:{index}"))


def session_id(uid: str, sample: int) -> str:
    """One sample of a prompt: every piece (trajectory) its agent loop returned shares it."""
    return f"{uid}:{sample}"


class PieceKeys:
    """The fields every row carries so the pieces of one sample stay one sample wherever the rows go: its
    `session_id` and `loss_weight` (the writer's: 1/k for a sample of k pieces, or 1.0 by `rows.loss_weight`),
    and in each trajectory's `extra_fields` which rule gave its reward (`reward_rule`, the actor's) and the
    fork's snapshot marks a loop may set (`is_snapshot`, `snapshot_index`)."""

    SESSION_ID: Final = "session_id"
    LOSS_WEIGHT: Final = "loss_weight"
    REWARD_RULE: Final = "reward_rule"
    IS_SNAPSHOT: Final = "is_snapshot"
    SNAPSHOT_INDEX: Final = "snapshot_index"


class TrajectoryKeys:
    """The keys of one trajectory in `RolloutRecord.trajectories`, which is verl's `AgentLoopOutput` as JSON:
    the field names pipegen reads by name. Plain str constants (not an Enum), so the JSON keys are verl's
    own bytes and hot loops can bind them to module-level names."""

    PROMPT_IDS: Final = "prompt_ids"
    RESPONSE_IDS: Final = "response_ids"
    RESPONSE_MASK: Final = "response_mask"  # 1 for a model token, 0 for a tool/user token
    RESPONSE_LOGPROBS: Final = "response_logprobs"  # None unless the servers returned log-probs
    REWARD_SCORE: Final = "reward_score"
    NUM_TURNS: Final = "num_turns"
    METRICS: Final = "metrics"
    EXTRA_FIELDS: Final = "extra_fields"
    MULTI_MODAL_DATA: Final = "multi_modal_data"
    ROUTED_EXPERTS: Final = "routed_experts"
    # one entry per token; the writer reads these as arrays
    TOKEN_LISTS: Final = (PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, RESPONSE_LOGPROBS)


def assistant_turns(response_mask: Any) -> int:
    """The model's turns in one trajectory, as its loop had them: the runs of model tokens (mask 1) in its response.
    verl's `num_turns` counts messages (the prompt's, every tool or user reply, and each answer), so a single-turn
    answer is 2 there and 1 here; status shows this count."""
    marks = np.asarray(response_mask, dtype=np.uint8).tobytes()
    return marks.count(b"\x00\x01") + (marks[:1] == b"\x01")


_R = TypeVar("_R", bound="_Line")


class _Line:
    """A record as one stream line: orjson of the dataclass, fields in declaration order, ending in \\n."""

    def to_line(self) -> bytes:
        return orjson.dumps(self, option=_DUMPS_OPTIONS) + b"\n"

    @classmethod
    def from_line(cls: type[_R], line: bytes) -> _R:
        return cls(**_known(cls, orjson.loads(line)))


@dataclass
class RolloutRecord(_Line):
    """One finished unit: every trajectory its agent loop returned, and what verl needs to pad them.

    `row` is the dataset row's non-tensor fields as verl's agent loop received them; `trajectories`
    are verl `AgentLoopOutput`s as JSON (`model_dump(mode="json")`, log-probs as float32).
    """

    index: int
    sample: int
    _: KW_ONLY
    # What a person watching the run reads (`tail -f ... | cut -c1-200`), right after the head: the unit's
    # reward (null when unscored), "length" when its response reached the response limit (else "stop"),
    # and the start of its response text. The trajectories hold the full data; the writer keeps none of these.
    reward: float | None = None
    finish: str = ""
    text: str = ""
    uid: str
    priority: int
    seed: int | None
    agent_name: str
    launch: str
    row: dict[str, Any]
    trajectories: list[dict[str, Any]]
    attempt: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.trajectories)

    def agent_kwargs(self, default_agent: str) -> dict[str, Any]:
        """The per-row kwargs verl's worker hands to the agent loop and its postprocessing."""
        kwargs = dict(self.row)
        kwargs.setdefault("agent_name", default_agent)
        kwargs["uid"] = self.uid
        kwargs["priority"] = self.priority
        return kwargs


# the reason of a unit that generated but whose reward failed: its samples are kept, and a rescore (or a launch with
# the reward unchanged) scores them without generating; every summary tells it from a failed generation by
# `is_not_scored`
NOT_SCORED = "not scored (its samples are kept: pipegen rescore DIR scores them without generating)"


def is_not_scored(reason: str) -> bool:
    """Whether a failure's reason is NOT_SCORED's (its wording before 2027-01 included): generated, not scored."""
    return reason.startswith("not scored (")


@dataclass
class FailureRecord(_Line):
    """One unit that failed after its retries: never a sample, retried by the next launch."""

    index: int
    sample: int
    launch: str
    seed: int | None
    agent_name: str
    reason: str
    attempt: int = 0
    # a unit that generated but could not be scored: its RolloutRecord as JSON (reward null), kept so that the
    # next launch scores it without generating (actor/rollout.py's rescore); None for every other failure
    unscored: dict[str, Any] | None = None


def kept_unscored(lines: Iterable[bytes]) -> dict[tuple[int, int], dict[str, Any]]:
    """(index, sample) -> the newest kept unscored record among the failures stream's lines (see FailureRecord)."""
    kept: dict[tuple[int, int], dict[str, Any]] = {}
    for line in lines:
        if b'"unscored":{' not in line:
            continue
        try:
            failure = FailureRecord.from_line(line)
        except (ValueError, TypeError):  # a damaged line: that unit is generated again
            continue
        if isinstance(failure.unscored, dict):
            kept[(failure.index, failure.sample)] = failure.unscored
    return kept


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """The keys cls declares: a line written by a newer pipegen with extra keys still reads."""
    names = cls.__dataclass_fields__
    return data if all(k in names for k in data) else {k: v for k, v in data.items() if k in names}


def encode_record(index: int, sample: int, body: dict[str, Any]) -> bytes:
    """A line with `index` and `sample` first and a free-form body: what the stream layer needs to
    know of a line. Product records go through RolloutRecord/FailureRecord.to_line."""
    return orjson.dumps({"index": index, "sample": sample, **body}, option=_DUMPS_OPTIONS) + b"\n"


def read_head(line: bytes) -> tuple[int, int] | None:
    """(index, sample) from the front of a line, without parsing the rest."""
    m = _HEAD.match(line)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---- reading a line into arrays (the writer) ----

# verl AgentLoopOutput lists read as arrays: buffer type code, numpy dtype
ARRAY_KEYS = {
    TrajectoryKeys.PROMPT_IDS: ("i", np.int64),
    TrajectoryKeys.RESPONSE_IDS: ("i", np.int64),
    TrajectoryKeys.RESPONSE_MASK: ("i", np.int64),
    TrajectoryKeys.RESPONSE_LOGPROBS: ("d", np.float64),
}
_SCALAR_FIELDS = tuple(f.name for f in fields(RolloutRecord) if f.name not in ("trajectories", "row", "reward", "finish",
                                                                                  "text"))  # the watcher's: not read
_MISSING = object()
ROW_CACHE_SIZE = 256  # distinct dataset rows remembered; a prompt's n samples arrive close together


class LineParser:
    """One reusable simdjson parser (a parser holds one document at a time; arrays are copied out)."""

    def __init__(self) -> None:
        self._parser = simdjson.Parser()
        self._rows: dict[bytes, dict[str, Any]] = {}

    def record(self, line: bytes) -> RolloutRecord:
        """The line as a RolloutRecord; trajectory token lists as numpy arrays when they are numeric."""
        try:
            return self._fast(line)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError):  # simdjson's errors
            # a fresh parser: the traceback may still hold proxies into the old one's document
            self._parser = simdjson.Parser()
            return RolloutRecord.from_line(line)  # the record contract decides (and raises) on odd lines

    def _fast(self, line: bytes) -> RolloutRecord:
        doc = self._parser.parse(line)
        if not isinstance(doc, simdjson.Object):
            raise TypeError("a record line is a JSON object")
        values = {}
        for name in _SCALAR_FIELDS:
            value = doc.get(name, _MISSING)
            if value is not _MISSING:
                values[name] = _plain(value)
        row = doc.get("row", _MISSING)
        if row is not _MISSING:
            values["row"] = self._row(row)
        return RolloutRecord(**values, trajectories=[_trajectory(t) for t in doc["trajectories"]])

    def _row(self, value) -> Any:
        """The dataset row, one shared dict per distinct row text: the n samples of a prompt carry the
        same row, and sharing it is what verl's own `DataProto.repeat` does for them. It also makes
        pickle write each row's fields once per batch file instead of once per sample."""
        if type(value) is not simdjson.Object:
            return _plain(value)
        text = value.mini
        row = self._rows.get(text)
        if row is None:
            if len(self._rows) >= ROW_CACHE_SIZE:
                self._rows.clear()
            row = self._rows[text] = value.as_dict()
        return row


def _trajectory(traj) -> dict[str, Any]:
    if not isinstance(traj, simdjson.Object):
        raise TypeError("a trajectory is a JSON object")
    out: dict[str, Any] = {}
    for key in traj.keys():
        value = traj[key]
        spec = ARRAY_KEYS.get(key)
        if spec is not None and type(value) is simdjson.Array:
            out[key] = np.frombuffer(value.as_buffer(of_type=spec[0]), dtype=spec[1])
        else:
            out[key] = _plain(value)
    return out


def _plain(value):
    kind = type(value)
    if kind is simdjson.Object:
        return value.as_dict()
    if kind is simdjson.Array:
        return value.as_list()
    return value


# ---- the shard files ----

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
    return units_in(line for _, _, line in tailer.lines())


def units_in(lines: Iterable[bytes]) -> Counter[tuple[int, int]]:
    """How many of `lines` name each (index, sample) (by the head alone; a line without one is not counted)."""
    found: Counter[tuple[int, int]] = Counter()
    for line in lines:
        head = read_head(line)
        if head is not None:
            found[head] += 1
    return found
