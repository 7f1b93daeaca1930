"""One unit of work: a dataset row -> a verl agent loop over HTTP -> one RolloutRecord.

`UnitRunner` is built once per actor process: it loads the tokenizer, the dataset (verl's
RLHFDataset) and the tools, registers the user's agent loops the verl way
(`rollout.agent.agent_loop_config_path`), and then, per unit, instantiates the row's verl agent loop
with pipegen's HTTP server manager (client.py), checks what the loop returned, scores it, and packs
it into a `RolloutRecord` (records.py).

Owns: the row -> agent-loop kwargs mapping (uid, priority, seed), building verl agent loops, checking
their output before it reaches a shard.
Must never: re-tokenize what the server returned, turn a failed or malformed unit into a record
(it raises; the worker writes a FailureRecord), or write files (the worker owns the shards).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from pipegen.actor.dataset import dataset_indices, load_dataset, load_tokenizer
from pipegen.actor.scoring import Scorer
from pipegen.run.config import CONF_DIR
from pipegen.run.layout import LaunchRecord, RunDir
from pipegen.run.records import RolloutRecord, UnitKeys, prompt_uid, unit_seed


class InvalidTrajectory(ValueError):
    """An agent loop returned something the writer could not turn into verl rows."""


def row_fields(dataset, position: int) -> dict[str, Any]:
    """The row's non-tensor fields, as verl's collate + agent-loop worker would pass them on."""
    row = dataset[position]
    fields = {k: v for k, v in row.items() if not hasattr(v, "dtype") or isinstance(v, np.ndarray)}
    fields.pop("dummy_tensor", None)
    # Arrow unifies struct schemas, so a missing tools_kwargs reads back as None; verl's tool loop
    # then fails inside the tool call. Normalise to {} as verl's own collate path would.
    if fields.get("tools_kwargs") is None:
        fields["tools_kwargs"] = {}
    if fields.get("interaction_kwargs") is None:
        fields["interaction_kwargs"] = {}
    return fields


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


def trajectory_json(output) -> dict[str, Any]:
    """An AgentLoopOutput as the record carries it."""
    data = output.model_dump(mode="json")
    if data.get("response_logprobs") is not None:
        # float32 shortest repr: half the bytes, and bit-identical after verl's float32 conversion
        data["response_logprobs"] = np.asarray(data["response_logprobs"], dtype=np.float32)
    return data


class PromptTokens:
    """The chat-template tokenisation of each prompt, done once for its n samples.

    verl's agent loops tokenise their initial messages through the loop's Continuous Token builder
    (`build_initial_tokens`, in an executor thread). The n samples of a prompt ask for the very same ids,
    so each loop's builder is wrapped: text-only calls with the same messages and tools are answered from
    here (the first caller computes them while the others of that prompt wait for it); everything else,
    multimodal prompts included, goes to verl's builder unchanged."""

    def __init__(self, max_prompts: int = 4096):
        import threading
        from collections import OrderedDict

        self._ids: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._key_locks: dict[bytes, Any] = {}
        self.max_prompts = max_prompts
        self.hits = self.misses = 0

    def wrap(self, builder: Any) -> Any:
        return _CachingBuilder(builder, self)

    def get(self, builder: Any, messages: list, tools: Any) -> list[int]:
        import threading

        import orjson

        key = orjson.dumps([type(builder).__name__, messages, tools], default=str,
                           option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_SORT_KEYS)
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                ids = self._ids.get(key)
                if ids is not None:
                    self._ids.move_to_end(key)
                    self.hits += 1
                    return list(ids)
            ids = tuple(builder.build_initial_tokens(messages, tools=tools))
            with self._lock:
                self.misses += 1
                self._ids[key] = ids
                while len(self._ids) > self.max_prompts:
                    old, _ = self._ids.popitem(last=False)
                    self._key_locks.pop(old, None)
            return list(ids)


class _CachingBuilder:
    """verl's Continuous Token builder with `build_initial_tokens` answered by PromptTokens for text."""

    def __init__(self, builder: Any, cache: PromptTokens):
        self._builder = builder
        self._cache = cache

    def build_initial_tokens(self, messages, *, tools=None, images=None, videos=None, audios=None,
                             mm_inputs_out=None) -> list[int]:
        if images or videos or audios:
            return self._builder.build_initial_tokens(messages, tools=tools, images=images, videos=videos,
                                                      audios=audios, mm_inputs_out=mm_inputs_out)
        return self._cache.get(self._builder, messages, tools)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._builder, name)


def share_text_token_builders() -> None:
    """Build verl's text Continuous Token builder once per actor instead of once per agent loop.

    `AgentLoopBase.__init__` calls `create_continuous_token_builder(tokenizer, ...)` for every loop, i.e.
    for every unit; a text builder only holds the tokenizer and a few token ids it encodes at
    construction (a tokenizer call per unit). With the same tokenizer, model type and chat-template
    arguments the builders are interchangeable, so the one in verl's agent-loop module is wrapped to
    return one shared builder for text loops (a processor, i.e. a multimodal loop, always gets its own)."""
    from verl.experimental.agent_loop import agent_loop as verl_agent_loop

    create = verl_agent_loop.create_continuous_token_builder
    if getattr(create, "pipegen_shared", False):
        return
    import orjson

    shared: dict[tuple, Any] = {}

    def create_shared(tokenizer, *args, processor=None, **kwargs):
        if processor is not None or args:
            return create(tokenizer, *args, processor=processor, **kwargs)
        key = (id(tokenizer), orjson.dumps(kwargs, default=str, option=orjson.OPT_SORT_KEYS))
        if key not in shared:
            shared[key] = create(tokenizer, processor=None, **kwargs)
        return shared[key]

    create_shared.pipegen_shared = True
    verl_agent_loop.create_continuous_token_builder = create_shared


