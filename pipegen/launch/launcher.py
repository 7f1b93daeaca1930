"""The launcher: `python -m pipegen.launch output_dir=DIR [overrides]`.

Resolves the config once (pipegen + verl groups) into DIR/conf/config.yaml, guards resumes with the
run fingerprint, writes the unit manifest, plans this node's servers and actors, starts and
supervises every role, shows the progress bar, and exits 0 when DIR/trajectories.pkl is complete.

Owns: the life of every child process of a run, and DIR/conf/.
Must never: generate, write streams or batches itself, or leave a child running when it exits.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from pipegen.launch.node_processes import NodeProcesses
from pipegen.launch.supervise import Role
from pipegen.observe.logs import setup_logging
from pipegen.run.checkpoint import failure_reason
from pipegen.launch.prepare import build_manifest, check_run_files, fail, prepare_run, print_help, resolve_inputs
from pipegen.run.config import check_types, compose, describe_config_error, resolved
from pipegen.run.diskfull import disk_full_message, is_disk_full
from pipegen.run.layout import BATCH_GLOB, LaunchRecord, RunDir, actor_role
from pipegen.run.ownership import DirectoryLock, lock_holder
from pipegen.run.handshake import EXIT_DAMAGED, EXIT_FAILED_UNITS, EXIT_LOCKED
from pipegen.run.stats_line import LaunchStats, WriterStats
from pipegen.run.verl_keys import translate as translate_verl_keys

log = logging.getLogger("pipegen.launch")


class Launcher(NodeProcesses):
    """This node's processes (NodeProcesses), plus what only the launcher does: the actors' and the writer's
    start, the run's supervision and progress, and the take-over of a writer started by hand."""

    def __init__(self, cfg: DictConfig, run: RunDir):
        super().__init__(cfg, run)
        self.n = int(cfg.actor_rollout_ref.rollout.n)
        self._outside_writer: int | None = None  # pid of a writer this launcher did not start
        self._outside_checked = 0.0
        self._startup_logged = False
        self._actors_started = 0
        self.cluster = None  # ray_cluster.RayCluster under cluster=ray: it leases the units to the nodes

    def log_startup(self, roles: dict, final: bool = False) -> None:
        """Once every actor has reported its first unit (or at the end, as far as it got): the launch's
        start-up phases, in one log line."""
        from pipegen.observe.startup import startup_phases

        if self._startup_logged:
            return
        phases = startup_phases(roles, self.launch_started)
        if phases is not None and (final or (phases.complete and phases.actors >= self._actors_started)):
            self._startup_logged = True
            log.info("start-up: %s", phases.render())

    def start_actors(self, plan) -> None:
        """Start this node's actors: they import verl while the servers load and the dataset is read."""
        world_actors = plan.num_actors * plan.node.world_size
        self._actors_started = plan.num_actors
        for k in range(plan.num_actors):
            rank = plan.node.rank * plan.num_actors + k
            self.sup.start(self.role(actor_role(rank), [sys.executable, "-m", "pipegen.actor",
                                                        f"output_dir={self.run.root}", f"rank={rank}",
                                                        f"num_actors={world_actors}"]))

    def start_writer(self, plan) -> Role | None:
        """Start the writer (rank 0 only): it imports verl, then waits for the unit manifest."""
        if not (plan.runs_writer and self.cfg.generation.run_writer):
            return None
        writer = self.role("writer", [sys.executable, "-m", "pipegen.writer", f"output_dir={self.run.root}"])
        writer.final_codes = frozenset({0, EXIT_FAILED_UNITS, EXIT_DAMAGED})
        writer.standby_codes = frozenset({EXIT_LOCKED})  # a writer started by hand owns the directory
        self.sup.start(writer)
        return writer

    def supervise(self, writer: Role | None, total: int) -> int:
        """Wait for the run to end while showing it: the progress bar (off with
        generation.show_progress=false), every role's warnings and errors above it, and the run's
        metrics through RunTracker (on the writer's node only, so a multi-node run tracks once)."""
        from contextlib import ExitStack

        from pipegen.observe.progress import LogWatcher, ProgressBar, snapshot
        from pipegen.observe.tracking import RunTracker

        watcher = LogWatcher(self.run.logs)
        tracker = RunTracker(self.cfg, self.run) if writer is not None else None
        snap = snapshot(self.run, self.n, total)
        bar = ProgressBar(total, initial=snap.committed) if self.cfg.generation.show_progress else None

        def refresh(force: bool = False) -> None:
            nonlocal snap
            for line in watcher.poll():  # warnings/errors of the roles reach this console
                if bar is not None:
                    bar.write(line)
                else:
                    print(line, file=sys.stderr, flush=True)
            snap = snapshot(self.run, self.n, total)
            self.log_startup(snap.roles, final=force)
            if tracker is not None:
                tracker.update(snap, force=force)
            if bar is not None:
                bar.show(snap)

        exit_code = 1
        with ExitStack() as stack:
            if bar is not None:
                from tqdm.contrib.logging import logging_redirect_tqdm

                stack.enter_context(logging_redirect_tqdm())  # the launcher's own log lines go above the bar
            try:
                last = 0.0
                while True:
                    finished = self.sup.poll()
                    self.check_servers()
                    if self.cluster is not None:
                        self.cluster.check()
                    if time.monotonic() - last >= 0.5:
                        refresh()
                        last = time.monotonic()
                    if writer is not None and writer in finished:
                        break
                    if writer is not None and writer.standing_by and self.outside_writer_done(writer, total):
                        break
                    if writer is None and (self.cluster.done() if self.cluster is not None else all(
                            r.finished for name, r in self.sup.roles.items() if name.startswith("actor_"))):
                        break
                    time.sleep(0.2)
                exit_code = 0
            finally:
                try:
                    refresh(force=True)
                except Exception as e:  # showing the end state must not hide why the loop ended
                    log.warning("final progress refresh failed: %s", e)
                if bar is not None:
                    bar.close()
                if tracker is not None:
                    tracker.finish(exit_code=exit_code)
        return 0

    def outside_writer_done(self, writer: Role, total: int) -> bool:
        """Our writer stood by because another writer (started by hand) holds the directory: that one
        is the run's writer while it lives. True once it has completed the run; if it exits before
        that, our writer starts again (not a crash: nothing failed)."""
        from pipegen.run.checkpoint import load_checkpoint

        if time.monotonic() - self._outside_checked < 1.0:
            return False
        self._outside_checked = time.monotonic()
        holder = lock_holder(self.run.writer_lock)
        if holder is not None:
            if holder != self._outside_writer:
                self._outside_writer = holder
                log.info("the writer of this run is pid %d, started outside the launcher: following it; the "
                         "launcher's writer takes over if it exits before the run is complete", holder)
            return False
        ckpt = load_checkpoint(self.run.checkpoint)
        if ckpt.complete and ckpt.num_committed >= total:
            log.info("the writer pid %s completed the run", self._outside_writer)
            return True
        log.info("the writer pid %s is gone before the run is complete; the launcher's writer takes over",
                 self._outside_writer)
        self._outside_writer = None
        self.sup.start(writer)
        return False

