"""The launcher's console: its refusals, what it shows while a run goes, and the closing report.

- `refuse(message)`: one line on stderr, `pipegen: error: ...`, and exit code 2.
- `Console`: while the run goes, every role's warnings and errors above the progress bar (off with
  generation.show_progress=false: then a progress line in pipegen's words every generation.tracking_interval_s
  instead), the start-up line once every actor of this launch has its first unit in a shard, and the run's
  metrics through RunTracker (on the writer's node only, so a multi-node run tracks once; what verl's Tracking
  prints goes to DIR/logs/launch.log).
- `report(run, n, writer_rc)`: where the data is, which units failed and why, or what the writer refused.

Owns: what the launcher prints. Must never: change the run it shows, or decide when the run ends (the
launcher does; the console only shows it).
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import ExitStack

from omegaconf import DictConfig
from tqdm.contrib.logging import logging_redirect_tqdm

from pipegen.observe.summary import job_lines
from pipegen.observe.outcomes import Outcomes, committed_outcomes, committed_rewards, unit_outcomes
from pipegen.run.medium import ROLLOUTS, open_medium
from pipegen.observe.progress import DurableShards, LogWatcher, ProgressBar, Snapshot, snapshot
from pipegen.observe.startup import startup_phases
from pipegen.observe.stats import (across_processes, actor_lines, aggregate, human_rate, latest_stats, stats_history,
                                   tail_metrics, tail_text)
from pipegen.observe.tracking import ELAPSED_S, GPU_BUSY, RunTracker
from pipegen.run.checkpoint import failure_summary, load_checkpoint
from pipegen.run.config import load_run_config
from pipegen.run.handshake import EXIT_DAMAGED
from pipegen.run.layout import BATCH_GLOB, RunDir
from pipegen.run.provenance import harness_named
from pipegen.config.invocation import command
from pipegen.config.schema import RewardSpec, uses_external_loop
from pipegen.run.stats_line import ClusterStats, LaunchStats, WriterStats

log = logging.getLogger("pipegen.launch")


def refuse(message: str) -> int:
    print(f"pipegen: error: {message}", file=sys.stderr)
    return 2


class Console:
    """The run as the launcher shows it; `with Console(...) as console:` around the supervision, which calls
    `refresh()`. Leaving the block shows the end state once more, closes the bar and finishes the tracking."""

    def __init__(self, cfg: DictConfig, run: RunDir, total: int, actors: int, tracked: bool):
        self.run = run
        self.n = int(cfg.actor_rollout_ref.rollout.n)
        self.total = total
        self.actors = actors  # actors this launcher started itself: the start-up line waits for each
        self.launch_started = run.read_launch().started  # the origin of every start-up phase
        self.watcher = LogWatcher(run.logs)
        self.tracker = RunTracker(cfg, run) if tracked else None
        self.shards = DurableShards(run, self.n)  # the units in the shards, read incrementally at each refresh
        self.snap = snapshot(run, self.n, total, self.shards)
        # a resumed bar starts at what is durable: committed, and finished in the shards (snapshot counts both)
        self.bar = ProgressBar(total, initial=self.snap.done) if cfg.generation.show_progress else None
        self.line_every_s = float(cfg.generation.tracking_interval_s)  # without the bar: a progress line this often
        self._last_line: tuple[float, str] | None = None  # when, and what, the last progress line said
        self._startup_logged = False
        self._stack = ExitStack()

    def __enter__(self) -> "Console":
        if self.bar is not None:
            self._stack.enter_context(logging_redirect_tqdm())  # the launcher's own log lines go above the bar
        return self

    def refresh(self, final: bool = False) -> None:
        for line in self.watcher.poll():  # warnings/errors of the roles reach this console
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, file=sys.stderr, flush=True)
        self.snap = snapshot(self.run, self.n, self.total, self.shards)
        self.log_startup(final)
        if self.tracker is not None:
            self.tracker.update(self.snap, force=final)
        if self.bar is not None:
            self.bar.show(self.snap)
        else:
            self.log_progress(final)

    def log_progress(self, final: bool) -> None:
        """Without the bar: what it would show, as a log line, at the start, every line_every_s and at the end
        (unless the last line said the same)."""
        now = time.monotonic()
        text = f"{self.snap.done}/{self.snap.total} samples on disk ({self.snap.committed} committed) | " \
               f"{self.snap.postfix()}"
        last = self._last_line
        if last is None or (text != last[1] and (final or now - last[0] >= self.line_every_s)):
            self._last_line = (now, text)
            log.info("%s", text)

    def log_startup(self, final: bool) -> None:
        """Once every actor has reported its first unit (or at the end, as far as it got): the launch's
        start-up phases, in one log line."""
        if self._startup_logged:
            return
        phases = startup_phases(self.snap.roles, self.launch_started)
        if phases is not None and (final or (phases.complete and phases.actors >= self.actors)):
            self._startup_logged = True
            log.info("start-up: %s", phases.render())

    def __exit__(self, exc_type, exc, tb) -> None:
        with self._stack:
            try:
                self.refresh(final=True)
            except Exception as e:  # showing the end state must not hide why the run ended
                log.warning("final progress refresh failed: %s", e)
            if self.bar is not None:
                self.bar.close()
            if self.tracker is not None:
                self.tracker.finish(exit_code=0 if exc_type is None else 1)


def is_store_run(cfg: DictConfig) -> bool:
    return bool(cfg.storage.url)


def run_counts(run: RunDir, snap: Snapshot, metrics: dict, generated: bool = True) -> str:
    """The closing line's counts after "N samples": trajectories and output tokens over the whole run (every
    launch's processes), then what this launch generated and how fast (`generated=False`: a launch that found the
    run complete and generated nothing; the stats then are an earlier launch's)."""
    history = stats_history(run.stats)
    whole = aggregate(across_processes(history))
    ckpt = load_checkpoint(run.checkpoint)
    completed, tokens = int(snap.metrics.get("actors/completed", 0)), snap.output_tokens
    run_tokens, counted_by, tokens_of = int(whole.get("actors/output_tokens", 0)), "", ""
    cluster = [line for line in history.get(ClusterStats.ROLE, []) if isinstance(line, ClusterStats)]
    if not whole.get("actors/total") and any(line.final for line in cluster):
        # a cluster with a store: the actors' stats stay on their nodes, and each runner's stop returned its counts
        run_tokens = sum(node_totals(line)[1] for line in cluster if line.final)
        completed, tokens = node_totals(cluster[-1]) if cluster[-1].final else (0, 0)  # this launch's last line
        counted_by = " (as each node's runner counted its actors when it stopped)"
        head = [line for line in history.get(WriterStats.ROLE, []) if isinstance(line, WriterStats)]
        if head and head[-1].committed is not None and head[-1].committed_before is not None:
            # what the store holds now that it did not at this launch's start: a lost node's commits are there,
            # though its runner's counts went with it
            committed = head[-1].committed - head[-1].committed_before
            if committed > completed:
                tokens_of = " (a lost node's output tokens are not counted)"
            completed = committed
    text = f" ({ckpt.batches.rows} trajectories), {run_tokens} output tokens{counted_by}"
    if not generated:
        return f"{text}; this launch generated nothing (the run was complete)."
    this = f"; this launch: {completed} samples, {tokens} output tokens{tokens_of}"
    elapsed = metrics.get(ELAPSED_S)
    if elapsed:
        # the rates of the counts this line shows, over the time it shows (the tracker's launch averages count
        # from its first look at the run, which a resumed or fast run had already passed)
        rates = [human_rate(completed / elapsed, "samples")]
        if tokens:
            rates.append(human_rate(tokens / elapsed, "output tok"))
        if metrics.get(GPU_BUSY) is not None:  # idle GPUs show here
            rates.append(f"GPUs {metrics[GPU_BUSY]:.0f}% busy while generating")
        this += f" in {metrics[ELAPSED_S]:.1f}s ({', '.join(rates)})"
    return f"{text}{this}."


