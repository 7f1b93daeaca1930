"""A full disk: every role stops with one exit code, and the launcher closes with one line saying where.

Nothing already on disk is lost when a write fails for space: shard lines are appended (a line cut
short is a torn last line, skipped), and every other file is written to a temporary and renamed
(`atomic.py`), so the old version stays until the new one is whole. So a role that cannot write stops
(`EXIT_DISK_FULL`; restarting it would fail the same way), the launcher stops the run, and the same
command, rerun once space is free, resumes it.

Owns: recognising a full disk, the exit code, the closing line.
Must never: delete anything to make room.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from pipegen.run.handshake import EXIT_DISK_FULL

_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _ERRNOS


def disk_full_message(root: Path, role: str) -> str:
    """The one line for a run stopped because role could not write under root."""
    try:
        free = f"{shutil.disk_usage(root).free // 1024} KiB free now"
    except OSError:
        free = "free space unknown"
    return (f"no space left on the device of {root} ({free}): {role} could not write there. Nothing already "
            f"on disk was lost (shard lines are appended, every other file is replaced only once its new version "
            f"is whole); free space, then rerun the same command to resume")


def exit_disk_full(root: Path, role: str, program: str) -> int:
    """Print the closing line for a role's own stderr (its log, when that still has room) and return
    the exit code the launcher reads."""
    try:
        os.write(2, f"{program}: error: {disk_full_message(root, role)}\n".encode())
    except OSError:
        pass
    return EXIT_DISK_FULL
