"""The run's writer as the launcher runs it, beside every placement, on the launcher's node.

Under cluster=ray with a store, each node runner runs one too, for its node (`node_writer`).
It starts once the actors are starting (it imports verl, then waits for the unit manifest), is restarted
after a crash like any role, and stands by (exit code EXIT_LOCKED) while a writer started by hand holds the
directory: that one is the run's writer while it lives. If it exits before the run is complete, this
writer takes over (not a crash: nothing failed).

Owns: the writer process of a launch. Must never: commit or merge anything itself, or start a second writer
while another one holds the directory.
"""

from __future__ import annotations

import logging
import sys
import time

from omegaconf import DictConfig

from pipegen.launch.node_processes import NodeProcesses
from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.handshake import EXIT_DAMAGED, EXIT_FAILED_UNITS, EXIT_LOCKED
from pipegen.run.layout import RunDir
from pipegen.run.ownership import lock_holder
from pipegen.run.stats_line import WriterStats

log = logging.getLogger("pipegen.launch")


class RunWriter:
    def __init__(self, cfg: DictConfig, run: RunDir, node_writer: str | None = None):
        """`node_writer`: cluster=ray with a store, a node runner's writer, publishing as that id."""
        self.run = run
        self.n = int(cfg.actor_rollout_ref.rollout.n)
        self.processes = NodeProcesses(cfg, run)
        self.role = self.processes.role(WriterStats.ROLE, [sys.executable, "-m", "pipegen.writer",
                                                           f"output_dir={run.root}"]
                                        + ([f"writer={node_writer}"] if node_writer else []))
        self.role.final_codes = frozenset({0, EXIT_FAILED_UNITS, EXIT_DAMAGED})
        self.role.standby_codes = frozenset({EXIT_LOCKED})  # a writer started by hand owns the directory
        self._outside: int | None = None  # pid of a writer this launcher did not start
        self._outside_checked = 0.0

    def start(self) -> None:
        self.processes.sup.start(self.role)

    def ended(self) -> int | None:
        """The run's writer is done: its exit code (0: the run is complete; EXIT_FAILED_UNITS: every unit is
        settled and some failed; EXIT_DAMAGED: it refused a damaged file), 0 when a writer started by hand
        completed the run; None while it runs. Raises when it crashes too often (CrashLoop, DiskFull)."""
        if self.role in self.processes.sup.poll():
            return self.role.last_rc
        if self.role.standing_by and self._outside_completed():
            return 0
        return None

    def _outside_completed(self) -> bool:
        """True once the writer that holds the directory has completed the run; if it exits before that, this
        launch's writer starts again."""
        if time.monotonic() - self._outside_checked < 1.0:
            return False
        self._outside_checked = time.monotonic()
        holder = lock_holder(self.run.writer_lock)
        if holder is not None:
            if holder != self._outside:
                self._outside = holder
                log.info("the writer of this run is pid %d, started outside the launcher: following it; the "
                         "launcher's writer takes over if it exits before the run is complete", holder)
            return False
        ckpt = load_checkpoint(self.run.checkpoint)
        if ckpt.complete and ckpt.num_committed >= self.run.total_units(self.n):
            log.info("the writer pid %s completed the run", self._outside)
            return True
        log.info("the writer pid %s is gone before the run is complete; the launcher's writer takes over",
                 self._outside)
        self._outside = None
        self.start()
        return False

    def stop(self) -> None:
        self.processes.stop()
