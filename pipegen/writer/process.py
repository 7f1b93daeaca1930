"""The writer process (`python -m pipegen.writer output_dir=DIR`): its refusals, its one-off commands, and the one
job it runs, picked here and nowhere else.

- `output_dir=s3://...`: a store run's merge, from the store alone (publish.py's `merge_from_store`);
- `writer=ID` (a node runner's): modes.py's `NodeWriter`, its signals installed before anything else;
- cluster=ray with a store and no id: the head, store_head.py's `StoreHead`;
- else the launcher's writer, modes.py's `LauncherWriter` (alone or under the launcher).
Before the job: the config read (a damaged one refused in one line, also in the final stats line), the writer lock
taken (EXIT_LOCKED while another writer holds it), --convert-pickle-batches, the old-format and fingerprint
refusals, --rebuild.

Owns: the writer's command line and exit codes. Must never: commit, checkpoint or merge (commit.py and the modes
do), or be imported by them.
"""

from __future__ import annotations

import signal
import sys

from omegaconf import DictConfig

from pipegen.observe.logs import setup_logging, watch_parent
from pipegen.observe.stats import StatsAppender
from pipegen.run.batchfile import CONVERT_FLAG, legacy_format_message
from pipegen.run.config import load_run_config
from pipegen.run.diskfull import exit_disk_full, is_disk_full
from pipegen.run.fingerprint import check_fingerprint
from pipegen.run.handshake import EXIT_DAMAGED, EXIT_LOCKED, WRITER_IMPORTS, import_then_wait_for_manifest
from pipegen.run.integrity import DamagedFile
from pipegen.run.layout import RunDir, arg_value, output_dir_from_args
from pipegen.run.ownership import DirectoryLock, LockHeld
from pipegen.run.stats_line import WriterStats
from pipegen.run.store import is_store_url
from pipegen.writer.modes import LauncherWriter, NodeWriter
from pipegen.writer.publish import merge_from_store
from pipegen.writer.store_head import StoreHead


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    store_url = arg_value(argv, "output_dir") or ""
    if is_store_url(store_url):  # a store run's merge, from the store alone
        setup_logging("writer")
        return merge_from_store(store_url)
    run = RunDir(output_dir_from_args(argv))
    node_writer, mode = arg_value(argv, "writer"), None
    if node_writer is not None:
        mode = NodeWriter(node_writer)
        mode.listen()  # first thing: a signal's default action would kill the writer
    # Ctrl-C raises KeyboardInterrupt (answered below) even where SIGINT arrived ignored (a background job, nohup)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    setup_logging("writer")
    watch_parent()
    taken = take(run)
    if isinstance(taken, int):
        return taken
    cfg, lock = taken
    try:
        code = one_off(run, cfg, argv)
        if code is None:
            import_then_wait_for_manifest(run, WRITER_IMPORTS)  # verl first; the launcher may still read the dataset
            head = bool(cfg.storage.url) and str(cfg.cluster.kind) == "ray"  # its nodes' writers commit the run
            mode = mode or (StoreHead() if head else LauncherWriter())
            code = mode.work(cfg, run)
        return code
    except KeyboardInterrupt:  # Ctrl-C on a writer run by hand: one line, no traceback; nothing committed is lost
        print(f"pipegen.writer: stopped (Ctrl-C); {mode.committed() if mode else 0} unit(s) committed are safe; rerun "
              f"python -m pipegen.writer output_dir={run.root} (or the launch command) to continue", file=sys.stderr)
        return 130
    except DamagedFile as e:
        return refuse(run, e)
    except OSError as e:
        if is_disk_full(e):
            return exit_disk_full(run.root, "writer", "pipegen.writer")
        raise
    finally:
        lock.release()


def take(run: RunDir) -> tuple[DictConfig, DirectoryLock] | int:
    """The run's config and the writer lock, taken; or the exit code of a refusal (a damaged config, a held lock)."""
    try:
        cfg = load_run_config(run)
    except DamagedFile as e:
        return refuse(run, e)
    lock = DirectoryLock(run.writer_lock)
    try:
        lock.acquire()
    except LockHeld as e:
        print(f"pipegen.writer: {e}", file=sys.stderr)
        return EXIT_LOCKED
    return cfg, lock


def one_off(run: RunDir, cfg: DictConfig, argv: list[str]) -> int | None:
    """What the writer does instead of its job, holding the lock: --convert-pickle-batches, a refusal (an old
    format, another job's config), --rebuild. None: none of them, the job goes on."""
    if CONVERT_FLAG in argv:
        from pipegen.writer.convert import convert_pickle_batches

        count = convert_pickle_batches(run)
        print(f"pipegen.writer: converted {count} pickle batch file(s) of {run.root} to Arrow batch files; "
              f"continue the run as before (python -m pipegen.launch output_dir={run.root})")
        return 0
    legacy = run.legacy_batch_files()
    problem = legacy_format_message(run.root, legacy) if legacy else check_fingerprint(cfg, run)
    if problem:
        print(f"pipegen.writer: {problem}", file=sys.stderr)
        return 2
    if "--rebuild" in argv:
        from pipegen.writer.rebuild import rebuild

        print(rebuild(run, int(cfg.actor_rollout_ref.rollout.n)).summary(run))
        return 0
    return None


def refuse(run: RunDir, damage: DamagedFile) -> int:
    """One line for a damaged run-directory file, also in the writer's final stats line (the launcher
    closes with it); nothing on disk is touched."""
    print(f"pipegen.writer: error: {damage}", file=sys.stderr)
    try:
        StatsAppender(run.stats, WriterStats.ROLE).append(WriterStats(final=True, refused=str(damage)))
    except OSError:
        pass
    return EXIT_DAMAGED
