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
