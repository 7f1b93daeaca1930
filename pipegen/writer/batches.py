"""Stream records -> padded verl DataProto batches, exactly as verl's agent-loop postprocessing builds them.

Batches are assembled by verl's own `AgentLoopWorker._postprocess`, run without Ray on a worker built
with `__new__` (only the attributes `_postprocess` reads are set). Per-trajectory padding uses verl's
`_agent_loop_postprocess` for anything unusual (multimodal, routed experts, over-long sequences); for
plain text it uses `pad_text_trajectory`, a direct torch version of the same padding that is ~10x
faster than verl's per-row `tokenizer.pad` calls. tests/test_verl_parity.py checks the result against
verl's real worker tensor for tensor, so the shortcut cannot drift silently.

Owns: the record -> row mapping (one row per trajectory; a unit's trajectories stay together), and
the int32 storage form of batch files.
Must never: touch the checkpoint or decide what is committed, or share its tokenizer (verl's
padding mutates `tokenizer.padding_side`).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from pipegen.run.records import RolloutRecord

ROW_ORDER = ("index", "sample", "trajectory")  # the non-tensor columns trajectories.pkl is sorted by
INT_TENSORS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


def object_array(values: list[Any]) -> np.ndarray:
    """A 1-D object array even when the values are lists (np.array would build a 2-D array)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


class BatchBuilder:
    def __init__(self, cfg: DictConfig, tokenizer):
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
        from verl.utils.config import omega_conf_to_dataclass

        worker = AgentLoopWorker.__new__(AgentLoopWorker)
        worker.config = cfg
        worker.rollout_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
        worker.tokenizer = tokenizer
        worker.processor = None
        worker.mm_processor_kwargs = {}
        worker.reward_loop_worker_handles = None
        worker.distillation_enabled = False
        self.worker = worker
        self.default_agent = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
        self.prompt_length = int(worker.rollout_config.prompt_length)
        self.response_length = int(worker.rollout_config.response_length)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    async def postprocess(self, output, kwargs: dict[str, Any]):
        if (output.routed_experts is None and not output.multi_modal_data and self.worker.processor is None
                and len(output.prompt_ids) <= self.prompt_length and len(output.response_ids) <= self.response_length
                and len(output.response_mask) == len(output.response_ids)):
            return pad_text_trajectory(output, kwargs, self.prompt_length, self.response_length, self.pad_id)
        return await self.worker._agent_loop_postprocess(output, False, **kwargs)

    async def build(self, records: list[RolloutRecord]):
        """One padded DataProto with a row per trajectory of every record, in the given order."""
        from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

        items, rows = [], []
        for record in records:
            kwargs = record.agent_kwargs(self.default_agent)
            for t, traj in enumerate(record.trajectories):
                output = AgentLoopOutput.model_validate(traj)
                items.append(await self.postprocess(output, kwargs))
                rows.append({**kwargs, "sample": record.sample, "trajectory": t, "seed": record.seed})
        keys = list(rows[0].keys())
        # dtypes as verl's collate_fn (object arrays) and AgentLoopManager (int64 priority) make them
        non_tensor = {k: object_array([r.get(k) for r in rows]) for k in keys}
        for k in ("sample", "trajectory", "priority"):
            non_tensor[k] = np.array([r[k] for r in rows], dtype=np.int64)
        return self.worker._postprocess(items, input_non_tensor_batch=non_tensor, validate=False)


def pad_text_trajectory(output, kwargs: dict[str, Any], prompt_length: int, response_length: int, pad_id: int):
    """What verl's `_agent_loop_postprocess` returns for a text-only trajectory without a processor:
    prompt left-padded and response right-padded with the pad id, response_mask zeroed on padding,
    logprobs padded with 0.0, positions = clip(cumsum(attention) - 1, 0)."""
    from verl.experimental.agent_loop.agent_loop import _InternalAgentLoopOutput
    from verl.utils.model import compute_position_id_with_mask

    output.extra_fields["raw_prompt"] = kwargs["raw_prompt"]
    p, r = output.prompt_ids, output.response_ids
    prompts = torch.full((1, prompt_length), pad_id, dtype=torch.long)
    prompt_att = torch.zeros((1, prompt_length), dtype=torch.long)
    if p:
        prompts[0, prompt_length - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_att[0, prompt_length - len(p):] = 1
    responses = torch.full((1, response_length), pad_id, dtype=torch.long)
    response_att = torch.zeros((1, response_length), dtype=torch.long)
    response_mask = torch.zeros((1, response_length), dtype=torch.long)
    logprobs = None
    if output.response_logprobs is not None:
        logprobs = torch.zeros((1, response_length), dtype=torch.float32)
        if output.response_logprobs:
            logprobs[0, : len(output.response_logprobs)] = torch.tensor(output.response_logprobs, dtype=torch.float32)
    if r:
        responses[0, : len(r)] = torch.tensor(r, dtype=torch.long)
        response_att[0, : len(r)] = 1
        response_mask[0, : len(r)] = torch.tensor(output.response_mask, dtype=torch.long)
    attention_mask = torch.cat([prompt_att, response_att], dim=1)
    return _InternalAgentLoopOutput(
        prompt_ids=prompts,
        response_ids=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        position_ids=compute_position_id_with_mask(attention_mask),
        response_mask=response_mask,
        attention_mask=attention_mask,
        response_logprobs=logprobs,
        routed_experts=None,
        multi_modal_inputs={},
        multi_modal_data=output.multi_modal_data,
        mm_processor_kwargs=output.mm_processor_kwargs,
        teacher_logprobs=None,
        teacher_ids=None,
        reward_score=output.reward_score,
        num_turns=output.num_turns,
        metrics=output.metrics,
        extra_fields=output.extra_fields,
    )


def load_batch(path: Path):
    """A batch file as written (what DataProto.save_to_disk writes; from_storage restores int64)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def to_storage(batch, int32: bool):
    """Halve batch files: token tensors fit int32 (ids and positions < 2**31)."""
    if int32:
        for key in INT_TENSORS:
            if key in batch.batch.keys():
                batch.batch[key] = batch.batch[key].to(torch.int32)
    return batch


def from_storage(batch):
    for key in INT_TENSORS:
        if key in batch.batch.keys() and batch.batch[key].dtype != torch.int64:
            batch.batch[key] = batch.batch[key].to(torch.int64)
    return batch


