"""Per-process logging and the orphan guard.

Owns: the log format every role uses (timestamps, role name; stdout/stderr go to DIR/logs/<role>.log
because the launcher redirects them), and the orphan guard: exiting when the process that started us (the
launcher, or a node runner under cluster=ray) is gone.
Also reads the end of a role's log, so that an error names what the process said before it died.
Must never: write log files itself (the launcher owns where logs go, so a hand-restarted role logs to
the terminal that started it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

PARENT_ENV = "PIPEGEN_PARENT_PID"


def setup_logging(role: str, level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    # verl and transformers are chatty at INFO on import; keep their warnings only.
    for noisy in ("verl", "transformers", "datasets", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(HarmlessNoiseFilter())


# (logger, message start, argument that must be in the message) of third-party warnings that are
# known to be harmless in every pipegen process; each is dropped alone, every other warning stays.
HARMLESS = (
    # verl picks a device platform on import; pipegen's processes never run a model through verl
    # (servers do, on their own), so a CPU-only host is expected, not a problem
    ("verl.plugin.platform.platform_manager", "No supported accelerator detected", ""),
    ("verl.plugin.platform.platform_manager", "Platform '", "is registered but not available"),
    # a text model without a model-specific builder gets verl's generic one, which is what it needs
    ("verl.utils.tokenizer.continuous_token_wiring", "No model-specific Continuous Token builder", "back to default."),
)


class HarmlessNoiseFilter(logging.Filter):
    """Drops the exact third-party messages listed in HARMLESS (matched by logger and text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, start, contains in HARMLESS:
            if record.name == name and isinstance(record.msg, str) and record.msg.startswith(start):
                if contains in record.getMessage():
                    return False
        return True


def watch_parent(poll_s: float = 1.0) -> None:
    """Exit at once when the process that started this one (the launcher, a node runner) dies, even by SIGKILL.

    Only active when the parent set PIPEGEN_PARENT_PID (launch/supervise.py does, for every child); a role restarted by hand has no parent to
    watch. A role forked by the parent's forkserver (launch/forks.py) has the forkserver as its parent, which
    exits with the launcher; either way the role is orphaned, so its parent pid changes. Hand-written because
    the portable alternative (prctl PDEATHSIG) is Linux-only ctypes and fires on thread exit, not process exit.
    """
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    parent_pid, first_ppid = int(parent), os.getppid()

    def loop() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != first_ppid or (first_ppid != parent_pid and not _alive(parent_pid)):
                os._exit(3)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    # kill(0) alone, not run/ownership.pid_alive: that one also wants "pipegen" in the command line, and a node
    # runner under Ray carries Ray's process title ("ray::NodeRunner")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OncePerMessageFilter(logging.Filter):
    """Lets each distinct message of the selected loggers through once per process (bounded memory).

    verl logs some warnings per agent-loop instance, i.e. once per unit; one copy says it all."""

    def __init__(self, selects: Callable[[logging.LogRecord], bool], limit: int = 10000):
        super().__init__()
        self.selects = selects
        self.seen: set[tuple[str, str]] = set()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.selects(record):
            return True
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        if len(self.seen) < self.limit:
            self.seen.add(key)
        return True


def log_tail(path: Path | None, lines: int = 15) -> str:
    """The last lines of a role's log, indented for an error message ("" when there is no log yet)."""
    if path is None or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    return "\n".join("    " + t for t in text)


TAIL_BYTES = 65536  # a log's end is all an error quotes: a long-running role's log may be large


def _last_lines(path: Path | None, lines: int) -> list[str]:
    """The log's last `lines` lines, read from its last TAIL_BYTES only ([] without a log)."""
    if path is None or not Path(path).exists():
        return []
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
        return f.read().decode(errors="replace").splitlines()[-lines:]


def last_log_line(path: Path | None) -> str:
    """The log's last non-blank line, stripped ("" without a log): what a process said as it died."""
    return next((line.strip() for line in reversed(_last_lines(path, 50)) if line.strip()), "")


def log_tail(path: Path | None, lines: int = 15) -> str:
    """The last lines of a role's log, indented for an error message ("" when there is no log yet)."""
    return "\n".join("    " + t for t in _last_lines(path, lines))


def with_log_tail(message: str, log_path: Path | None) -> str:
    """message, then where the log is and how it ends: the reason is on the terminal, not only in the file."""
    tail = log_tail(log_path)
    if log_path is None:
        return message
    return f"{message}; its log ({log_path}) ends with:\n{tail}" if tail else f"{message}; its log: {log_path}"
