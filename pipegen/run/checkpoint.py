"""The writer's commit record, `checkpoint.json`.

Holds: committed units as compact ranges of unit keys, the batch files (numbered 0..count-1, their
row counts run-length encoded), per actor the watermark below which every shard is sealed and fully
consumed plus byte offsets of the shards above it (streams=redis: the last stream entry ID it covers, per
topic), units that failed in the current launch, the config fingerprint, the n its unit keys are numbered by, and
whether the merge finished. Every part is O(ranges + actors), not O(units) or O(batches), so a commit costs the same
at 1k and at 1M committed units. Samples added to a finished run (n 1 -> 2, `renumber`) leave one range per prompt
until the new samples are committed beside the old ones, which joins the ranges again.

Owns: the checkpoint's schema, its validation on load (a damaged one is a DamagedFile naming the
rebuild command, never an empty checkpoint), its atomic replacement, and what failed_units.json holds
(`failed_listing`: every writer that settles a run writes it, on disk or in the store).
Must never: list every committed unit (its cost per batch must not grow with the run), or be written
before the batch file it lists is durable.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import orjson

from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.integrity import DamagedFile, read_json_file, rebuild_command
from pipegen.run.layout import BATCH_GLOB, batch_file_name

VERSION = 2
REQUIRED_KEYS = frozenset({"version", "committed_ranges", "batches", "rollout_offsets", "failure_offsets"})


class RangeSet:
    """A set of non-negative ints stored as sorted, disjoint, non-adjacent half-open ranges.

    Hand-written because no well-kept library offers a small, JSON-friendly interval set; adds are
    O(log r + r) in the number of ranges r, which stays tiny when work completes roughly in order.
    """

    def __init__(self, ranges: Iterable[Iterable[int]] = ()):
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges:
            self.add_range(int(start), int(end))

    def __contains__(self, key: int) -> bool:
        i = bisect.bisect_right(self._starts, key) - 1
        return i >= 0 and key < self._ends[i]

    def __len__(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    def __iter__(self) -> Iterator[int]:
        for s, e in zip(self._starts, self._ends):
            yield from range(s, e)

    def add(self, key: int) -> None:
        self.add_range(key, key + 1)

    def add_range(self, start: int, end: int) -> None:
        if end <= start:
            return
        lo = bisect.bisect_left(self._ends, start)  # first range that ends at/after start (touching merges)
        hi = bisect.bisect_right(self._starts, end)  # ranges starting at/before end touch or overlap
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def add_sorted(self, sorted_keys: Iterable[int]) -> None:
        """Add sorted distinct keys, one range add per run of consecutive keys (a batch's units mostly are)."""
        start = prev = None
        for k in sorted_keys:
            if prev is not None and k == prev + 1:
                prev = k
                continue
            if start is not None:
                self.add_range(start, prev + 1)
            start = prev = k
        if start is not None:
            self.add_range(start, prev + 1)

    def ranges(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self._starts, self._ends)]

    @property
    def num_ranges(self) -> int:
        return len(self._starts)


@dataclass
class BatchLedger:
    """The committed batch files, numbered 0..count-1, their sizes run-length encoded."""

    sizes: list[list[int]] = field(default_factory=list)  # [[rows, units, repeat], ...]

    def add(self, rows: int, units: int) -> None:
        if self.sizes and self.sizes[-1][0] == rows and self.sizes[-1][1] == units:
            self.sizes[-1][2] += 1
        else:
            self.sizes.append([rows, units, 1])

    def __len__(self) -> int:
        return sum(r for _, _, r in self.sizes)

    @property
    def rows(self) -> int:
        return sum(rows * r for rows, _, r in self.sizes)

    def numbers(self) -> range:
        """The batch numbers committed so far (RunDir.batch_file gives each one's path)."""
        return range(len(self))

    def files(self) -> list[str]:
        return [batch_file_name(i) for i in self.numbers()]

    def to_json(self) -> dict[str, Any]:
        return {"count": len(self), "rows": self.rows, "sizes": self.sizes}


