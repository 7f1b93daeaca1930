"""What the launcher shows on its console: a read-only snapshot of a run, the progress bar, and the
warnings and errors of every role's log.

- `snapshot(run, n)`: checkpoint.json + the unit manifest + the latest stats line of each role, in
  one summary (also read by `pipegen.observe.run_status` and `pipegen.observe.tracking`); with no live
  writer, the finished units durable in the shards past the checkpoint's offsets count as done too (a
  Ctrl-C leaves them there, uncommitted: they are not lost, and not generated again), counted by
  `DurableShards`, which reads each shard line once however often the console asks.
- `ProgressBar`: tqdm with done/total, rate, ETA and `Saved: B batches | Pending: P | In-flight: F |
  Failed: X` (plus output tokens/s when the actors report them).
- `LogWatcher`: follows DIR/logs/<role>.log from each role's latest start banner and hands back the
  WARNING/ERROR/CRITICAL lines and tracebacks, so they reach the launcher's console above the bar.

Owns: reading a run's state for display. Must never: write anything, take the writer lock (it runs
beside a live writer), or be needed for correctness.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any


from pipegen.run.checkpoint import Checkpoint, load_checkpoint
from pipegen.run.layout import RunDir, role_logs
from pipegen.observe.stats import aggregate, human_rate, latest_stats, line_alive
from pipegen.run.stats_line import StatsLine, WriterStats
from pipegen.run.medium import ROLLOUTS, Tail, open_medium
from pipegen.run.stream import UnitKeys, read_head


@dataclass
class Snapshot:
    total: int = 0
    committed: int = 0
    # finished and durable in a shard line, not yet in a batch file: the live writer's buffer, or, with no
    # writer alive, the complete shard lines past the checkpoint's offsets whose units are not committed
    buffered: int = 0
    batches: int = 0
    failed: int = 0
    in_flight: int = 0
    requests_in_flight: int = 0
    complete: bool = False
    merged: bool = False
    output_tokens: int = 0
    failed_units: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, StatsLine] = field(default_factory=dict)  # each role's latest stats line
    metrics: dict[str, Any] = field(default_factory=dict)  # stats.aggregate() of the latest lines
    tokens_per_s: float | None = None  # set by whoever measures it over time (the launcher's tracker)

    @property
    def done(self) -> int:
        """Samples on disk: committed to batch files, or in a shard the writer has read. Batch files fill
        to generation.save_batch_size before they are written, so committed alone moves in big steps."""
        return self.committed + self.buffered

    @property
    def pending(self) -> int:
        return max(0, self.total - self.done - self.failed)

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0

    def postfix(self) -> str:
        text = (f"Saved: {self.batches} batches | Pending: {self.pending} | In-flight: {self.in_flight} | "
                f"Failed: {self.failed}")
        if self.tokens_per_s is not None:
            text += f" | {human_rate(self.tokens_per_s, 'tok')}"
        return text


def snapshot(run: RunDir, n: int, total: int | None = None, shards: "DurableShards | None" = None) -> Snapshot:
    """The run's state now. Pass total when known: the manifest of a big dataset is not re-read. `shards`: the
    caller's counter of the units in the shards, kept across snapshots so each reads only new lines (the
    console's, refreshed every second; a one-off snapshot scans the shards' uncommitted tails once)."""
    snap = Snapshot()
    snap.total = run.total_units(n) if total is None else total
    try:
        ckpt = load_checkpoint(run.checkpoint)
    except (ValueError, OSError, KeyError, TypeError):  # ValueError: orjson's, or integrity.DamagedFile
        ckpt = None
    if ckpt is not None:
        snap.committed = ckpt.num_committed
        snap.batches = len(ckpt.batches)
        snap.complete = ckpt.complete
        snap.merged = ckpt.merged
        snap.failed_units = dict(ckpt.failed)
    snap.roles = latest_stats(run.stats)
    snap.metrics = aggregate(snap.roles)
    snap.in_flight = int(snap.metrics.get("actors/in_flight", 0))
    snap.requests_in_flight = int(snap.metrics.get("actors/requests_in_flight", 0))
    snap.output_tokens = int(snap.metrics.get("actors/output_tokens", 0))
    snap.failed = len(snap.failed_units)
    writer = snap.roles.get(WriterStats.ROLE)
    if isinstance(writer, WriterStats) and not snap.complete and line_alive(writer):
        # the live writer knows failures it has not checkpointed yet; its committed count is newer too
        snap.failed = max(snap.failed, writer.failed or 0)
        snap.committed = max(snap.committed, writer.committed or 0)
        snap.batches = max(snap.batches, writer.batches or 0)
        snap.buffered = writer.buffered or 0
    elif ckpt is not None and not snap.complete:
        snap.buffered = (shards or DurableShards(run, n)).count(ckpt)
    return snap


class DurableShards:
    """Units whose complete line is in a shard and not committed, each once: what a writer would commit now.

    The first count reads the shards from the checkpoint's offsets (their uncommitted tails); later counts read
    only the lines added since, and forget the units committed meanwhile, so a console that counts every second
    beside a run without a writer (generation.run_writer=false) never reads a shard twice."""

    def __init__(self, run: RunDir, n: int):
        self.run = run
        self.keys = UnitKeys(n)
        self.tailer: Tail | None = None
        self.found: set[int] = set()

    def count(self, ckpt: Checkpoint) -> int:
        if self.tailer is None:
            # past the checkpoint: the shards, or the run's Redis stream (a console never waits for an outage)
            self.tailer = open_medium(self.run, wait_s=0).tail(ROLLOUTS, ckpt)
        try:
            for _, _, line in self.tailer.lines():
                head = read_head(line)
                if head is not None and self.keys.valid_sample(head[1]):
                    self.found.add(self.keys.key(*head))
        except OSError:  # Redis unreachable: the units found so far; the next count reads on from there
            pass
        self.found = {k for k in self.found if k not in ckpt.committed}
        return len(self.found)


class ProgressBar:
    """The launcher's tqdm bar: samples on disk (Snapshot.done) out of all (prompt, sample) units of the run."""

    def __init__(self, total: int, initial: int = 0, file: IO[str] | None = None):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.bar = tqdm(total=total, initial=initial, unit="sample", desc="pipegen", dynamic_ncols=True,
                        file=file or sys.stderr, smoothing=0.3, mininterval=0.5)
        self.initial = initial

    def show(self, snap: Snapshot) -> None:
        if snap.total and snap.total != self.bar.total:
            self.bar.total = snap.total
        delta = snap.done - self.bar.n
        self.bar.set_postfix_str(snap.postfix(), refresh=False)
        if self.bar.n == self.initial:
            # nothing done yet (servers and roles starting): keep that wait out of the rate,
            # which tqdm measures from the previous print; elapsed still counts from the start
            self.bar.last_print_t = self.bar._time()
        if delta > 0:
            self.bar.update(delta)  # update() feeds tqdm's smoothed rate and ETA
        else:
            self.bar.refresh()

    def write(self, line: str) -> None:
        self._tqdm.write(line, file=self.bar.fp)

    def close(self, snap: Snapshot | None = None) -> None:
        if snap is not None:
            self.show(snap)
        self.bar.close()


