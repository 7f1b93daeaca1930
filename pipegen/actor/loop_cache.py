"""Building each unit's verl agent loop, with the per-unit work verl would repeat done once per actor.

verl's AgentLoopWorker builds one agent loop per sample; so does pipegen. What that costs per unit, and
what this module does about it (each one leaves the loop verl would have built):
- `hydra.utils.instantiate(registry[name], **kw)` per loop (an OmegaConf merge, ~10 ms): a plain
  `{_target_, **extra}` entry is resolved once to its class (`AgentLoops._factory`);
- a Continuous Token builder per loop (a tokenizer call at construction): text builders are shared
  (`share_text_token_builders`);
- the chat-template tokenisation of the prompt, for each of its n samples: done once (`PromptTokens`);
- a thread hop for each of the single-turn loop's two tiny executor calls (`InlineExecutorLoop`);
- the single-turn loop's constructor itself: about ten OmegaConf reads (~10-25 us each) that give the
  same values for every unit. verl's `SingleTurnAgentLoop.__init__` only stores its arguments and
  values read from the config, and its `run` keeps all its state in locals, so a shallow copy of one
  built with the same arguments, given the unit's own server manager, is the object verl would build
  (`AgentLoops.build`). Only that exact class: a subclass or a user's loop may keep state per instance;
- the single-turn loop's three rollout-config reads per run: its prototype reads them from verl's own
  typed view of the same config (`omega_conf_to_dataclass`, a frozen `RolloutConfig`, as verl's
  AgentLoopWorker holds it) instead of the OmegaConf node: the same values, without OmegaConf's ~10 us
  per read; and `data.mm_processor_kwargs`, which each run copies with `dict(...)`, as the plain dict
  it holds.

Owns: the registry name -> constructor resolution, these caches, and the prototype loops.
Must never: change what a loop computes (ids, masks, log-probs), share a loop instance between two
units, or reuse a prototype across event loops.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

import orjson
from cachetools import LRUCache
from omegaconf import OmegaConf

from pipegen.verl_private import copy_agent_loop, replace_token_builder_factory

log = logging.getLogger("pipegen.actor")


class PromptTokens:
    """The chat-template tokenisation of each prompt, done once for its n samples.

    verl's agent loops tokenise their initial messages through the loop's Continuous Token builder
    (`build_initial_tokens`, in an executor thread). The n samples of a prompt ask for the very same ids,
    so each loop's builder is wrapped: text-only calls with the same messages and tools are answered from
    here (the first caller computes them while the others of that prompt wait for it); everything else,
    multimodal prompts included, goes to verl's builder unchanged."""

    def __init__(self, max_prompts: int = 4096):
        self._key_locks: dict[bytes, Any] = {}
        self._ids = _PromptIds(max_prompts, self._key_locks)
        self._lock = threading.Lock()
        self.max_prompts = max_prompts

    def wrap(self, builder: Any) -> Any:
        return _CachingBuilder(builder, self)

    def get(self, builder: Any, messages: list, tools: Any) -> list[int]:
        key = orjson.dumps([type(builder).__name__, messages, tools], default=str,
                           option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_SORT_KEYS)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:  # the common case (n-1 of n samples): no per-key lock needed
                return list(ids)
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                ids = self._ids.get(key)
                if ids is not None:
                    return list(ids)
            ids = tuple(builder.build_initial_tokens(messages, tools=tools))
            with self._lock:
                self._ids[key] = ids  # past max_prompts the least recently used prompt goes, with its key lock
            return list(ids)


