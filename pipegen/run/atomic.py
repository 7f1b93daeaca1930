"""Crash-safe file primitives: write-to-temp + fsync + rename + directory fsync, and the writer lock.

Owns: the only way pipegen replaces a file that a reader may look at after a crash.
Must never: leave a half-written file under its final name, or hold state between calls.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import IO, Callable

from filelock import FileLock, Timeout


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_sibling(path: Path) -> Path:
    """Where a new version of path is written before its rename (remove_stale_temporaries finds it)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_synced(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call write(fileobj) on a new file at path and fsync it (its directory entry is not synced)."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call write(fileobj) on a temporary sibling, fsync it, rename over path, fsync the directory.

    After a crash at any point, path holds either its old content or the new one, never a mix.
    """
    path = Path(path)
    tmp = temporary_sibling(path)
    write_synced(tmp, write)
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
    """An exclusive OS lock (filelock's flock) on a file: released by the kernel when the holder dies.

    The holder's pid (and, with `name_host`, its host) is written into the file so a refused process,
    and `pipegen.status`, can name it. `role` names the holder in the refusal ("writer", "launcher").
    """

    def __init__(self, path: Path, role: str = "writer", name_host: bool = False):
        self.path = Path(path)
        self.role = role
        self.name_host = name_host
        self._lock = FileLock(str(self.path))

    def acquire(self) -> None:
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            try:
                holder = self.path.read_text().strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise LockHeld(self.path, holder, self.role) from None
        with open(self.path, "r+") as f:  # the lock is on the inode, so a second descriptor may write
            f.truncate()
            f.write(f"{os.getpid()} {socket.gethostname()}\n" if self.name_host else f"{os.getpid()}\n")

    def release(self) -> None:
        self._lock.release()


class LockHeld(RuntimeError):
    def __init__(self, path: Path, holder: str, role: str = "writer"):
        pid, _, host = holder.partition(" ")
        who = f"pid {pid} on {host}" if host else f"pid {pid}"
        super().__init__(f"another {role} ({who}) already owns {path.parent}; stop it first or wait for it")
        self.holder = pid
