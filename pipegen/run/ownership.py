"""Who owns a run directory: the OS locks a role takes on it, and whether a recorded pid still lives.

Owns: `DirectoryLock` (the writer lock: one writer per run directory; the launcher lock: one launcher),
reading who holds a lock without touching it, and telling a live pipegen process from a dead or reused pid.
Must never: decide what a role does about a held lock (each role's main does), or write anything but the
holder's pid (and, for the launcher lock, its host) into a lock file.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

HOST = socket.gethostname()
PF_EXITING = 0x4  # /proc/<pid>/stat field 9 (flags): the kernel is tearing the process down


class DirectoryLock:
    """An exclusive OS lock (filelock's flock) on a file: released by the kernel when the holder dies.

    The holder's pid (and, with `name_host`, its host) is written into the file so a refused process, and
    `pipegen.status`, can name it; `role` names the holder in the refusal ("writer", "launcher").
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
            f.write(f"{os.getpid()} {HOST}\n" if self.name_host else f"{os.getpid()}\n")

    def release(self) -> None:
        self._lock.release()


class LockHeld(RuntimeError):
    def __init__(self, path: Path, holder: str, role: str = "writer"):
        pid, _, host = holder.partition(" ")
        who = f"pid {pid} on {host}" if host else f"pid {pid}"
        super().__init__(f"another {role} ({who}) already owns {path.parent}; stop it first or wait for it")


@dataclass
class LockStatus:
    path: str
    pid: int | None = None  # the pid written into the lock file by its last holder
    held: bool | None = None  # None: cannot tell (no /proc/locks and the pid is on another host)


def lock_status(path: Path) -> LockStatus:
    """Who holds the lock at `path`, without touching it: the pid in the file, and /proc/locks."""
    path = Path(path)
    status = LockStatus(str(path))
    try:
        text = path.read_text().strip()
        st = path.stat()
    except OSError:
        return status
    pid = text.split(" ", 1)[0]  # the launcher lock adds the host after the pid
    status.pid = int(pid) if pid.isdigit() else None
    try:
        locks = Path("/proc/locks").read_text()
    except OSError:
        status.held = pid_alive(status.pid) if status.pid else None
        return status
    status.held = False
    for line in locks.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter has "->" after the number)
        if len(parts) < 6 or "->" in parts[1]:
            continue
        if parts[1] != "FLOCK":
            continue
        try:
            inode = int(parts[5].rsplit(":", 1)[1])
        except (IndexError, ValueError):
            continue
        if inode == st.st_ino:
            status.held = True
            if parts[4].isdigit() and int(parts[4]) > 0:
                status.pid = int(parts[4])
            break
    return status


def lock_holder(path: Path) -> int | None:
    """The pid of the live process that holds the lock at `path`, or None when the lock is free."""
    lock = lock_status(path)
    if lock.held is None:  # no /proc/locks: trust the pid the holder wrote, if that process lives
        return lock.pid if lock.pid is not None and pid_alive(lock.pid) else None
    return lock.pid if lock.held else None


def pid_alive(pid: Any, host: str | None = None) -> bool | None:
    """True/False for a pid on this host (a reused pid that is not a pipegen process counts as dead);
    None when the line came from another host (multi-node runs): unknown from here."""
    if host and host != HOST:
        return None
    try:
        pid = int(pid)
        os.kill(pid, 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    try:
        # cmdline first: an exiting process empties it before its state says so, and the stat read
        # after it then shows the exit (a flag, then Z), so an empty cmdline is exec() only when it does not
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        fields = (stat := Path(f"/proc/{pid}/stat").read_bytes())[stat.rfind(b")") + 2 :].split()
    except FileNotFoundError:
        return False  # exited between the two checks
    except OSError:
        return True  # no /proc (macOS): trust kill(0)
    if fields[0] in (b"Z", b"X") or int(fields[6]) & PF_EXITING:
        return False  # exiting, or a zombie: exited, not yet reaped by its parent
    if not cmdline:
        return True  # in the middle of exec(): nothing to check yet
    return b"pipegen" in cmdline
