"""The actor process: its parts wired together, its shards opened, its stats lines written.

`python -m pipegen.actor output_dir=DIR rank=K [num_actors=A]` (started by the launcher; restartable
by hand: it resumes with what is still pending). With cluster=ray a node runner starts it as
`rank=NODE-INCARNATION-K node=NODE leases=URL`: it reads its node's own launch record and pulls its units
from the runner instead of taking a fixed share.

The parts: units.py (which units: its share of what is pending, or its node's leases), admission.py (how
many at once, and when), attempts.py (the server pool; routing.py, sending.py), rollout.py (one unit, row to shard
line). No sample
passes through this module: it hands each admitted unit to rollout.py and counts what became of it.

Owns: the actor's appenders of its run's stream medium (run/medium.py: with files a new shard per start, so a
restart never appends to a line a crash tore), the
process's lifetime (start-up, gc tuning, the final stats line) and the actor's stats lines.
Must never: write to another actor's shard, decide which units run or how many at once, or write a
failed unit as a trajectory.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass, field

from omegaconf import DictConfig

from pipegen.config.schema import draws_by_position
from pipegen.actor.rollout import UnitRunner
from pipegen.actor.readiness import StartupClock, wait_for_first_server
from pipegen.actor.units import FixedUnits, LeasedUnits, earlier_lengths, pending_units
from pipegen.actor.supervision import SUPERVISION
from pipegen.observe.logs import OncePerMessageFilter, setup_logging, watch_parent
from pipegen.observe.stats import CPU_BOUND, StatsAppender, percentile
from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.config import load_run_config
from pipegen.run.diskfull import exit_disk_full, is_disk_full
from pipegen.run.handshake import ACTOR_IMPORTS, import_then_wait_for_manifest
from pipegen.run.integrity import DamagedFile
from pipegen.run.layout import RunDir, actor_role, arg_value, output_dir_from_args
from pipegen.run.stats_line import ActorStats
from pipegen.run.medium import Appender, FAILURES, ROLLOUTS, open_medium
from pipegen.run.stream import assistant_turns, kept_unscored, RolloutRecord, TrajectoryKeys

log = logging.getLogger("pipegen.actor")

GC_YOUNG_THRESHOLD = 20_000  # net new containers between young collections (CPython's default: 700)


@dataclass
class ActorCounters:
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    trajectories: int = 0
    turns: list[int] = field(default_factory=list)
    response_lengths: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def count_record(self, record: RolloutRecord) -> None:
        self.completed += 1
        self.trajectories += record.num_rows
        for t in record.trajectories:
            self.response_lengths.append(len(t[TrajectoryKeys.RESPONSE_IDS]))
            self.turns.append(assistant_turns(t[TrajectoryKeys.RESPONSE_MASK]))  # not verl's num_turns: messages
            if t.get(TrajectoryKeys.REWARD_SCORE) is not None:
                self.rewards.append(t[TrajectoryKeys.REWARD_SCORE])

    def count_failure(self, kind: str) -> None:
        self.failed += 1
        self.errors[kind] = self.errors.get(kind, 0) + 1


class Actor:
    def __init__(self, cfg: DictConfig, run: RunDir, rank: int | str, num_actors: int, node: str | None = None,
                 leases_url: str | None = None):
        self.cfg = cfg
        self.run = run
        self.rank = rank
        self.num_actors = num_actors  # actors sharing this node's servers
        self.leases_url = leases_url
        # a node's actors read only their own node's record (its servers), never another node's
        self.launch = (run.read_node(node) if node else None) or run.read_launch()
        self.units: FixedUnits | LeasedUnits = FixedUnits([])  # set in main()
        self.runner = UnitRunner(cfg, run, self.launch, who=f"actor {rank}")
        self.counters = ActorCounters()
        self.clock = StartupClock()  # start-up phases, in every stats line (pipegen.status shows them)
        self.admission = None  # admission.Admission, once main() started
        self.medium = open_medium(run, cfg)  # streams.kind: this actor's shards, or the run's Redis streams
        # a unit's attempt number = its tries that ended in a FailureRecord before (any launch, any actor)
        self.failed_tries = self.medium.units(FAILURES)
        # units an earlier try generated but could not score: scored from their kept records, not generated
        self.kept = kept_unscored(self.medium.lines(FAILURES))
        self._busy_since = (time.monotonic(), time.process_time())  # for cpu_busy in the stats lines
        self._busy_intervals = 0  # consecutive stats intervals spent CPU-bound while units wait to start

    async def run_unit(self, pool, pos: int, sample: int, rollouts: Appender, failures: Appender, slot) -> None:
        """Run one admitted unit (rollout.py writes its line) and count what became of it."""
        index = self.runner.indices[pos]
        attempt = self.failed_tries.get((index, sample), 0)
        self.counters.in_flight += 1
        try:
            outcome = await self.runner.run_unit(pool, pos, sample, slot, attempt, rollouts, failures,
                                                 kept=self.kept.get((index, sample)))
        finally:
            self.counters.in_flight -= 1
            slot.release()  # as the task ends, so the slot counts never drift
        self.units.done(index, sample)  # after its line is written: a lease reports it finished
        if isinstance(outcome, Exception):
            self.counters.count_failure(type(outcome).__name__)
            log.warning("unit (%d, %d) failed: %s: %s", index, sample, type(outcome).__name__, outcome)
            self.failed_tries[(index, sample)] = attempt + 1
        else:
            self.clock.unit_written()
            self.counters.count_record(outcome)

    async def main(self) -> int:
        import aiohttp

        from pipegen.actor.attempts import ClientLimits, ServerPool
        from pipegen.actor.admission import Admission, WatchdogLimits
        from pipegen.actor.concurrency import ConcurrencyControl, unit_memory_bytes

        if self.leases_url is None:
            todo = pending_units(self.runner.keys, self.runner.indices, self.run, self.medium, int(self.rank),
                                 self.num_actors)
            log.info("actor %s: %d units pending", self.rank, len(todo))
            if not todo:
                return 0
        # What start-up loaded (torch, verl, transformers, the dataset: ~500k objects) lives as long as the
        # process; frozen, a full collection no longer walks it (~0.1 s each, every thousand units or so).
        # Units in flight keep thousands of young containers alive, so the default young-generation
        # threshold (700) walks them again and again (~40 us a unit); cyclic garbage is rare here.
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        actors_cfg = self.cfg.actors
        ckpt = load_checkpoint(self.run.checkpoint)
        rollouts = self.medium.appender(ROLLOUTS, self.rank, ckpt, int(actors_cfg.shard_max_bytes),
                                        float(actors_cfg.fsync_interval_s))
        failures = self.medium.appender(FAILURES, self.rank, ckpt, int(actors_cfg.shard_max_bytes), 0.0)
        limits = ClientLimits(
            prompt_length=self.runner.prompt_length,
            response_length=self.runner.response_length,
            max_model_len=self.runner.max_model_len,
            request_timeout_s=float(self.cfg.llm.request_timeout_s),
            max_attempts=int(self.cfg.generation.max_attempts),
            vocab_size=self.runner.vocab_size,
            draws_by_position=draws_by_position(self.cfg),
        )
        watchdog = WatchdogLimits(stall_floor_s=float(self.cfg.llm.stall_floor_s),
                                  stall_margin=float(self.cfg.llm.stall_margin), hedge=bool(self.cfg.actors.hedge))
        stats = StatsAppender(self.run.stats, actor_role(self.rank))
        control = ConcurrencyControl(
            list(self.launch.servers), actors_cfg.concurrency, sharing=self.num_actors,
            memory_cap_units=int(actors_cfg.max_memory_mb) * 2**20 // unit_memory_bytes(
                self.runner.prompt_length, self.runner.response_length),
            configured_max_running=self.cfg.llm.max_running_requests)
        admission = Admission(watchdog, control)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            if self.leases_url is None:
                spec = actors_cfg.get("lengths_from")
                self.units = FixedUnits(todo, longest_first=bool(actors_cfg.admit_longest_first),
                                        earlier=earlier_lengths(str(spec), self.runner.indices) if spec else None)
                self.runner.lengths = self.units.observe  # answers' lengths as they grow: the admission's evidence
            else:
                self.units = LeasedUnits(self.leases_url, actor_role(self.rank), session, self.runner.keys,
                                         self.runner.indices, lambda: (rollouts.sync(), failures.sync()))
            pool = ServerPool(list(self.launch.servers), limits, session, str(self.cfg.llm.protocol), admission,
                              on_first_request=lambda: self.clock.mark("first_request"),
                              group=bool(self.cfg.actors.group_requests))
            reporter = asyncio.create_task(self._report(pool, stats))
            # servers may still be loading (the launcher starts actors beside them): send once one answers,
            # then read the limits of those that answer (a late one starts at the default; its load adapts it)
            await wait_for_first_server(session, pool, self.clock)
            await control.discover(session, pool.engine)
            await pool.learn_group_limits()  # before the first burst: the first round goes grouped too
            if any((s.group_limit or 1) > 1 for s in pool.servers):
                admission.round = SUPERVISION.round  # refills wait for a few slots, to go out as one grouped request
            self.admission = admission  # stats lines show its concurrency from here (None while discovering)
            await admission.run(
                self.units, lambda pos, sample, slot: self.run_unit(pool, pos, sample, rollouts, failures, slot),
                session, pool.engine)
            reporter.cancel()
            await self.units.close()
            self._write_stats(pool, stats, final=True)
            pool.close()
            await self.runner.close()
        rollouts.close()
        failures.close()
        log.info("actor %s done: %d completed, %d failed; %d requests (%d retries), errors %s", self.rank,
                 self.counters.completed, self.counters.failed, pool.requests_sent, pool.retries,
                 pool.error_summary() or "none")
        return 0

    async def _report(self, pool, stats: StatsAppender) -> None:
        while True:
            await asyncio.sleep(float(self.cfg.actors.stats_interval_s))
            self._write_stats(pool, stats)

    def cpu_busy(self) -> float:
        """Share of the wall clock this process spent on CPU since the last stats line: near 1.0, the
        actor's event loop (one core) is what limits the run, and more actors would go faster."""
        wall, cpu = time.monotonic(), time.process_time()
        (wall0, cpu0), self._busy_since = self._busy_since, (wall, cpu)
        return round((cpu - cpu0) / max(wall - wall0, 1e-9), 3)

    def warn_if_cpu_bound(self, busy: float, draining: bool) -> None:
        """Once per process: the actor's one core, not the servers, has set the pace for two intervals."""
        self._busy_intervals = self._busy_intervals + 1 if busy >= CPU_BOUND and not draining else 0
        if self._busy_intervals == 2:
            log.warning("actor %s is %.0f%% busy on its CPU core: it, not the servers, limits this run; more "
                        "actors go faster (actors.num_actors=%d on the next launch)", self.rank, 100 * busy,
                        2 * self.num_actors)

    def _write_stats(self, pool, stats: StatsAppender, final: bool = False) -> None:
        c = self.counters
        control = self.admission.control if self.admission is not None else None
        busy = self.cpu_busy()
        if not final:
            self.warn_if_cpu_bound(busy, self.admission is not None and self.admission.draining)
        lat = sorted(pool.latencies)
        recent = lambda xs: xs[-10000:]  # noqa: E731  (bounded memory and work per line)
        c.turns, c.response_lengths, c.rewards = recent(c.turns), recent(c.response_lengths), recent(c.rewards)
        stats.append(
            ActorStats(
                final=final,
                units_total=self.units.total,
                completed=c.completed,
                failed=c.failed,
                in_flight=c.in_flight,
                trajectories=c.trajectories,
                requests=pool.requests_sent,
                retries=pool.retries,
                requests_in_flight=pool.in_flight(),
                output_tokens=pool.output_tokens,
                latency_p50_s=percentile(lat, 50),
                latency_p95_s=percentile(lat, 95),
                finish_reasons=dict(pool.finish_reasons),
                mean_turns=sum(c.turns) / len(c.turns) if c.turns else None,
                mean_response_length=sum(c.response_lengths) / len(c.response_lengths) if c.response_lengths else None,
                mean_reward=sum(c.rewards) / len(c.rewards) if c.rewards else None,
                errors={**c.errors, **pool.error_summary()},
                servers_out_of_rotation=[s.url for s in pool.servers if not s.healthy],
                stalled=pool.stalled,
                aborts_sent=pool.aborts_sent,
                hedges=pool.hedges,
                hedge_wins=pool.hedge_wins,
                hedge_tokens=pool.hedge_tokens,
                http_requests=pool.http_requests,
                concurrency=control.total() if control else None,
                concurrency_by_server=control.by_server() if control else {},
                server_load=({s.url: {"running": s.running, "waiting": s.waiting} for s in control.servers}
                             if control and control.auto else {}),
                requests_by_server={s.url: s.requests for s in pool.servers},
                tail=control.tail_by_server() if control else {},
                longest_request_s=round(pool.longest_request_s, 3),
                cpu_busy=busy,
                startup=self.clock.as_stats(),
            )
        )