@dataclass
class Checkpoint:
    run_key: str = ""  # the run key (layout.RunDir.run_key) of the run whose units this checkpoint commits
    committed: RangeSet = field(default_factory=RangeSet)
    batches: BatchLedger = field(default_factory=BatchLedger)
    rollout_offsets: dict[str, int] = field(default_factory=dict)
    failure_offsets: dict[str, int] = field(default_factory=dict)
    rollout_sealed: dict[str, int] = field(default_factory=dict)  # actor -> shards below this seq are done
    failure_sealed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)  # "index:sample" -> {reason, launch}
    # streams=redis: topic -> the last stream entry ID this checkpoint covers (every entry up to it is committed,
    # failed or a duplicate; acknowledged once this checkpoint is durable). Absent in older checkpoints: {}
    stream_ids: dict[str, str] = field(default_factory=dict)
    launch: str = ""
    complete: bool = False
    merged: bool = False
    n: int = 0  # the n its unit keys are numbered by (stream.UnitKeys); 0: written before it was recorded, the run's n

    def renumber(self, old_n: int, new_n: int) -> None:
        """The committed units, numbered by `new_n` instead of `old_n` (the same (index, sample) pairs): samples added
        to a run (a larger n) keep every unit it committed. The run is complete again only once the new ones are."""
        if old_n == new_n:
            self.n = new_n
            return
        committed = RangeSet()
        for key in self.committed:
            index, sample = divmod(key, old_n)
            if sample >= new_n:
                raise ValueError(f"sample {sample} of prompt {index} is committed: a run numbered by n={new_n} "
                                 f"cannot hold it")
            committed.add(index * new_n + sample)
        self.committed, self.n = committed, new_n
        self.complete = self.merged = False

    def mark_failed(self, label: str, reason: str) -> None:
        """A unit (records.unit_label) that gave up in this launch, and why."""
        self.failed[label] = {"reason": reason}

    @property
    def num_committed(self) -> int:
        return len(self.committed)

    @property
    def num_rows(self) -> int:
        return self.batches.rows

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "version": VERSION,
                "run_key": self.run_key,
                "launch": self.launch,
                "complete": self.complete,
                "merged": self.merged,
                "num_committed": self.num_committed,
                "committed_ranges": self.committed.ranges(),
                "batches": self.batches.to_json(),
                "failed": self.failed,
                "rollout_sealed": self.rollout_sealed,
                "rollout_offsets": self.rollout_offsets,
                "failure_sealed": self.failure_sealed,
                "failure_offsets": self.failure_offsets,
                "stream_ids": self.stream_ids,
                "n": self.n,
            },
            option=orjson.OPT_INDENT_2,
        )

    @classmethod
    def from_dict(cls, d: Any) -> "Checkpoint":
        if not isinstance(d, dict) or not REQUIRED_KEYS <= d.keys():
            raise ValueError(f"a checkpoint is an object with the keys {', '.join(sorted(REQUIRED_KEYS))}")
        if d.get("version") != VERSION:
            raise ValueError(f"checkpoint format {d.get('version')} is not {VERSION}; this run was written by "
                             "another pipegen version: finish it with that version or start a new output_dir")
        return cls(
            run_key=d.get("run_key", d.get("fingerprint", "")),  # "fingerprint": its name before 2026-11
            committed=RangeSet(d.get("committed_ranges", [])),
            batches=BatchLedger(d.get("batches", {}).get("sizes", [])),
            rollout_offsets=d.get("rollout_offsets", {}),
            failure_offsets=d.get("failure_offsets", {}),
            rollout_sealed=d.get("rollout_sealed", {}),
            failure_sealed=d.get("failure_sealed", {}),
            failed=d.get("failed", {}),
            stream_ids=d.get("stream_ids", {}),
            launch=d.get("launch", ""),
            complete=d.get("complete", False),
            merged=d.get("merged", False),
            n=int(d.get("n") or 0),
        )


def failure_reason(entry: dict[str, Any] | None) -> str:
    """The reason stored for one entry of Checkpoint.failed."""
    return str((entry or {}).get("reason", ""))


REASON_SHOWN = 160  # characters of a group's first reason shown in a summary line

# A reason's class: what failed and how, without what a unit's own text adds (the response in a parse error,
# a row's value): "... raised ValueError", or the text before its first ": ".
_RAISED = re.compile(r"^(.*? raised [A-Za-z_][\w.]*)")