def trajectories_where(run: RunDir, cfg: DictConfig) -> str:
    """Where the merged output is: a store run's in its store (with this node's copy), else the run directory's."""
    local = run.merged_output() or run.trajectories
    url = cfg.storage.url
    if not url:
        return str(local)
    from pipegen.transport.store_read import store_output

    return f"{store_output(str(url), run)} (this node's copy: {local})"


def in_store(run: RunDir, cfg: DictConfig, path) -> str:
    """A run file as the user finds it: its object in the store on a store run (storage.url), else its path."""
    url = cfg.storage.url
    if not url:
        return str(path)
    from pipegen.run.store import output_key

    return f"{str(url).rstrip('/')}/{output_key(path.relative_to(run.root))}"


def streams_where(run: RunDir, cfg: DictConfig) -> str:
    """The logs line's streams: the folder, or the Redis stream; with a cluster and a store each node's own stream,
    which the head's folder does not name (each node's scratch folder names its own in conf/streams.json)."""
    medium = open_medium(run, cfg)
    if medium.kind == "files":
        return f"{run.streams}/"
    if cfg.cluster.kind == "ray" and cfg.storage.url:
        kept = ("named in that node's scratch folder's conf/streams.json" if cfg.generation.keep_streams else
                "each deleted by its writer once its commits were in the store (generation.keep_streams=false)")
        return f"{run.streams}/ (stats); each node's own Redis stream at {cfg.streams.redis_url}, {kept}"
    return f"{run.streams}/ (stats), {medium.where(ROLLOUTS)}"