def world_actor_count(arg: str | None, run: RunDir, cfg: DictConfig) -> int:
    """Actors in the whole run: the launcher's argument, else what it wrote in the launch record (an
    actor restarted by hand), else a fixed `actors.num_actors` (a record from an older pipegen)."""
    if arg:
        return int(arg)
    recorded = run.read_launch().num_actors
    if recorded:
        return recorded
    setting = str(cfg.actors.num_actors)
    return int(setting) if setting.isdigit() else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = RunDir(output_dir_from_args(argv))
    rank_arg = arg_value(argv, "rank", "0")
    rank: int | str = int(rank_arg) if rank_arg.isdigit() else rank_arg  # NODE-INCARNATION-K under cluster=ray
    num_actors_arg = arg_value(argv, "num_actors")
    setup_logging(actor_role(rank))
    # verl logs some warnings per agent-loop instance, i.e. once per unit (e.g. "No model-specific
    # Continuous Token builder ..."): let each distinct verl message through once per process.
    once = OncePerMessageFilter(lambda record: record.name.startswith("verl") or "/verl/" in record.name)
    for handler in logging.getLogger().handlers:
        handler.addFilter(once)
    watch_parent()
    try:
        cfg = load_run_config(run)
        import uvloop

        import_then_wait_for_manifest(run, ACTOR_IMPORTS)  # the launcher may still be reading the dataset
        actor = Actor(cfg, run, rank, world_actor_count(num_actors_arg, run, cfg), node=arg_value(argv, "node"),
                      leases_url=arg_value(argv, "leases"))
        actor.clock.mark("ready")
        log.info("actor %s ready %.1fs after its process started (pid %d)", rank, actor.clock.since("ready"),
                 os.getpid())
        return uvloop.run(actor.main())
    except DamagedFile as e:  # the launcher checks these files first: this is a role started by hand
        print(f"pipegen.actor: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if is_disk_full(e):
            return exit_disk_full(run.root, actor_role(rank), "pipegen.actor")
        raise
