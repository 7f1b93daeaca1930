"""Process supervision: start roles, restart them with bounded backoff, stop the whole tree.

Owns: each child's process group, its log file (DIR/logs/<role>.log), the saved command line and
environment next to it (DIR/logs/<role>.cmd.sh, runnable by hand), and the restart policy: a role is given up
after more than `max_restarts` crashes within `restart_window_s` seconds (crashes days apart in a week-long run
are not a crash loop).
Must never: leave a child running after stop_all(), restart a role that exited 0, or count a role
that stood by for another process (a writer started by hand) as crashed.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipegen.launch.forks import ForkedRole, forkable
from pipegen.observe.logs import PARENT_ENV, last_log_line
from pipegen.run.diskfull import disk_full_message
from pipegen.run.handshake import EXIT_DISK_FULL
from pipegen.run.layout import RunDir

log = logging.getLogger("pipegen.supervise")


class DiskFull(RuntimeError):
    """A role stopped because it could not write for lack of space: the run stops (a restart fails alike)."""

    def __init__(self, run: RunDir, role: "Role"):
        super().__init__(disk_full_message(run.root, role.name))
        self.role = role


class CrashLoop(RuntimeError):
    def __init__(self, role: "Role"):
        # one line that ends naming the log, with what the role said last: on a Ray cluster the log is on
        # another machine, and the launcher's terminal is where the user looks
        said = last_log_line(role.log_path)
        super().__init__(f"{role.name} crashed {len(role.crashes)} times within {role.restart_window_s / 60:g} "
                         f"min (last exit code {role.last_rc})"
                         + (f"; it said last: {said[-300:]}" if said else "") + f"; see its log: {role.log_path}")
        self.role = role


@dataclass
class Role:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    restartable: bool = True
    max_restarts: int = 5  # crashes within restart_window_s that are still restarted (generation.restart_limit)
    restart_window_s: float = 600.0  # generation.restart_window_s
    final_codes: frozenset[int] = frozenset({0})  # exit codes that end the role without a restart
    # exit codes that mean "another process does this role's work now" (the writer lock is held):
    # no crash and no restart; whoever owns the role calls Supervisor.start() again when it is free
    standby_codes: frozenset[int] = frozenset()
    standing_by: bool = False
    group: str | None = None  # roles that stand in for each other (LLM servers): one may be given up
    abandoned: bool = False
    proc: subprocess.Popen | ForkedRole | None = None
    restarts: int = 0
    last_rc: int | None = None
    finished: bool = False
    restart_at: float | None = None
    started_at: float = field(default=0.0)
    crashes: list[float] = field(default_factory=list)  # clock times of the crashes within the window

    def crashed(self, now: float) -> int:
        """Record a crash at `now`; how many crashes fall within the window ending now (this one included)."""
        self.crashes = [t for t in self.crashes if now - t < self.restart_window_s] + [now]
        return len(self.crashes)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, run: RunDir, clock: Callable[[], float] = time.monotonic):
        self.run = run
        self.clock = clock  # the restart window's clock (a test passes its own to span hours at no cost)
        run.logs.mkdir(parents=True, exist_ok=True)
        self.roles: dict[str, Role] = {}

    def add(self, role: Role) -> Role:
        self.roles[role.name] = role
        return role

    def start(self, role: Role) -> None:
        env = {**os.environ, **role.env, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        self._save_command(role)
        with open(role.log_path, "ab") as logf:
            logf.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {role.name} =====\n".encode())
            logf.flush()
            if forkable(role.argv):  # an actor or the writer: a fork that has verl imported (launch/forks.py)
                role.proc = ForkedRole(role.argv, env, role.log_path)
            else:
                # A new session per child: Ctrl-C reaches only the launcher, which then stops each
                # child's whole process group (servers spawn their own subprocesses).
                role.proc = subprocess.Popen(role.argv, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True, stdin=subprocess.DEVNULL)
        role.started_at = self.clock()
        role.restart_at = None
        role.standing_by = False
        log.debug("started %s pid %d", role.name, role.proc.pid)

    def _save_command(self, role: Role) -> None:
        path = self.run.role_command(role.name)
        lines = ["#!/usr/bin/env bash", f"# restart {role.name} by hand: bash {path}"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(role.env.items())]
        lines.append(f"cd {shlex.quote(os.getcwd())}")
        lines.append(" ".join(shlex.quote(a) for a in role.argv))
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o755)

    def poll(self) -> list[Role]:
        """Reap exited roles, schedule restarts; returns roles that finished (a final exit code) this call."""
        finished = []
        now = self.clock()
        for role in self.roles.values():
            if role.proc is None:
                if role.restart_at is not None and now >= role.restart_at:
                    log.warning("restarting %s (restart %d; %d of %d crash(es) allowed within %g min)", role.name,
                                role.restarts, len(role.crashes), role.max_restarts, role.restart_window_s / 60)
                    self.start(role)
                continue
            rc = role.proc.poll()
            if rc is None:
                continue
            role.proc = None
            role.last_rc = rc
            if rc in role.final_codes:
                role.finished = True
                finished.append(role)
                continue
            if rc in role.standby_codes:
                role.standing_by = True
                continue
            if rc == EXIT_DISK_FULL:
                raise DiskFull(self.run, role)
            recent = role.crashed(now)
            if not role.restartable or recent > role.max_restarts:
                peers = [r for r in self.roles.values() if r.group and r.group == role.group and r is not role
                         and not r.abandoned]
                if not peers:
                    raise CrashLoop(role)
                role.abandoned = True  # the others carry the load; the client routes around this one
                log.error("%s keeps crashing (exit code %s); giving it up, %d other(s) of %s carry on (log: %s)",
                          role.name, rc, len(peers), role.group, role.log_path)
                continue
            role.restarts += 1
            # a role that ran a while before dying is not in a crash loop: restart it quickly
            backoff = 0.5 if now - role.started_at > 30 else min(10.0, 0.5 * 2 ** recent)
            role.restart_at = now + backoff
            log.warning("%s exited with code %s; restarting in %.1fs (log: %s)", role.name, rc, backoff, role.log_path)
        return finished

    def stop_all(self, grace_s: float = 5.0) -> None:
        self._signal_all(list(self.roles.values()), grace_s)

    def _signal_all(self, roles: list[Role], grace_s: float) -> None:
        live = [r for r in roles if r.proc is not None and r.proc.poll() is None]
        for r in live:
            _kill_group(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for r in live:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for r in roles:
            if r.proc is not None:
                _kill_group(r.proc.pid, signal.SIGKILL)  # the group may outlive its leader
                try:
                    r.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                r.proc = None
            r.restart_at = None


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