def failed_what(run: RunDir, cfg: DictConfig, failed: dict) -> str:
    """What failed and what to do, in words: units whose generation failed are retried by the same command, each
    with a fresh seed; units generated but not scored keep their samples, which a rescore scores without generating
    (rerunning is no fix for them: it generates nothing, and a changed reward is refused pointing to the rescore).
    Each told apart by its reason (run/stream.py's NOT_SCORED)."""
    from pipegen.run.checkpoint import failure_reason
    from pipegen.run.stream import is_not_scored

    unscored = sum(1 for info in failed.values() if is_not_scored(failure_reason(info)))
    generation = len(failed) - unscored
    parts = []
    if generation:
        parts.append(f"{generation} unit(s) failed to generate: rerun the same command to retry only them (each "
                     f"with a fresh seed)")
    if unscored:
        parts.append(f"{unscored} unit(s) generated but not scored (the reward raised or gave no score; their samples "
                     f"are kept): fix the reward, then {command('rescore')} {run.root} scores them without "
                     f"generating")
    return "; ".join(parts) + f". Listed in {in_store(run, cfg, run.failed_units)}."


def unscored_line(run: RunDir, cfg: DictConfig, outcomes: Outcomes | None) -> str:
    """The closing summary's warning when trajectories have no score ('' when every one has, or when the outcomes
    could not be read): how many, and how to score them."""
    if outcomes is None:
        return ""
    rows = load_checkpoint(run.checkpoint).batches.rows
    scored = outcomes.rewards.scored if outcomes.rewards is not None else 0
    if not rows or scored >= rows:
        return ""
    if not cfg.actors.scoring:
        return ""
    why = ("rows verl's default_compute_score cannot score: no data_source it knows, or no "
           "reward_model.ground_truth" if not (cfg.reward.verifier_url or cfg.custom_reward_function.path or cfg.tasks)
           else "the reward gave no score")
    return (f"  warning:      {rows - scored} of {rows} trajectories have no score ({why}); set "
            f"custom_reward_function.path=my_reward.py or reward.verifier_url=URL, then {command('rescore')} "
            f"{run.root} scores them without generating")


def node_totals(line: ClusterStats) -> tuple[int, int]:
    """Units completed and output tokens of one launch's node runners, as their stops returned them (a runner lost
    or stopped uncleanly counts nothing: its actors' stats went with it)."""
    nodes = line.nodes.values()
    return sum(n.completed or 0 for n in nodes), sum(n.output_tokens or 0 for n in nodes)


def reward_name(cfg: DictConfig) -> str:
    """Which reward scored the run, as the closing summary names it: a harness's own where it returns one
    (actor/rollout.py scores only what it leaves unscored), then rewards/spec.py's order."""
    if cfg.reward.verifier_url:
        run_reward = RewardSpec(url=str(cfg.reward.verifier_url)).describe()
    elif cfg.custom_reward_function.path:
        run_reward = RewardSpec(str(cfg.custom_reward_function.path), str(cfg.custom_reward_function.name)).describe()
    elif cfg.tasks:
        run_reward = "each task's own, by data_source (tasks=[...])"
    else:
        run_reward = "verl's default_compute_score by data_source (rows without one, or a code data_source, stay " \
                     "unscored)"
    if not uses_external_loop(cfg):
        return run_reward
    return f"what {harness_named(cfg)} returns; for a unit it returns no reward for, {run_reward}"


