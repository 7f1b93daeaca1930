"""A read-only snapshot of a run's progress, for the launcher's bar and `pipegen.status`.

Owns: reading checkpoint.json, the unit manifest and the latest stats lines into one summary.
Must never: write anything or take the writer lock (it runs beside a live writer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from pipegen.checkpoint import load_checkpoint
from pipegen.config import RunDir
from pipegen.stats import latest_stats


@dataclass
class Snapshot:
    total: int = 0
    committed: int = 0
    batches: int = 0
    failed: int = 0
    in_flight: int = 0
    complete: bool = False
    merged: bool = False
    output_tokens: int = 0
    failed_units: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def pending(self) -> int:
        return max(0, self.total - self.committed - self.failed)

    def postfix(self) -> str:
        return f"Saved: {self.batches} batches | Pending: {self.pending} | In-flight: {self.in_flight} | Failed: {self.failed}"


def snapshot(run: RunDir, n: int) -> Snapshot:
    snap = Snapshot()
    if run.units_file.exists():
        snap.total = len(orjson.loads(run.units_file.read_bytes())["indices"]) * n
    try:
        ckpt = load_checkpoint(run.checkpoint)
    except (orjson.JSONDecodeError, OSError):
        ckpt = None
    if ckpt is not None:
        snap.committed = ckpt.num_committed
        snap.batches = len(ckpt.batches)
        snap.complete = ckpt.complete
        snap.merged = ckpt.merged
        snap.failed_units = dict(ckpt.failed)
    snap.roles = latest_stats(run.stats)
    actor_failed = 0
    for role, line in snap.roles.items():
        if role.startswith("actor_"):
            snap.in_flight += int(line.get("in_flight") or 0)
            snap.output_tokens += int(line.get("output_tokens") or 0)
            actor_failed += int(line.get("failed") or 0)
    snap.failed = max(len(snap.failed_units), 0)
    return snap
