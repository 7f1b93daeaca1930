"""The launcher: `python -m pipegen.launch output_dir=DIR [overrides]`, read top to bottom in `main`.

the first look (launch/early.py: what the command line alone refuses, before the imports that take seconds) →
prepare (launch/prepare.py: every check and write before a process starts) → place (the run's placement
starts its servers and actors, the writer starts here, and the unit manifest is read meanwhile) → supervise
(wait for the run's end while the console shows it) → report (observe/console.py; its last line names the run
report, pipegen/report/). It exits 0 when DIR/trajectories.pkl is complete.

Owns: the life of every child process of a launch. Must never: generate, write streams or batches itself,
or leave a child running when it exits.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from typing import TYPE_CHECKING

from pipegen.config.invocation import remember
from pipegen.launch.early import first_refusal

if TYPE_CHECKING:
    from pipegen.launch.placement import Placement
    from pipegen.launch.run_writer import RunWriter
    from pipegen.observe.console import Console

log = logging.getLogger("pipegen.launch")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    problem = "" if "--help" in argv or "-h" in argv else first_refusal(argv)
    if problem:  # a typo is refused before the imports below (numpy, pydantic, the run's readers: seconds)
        print(f"pipegen: error: {problem}", file=sys.stderr)
        return 2
    remember()  # every child's messages name the command the user typed
    from pipegen.launch.forks import call_forked
    from pipegen.launch.prepare import prepare
    from pipegen.launch.run_writer import RunWriter
    from pipegen.launch.unit_manifest import build_manifest
    from pipegen.observe.console import Console, refuse, report
    from pipegen.report import end_of_run
    from pipegen.run.diskfull import disk_full_message, is_disk_full

    ready = prepare(argv)
    if isinstance(ready, int):
        return ready  # --help (0), or a one-line refusal (2)
    cfg, run, placement = ready.cfg, ready.run, ready.placement
    if ready.complete:
        return end_of_run(cfg, run, report(run, ready.n, 0, already_complete=True))
    writer = RunWriter(cfg, run) if cfg.generation.run_writer else None
    stop_on_signals()
    started, failure = time.monotonic(), None
    try:
        placement.place()  # servers first: they take longest (SGLang ~100 s); the actors import verl meanwhile
        if writer is not None:
            writer.start()  # it imports verl too, then waits for the manifest
        if not run.units_file.exists():
            log.info("reading the dataset %s", cfg.data.train_files)
            rows = call_forked(build_manifest, cfg, run, log_path=run.role_log("launch"))  # verl imported there
            log.info("%d prompts x %d samples = %d units", rows, ready.n, rows * ready.n)
        placement.begin()
        with Console(cfg, run, run.total_units(ready.n), ready.num_actors, tracked=writer is not None) as console:
            writer_rc = supervise(placement, writer, console)
    except KeyboardInterrupt:
        print("\npipegen: interrupted; stopping every process. Run the same command to resume.", file=sys.stderr)
        return 130
    except Exception as e:  # CrashLoop, ServerNotReady, ClusterError, DiskFull...: each says what failed and where
        failure = e
    finally:
        try:
            placement.stop()
        finally:
            if writer is not None:
                writer.stop()
    if failure is not None:  # the last line, after what the stop logged
        return refuse(disk_full_message(run.root, "launcher") if is_disk_full(failure) else str(failure))
    log.info("run took %.1fs", time.monotonic() - started)
    code = report(run, ready.n, writer_rc)
    return end_of_run(cfg, run, code) if writer_rc is not None else code  # the run report: the writer's node


def supervise(placement: Placement, writer: RunWriter | None, console: Console) -> int | None:
    """Wait for the launch to end, refreshing the console twice a second. Returns the writer's exit code
    (RunWriter.ended), or None when this launch runs no writer and its placement is done. Raises what stops
    the run: a role that keeps crashing, no server ever ready, every node failed, a full disk."""
    last = 0.0
    while True:
        placement.check()
        writer_rc = writer.ended() if writer is not None else None
        if time.monotonic() - last >= 0.5:
            console.refresh()
            last = time.monotonic()
        if writer_rc is not None:
            return writer_rc
        if writer is None and placement.done():
            return None
        time.sleep(0.2)


def stop_on_signals() -> None:
    """SIGTERM and SIGINT stop the launch as Ctrl-C does (every child is stopped; the run resumes later).
    Python leaves SIGINT ignored when it starts ignored (a shell's background job, nohup): a launcher sent
    SIGINT must still stop every child and say how to resume."""

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