def one_line(text: str, limit: int = REASON_SHOWN) -> str:
    """`text` with its whitespace folded to single spaces, cut to `limit` characters (an ellipsis says so)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1].rstrip() + "…"


def reason_class(reason: str) -> str:
    flat = " ".join(reason.split())
    raised = _RAISED.match(flat)
    return raised.group(1) if raised else flat.partition(": ")[0]


def failures_by_reason(failed: dict[str, Any]) -> list[tuple[str, list[str], str]]:
    """Checkpoint.failed grouped by reason class: (class, its units, the first unit's reason on one line and
    cut), the most common class first."""
    groups: dict[str, tuple[list[str], str]] = {}
    for unit, info in failed.items():
        reason = failure_reason(info)
        groups.setdefault(reason_class(reason), ([], one_line(reason)))[0].append(unit)
    return sorted(((c, units, first) for c, (units, first) in groups.items()), key=lambda group: -len(group[1]))


def failure_summary(failed: dict[str, Any], reasons: int = 5, units: int = 4) -> list[str]:
    """Checkpoint.failed as a few lines, one per reason class: its count, its first units and the first one's
    reason (one line, cut), then "and N more"."""
    groups = failures_by_reason(failed)
    lines = []
    for cls, labels, first in groups[:reasons]:
        shown = ", ".join(labels[:units]) + (f" and {len(labels) - units} more" if len(labels) > units else "")
        lines.append(f"{len(labels)} unit(s) ({shown}): {first}" if len(labels) == 1 or first == cls
                     else f"{len(labels)} unit(s) ({shown}): {cls}; the first: {first}")
    if len(groups) > reasons:
        rest = sum(len(labels) for _, labels, _ in groups[reasons:])
        lines.append(f"and {rest} more unit(s) with {len(groups) - reasons} other reason(s)")
    return lines


PENDING_LISTED = 10000  # pending units named one by one in failed_units.json (the count is always there)


def failed_listing(committed: int, total: int, failed: dict[str, str], pending: list[str]) -> bytes:
    """failed_units.json: each failed unit (index:sample) with its reason, and the units still pending when a writer
    alone delivers a partial output."""
    from pipegen.run.stream import is_not_scored

    unscored = sum(1 for reason in failed.values() if is_not_scored(str(reason)))
    retry = []
    if len(failed) > unscored:
        retry.append("rerun the same command: it retries only the units that failed to generate, each with a fresh "
                     "seed")
    if unscored:
        retry.append("the units not scored keep their samples: fix the reward, then pipegen rescore DIR scores them "
                     "without generating")
    listing: dict[str, Any] = {"committed": committed, "total": total, "failed": len(failed),
                               "retry": "; ".join(retry) or "nothing to retry", "units": failed}
    if pending:
        listing["pending"] = len(pending)
        listing["pending_why"] = ("not generated: no launcher or actor was alive when the writer ran alone; "
                                  "rerun the same command to generate only them")
        listing["pending_units"] = pending[:PENDING_LISTED]  # the first ones; the count says how many
    return orjson.dumps(listing, option=orjson.OPT_INDENT_2)


def load_checkpoint(path: Path) -> Checkpoint:
    """The saved checkpoint, or an empty one when there is none (a new run, or one whose checkpoint is
    gone: the writer then rebuilds it from the batch files). A damaged one raises DamagedFile naming
    what is intact and the rebuild command."""
    path = Path(path)
    try:
        ckpt = read_json_file(path, _checked, "pipegen checkpoint", missing_ok=True)
    except DamagedFile as e:
        raise e.with_advice(*damaged_checkpoint_advice(path.parent)) from None
    return Checkpoint() if ckpt is None else ckpt


def _checked(data: Any) -> Checkpoint:
    ckpt = Checkpoint.from_dict(data)
    for sizes in ckpt.batches.sizes:
        if len(sizes) != 3 or not all(isinstance(v, int) and v >= 0 for v in sizes):
            raise ValueError(f"batch sizes {sizes!r} are not [rows, units, repeat]")
    for offsets in (ckpt.rollout_offsets, ckpt.failure_offsets, ckpt.rollout_sealed, ckpt.failure_sealed):
        if not isinstance(offsets, dict) or not all(isinstance(v, int) for v in offsets.values()):
            raise ValueError("shard offsets are not a {shard: int} object")
    if not isinstance(ckpt.failed, dict):
        raise ValueError("failed units are not an object")
    if not isinstance(ckpt.stream_ids, dict) or not all(isinstance(v, str) for v in ckpt.stream_ids.values()):
        raise ValueError("stream_ids are not a {topic: entry id} object")
    return ckpt


def damaged_checkpoint_advice(root: Path) -> tuple[str, str]:
    """(what is intact, the fix) for a damaged checkpoint.json in root."""
    batches = len(list(Path(root).glob(BATCH_GLOB)))
    return (f"{batches} batch file(s) and the stream shards, which hold every committed sample",
            f"{rebuild_command(root)} (rebuilds it from them and keeps the damaged file beside it), "
            "then rerun the same command")


def damaged_batch(path: Path, problem: str) -> DamagedFile:
    """A batch file that cannot be read: its units are still in the stream shards."""
    root = Path(path).parent
    return DamagedFile(path, problem, "checkpoint.json, the other batch files, and the stream shards, which still "
                       "hold this file's samples",
                       f"{rebuild_command(root)} (sets it aside, rebuilds the checkpoint from the other batch "
                       "files; the writer then reads its samples again from the shards), then rerun the same command")


def check_listed_batches(root: Path, ckpt: Checkpoint) -> None:
    """Raise DamagedFile for the first batch file the checkpoint lists that is missing or empty (a
    stat each: cheap at every start; a file damaged inside is found when it is read)."""
    for number in ckpt.batches.numbers():
        path = Path(root) / batch_file_name(number)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise damaged_batch(path, "missing, though checkpoint.json lists it") from None
        if size == 0:
            raise damaged_batch(path, "empty")


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    atomic_write_bytes(Path(path), ckpt.to_json())