# ---- warnings and errors from the role logs ----

# pipegen's own format (pipegen.observe.logs): "2025-01-01 12:00:00 WARNING [writer] pipegen.writer: message"
_OWN = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? (WARNING|ERROR|CRITICAL) \[[^\]]+\] (.*)$")
# anyone else's (uvicorn "ERROR:    ...", SGLang "[2025-..] WARNING ...", "... - ERROR - ...")
_OTHER = re.compile(r"^.{0,48}?\b(WARNING|WARN|ERROR|CRITICAL|FATAL)\b[\s:\]-]")
_BANNER = b"\n===== "
# Harmless on every CPU-only run; shown once per log would still be noise above the bar.
QUIET = ("No supported accelerator detected", "is registered but not available")
MAX_LINES_PER_LOG = 40


@dataclass
class _Followed:
    path: Path
    offset: int
    partial: bytes = b""
    in_traceback: bool = False
    forwarded: int = 0
    muted: bool = False


class LogWatcher:
    """Follows every DIR/logs/*.log; `poll()` returns the new warning/error lines, each prefixed with
    its role, deduplicated (a message seen from one role is not repeated from another) and capped
    per log (then one line saying where the rest is). A log is read from its latest start banner,
    so warnings a role printed before the watcher started are not lost, and older launches are not
    replayed."""

    def __init__(self, logs_dir: Path, max_lines_per_log: int = MAX_LINES_PER_LOG):
        self.logs_dir = Path(logs_dir)
        self.max_lines = max_lines_per_log
        self.files: dict[str, _Followed] = {}
        self.seen: set[str] = set()

    def _start_offset(self, path: Path) -> int:
        try:
            data = path.read_bytes()[-(4 << 20):]
            size = path.stat().st_size
        except OSError:
            return 0
        pos = data.rfind(_BANNER)
        return size - len(data) + pos + 1 if pos >= 0 else size

    def poll(self) -> list[str]:
        out: list[str] = []
        if not self.logs_dir.is_dir():
            return out
        for path in role_logs(self.logs_dir):
            role = path.stem
            if role.startswith("launch"):  # the launcher's own log already goes to its console
                continue
            f = self.files.get(role)
            if f is None:
                f = self.files[role] = _Followed(path, self._start_offset(path))
            try:
                size = path.stat().st_size
                if size < f.offset:  # truncated or replaced: start over
                    f.offset, f.partial = 0, b""
                if size == f.offset:
                    continue
                with open(path, "rb") as fh:
                    fh.seek(f.offset)
                    data = fh.read(min(size - f.offset, 8 << 20))
            except OSError:
                continue
            f.offset += len(data)
            data = f.partial + data
            lines = data.split(b"\n")
            f.partial = lines.pop()
            for raw in lines:
                line = raw.decode(errors="replace").rstrip("\r")
                message = self._classify(f, line)
                if message is None or f.muted:
                    continue
                key = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\S* ", "", message)
                key = re.sub(r"\[[^\]]+\] ", "", key, count=1)
                if key in self.seen or any(q in message for q in QUIET):
                    continue
                self.seen.add(key)
                f.forwarded += 1
                if f.forwarded > self.max_lines:
                    f.muted = True
                    out.append(f"[{role}] ... more warnings and errors in {path}")
                    continue
                out.append(message if f"[{role}]" in message else f"[{role}] {message}")
        return out

    @staticmethod
    def _classify(f: _Followed, line: str) -> str | None:
        if f.in_traceback:
            if line.startswith((" ", "\t")) or not line.strip():
                return None
            if line.startswith(("During handling", "The above exception")):
                return None
            if line.startswith("Traceback (most recent call last)"):
                return None
            f.in_traceback = False  # the exception's own line ends the traceback
            return f"{line[:400]}  (traceback in {f.path})"
        if line.startswith("Traceback (most recent call last)"):
            f.in_traceback = True
            return None
        m = _OWN.match(line)
        if m:
            return line[:400]
        if _OTHER.match(line) and not line.startswith("=====") and "INFO" not in line[:48]:
            return line[:400]
        return None
