"""Crash-safe file primitives: write-to-temp + fsync + rename + directory fsync.

Owns: the primitives every crash-safe replacement in pipegen is built from (a temporary sibling, a synced
write, a rename, a directory fsync) and `atomic_write`, their single-file form; and `replace_unsynced`, the same
rename without the fsyncs, for a status file rewritten many times a second that a reader must never see torn but
that a power cut may lose. The writer's group commit
(writer/committer.py) composes the same primitives so that one directory fsync covers many renames.
Must never: leave a half-written file under its final name, or hold state between calls.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Callable



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


def replace_unsynced(path: Path, data: bytes) -> None:
    """Write data to a temporary sibling and rename it over path, with no fsync: a reader sees the old file or the
    new one whole, and a crash of the process leaves one of them; after a power cut the file may be empty or old."""
    path = Path(path)
    tmp = temporary_sibling(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def remove_stale_temporaries(directory: Path) -> int:
    """Delete temporaries left by a crash inside atomic_write (they are never referenced)."""
    removed = 0
    for p in Path(directory).glob(".*.tmp-*"):
        p.unlink(missing_ok=True)
        removed += 1
    return removed
