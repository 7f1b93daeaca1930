"""Actor process: runs verl agent loops for its share of pending units and appends one line per unit.

`python -m pipegen.actor output_dir=DIR rank=K` (started by the launcher; restartable by hand).

Owns: the actor's share of pending units (all units - committed in the checkpoint - units already in
complete shard lines past the checkpoint's offsets), bounded concurrency, registering the user's agent
loops (`rollout.agent.agent_loop_config_path`, the verl way) and loading verl tools, instantiating one
verl agent loop per unit inside the running event loop, checking what a loop returns (one trajectory or
a list of them) before it reaches a shard, optional scoring with verl's default_compute_score, and this
actor's shards (one record per unit, all its trajectories together; a new shard per start).
Must never: write to another actor's shard, write a failed or malformed unit as a trajectory, re-tokenize
what the server returned, or run model-written code to score it (code data sources stay unscored).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from omegaconf import DictConfig, OmegaConf

from pipegen.checkpoint import load_checkpoint
from pipegen.config import CONF_DIR, RunDir, load_run_config, output_dir_from_args
from pipegen.dataset import dataset_indices, load_dataset, load_tokenizer, read_manifest, row_fields
from pipegen.logs import setup_logging, watch_parent
from pipegen.stats import StatsAppender, percentile
from pipegen.streams import ShardAppender, encode_record, scan_units
from pipegen.units import prompt_uid, unit_seed

log = logging.getLogger("pipegen.actor")

# verl's default_compute_score executes the model's code for these unless a sandbox is configured
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")


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


class VerlOnceFilter(logging.Filter):
    """verl logs some warnings per agent-loop instance, i.e. once per unit (e.g. "No model-specific
    Continuous Token builder ..."): let each distinct verl message through once per process."""

    def __init__(self, limit: int = 10000):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name.startswith("verl") or "/verl/" in record.name):
            return True
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        if len(self.seen) < self.limit:
            self.seen.add(key)
        return True


class InvalidTrajectory(ValueError):
    """An agent loop returned something the writer could not turn into verl rows."""


def arg_value(argv: list[str], key: str, default: str | None = None) -> str | None:
    for a in argv:
        if a.startswith(f"{key}="):
            return a.split("=", 1)[1]
    return default


def resolve_user_path(path: str) -> str:
    """A config file path as verl resolves it (absolute, or under the working directory), falling back
    to pipegen's own folder so the shipped `conf/tools/...` and `conf/agent_loops/...` work from anywhere."""
    from verl.utils.import_utils import resolve_config_path

    p = Path(os.path.expanduser(str(path)))
    if not p.is_absolute() and not p.exists():
        shipped = CONF_DIR.parent / p
        if shipped.exists():
            return str(shipped)
    return resolve_config_path(str(p))


def register_agent_loops(config_path: str | None) -> None:
    """Add the YAML-declared loops (`- {name, _target_, **kwargs}`) to verl's registry, as
    AgentLoopWorker.__init__ does; extra keys reach the loop's constructor."""
    if not config_path:
        return
    from verl.experimental.agent_loop import agent_loop as verl_agent_loop

    loops = OmegaConf.load(resolve_user_path(config_path))
    for loop_cfg in loops:
        if "name" not in loop_cfg or "_target_" not in loop_cfg:
            raise ValueError(f"{config_path}: every agent loop entry needs 'name' and '_target_', got {dict(loop_cfg)}")
        verl_agent_loop._agent_loop_registry[loop_cfg.name] = loop_cfg


def pending_units(cfg: DictConfig, run: RunDir, indices: list[int], rank: int, num_actors: int) -> list[tuple[int, int]]:
    """(position, sample) pairs this actor still has to run, prompt-major so n samples share a prefix."""
    n = int(cfg.actor_rollout_ref.rollout.n)
    ckpt = load_checkpoint(run.checkpoint)
    in_shards = scan_units(run.rollouts, ckpt.rollout_offsets, ckpt.rollout_sealed)
    todo = []
    for pos in range(rank, len(indices), num_actors):
        index = indices[pos]
        for s in range(n):
            if index * n + s in ckpt.committed or (index, s) in in_shards:
                continue
            todo.append((pos, s))
    return todo