def refuse_node_variables(cfg: DictConfig) -> None:
    """torchrun/Slurm node variables without cluster=ray are refused (ValueError, one line): nodes launched
    that way would share one launch record and split the units statically, so a lost node's units
    would wait for its relaunch."""
    import os

    from pipegen.launch.world import node_info

    node = node_info(os.environ)
    if node.world_size > 1 and cfg.cluster.kind != "ray":
        raise ValueError(f"this environment says node {node.rank} of {node.world_size} (WORLD_SIZE/RANK or "
                         f"SLURM_NNODES): several nodes run through a Ray cluster, started once on the head with "
                         f"cluster=ray (README: Several nodes); unset those variables to run on this node alone")


def one_launcher(run: RunDir) -> DirectoryLock:
    """The launcher lock of `run` (ValueError naming the first launcher, pid and host, when it is held)."""
    from pipegen.run.ownership import LockHeld

    run.root.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(run.launcher_lock, role="launcher", name_host=True)
    try:
        lock.acquire()
    except LockHeld as e:
        raise ValueError(str(e)) from None
    return lock


def stop_all(launcher: Launcher) -> None:
    if launcher.cluster is not None:
        launcher.cluster.stop()
    launcher.stop()


def report(run: RunDir, n: int) -> int:
    """The closing summary: where the data is, or which units failed and why. 0 when complete."""
    from pipegen.observe.job import job_lines
    from pipegen.observe.outcomes import unit_outcomes
    from pipegen.observe.progress import snapshot
    from pipegen.observe.stats import human_rate
    from pipegen.observe.tracking import ELAPSED_S, LAUNCH_UNITS_PER_S

    snap = snapshot(run, n)
    launch = snap.roles.get(LaunchStats.ROLE)
    metrics = launch.metrics if isinstance(launch, LaunchStats) else {}
    if snap.complete:
        tokens = f", {snap.output_tokens} output tokens" if snap.output_tokens else ""
        took = ""
        if metrics.get(ELAPSED_S) and metrics.get(LAUNCH_UNITS_PER_S) is not None:
            took = (f" (this launch: {metrics[ELAPSED_S]:.1f}s, "
                    f"{human_rate(metrics[LAUNCH_UNITS_PER_S], 'samples')})")
        print(f"pipegen: done: {snap.committed} samples{tokens}.{took}")
        outcomes = unit_outcomes(run)
        scores = outcomes.rewards if outcomes is not None else None
        if scores is not None:
            print(f"  rewards:      mean {scores.mean_reward:.3f} over {scores.scored} samples; pass@{n} "
                  f"{scores.pass_at_n:.2f} ({scores.passed} of {scores.prompts} prompts have a sample scoring > 0)")
        for line in job_lines(run, outcomes):  # prompts skipped, responses that reached the limit
            print(line)
        if snap.merged:
            print(f"  trajectories: {run.merged_output() or run.trajectories}")
            print(f"  artifact:     {run.artifact}")
        else:
            print(f"  batches:      {run.root / BATCH_GLOB} (generation.final_merge=false)")
        print(f"  logs:         {run.logs}/   streams: {run.streams}/")
        return 0
    print(f"pipegen: {snap.failed} unit(s) failed, {snap.committed}/{snap.total} committed. "
          f"Reasons: {run.checkpoint} ('failed'); rerun the same command to retry them.", file=sys.stderr)
    for unit, info in list(snap.failed_units.items())[:10]:
        print(f"  unit {unit}: {failure_reason(info)}", file=sys.stderr)
    print(f"  logs: {run.logs}/   details: python -m pipegen.status {run.root}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print_help(argv)
        return 0
    setup_logging("launch")
    if not any(a.startswith("output_dir=") for a in argv):
        return fail("missing output_dir=DIR (where the run's files go); see --help")
    try:
        argv = translate_verl_keys(argv)  # verl's own keys: pipegen's equivalents set, or refused in one line
        cfg = compose(argv)
    except ValueError as e:
        return fail(str(e))
    except Exception as e:  # Hydra's override errors are long: one line naming the key and the fix
        return fail(describe_config_error(e, argv))
    try:
        check_types(cfg)  # every key, output_dir first among them, before any path is resolved or written
    except ValueError as e:
        return fail(str(e))
    except OmegaConfBaseException as e:  # an interpolation that cannot resolve
        return fail(describe_config_error(e, argv))
    run = RunDir(Path(cfg.output_dir).expanduser().resolve())
    if run.root.exists() and not run.root.is_dir():
        return fail(f"output_dir={run.root} is a file; output_dir names a directory (new or a run's): pick another path")
    with open_dict(cfg):
        cfg.output_dir = str(run.root)
    try:
        refuse_node_variables(cfg)
        resolve_inputs(cfg)
        cfg = resolved(cfg)
    except (ValueError, RuntimeError) as e:
        return fail(str(e))
    except OmegaConfBaseException as e:  # a missing mandatory value (llm.urls), an interpolation
        return fail(describe_config_error(e, argv))
    try:
        from pipegen.observe.job import plan_line

        print(plan_line(cfg, run), flush=True)  # the launch's first line: what will run
    except (OSError, ValueError):  # an unreadable data file: check_files below names it and the fix
        pass
    try:
        # held until this process exits (the kernel releases it even on SIGKILL)
        launcher_lock = one_launcher(run)  # noqa: F841
    except ValueError as e:
        return fail(str(e))
    problem = prepare_run(cfg, run) or check_run_files(run)
    if problem:
        return fail(problem)
    root_logger = logging.getLogger()
    file_handler = logging.FileHandler(run.role_log("launch"))
    file_handler.setFormatter(root_logger.handlers[0].formatter)
    root_logger.addHandler(file_handler)
    from pipegen.run.checkpoint import load_checkpoint

    ckpt = load_checkpoint(run.checkpoint)
    n = int(cfg.actor_rollout_ref.rollout.n)
    if cfg.llm.kind == "external":  # before the dataset: reading a big one takes minutes
        from pipegen.launch.servers import ServerNotReady, check_reachable

        try:
            for url in cfg.llm.urls or []:
                check_reachable(str(url).rstrip("/"))
        except ServerNotReady as e:
            return fail(str(e))
    if not run.units_file.exists():
        from pipegen.inputs.dataset import check_files

        try:
            check_files(cfg)  # the parquet footers: seconds, before any process starts
        except ValueError as e:
            return fail(str(e))
    if (run.units_file.exists() and ckpt.complete and not ckpt.failed
            and (run.merged_output() is not None) == bool(cfg.generation.final_merge)):
        print(f"pipegen: {run.root} is already complete.")
        return report(run, n)

    from pipegen.launch.world import NodeInfo, PlanError, WorldPlan, current_plan

    try:
        # cluster=ray: the head runs the writer only; each node runner plans its own node
        plan = (WorldPlan(NodeInfo(), num_actors=0) if cfg.cluster.kind == "ray" else
                current_plan(OmegaConf.to_container(cfg.llm, resolve=True), cfg.actors.num_actors))
    except PlanError as e:
        return fail(str(e))
    launch_id = uuid.uuid4().hex
    run.write_launch(LaunchRecord(launch=launch_id, run_key=run.run_key(), servers=plan.urls,
                                  num_actors=plan.num_actors * plan.node.world_size))
    launcher = Launcher(cfg, run)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # Python leaves SIGINT ignored when it starts ignored (a shell's background job, nohup): a launcher
    # sent SIGINT must still stop every child and say how to resume.
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    try:
        if cfg.cluster.kind == "ray":
            from pipegen.launch.ray_cluster import RayCluster

            launcher.cluster = RayCluster(cfg, run, launch_id)
            launcher.cluster.connect()
            launcher.cluster.place()  # the runners start their nodes' servers and actors meanwhile
        else:
            # Servers first: they take longest (SGLang ~100 s). Then the actors and the writer, which import
            # verl (~6-17 s) while the servers load and the dataset is read here, then wait for the manifest.
            launcher.start_servers(plan)
            launcher.start_actors(plan)
        writer = launcher.start_writer(plan)
        if not run.units_file.exists():
            log.info("reading the dataset %s", cfg.data.train_files)
            rows = build_manifest(cfg, run)
            log.info("%d prompts x %d samples = %d units", rows, n, rows * n)
        if launcher.cluster is not None:
            launcher.cluster.start()
        launcher.supervise(writer, run.total_units(n))
    except KeyboardInterrupt:
        print("\npipegen: interrupted; stopping every process. Run the same command to resume.", file=sys.stderr)
        stop_all(launcher)
        return 130
    except Exception as e:  # CrashLoop, ServerNotReady, ClusterError, DiskFull...: each says what failed and where
        stop_all(launcher)
        return fail(disk_full_message(run.root, "launcher") if is_disk_full(e) else str(e))
    stop_all(launcher)
    log.info("run took %.1fs", time.monotonic() - started)
    if writer is not None and writer.last_rc == EXIT_DAMAGED:
        from pipegen.observe.stats import latest_stats

        writer_line = latest_stats(run.stats).get(WriterStats.ROLE)
        refusal = writer_line.refused if isinstance(writer_line, WriterStats) else None
        return fail(refusal or f"the writer refused a damaged file; see {writer.log_path}")
    if not (plan.runs_writer and cfg.generation.run_writer):
        print(f"pipegen: this node's actors finished; the writer of {run.root} commits and merges "
              f"(python -m pipegen.writer output_dir={run.root}).")
        return 0
    return report(run, n)
