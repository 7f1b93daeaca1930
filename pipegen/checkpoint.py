"""The writer's commit record, `checkpoint.json`.

Holds: committed units as compact ranges of unit keys, the batch files with their row counts, the
byte offsets consumed in every rollout and failure shard, units that failed in the current launch,
the config fingerprint, and whether the merge finished.

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

VERSION = 1


@dataclass
class Checkpoint:
    fingerprint: str = ""
    committed: RangeSet = field(default_factory=RangeSet)
    batches: list[dict[str, Any]] = field(default_factory=list)  # [{"file": name, "rows": r, "units": u}]
    rollout_offsets: dict[str, int] = field(default_factory=dict)
    failure_offsets: dict[str, int] = field(default_factory=dict)
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)  # "index:sample" -> {reason, launch}
    launch: str = ""
    complete: bool = False
    merged: bool = False

    @property
    def num_committed(self) -> int:
        return len(self.committed)

    @property
    def num_rows(self) -> int:
        return sum(b["rows"] for b in self.batches)

    def next_batch_number(self) -> int:
        return len(self.batches)

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
                "batches": self.batches,
                "failed": self.failed,
                "rollout_offsets": self.rollout_offsets,
                "failure_offsets": self.failure_offsets,
            },
            option=orjson.OPT_INDENT_2,
        )

    @classmethod
    def from_json(cls, data: bytes) -> "Checkpoint":
        d = orjson.loads(data)
        return cls(
            fingerprint=d.get("fingerprint", ""),
            committed=RangeSet(d.get("committed_ranges", [])),
            batches=d.get("batches", []),
            rollout_offsets=d.get("rollout_offsets", {}),
            failure_offsets=d.get("failure_offsets", {}),
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