class _PromptIds(LRUCache):
    """The prompts' ids, least recently used first out; a prompt evicted takes its key lock along."""

    def __init__(self, maxsize: int, key_locks: dict[bytes, Any]):
        super().__init__(maxsize=maxsize)
        self._key_locks = key_locks

    def popitem(self) -> tuple[bytes, tuple[int, ...]]:
        key, ids = super().popitem()
        self._key_locks.pop(key, None)
        return key, ids


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
    def sharing(create: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(create, "pipegen_shared", False):
            return create
        shared: dict[tuple, Any] = {}

        def create_shared(tokenizer, *args, processor=None, **kwargs):
            if processor is not None or args:
                return create(tokenizer, *args, processor=processor, **kwargs)
            key = (id(tokenizer), orjson.dumps(kwargs, default=str, option=orjson.OPT_SORT_KEYS))
            if key not in shared:
                shared[key] = create(tokenizer, processor=None, **kwargs)
            return shared[key]

        create_shared.pipegen_shared = True
        return create_shared

    replace_token_builder_factory(sharing)


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


class AgentLoops:
    """Builds the agent loop of each unit from verl's registry, with the constructor arguments verl's
    AgentLoopWorker passes (`common`: trainer_config, tokenizer, processor, hf_model_type, dataset_cls,
    data_config, tools) and the unit's own server manager."""

    def __init__(self, registry: dict, common: dict[str, Any], tool_list_wrap: Callable[[list], Any], tools: list):
        share_text_token_builders()
        self.registry = registry
        self.common = common
        self._tool_list_wrap = tool_list_wrap
        self._tools = tools
        self.prompt_tokens = PromptTokens()
        self._factories: dict[str, Callable[..., Any]] = {}
        self._prototypes: dict[str, tuple[asyncio.AbstractEventLoop, Any]] = {}
        self._typed_rollout: Any = None

    def _factory(self, agent_name: str) -> Callable[..., Any]:
        """A callable building one agent loop, resolved once per name.

        verl builds every loop with `hydra.utils.instantiate(registry[name], **kw)`, which merges the
        arguments into an OmegaConf node each time (about 10 ms per unit). For a plain
        `{_target_, **extra}` entry that is the same as calling the class with the entry's keys plus kw,
        so do that; anything using Hydra's special keys or nested targets still goes through instantiate."""
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

    def build(self, agent_name: str, server_manager: Any) -> Any:
        """A new agent loop for one unit (a copy of the name's prototype where that is verl's object)."""
        loop = asyncio.get_running_loop()
        prototype = self._prototypes.get(agent_name)
        if prototype is not None and prototype[0] is loop:
            agent = copy_agent_loop(prototype[1])
            agent.server_manager = server_manager
            return agent
        agent = self._factory(agent_name)(server_manager=server_manager, tools=self._tool_list_wrap(self._tools),
                                          **self.common)
        builder = getattr(agent, "continuous_token_builder", None)
        if builder is not None:
            agent.continuous_token_builder = self.prompt_tokens.wrap(builder)
            if _is_text_single_turn(agent):
                agent.loop = InlineExecutorLoop(agent.loop)
                prototype = copy_agent_loop(agent)
                prototype.server_manager = None
                prototype.rollout_config = self._typed_rollout_config(agent.rollout_config)
                prototype.mm_processor_kwargs = _plain(agent.mm_processor_kwargs)
                self._prototypes[agent_name] = (loop, prototype)
        return agent

    def _typed_rollout_config(self, node: Any) -> Any:
        """verl's frozen RolloutConfig for the rollout node (the node itself if verl cannot convert it)."""
        if self._typed_rollout is None:
            from verl.utils.config import omega_conf_to_dataclass

            try:
                self._typed_rollout = omega_conf_to_dataclass(node)
            except Exception as e:  # noqa: BLE001  (a config verl's dataclass refuses: keep reading the node)
                log.info("rollout config kept as an OmegaConf node for agent loops (%s)", e)
                self._typed_rollout = node
        return self._typed_rollout


def _plain(value: Any) -> Any:
    """An OmegaConf node as the plain containers it holds (`dict(node)` per run costs ~10 us)."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _is_text_single_turn(agent: Any) -> bool:
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    return type(agent) is SingleTurnAgentLoop and getattr(agent, "processor", None) is None