class InlineExecutorLoop:
    """The event loop as verl's single-turn loop sees it (`agent.loop`), with `run_in_executor(None, fn)`
    run inline. Its two executor calls per unit are the prompt tokens (a lookup in PromptTokens after the
    first sample of a prompt) and `merge_assistant_tokens` (a list concatenation): a thread hop costs more
    than either, and on the GIL a thread does not make Python work parallel anyway."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop

    def run_in_executor(self, executor, fn, *args):
        if executor is not None:
            return self._loop.run_in_executor(executor, fn, *args)
        future = self._loop.create_future()
        try:
            future.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001  (handed to the awaiting coroutine, as the executor would)
            future.set_exception(e)
        return future

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


class UnitRunner:
    """Everything one actor needs to turn (position, sample) into a RolloutRecord."""

    def __init__(self, cfg: DictConfig, run: RunDir, launch: LaunchRecord, who: str = "actor"):
        from transformers import AutoConfig
        from verl.experimental.agent_loop import agent_loop as verl_agent_loop
        from verl.tools.tool_registry import load_all_tools
        from verl.utils.dataset.rl_dataset import get_dataset_class

        self.cfg = cfg
        self.launch = launch
        rollout = cfg.actor_rollout_ref.rollout
        self.keys = UnitKeys(int(rollout.n))
        self.prompt_length = int(rollout.prompt_length)
        self.response_length = int(rollout.response_length)
        self.tokenizer = load_tokenizer(cfg)
        self.dataset = load_dataset(cfg, self.tokenizer)
        self.indices = run.read_manifest()
        if dataset_indices(self.dataset) != self.indices:
            # e.g. data.shuffle=true without data.seed: verl then samples a different subset per process
            raise SystemExit(
                f"{who}: the dataset's rows differ from {run.units_file}; the data files changed or "
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
        share_text_token_builders()
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
        self._rows: dict[int, dict[str, Any]] = {}
        self._factories: dict[str, Any] = {}
        self.prompt_tokens = PromptTokens()
        # read once: a DictConfig lookup costs tens of microseconds, and these are read per unit
        self._base_seed = int(cfg.seed)
        self._per_unit_seed = bool(cfg.actors.per_unit_seed)
        self._cfg_wrap = self.DictConfigWrap(cfg)  # verl only reads through these wrappers
        self._data_wrap = self.DictConfigWrap(cfg.data)

    def row(self, pos: int) -> dict[str, Any]:
        if pos not in self._rows:
            self._rows[pos] = row_fields(self.dataset, pos)
        return self._rows[pos]

    def seed(self, index: int, sample: int) -> int | None:
        return unit_seed(self._base_seed, index, sample) if self._per_unit_seed else None

    def agent_name(self, pos: int) -> str:
        return self.row(pos).get("agent_name") or self.default_agent

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

    async def run(self, pool, pos: int, sample: int) -> RolloutRecord:
        """Run the unit's agent loop against the server pool; raises on any failure of the unit."""
        from pipegen.actor.client import UnitServerManager

        index = self.indices[pos]
        row = self.row(pos)
        seed = self.seed(index, sample)
        agent_name = self.agent_name(pos)
        uid = prompt_uid(self.launch.run_key, index)
        priority = self.keys.priority(pos, sample)
        kwargs = {k: v for k, v in row.items() if k not in ("agent_name", "__do_sample__")}
        kwargs.update(uid=uid, priority=priority)
        if agent_name not in self.registry:
            raise ValueError(f"agent loop '{agent_name}' is not registered; known: {sorted(self.registry)} "
                             "(register yours with actor_rollout_ref.rollout.agent.agent_loop_config_path)")
        agent = self._loop_factory(agent_name)(
            trainer_config=self._cfg_wrap,
            server_manager=UnitServerManager(pool, sticky_key=index, sampling_seed=seed),
            tokenizer=self.tokenizer,
            processor=None,
            hf_model_type=self.hf_model_type,
            dataset_cls=self.dataset_cls,
            data_config=self._data_wrap,
            tools=self.ToolListWrap(self.tools),
        )
        builder = getattr(agent, "continuous_token_builder", None)
        if builder is not None:
            agent.continuous_token_builder = self.prompt_tokens.wrap(builder)
            if type(agent).__name__ == "SingleTurnAgentLoop" and getattr(agent, "processor", None) is None:
                agent.loop = InlineExecutorLoop(agent.loop)
        result = await agent.run(dict(self.sampling_params), **kwargs)
        outputs = check_trajectories(result, self.prompt_length, self.response_length)
        # like verl's _compute_score: a loop that scored its own trajectory (e.g. SWE-agent) keeps its score
        if self.scorer is not None and outputs[-1].reward_score is None and self.scorer.applies(row):
            if self.scorer.cheap(row):
                self.scorer.score(outputs[-1], row)  # proven fast: a thread hop would cost more
            else:  # off the event loop: math scorers (sympy) can take a while
                await asyncio.get_running_loop().run_in_executor(None, self.scorer.score, outputs[-1], row)
            for out in outputs[:-1]:  # a multi-trajectory unit shares its final reward, as verl's TQ worker does
                out.reward_score = outputs[-1].reward_score
                if "reward_extra_info" in outputs[-1].extra_fields:
                    out.extra_fields["reward_extra_info"] = outputs[-1].extra_fields["reward_extra_info"]
        return RolloutRecord(index=index, sample=sample, uid=uid, priority=priority, seed=seed,
                             agent_name=agent_name, launch=self.launch.launch, row=row,
                             trajectories=[trajectory_json(o) for o in outputs])
