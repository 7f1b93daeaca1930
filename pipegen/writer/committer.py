"""The disk half of the writer's commit protocol (steps 3-4 in commit.py), on one background thread.

`Committer` takes commits strictly in order, and when several queued up behind a slow fsync it writes
all their batch files and then one checkpoint listing them all (group commit). The checkpoint is never
renamed before every batch it lists is fsynced, renamed and its directory fsynced; the rename itself
is not followed by a directory fsync, because losing it in a power cut leaves the previous checkpoint,
which is safe (its batches are durable; the newer batch files are orphans, adopted at start, and
their lines are dropped as committed when read again); the next commit's directory fsync, or the final
checkpoint, makes it durable. A commit that something waits for (`after`: streams=redis acknowledges its
entries only once the checkpoint covering them is durable) fsyncs the directory after the rename too.

Owns: writing batch files and checkpoint.json (bytes the writer encoded) in order, and the kill tests'
crash points inside those writes (`PIPEGEN_WRITER_FAULT`).
Must never: decide what is committed or encode anything (the writer hands it bytes), rename a
checkpoint before the batch files it lists are durable, or write from more than one thread.
"""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from pipegen.run.atomic import fsync_dir, temporary_sibling, write_synced
from pipegen.run.layout import RunDir

FAULT_ENV = "PIPEGEN_WRITER_FAULT"  # test hook: "<point>:<k>" SIGKILLs the writer the k-th time it reaches point
IOV_MAX = 1024  # buffers one writev takes (POSIX minimum 16; Linux 1024)


class FaultInjector:
    """Deterministic crash points for the kill tests: batch_write, after_batch_rename, checkpoint_write, and
    before_acknowledge (a checkpoint durable, the Redis entries it covers not yet acknowledged)."""

    def __init__(self, spec: str | None):
        self.point, self.remaining = None, 0
        if spec:
            point, _, count = spec.partition(":")
            self.point, self.remaining = point, int(count or 1)

    def reached(self, point: str) -> None:
        if point == self.point:
            self.remaining -= 1
            if self.remaining <= 0:
                os.kill(os.getpid(), signal.SIGKILL)


class Committer:
    """The disk half of the commit protocol (steps 3-4) on one background thread, commits in order.

    `submit` queues a batch file's chunks with the checkpoint that lists it; a job takes everything
    queued so far: it writes each batch file (temporary, fsync, rename), then the last checkpoint
    (temporary, fsync, directory fsync, rename). Errors surface in the main loop at the next `poll`.
    `on_commit`, when set, is called on the thread after each checkpoint rename (the publisher's wake-up).
    """

    def __init__(self, run: RunDir, fault: FaultInjector | None = None):
        self.run = run
        self.fault = fault or FaultInjector(os.environ.get(FAULT_ENV))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pipegen-commit")
        self._running: Future | None = None
        self._batches: list[tuple[Path, list]] = []
        self._checkpoint: bytes | None = None
        self._after: list[Callable[[], None]] = []
        self.on_commit: Callable[[], None] | None = None

    def submit(self, path: Path, chunks: list, checkpoint: bytes, after: Callable[[], None] | None = None) -> None:
        """`after`: run once this checkpoint is durable, its rename included (streams=redis: the XACK of the
        entries it covers)."""
        self._batches.append((path, chunks))
        self._checkpoint = checkpoint
        if after is not None:
            self._after.append(after)
        self.poll()

    @property
    def queued(self) -> int:
        return len(self._batches)

    def poll(self) -> None:
        """Raise what the last job raised; start the next job when the thread is free."""
        if self._running is not None:
            if not self._running.done():
                return
            running, self._running = self._running, None
            running.result()
        if self._checkpoint is not None:
            batches, checkpoint, after = self._batches, self._checkpoint, self._after
            self._batches, self._checkpoint, self._after = [], None, []
            self._running = self._pool.submit(self._write, batches, checkpoint, after)

    async def wait(self, max_queued: int = 0) -> None:
        """Until at most max_queued batches wait for the disk (0: until everything is on disk)."""
        self.poll()
        while self._running is not None and (self.queued > max_queued or max_queued == 0):
            await asyncio.wrap_future(self._running)
            self.poll()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _write(self, batches: list[tuple[Path, list]], checkpoint: bytes, after: list[Callable[[], None]]) -> None:
        for path, chunks in batches:
            tmp = temporary_sibling(path)
            write_synced(tmp, lambda f: self._write_chunks(f, chunks, "batch_write"))
            os.replace(tmp, path)
            self.fault.reached("after_batch_rename")
        tmp = temporary_sibling(self.run.checkpoint)
        write_synced(tmp, lambda f: self._write_chunks(f, [checkpoint[: len(checkpoint) // 2],
                                                            checkpoint[len(checkpoint) // 2 :]], "checkpoint_write"))
        fsync_dir(self.run.root)  # the batch renames above and this temporary are durable before the rename
        os.replace(tmp, self.run.checkpoint)
        if after:  # what waits for this checkpoint needs its rename durable too: a power cut must not undo it
            fsync_dir(self.run.root)
            self.fault.reached("before_acknowledge")  # streams=redis: durable, its entries not yet acknowledged
            for then in after:
                then()
        if self.on_commit is not None:
            self.on_commit()

    def _write_chunks(self, f, chunks: list, fault_point: str) -> None:
        # two writev calls, not a write per chunk: each system call hands the GIL back and forth
        # with the main loop, which is busy parsing
        half = len(chunks) // 2
        f.flush()
        _write_all(f.fileno(), chunks[:half])
        self.fault.reached(fault_point)
        _write_all(f.fileno(), chunks[half:])


def _write_all(fd: int, chunks: list) -> None:
    """Every byte of chunks, in order, with as few writev calls as the kernel allows."""
    views = [memoryview(chunk).cast("B") for chunk in chunks if len(chunk)]
    while views:
        written = os.writev(fd, views[:IOV_MAX])
        while views and written >= views[0].nbytes:
            written -= views.pop(0).nbytes
        if written:
            views[0] = views[0][written:]
