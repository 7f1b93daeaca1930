"""Per-process logging and the orphan guard.

Owns: the log format every role uses (timestamps, role name; stdout/stderr go to DIR/logs/<role>.log
because the launcher redirects them), and exiting when the launcher that started us is gone.
Must never: write log files itself (the launcher owns where logs go, so a hand-restarted role logs to
the terminal that started it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
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
    # "No supported accelerator detected" on every CPU-only import of verl: expected, not a warning here
    logging.getLogger("verl.plugin.platform").setLevel(logging.ERROR)


def watch_parent(poll_s: float = 1.0) -> None:
    """Exit at once when the launcher that started this process dies (even by SIGKILL).

    Only active when the launcher set PIPEGEN_PARENT_PID; a role restarted by hand has no parent to
    watch. Hand-written because the portable alternative (prctl PDEATHSIG) is Linux-only ctypes and
    fires on thread exit, not process exit.
    """
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    parent_pid = int(parent)

    def loop() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


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
