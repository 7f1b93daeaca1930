"""The stats stream: periodic metric lines per role under DIR/streams/stats/<role>.jsonl.

Owns: appending stats lines (orjson, one write each) and reading the latest line of each role.
Must never: block a hot path (one small append every few seconds) or be needed for correctness.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


class StatsAppender:
    def __init__(self, stats_dir: Path, role: str):
        Path(stats_dir).mkdir(parents=True, exist_ok=True)
        self.role = role
        self.path = Path(stats_dir) / f"{role}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, metrics: dict[str, Any]) -> None:
        line = orjson.dumps({"time": time.time(), "role": self.role, "pid": os.getpid(), **metrics}) + b"\n"
        os.write(self._fd, line)


def latest_stats(stats_dir: Path) -> dict[str, dict[str, Any]]:
    """The last complete line of every role's stats file."""
    out: dict[str, dict[str, Any]] = {}
    stats_dir = Path(stats_dir)
    if not stats_dir.is_dir():
        return out
    for path in stats_dir.glob("*.jsonl"):
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 65536))
                tail = f.read()
        except OSError:
            continue
        lines = [ln for ln in tail.split(b"\n")[:-1] if ln]  # only newline-terminated lines
        for line in reversed(lines):
            try:
                out[path.stem] = orjson.loads(line)
                break
            except orjson.JSONDecodeError:
                continue
    return out
