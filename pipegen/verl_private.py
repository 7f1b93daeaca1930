"""Everything pipegen takes from verl's internals: names verl does not offer as API, each with its reason.

A verl upgrade that renames or reshapes one of these breaks here, in one file, and tests/test_verl_parity.py
(which holds pipegen's batches to verl's real AgentLoopWorker, tensor for tensor) says so. Everything else
pipegen uses from verl is public: DataProto, RLHFDataset, the agent-loop classes, the tool registry, the
tokenizer and tracking helpers, default_compute_score.

Must never: hold state, or be the way to a public verl name (import that where it is used).
"""

from __future__ import annotations

from typing import Any, Callable

from omegaconf import DictConfig


def agent_loop_registry() -> dict[str, Any]:
    """verl's agent-loop registry. Why: verl adds YAML-declared loops to it only inside
    AgentLoopWorker.__init__, which pipegen does not run (it starts Ray actors)."""
    from verl.experimental.agent_loop import agent_loop

    return agent_loop._agent_loop_registry


def replace_token_builder_factory(replace: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Swap the module-level `create_continuous_token_builder` that AgentLoopBase.__init__ calls for
    `replace(current)`. Why: verl builds one builder per agent loop, i.e. per unit; text builders are
    interchangeable, so an actor shares one (actor/loop_cache.py)."""
    from verl.experimental.agent_loop import agent_loop

    agent_loop.create_continuous_token_builder = replace(agent_loop.create_continuous_token_builder)


def copy_agent_loop(prototype: Any) -> Any:
    """A new agent loop with the prototype's attributes. Why: SingleTurnAgentLoop.__init__ only stores
    its arguments, so a copy is the object verl would build, without re-reading the config per unit."""
    agent = object.__new__(type(prototype))
    agent.__dict__.update(prototype.__dict__)
    return agent


def postprocess_worker(cfg: DictConfig, tokenizer: Any, processor: Any = None) -> Any:
    """An AgentLoopWorker holding only what its postprocessing reads. Why: verl's padding of agent-loop
    outputs into a DataProto lives on that worker, whose __init__ starts Ray actors and servers. `processor`:
    the model's multimodal processor, from which verl builds multi_modal_inputs and M-RoPE position ids."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.config import omega_conf_to_dataclass

    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.config = cfg
    worker.rollout_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    worker.tokenizer = tokenizer
    worker.processor = processor
    worker.mm_processor_kwargs = dict(cfg.data.get("mm_processor_kwargs") or {}) if processor is not None else {}
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    return worker


async def postprocess_trajectory(worker: Any, output: Any, **kwargs: Any) -> Any:
    """verl's per-trajectory padding (`_agent_loop_postprocess`). Why: the exact layout verl's trainer
    reads, for anything unusual (multimodal, routed experts, over-long sequences)."""
    return await worker._agent_loop_postprocess(output, False, **kwargs)


def postprocess_batch(worker: Any, items: list[Any], non_tensor: dict[str, Any]) -> Any:
    """verl's assembly of padded trajectories into one DataProto (`_postprocess`). Why: the same."""
    return worker._postprocess(items, input_non_tensor_batch=non_tensor, validate=False)


def performance_metrics(metrics: list[Any], batch: Any) -> dict[str, Any]:
    """verl's `timing` meta_info of a generated batch (`AgentLoopManager._performance_metrics`). Why:
    verl's trainer logs it; the merged output carries what verl's own rollout would."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    return AgentLoopManager._performance_metrics(None, metrics, batch)


def custom_reward_fn(path: str, name: str, reward_kwargs: dict[str, Any]) -> Callable[..., Any]:
    """verl's `get_custom_reward_fn` for custom_reward_function.{path,name,reward_kwargs}, without importing verl's
    package. Why: verl's lives in verl/trainer/ppo/reward.py, whose imports (DataProto, torch) cost ~6 s of CPU,
    and the launcher checks the user's reward file before anything imports verl (a refusal in seconds, not 15).
    Its parts are verl's own: the file loaded by `load_extern_object` of verl/utils/import_utils.py (executed from
    its file, which imports only the standard library), wrapped as verl wraps it, reward_kwargs merged into every
    call and taking precedence (verl's `_call_with_kwargs`, or its async twin for a coroutine function).
    tests/test_rewards.py holds it equal to verl's."""
    import importlib.util
    import inspect
    import sys
    from functools import partial
    from pathlib import Path

    utils = sys.modules.get("verl.utils.import_utils")
    if utils is None:
        found = importlib.util.find_spec("verl")
        if found is None or not found.submodule_search_locations:
            raise ImportError("verl is not installed: run ./launch.sh --setup")
        source = Path(list(found.submodule_search_locations)[0]) / "utils" / "import_utils.py"
        spec = importlib.util.spec_from_file_location("pipegen_verl_import_utils", source)
        assert spec is not None and spec.loader is not None
        utils = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(utils)
    raw = utils.load_extern_object(module_path=path, object_name=name)
    call = _call_with_kwargs_async if inspect.iscoroutinefunction(raw) else _call_with_kwargs
    return partial(call, raw, dict(reward_kwargs))


def _call_with_kwargs(raw_fn: Callable[..., Any], extra_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    return raw_fn(*args, **{**kwargs, **extra_kwargs})  # verl's: the reward_kwargs win


async def _call_with_kwargs_async(raw_fn: Callable[..., Any], extra_kwargs: dict[str, Any], *args: Any,
                                  **kwargs: Any) -> Any:
    return await raw_fn(*args, **{**kwargs, **extra_kwargs})