def check_trajectories(result: Any, prompt_length: int, response_length: int) -> list:
    """What an agent loop returned, as a non-empty list of AgentLoopOutput that verl's padding accepts."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    outputs = result if isinstance(result, (list, tuple)) else [result]
    if not outputs:
        raise InvalidTrajectory("the agent loop returned no trajectory")
    checked = []
    for t, out in enumerate(outputs):
        if isinstance(out, dict):
            out = AgentLoopOutput.model_validate(out)
        if not isinstance(out, AgentLoopOutput):
            raise InvalidTrajectory(f"trajectory {t} is a {type(out).__name__}, not an AgentLoopOutput")
        where = f"trajectory {t}"
        if not out.prompt_ids:
            raise InvalidTrajectory(f"{where}: empty prompt_ids")
        if len(out.prompt_ids) > prompt_length:
            raise InvalidTrajectory(f"{where}: {len(out.prompt_ids)} prompt tokens > prompt_length={prompt_length}")
        if len(out.response_ids) > response_length:
            raise InvalidTrajectory(
                f"{where}: {len(out.response_ids)} response tokens > response_length={response_length}")
        if len(out.response_mask) != len(out.response_ids):
            raise InvalidTrajectory(f"{where}: response_mask has {len(out.response_mask)} entries for "
                                    f"{len(out.response_ids)} response tokens")
        if any(m not in (0, 1) for m in out.response_mask):
            raise InvalidTrajectory(f"{where}: response_mask holds values other than 0 and 1")
        if out.response_logprobs is not None and len(out.response_logprobs) != len(out.response_ids):
            raise InvalidTrajectory(f"{where}: {len(out.response_logprobs)} logprobs for "
                                    f"{len(out.response_ids)} response tokens")
        checked.append(out)
    return checked


class Scorer:
    """verl's default_compute_score, applied the way verl's reward loop applies it (§9)."""

    def __init__(self, tokenizer):
        from verl.utils.reward_score import default_compute_score

        self.tokenizer = tokenizer
        self.compute = default_compute_score
        self._warned: set[str] = set()

    def applies(self, row: dict[str, Any]) -> bool:
        reward_model = row.get("reward_model") or {}
        source = row.get("data_source")
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model or not source:
            return False
        if source in CODE_DATA_SOURCES:
            if source not in self._warned:
                self._warned.add(source)
                log.warning("not scoring data_source=%s: verl would execute the generated code on this machine", source)
            return False
        return True

    def score(self, output, row: dict[str, Any]) -> None:
        """Set output.reward_score and extra_fields['reward_extra_info'] (NotImplementedError: unscored)."""
        if not self.applies(row):
            return
        reward_model = row["reward_model"]
        text = self.tokenizer.decode(output.response_ids, skip_special_tokens=True)
        extra = dict(row.get("extra_info") or {})
        extra.update(num_turns=output.num_turns, rollout_reward_scores={})
        try:
            result = self.compute(row["data_source"], text, reward_model["ground_truth"], extra_info=extra)
        except NotImplementedError:
            if row["data_source"] not in self._warned:
                self._warned.add(row["data_source"])
                log.warning("verl has no scorer for data_source=%s: its rows stay unscored", row["data_source"])
            return  # verl knows no scorer for this data_source: leave the row unscored
        if isinstance(result, dict):
            output.reward_score = float(result["score"])
            output.extra_fields["reward_extra_info"] = result
        else:
            output.reward_score = float(result)
            output.extra_fields["reward_extra_info"] = {"acc": float(result)}


class Actor:
    def __init__(self, cfg: DictConfig, run: RunDir, rank: int, num_actors: int):
        import hydra  # noqa: F401  (instantiate below)
        from transformers import AutoConfig
        from verl.experimental.agent_loop import agent_loop as verl_agent_loop
        from verl.tools.tool_registry import load_all_tools
        from verl.utils.dataset.rl_dataset import get_dataset_class

        self.cfg = cfg
        self.run = run
        self.rank = rank
        self.num_actors = num_actors
        self.n = int(cfg.actor_rollout_ref.rollout.n)
        rollout = cfg.actor_rollout_ref.rollout
        self.prompt_length = int(rollout.prompt_length)
        self.response_length = int(rollout.response_length)
        self.launch = orjson.loads(run.launch_file.read_bytes())
        self.tokenizer = load_tokenizer(cfg)
        self.dataset = load_dataset(cfg, self.tokenizer)
        self.indices = read_manifest(run.units_file)
        if dataset_indices(self.dataset) != self.indices:
            # e.g. data.shuffle=true without data.seed: verl then samples a different subset per process
            raise SystemExit(
                f"actor {rank}: the dataset's rows differ from {run.units_file}; the data files changed or "
                "row selection is random (set data.seed, or data.shuffle=false)"
            )
        hf_config = AutoConfig.from_pretrained(cfg.actor_rollout_ref.model.path,
                                               trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
        model_type = getattr(hf_config, "model_type", None)
        self.hf_model_type = model_type if isinstance(model_type, str) else None
        self.max_model_len = int(rollout.get("max_model_len") or hf_config.max_position_embeddings)
        vocab = getattr(hf_config, "vocab_size", None) or getattr(getattr(hf_config, "text_config", None),
                                                                  "vocab_size", None)
        self.vocab_size = int(vocab) if vocab else None
        multi_turn = rollout.multi_turn
        self.tools = load_all_tools(
            tool_config_path=resolve_user_path(multi_turn.tool_config_path) if multi_turn.tool_config_path else None,
            function_tool_path=resolve_user_path(multi_turn.function_tool_path) if multi_turn.function_tool_path else None,
        )
        # verl adds YAML-registered loops only inside AgentLoopWorker.__init__; do the same here.
        register_agent_loops(rollout.agent.agent_loop_config_path)
        self.registry = verl_agent_loop._agent_loop_registry
        self.DictConfigWrap = verl_agent_loop.DictConfigWrap
        self.ToolListWrap = verl_agent_loop.ToolListWrap
        self.dataset_cls = get_dataset_class(cfg.data)
        self.default_agent = rollout.agent.default_agent_loop
        self.sampling_params = dict(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            repetition_penalty=1.0,
            logprobs=rollout.calculate_log_probs,
        )
        self.scorer = Scorer(self.tokenizer) if cfg.actors.scoring else None
        self.counters = ActorCounters()
        self.rows: dict[int, dict[str, Any]] = {}
        self._factories: dict[str, Any] = {}

    def _row(self, pos: int) -> dict[str, Any]:
        if pos not in self.rows:
            self.rows[pos] = row_fields(self.dataset, pos)
        return self.rows[pos]

    def _loop_factory(self, agent_name: str):
        """A callable building one agent loop, resolved once per name.

        verl builds every loop with `hydra.utils.instantiate(registry[name], **kw)`, which merges the
        arguments into an OmegaConf node each time (about 10 ms per unit, the actor's largest cost).
        For a plain `{_target_, **extra}` entry that is the same as calling the class with the entry's
        keys plus kw, so do that; anything using Hydra's special keys or nested targets still goes
        through instantiate."""
        factory = self._factories.get(agent_name)
        if factory is None:
            import hydra

            entry = self.registry[agent_name]
            keys = list(entry.keys())
            special = any(str(k).startswith("_") and k != "_target_" for k in keys)
            nested = any(isinstance(v, (dict, list)) or OmegaConf.is_config(v)
                         for k, v in entry.items() if k != "_target_")
            if special or nested:
                factory = lambda **kw: hydra.utils.instantiate(entry, **kw)  # noqa: E731
            else:
                cls = hydra.utils.get_class(entry["_target_"])
                extra = {k: entry[k] for k in keys if k != "_target_"}
                factory = lambda **kw: cls(**{**extra, **kw})  # noqa: E731
            self._factories[agent_name] = factory
        return factory

    def _count_error(self, kind: str) -> None:
        self.counters.errors[kind] = self.counters.errors.get(kind, 0) + 1

    async def run_unit(self, pool, pos: int, sample: int, rollouts: ShardAppender, failures: ShardAppender) -> None:
        from pipegen.client import UnitServerManager

        index = self.indices[pos]
        row = self._row(pos)
        seed = unit_seed(int(self.cfg.seed), index, sample) if self.cfg.actors.per_unit_seed else None
        agent_name = row.get("agent_name") or self.default_agent
        kwargs = {k: v for k, v in row.items() if k not in ("agent_name", "__do_sample__")}
        kwargs["uid"] = prompt_uid(self.launch["run_key"], index)
        kwargs["priority"] = pos * self.n + sample
        self.counters.in_flight += 1
        try:
            if agent_name not in self.registry:
                raise ValueError(f"agent loop '{agent_name}' is not registered; known: {sorted(self.registry)} "
                                 "(register yours with actor_rollout_ref.rollout.agent.agent_loop_config_path)")
            agent = self._loop_factory(agent_name)(
                trainer_config=self.DictConfigWrap(self.cfg),
                server_manager=UnitServerManager(pool, sticky_key=index, sampling_seed=seed),
                tokenizer=self.tokenizer,
                processor=None,
                hf_model_type=self.hf_model_type,
                dataset_cls=self.dataset_cls,
                data_config=self.DictConfigWrap(self.cfg.data),
                tools=self.ToolListWrap(self.tools),
            )
            result = await agent.run(dict(self.sampling_params), **kwargs)
            outputs = check_trajectories(result, self.prompt_length, self.response_length)
            # like verl's _compute_score: a loop that scored its own trajectory (e.g. SWE-agent) keeps its score
            if self.scorer is not None and outputs[-1].reward_score is None and self.scorer.applies(row):
                loop = asyncio.get_running_loop()
                # off the event loop: math scorers (sympy) can take a while
                await loop.run_in_executor(None, self.scorer.score, outputs[-1], row)
                for out in outputs[:-1]:  # a multi-trajectory unit shares its final reward, as verl's TQ worker does
                    out.reward_score = outputs[-1].reward_score
                    if "reward_extra_info" in outputs[-1].extra_fields:
                        out.extra_fields["reward_extra_info"] = outputs[-1].extra_fields["reward_extra_info"]
            body = {
                "uid": kwargs["uid"],
                "priority": kwargs["priority"],
                "seed": seed,
                "agent_name": agent_name,
                "launch": self.launch["launch"],
                "row": row,
                "trajectories": [_trajectory_json(o) for o in outputs],
            }
            line = encode_record(index, sample, body)
        except Exception as e:  # any failure of this unit is recorded, never turned into a sample
            reason = f"{type(e).__name__}: {e}"
            self._count_error(type(e).__name__)
            self.counters.failed += 1
            log.warning("unit (%d, %d) failed: %s", index, sample, reason)
            failures.append(encode_record(index, sample, {"launch": self.launch["launch"], "seed": seed,
                                                          "agent_name": agent_name, "reason": reason}))
            return
        finally:
            self.counters.in_flight -= 1
        rollouts.append(line)
        self.counters.completed += 1
        self.counters.trajectories += len(outputs)
        for o in outputs:
            self.counters.response_lengths.append(len(o.response_ids))
            self.counters.turns.append(o.num_turns)
            if o.reward_score is not None:
                self.counters.rewards.append(o.reward_score)

    async def main(self) -> int:
        import aiohttp

        from pipegen.client import ClientLimits, ServerPool

        todo = pending_units(self.cfg, self.run, self.indices, self.rank, self.num_actors)
        log.info("actor %d: %d units pending", self.rank, len(todo))
        if not todo:
            return 0
        actors_cfg = self.cfg.actors
        rollouts = ShardAppender(self.run.rollouts, self.rank, int(actors_cfg.shard_max_bytes),
                                 float(actors_cfg.fsync_interval_s))
        failures = ShardAppender(self.run.failures, self.rank, int(actors_cfg.shard_max_bytes), 0.0)
        limits = ClientLimits(
            prompt_length=self.prompt_length,
            response_length=self.response_length,
            max_model_len=self.max_model_len,
            request_timeout_s=float(self.cfg.llm.request_timeout_s),
            max_attempts=int(self.cfg.generation.max_attempts),
            vocab_size=self.vocab_size,
        )
        stats = StatsAppender(self.run.stats, f"actor_{self.rank}")
        queue: asyncio.Queue = asyncio.Queue()
        for item in todo:
            queue.put_nowait(item)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            pool = ServerPool(list(self.launch["servers"]), limits, session)

            async def worker() -> None:
                while True:
                    try:
                        pos, sample = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    await self.run_unit(pool, pos, sample, rollouts, failures)

            reporter = asyncio.create_task(self._report(pool, stats, len(todo)))
            workers = [asyncio.create_task(worker()) for _ in range(int(actors_cfg.concurrency))]
            await asyncio.gather(*workers)
            reporter.cancel()
            self._write_stats(pool, stats, len(todo), final=True)
            pool.close()
        rollouts.close()
        failures.close()
        log.info("actor %d done: %d completed, %d failed; %d requests (%d retries), errors %s", self.rank,
                 self.counters.completed, self.counters.failed, pool.requests_sent, pool.retries,
                 pool.error_summary() or "none")
        return 0

    async def _report(self, pool, stats: StatsAppender, total: int) -> None:
        while True:
            await asyncio.sleep(float(self.cfg.actors.stats_interval_s))
            self._write_stats(pool, stats, total)

    def _write_stats(self, pool, stats: StatsAppender, total: int, final: bool = False) -> None:
        c = self.counters
        lat = sorted(pool.latencies)
        recent = lambda xs: xs[-10000:]  # noqa: E731  (bounded memory and work per line)
        c.turns, c.response_lengths, c.rewards = recent(c.turns), recent(c.response_lengths), recent(c.rewards)
        stats.append(
            {
                "final": final,
                "units_total": total,
                "completed": c.completed,
                "failed": c.failed,
                "in_flight": c.in_flight,
                "trajectories": c.trajectories,
                "requests": pool.requests_sent,
                "retries": pool.retries,
                "requests_in_flight": pool.in_flight(),
                "output_tokens": pool.output_tokens,
                "latency_p50_s": percentile(lat, 50),
                "latency_p95_s": percentile(lat, 95),
                "finish_reasons": dict(pool.finish_reasons),
                "mean_turns": sum(c.turns) / len(c.turns) if c.turns else None,
                "mean_response_length": sum(c.response_lengths) / len(c.response_lengths) if c.response_lengths else None,
                "mean_reward": sum(c.rewards) / len(c.rewards) if c.rewards else None,
                "errors": {**c.errors, **pool.error_summary()},
                "servers_out_of_rotation": [s.url for s in pool.servers if not s.healthy],
                "requests_by_server": {s.url: s.requests for s in pool.servers},
            }
        )


def _trajectory_json(output) -> dict[str, Any]:
    import numpy as np

    data = output.model_dump(mode="json")
    if data.get("response_logprobs") is not None:
        # float32 shortest repr: half the bytes, and bit-identical after verl's float32 conversion
        data["response_logprobs"] = np.asarray(data["response_logprobs"], dtype=np.float32)
    return data


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = RunDir(output_dir_from_args(argv))
    rank = int(arg_value(argv, "rank", "0"))
    num_actors_arg = arg_value(argv, "num_actors")
    setup_logging(f"actor_{rank}")
    once = VerlOnceFilter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(once)
    watch_parent()
    cfg = load_run_config(run)
    import uvloop

    started = time.monotonic()
    actor = Actor(cfg, run, rank, int(num_actors_arg or cfg.actors.num_actors))
    log.info("actor %d ready in %.1fs (pid %d)", rank, time.monotonic() - started, os.getpid())
    return uvloop.run(actor.main())


if __name__ == "__main__":
    sys.exit(main())
