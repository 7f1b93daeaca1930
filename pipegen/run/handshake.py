"""How roles meet at the edges of their lives: the wait for the unit manifest at start, the exit codes at end.

Owns: the exit codes a role returns that another role acts on (the launcher reads the writer's), the signals a node
runner sends its writer, and the
start-up wait every role does for `conf/units.json`, which the launcher writes once it has read the dataset.
Must never: import verl or torch itself (a role names the modules it wants imported before the wait), or
write into the run directory.
"""

from __future__ import annotations

import importlib
import logging
import signal
import time

from pipegen.run.layout import RunDir

log = logging.getLogger("pipegen.run")

EXIT_LOCKED = 3  # the writer found another writer holding the directory: it stands by
EXIT_FAILED_UNITS = 4  # settled, but some units failed in this launch: a restart would not change that
EXIT_DAMAGED = 5  # the writer found a run-directory file damaged: refused with one line, a restart would too
EXIT_DISK_FULL = 6  # a role could not write for lack of space (run/diskfull.py): the launcher stops the run

# cluster=ray with a store: what a node runner asks of its node's writer (`python -m pipegen.writer ... writer=ID`)
FLUSH_SIGNAL = signal.SIGUSR1  # commit what the node's shards hold now (a partial batch too) and publish it
FINISH_SIGNAL = signal.SIGUSR2  # the same, then exit 0 once every commit of it is in the store

# What each role imports before its work starts: nearly all of its start-up (verl's agent loop pulls in torch,
# tensordict, transformers and ray: ~6 s of CPU). A role imports its list while the launcher reads the dataset;
# a launcher's forkserver (launch/forks.py) imports them all once, and the roles it forks start with them loaded.
ACTOR_IMPORTS = ("transformers", "verl.experimental.agent_loop.agent_loop", "verl.tools.tool_registry",
                 "verl.utils.dataset.rl_dataset", "pipegen.actor.worker")
WRITER_IMPORTS = ("transformers", "verl.protocol", "verl.utils", "pipegen.writer.commit")

MANIFEST_WAIT_S = 1800.0  # as long as the slowest dataset read a launcher may do; a hand-started role gets a clear exit


def import_then_wait_for_manifest(run: RunDir, modules: tuple[str, ...],
                                  timeout_s: float = MANIFEST_WAIT_S) -> None:
    """Import `modules` (what the process needs: the slow part of its start-up), then wait until the
    launcher has written the unit manifest: it reads the dataset meanwhile, so the two overlap."""
    for module in modules:
        importlib.import_module(module)
    started = time.monotonic()
    if not run.units_file.exists():
        log.info("imports done; waiting for the launcher to write %s", run.units_file)
    while not run.units_file.exists():
        if time.monotonic() - started > timeout_s:
            raise SystemExit(f"no unit manifest {run.units_file} after {timeout_s:.0f}s; it is written by "
                             f"python -m pipegen.launch output_dir={run.root}, which starts actors and writer")
        time.sleep(0.05)
