"""The writer's commit record, `checkpoint.json`.

Holds: committed units as compact ranges of unit keys, the batch files (numbered 0..count-1, their
row counts run-length encoded), per actor the watermark below which every shard is sealed and fully
consumed plus byte offsets of the shards above it, units that failed in the current launch, the config
fingerprint, and whether the merge finished. Every part is O(ranges + actors), not O(units) or
O(batches), so a commit costs the same at 1k and at 1M committed units.

Owns: the checkpoint's schema and its atomic replacement.
Must never: list every committed unit (its cost per batch must not grow with the run), or be written
before the batch file it lists is durable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipegen.atomic import atomic_write_bytes
from pipegen.units import RangeSet

VERSION = 2


def batch_file_name(number: int) -> str:
    return f"batch_{number:05d}.pkl"


@dataclass
class BatchLedger:
    """The committed batch files: batch_00000.pkl .. batch_{count-1}.pkl, sizes run-length encoded."""

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

    def files(self) -> list[str]:
        return [batch_file_name(i) for i in range(len(self))]

    def to_json(self) -> dict[str, Any]:
        return {"count": len(self), "rows": self.rows, "sizes": self.sizes}


@dataclass
class Checkpoint:
    fingerprint: str = ""
    committed: RangeSet = field(default_factory=RangeSet)
    batches: BatchLedger = field(default_factory=BatchLedger)
    rollout_offsets: dict[str, int] = field(default_factory=dict)
    failure_offsets: dict[str, int] = field(default_factory=dict)
    rollout_sealed: dict[str, int] = field(default_factory=dict)  # actor -> shards below this seq are done
    failure_sealed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)  # "index:sample" -> {reason, launch}
    launch: str = ""
    complete: bool = False
    merged: bool = False

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
                "fingerprint": self.fingerprint,
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
            },
            option=orjson.OPT_INDENT_2,
        )

    @classmethod
    def from_json(cls, data: bytes) -> "Checkpoint":
        d = orjson.loads(data)
        if d.get("version") != VERSION:
            raise ValueError(f"checkpoint format {d.get('version')} is not {VERSION}; this run was written by "
                             "another pipegen version: finish it with that version or start a new output_dir")
        return cls(
            fingerprint=d.get("fingerprint", ""),
            committed=RangeSet(d.get("committed_ranges", [])),
            batches=BatchLedger(d.get("batches", {}).get("sizes", [])),
            rollout_offsets=d.get("rollout_offsets", {}),
            failure_offsets=d.get("failure_offsets", {}),
            rollout_sealed=d.get("rollout_sealed", {}),
            failure_sealed=d.get("failure_sealed", {}),
            failed=d.get("failed", {}),
            launch=d.get("launch", ""),
            complete=d.get("complete", False),
            merged=d.get("merged", False),
        )


def load_checkpoint(path: Path) -> Checkpoint:
    """The saved checkpoint, or an empty one for a new run."""
    path = Path(path)
    if not path.exists():
        return Checkpoint()
    return Checkpoint.from_json(path.read_bytes())


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    atomic_write_bytes(Path(path), ckpt.to_json())