def report(run: RunDir, n: int, writer_rc: int | None, already_complete: bool = False) -> int:
    """The closing report of a launch whose writer exited with `writer_rc` (None: this launch ran no writer).
    Returns the launch's exit code: 0 when the run is complete (or this node's part of it is done), 1 when
    units failed, 2 when the writer refused a damaged file."""
    if already_complete:
        print(f"pipegen: {run.root} is already complete.")
    if writer_rc == EXIT_DAMAGED:
        writer_line = latest_stats(run.stats).get(WriterStats.ROLE)
        refusal = writer_line.refused if isinstance(writer_line, WriterStats) else None
        return refuse(refusal or f"the writer refused a damaged file; see {run.role_log(WriterStats.ROLE)}")
    if writer_rc is None:
        print(f"pipegen: this node's actors finished; the writer of {run.root} commits and merges "
              f"(python -m pipegen.writer output_dir={run.root}).")
        return 0
    cfg = load_run_config(run)  # once: every line below reads it (a load is ~50 ms of CPU)
    snap = snapshot(run, n)
    launch = snap.roles.get(LaunchStats.ROLE)
    metrics = launch.metrics if isinstance(launch, LaunchStats) else {}
    if snap.complete:
        print(f"pipegen: done: {snap.committed} samples{run_counts(run, snap, metrics, not already_complete)}")
        print(f"  reward:       {reward_name(cfg)}")
        # a store run's lines stay on its nodes: its rows, as the store committed them, say what they scored
        outcomes = committed_outcomes(run, cfg) if is_store_run(cfg) else unit_outcomes(run, cfg)
        scores = outcomes.rewards if outcomes is not None else None
        if run.role_log("rescore").exists():  # rescored (logs/rescore.log): the batch files hold the rewards, the
            # streams the rewards at generation
            scores = committed_rewards(run)
            if outcomes is not None:
                outcomes.rewards = scores
        if scores is not None:
            print(f"  rewards:      mean {scores.mean_reward:.3f} over {scores.scored} samples; pass@{n} "
                  f"{scores.pass_at_n:.2f} ({scores.passed} of {scores.prompts} prompts have a sample scoring > 0)")
        unscored = unscored_line(run, cfg, outcomes)
        if unscored:
            print(unscored)
        for line in job_lines(run, cfg, outcomes):  # prompts skipped, responses that reached the limit
            print(line)
        tail = tail_text(tail_metrics(list(actor_lines(snap.roles).values())))
        if tail:  # the servers' idle slots once fewer answers than a full batch were left
            print(f"  tail:         {tail}")
        if snap.merged:
            print(f"  trajectories: {trajectories_where(run, cfg)}")
            print(f"  artifact:     {run.artifact}" + (" (made on this node; the store holds trajectories.pkl)"
                                                       if is_store_run(cfg) else ""))
        else:
            print(f"  batches:      {run.root / BATCH_GLOB} (generation.final_merge=false)")
        print(f"  logs:         {run.logs}/   streams: {streams_where(run, cfg)}")
        return 0
    what = failed_what(run, cfg, snap.failed_units)
    if snap.merged or run.merged_output() is not None:
        where = f"{trajectories_where(run, cfg)} and {run.artifact}"
        print(f"pipegen: partial output: {snap.committed} of {snap.total} samples in {where}; {what}",
              file=sys.stderr)
    else:
        print(f"pipegen: {snap.committed}/{snap.total} committed, no merged output (generation.all_or_nothing=true, "
              f"or generation.final_merge=false: the batch files); {what}", file=sys.stderr)
    for line in failure_summary(snap.failed_units):
        print(f"  {line}", file=sys.stderr)
    print(f"  logs: {run.logs}/   details: {command('status')} {run.root}", file=sys.stderr)
    return 1
