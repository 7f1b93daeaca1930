"""Crash-safe file primitives: write-to-temp + fsync + rename + directory fsync, and the writer lock.

Owns: the only way pipegen replaces a file that a reader may look at after a crash.
Must never: leave a half-written file under its final name, or hold state between calls.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO, Callable


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call write(fileobj) on a temporary sibling, fsync it, rename over path, fsync the directory.

    After a crash at any point, path holds either its old content or the new one, never a mix.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def remove_stale_temporaries(directory: Path) -> int:
    """Delete temporaries left by a crash inside atomic_write (they are never referenced)."""
    removed = 0
    for p in Path(directory).glob(".*.tmp-*"):
        p.unlink(missing_ok=True)
        removed += 1
    return removed


class DirectoryLock:
    """An exclusive OS lock (flock) on a file: released by the kernel when the holder dies.

    The holder's pid is written into the file so a refused process can name it.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockHeld(self.path, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LockHeld(RuntimeError):
    def __init__(self, path: Path, holder: str):
        super().__init__(f"another writer (pid {holder}) already owns {path.parent}; stop it first or wait for it")
        self.holder = holder
