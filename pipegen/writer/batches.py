"""Stream records -> padded verl DataProto batches, exactly as verl's agent-loop postprocessing builds them,
and batch files <-> DataProtos.

Batches are assembled by verl's own `AgentLoopWorker._postprocess`, run without Ray on a worker built
with `__new__` (only the attributes `_postprocess` reads are set). The padding of each trajectory is
verl's `_agent_loop_postprocess` for anything unusual (multimodal, routed experts, over-long sequences,
a processor); for plain text the whole batch is padded at once with numpy (`pad_text_batch`): the same
left-padded prompts, right-padded responses, masks, 0.0-padded log-probs and positions
clip(cumsum(attention) - 1, 0), written into one array per tensor instead of a tensor per token list.
tests/test_verl_parity.py checks the result against verl's real worker tensor for tensor, and
tests/test_writer_batches.py checks the numpy padding against verl's per-trajectory path, so the shortcut
cannot drift silently.

Batch files are written and read through `pipegen/run/batchfile.py`, which owns their format (Arrow IPC:
nothing in one can execute on load); `encode_batch` and `load_batch` only convert between it and a DataProto.

Owns: the record -> row mapping (one row per trajectory, `trajectory` = 0, 1, ...; a unit's trajectories stay
together, each row with its sample's `session_id` and its `loss_weight`), and the DataProto side of a batch file.
Must never: touch the checkpoint or decide what is committed, or share its tokenizer (verl's
padding mutates `tokenizer.padding_side`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from pipegen.config.schema import Rows
from pipegen.run.batchfile import (INT_TENSORS, BatchColumns, StoredBatch, attention_mask_of, encode_batch_file,
                                   object_array, position_ids_of, read_batch)
from pipegen.run.pictures import MULTI_MODAL_INPUTS, decode_multi_modal_data
from pipegen.run.stream import PieceKeys, RolloutRecord, TrajectoryKeys, session_id
from pipegen.verl_private import postprocess_batch, postprocess_trajectory, postprocess_worker

REWARD_EXTRA_INFO = "reward_extra_info"  # verl's key in AgentLoopOutput.extra_fields
INT64_COLUMNS = (BatchColumns.SAMPLE, BatchColumns.TRAJECTORY, BatchColumns.PRIORITY)


class BatchBuilder:
    def __init__(self, cfg: DictConfig, tokenizer, processor=None):
        """processor: the model's multimodal processor (`inputs.dataset.load_processor`); with one, every row
        goes through verl's own postprocessing, which builds multi_modal_inputs and the M-RoPE position ids."""
        worker = postprocess_worker(cfg, tokenizer, processor)
        self.worker = worker
        self.default_agent = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
        self.prompt_length = int(worker.rollout_config.prompt_length)
        self.response_length = int(worker.rollout_config.response_length)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # an older run's saved config lacks the group: its default
        self.session_weight = (cfg.get("rows") or {}).get("loss_weight", Rows.loss_weight) == "session"

    def plain_text(self, traj: dict[str, Any]) -> bool:
        """Whether verl's per-trajectory postprocessing reduces to plain padding for this trajectory."""
        logprobs = traj.get(TrajectoryKeys.RESPONSE_LOGPROBS)
        return (traj.get(TrajectoryKeys.ROUTED_EXPERTS) is None and not traj.get(TrajectoryKeys.MULTI_MODAL_DATA)
                and self.worker.processor is None
                and len(traj[TrajectoryKeys.PROMPT_IDS]) <= self.prompt_length
                and len(traj[TrajectoryKeys.RESPONSE_IDS]) <= self.response_length
                and len(traj[TrajectoryKeys.RESPONSE_MASK]) == len(traj[TrajectoryKeys.RESPONSE_IDS])
                and (logprobs is None or len(logprobs) <= self.response_length))

    async def build(self, records: list[RolloutRecord], int32: bool = False):
        """One padded DataProto with a row per trajectory of every record, in the given order.

        int32: token tensors may come out as int32, the storage form (`from_storage` gives verl's
        int64); the plain-text path then pads in int32 directly, half the memory traffic."""
        return (await self.build_for_storage(records, int32))[0]

    async def build_for_storage(self, records: list[RolloutRecord], int32: bool) -> tuple[Any, dict[str, Any]]:
        """`build`, and the tensors that equal what `load_batch` derives by construction, for
        `encode_batch` (the plain-text path builds input_ids and position_ids from prompts, responses
        and the attention mask, and that mask from each row's prompt and response lengths)."""
        kwargs_of, trajs = [], []
        samples, trajectory_numbers, seeds, sessions, weights = [], [], [], [], []
        for record in records:
            kwargs = record.agent_kwargs(self.default_agent)
            # every piece of a sample is one session; with rows.loss_weight=session each weighs 1/k, so a sample
            # split into k rows weighs what a one-row sample does (verl#7580's per-row loss_weight)
            session = session_id(record.uid, record.sample)
            weight = 1.0 / record.num_rows if self.session_weight else 1.0
            for t, traj in enumerate(record.trajectories):
                kwargs_of.append(kwargs)
                trajs.append(traj)
                samples.append(record.sample)
                trajectory_numbers.append(t)
                seeds.append(record.seed)
                sessions.append(session)
                weights.append(weight)
        uniform_reward_extras(trajs)
        # the columns each row has besides its kwargs
        per_row = {BatchColumns.SAMPLE: samples, BatchColumns.TRAJECTORY: trajectory_numbers, BatchColumns.SEED: seeds,
                   PieceKeys.SESSION_ID: sessions, PieceKeys.LOSS_WEIGHT: weights}
        has_logprobs = {traj.get(TrajectoryKeys.RESPONSE_LOGPROBS) is not None for traj in trajs}
        if len(has_logprobs) == 1 and all(self.plain_text(traj) for traj in trajs):
            items = pad_text_batch(trajs, kwargs_of, self.prompt_length, self.response_length, self.pad_id,
                                   np.int32 if int32 else np.int64)
            derived = {BatchColumns.INPUT_IDS: None, BatchColumns.POSITION_IDS: None, BatchColumns.ATTENTION_MASK: (
                np.array([len(t[TrajectoryKeys.PROMPT_IDS]) for t in trajs], dtype=np.int32),
                np.array([len(t[TrajectoryKeys.RESPONSE_IDS]) for t in trajs], dtype=np.int32))}
        else:
            items = [await self._verl_postprocess(traj, kwargs) for traj, kwargs in zip(trajs, kwargs_of)]
            derived = {}
        # the first row's columns, in its order; dtypes as verl's collate_fn (object arrays) and
        # AgentLoopManager (int64 priority) make them
        non_tensor = {}
        for k in dict.fromkeys([*kwargs_of[0], *per_row]):
            values = per_row[k] if k in per_row else [kwargs.get(k) for kwargs in kwargs_of]
            non_tensor[k] = (np.array(values, dtype=np.int64) if k in INT64_COLUMNS else
                             np.array(values, dtype=np.float64) if k == PieceKeys.LOSS_WEIGHT else object_array(values))
        return postprocess_batch(self.worker, items, non_tensor), derived

    async def _verl_postprocess(self, traj: dict[str, Any], kwargs: dict[str, Any]):
        from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

        plain = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in traj.items()}
        if plain.get(TrajectoryKeys.MULTI_MODAL_DATA):  # the line's PNGs back as the pictures verl's loop had
            plain[TrajectoryKeys.MULTI_MODAL_DATA] = decode_multi_modal_data(plain[TrajectoryKeys.MULTI_MODAL_DATA])
        output = AgentLoopOutput.model_validate(plain)
        return await postprocess_trajectory(self.worker, output, **kwargs)


def uniform_reward_extras(trajs: list[dict[str, Any]]) -> None:
    """Every row's reward_extra_info with the same keys (a missing one as None): verl's `_postprocess` takes
    the first row's keys for every row, so rows scored by different rewards (tasks of one run), or a
    reward whose dict varies, would fail the batch or lose columns."""
    infos = [(traj.get(TrajectoryKeys.EXTRA_FIELDS) or {}).get(REWARD_EXTRA_INFO) for traj in trajs]
    keys = list(dict.fromkeys(k for info in infos if info for k in info))
    if not keys or all(info is not None and len(info) == len(keys) for info in infos):
        return
    for traj, info in zip(trajs, infos):
        fields = traj.get(TrajectoryKeys.EXTRA_FIELDS)
        if fields is None:
            fields = traj[TrajectoryKeys.EXTRA_FIELDS] = {}
        fields[REWARD_EXTRA_INFO] = {k: (info or {}).get(k) for k in keys}


@dataclass(slots=True)
class PaddedRow:
    """One padded trajectory with exactly the attributes verl's `_postprocess` reads from its
    `_InternalAgentLoopOutput` inputs (building that pydantic model per row cost more than padding)."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    attention_mask: torch.Tensor
    response_logprobs: torch.Tensor | None
    reward_score: float | None
    num_turns: int
    metrics: Any  # verl's AgentLoopMetrics
    extra_fields: dict[str, Any]
    multi_modal_inputs: dict[str, Any] = field(default_factory=dict)
    routed_experts: None = None
    teacher_logprobs: None = None
    teacher_ids: None = None


def pad_text_batch(trajs: list[dict[str, Any]], kwargs_of: list[dict[str, Any]], prompt_length: int,
                   response_length: int, pad_id: int, dtype: type = np.int64) -> list[PaddedRow]:
    """What verl's `_agent_loop_postprocess` returns for text-only trajectories without a processor,
    padded for the whole batch at once: prompt left-padded and response right-padded with the pad id,
    response_mask zeroed on padding, logprobs padded with 0.0 (float32), positions =
    clip(cumsum(attention) - 1, 0), extra_fields["raw_prompt"] set; integer tensors in dtype (verl's
    is int64). Only for verl's `_postprocess`: the first row holds every row's tensors (see below)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics

    rows, P, R = len(trajs), prompt_length, response_length
    prompts = np.full((rows, P), pad_id, dtype=dtype)
    responses = np.full((rows, R), pad_id, dtype=dtype)
    response_mask = np.zeros((rows, R), dtype=dtype)
    with_logprobs = trajs[0].get(TrajectoryKeys.RESPONSE_LOGPROBS) is not None
    logprobs = np.zeros((rows, R), dtype=np.float32) if with_logprobs else None
    prompt_lens = np.empty(rows, dtype=np.intp)
    response_lens = np.empty(rows, dtype=np.intp)
    for i, traj in enumerate(trajs):
        p, r = traj[TrajectoryKeys.PROMPT_IDS], traj[TrajectoryKeys.RESPONSE_IDS]
        prompt_lens[i] = n = len(p)
        if n:
            prompts[i, P - n:] = p
        response_lens[i] = n = len(r)
        if n:
            responses[i, :n] = r
            response_mask[i, :n] = traj[TrajectoryKeys.RESPONSE_MASK]
        if with_logprobs:
            lp = traj[TrajectoryKeys.RESPONSE_LOGPROBS]
            if len(lp):
                # float64 -> float32 rounds to nearest, as torch.tensor(list_of_floats, dtype=float32) does
                logprobs[i, : len(lp)] = lp
    # attention: 1 over each row's prompt (left-padded) and response (right-padded), in one pass; in the
    # storage form (int32 tokens) as int8, the mask's on-disk type, so neither verl's concatenation
    # nor the batch file moves 4 bytes per 0/1 value
    inside = attention_mask_of(prompt_lens, response_lens, P, R)
    attention = inside.view(np.int8) if dtype == np.int32 else inside.astype(dtype)
    positions = position_ids_of(attention)
    # verl's _postprocess only concatenates the rows' tensors along dim 0. The first row carries the
    # whole batch and every other row an empty (0, L) tensor: the concatenation is the same batch,
    # without a tensor view per row and tensor (~1 us each, a tenth of the writer's time at 1k tokens).
    whole = [torch.from_numpy(a) for a in
             (prompts, responses, np.concatenate([prompts, responses], axis=1), positions, response_mask, attention)]
    if logprobs is not None:
        whole.append(torch.from_numpy(logprobs))
    empty = [t[:0] for t in whole]
    out = []
    for i, (traj, kwargs) in enumerate(zip(trajs, kwargs_of)):
        p, r, ids, pos, mask, att, *lp = whole if i == 0 else empty
        score = traj.get(TrajectoryKeys.REWARD_SCORE)
        out.append(PaddedRow(
            prompt_ids=p, response_ids=r, input_ids=ids, position_ids=pos, response_mask=mask, attention_mask=att,
            response_logprobs=lp[0] if lp else None, reward_score=None if score is None else float(score),
            num_turns=int(traj.get(TrajectoryKeys.NUM_TURNS, 0)),
            metrics=AgentLoopMetrics.model_validate(traj[TrajectoryKeys.METRICS]),
            extra_fields={**(traj.get(TrajectoryKeys.EXTRA_FIELDS) or {}),
                          BatchColumns.RAW_PROMPT: kwargs[BatchColumns.RAW_PROMPT]},
        ))
    return out


# ---- the batch file (its format is the run contract's: pipegen/run/batchfile.py) ----


def encode_batch(batch, int32: bool, derived_known: dict[str, Any] | None = None) -> list[Any]:
    """A DataProto as the buffers of a batch file, in order (write them one after the other).

    derived_known: tensors the caller built as `load_batch` derives them (`build_for_storage`)."""
    return encode_batch_file({k: t.numpy() for k, t in batch.batch.items()}, batch.non_tensor_batch,
                             batch.meta_info, int32, derived_known)


def load_batch(path: Path):
    """A batch file as a DataProto, token tensors as stored (int32 when batch_int32; from_storage
    restores verl's int64). Raises BatchFileError (with the path) for a damaged or foreign file."""
    return to_dataproto(read_batch(path))


def to_dataproto(stored: StoredBatch):
    """verl's DataProto over a batch file's arrays (no copy)."""
    from tensordict import TensorDict
    from verl.protocol import DataProto

    tensors = {k: torch.from_numpy(v) for k, v in stored.tensors.items()}
    return DataProto(batch=TensorDict(tensors, batch_size=[len(stored)]),
                     non_tensor_batch=torch_tensor_dicts(stored.non_tensor), meta_info=stored.meta_info)


def torch_tensor_dicts(non_tensor: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Non-tensor columns with each dict of numpy arrays (a batch file's multi_modal_inputs) as a dict of torch
    tensors, as verl's agent loop holds it and its trainer concatenates it."""

    values = non_tensor.get(MULTI_MODAL_INPUTS)
    if values is None:
        return non_tensor
    converted = object_array([None if v is None else {k: torch.from_numpy(np.asarray(t)) for k, t in v.items()}
                              for v in values])
    return {**non_tensor, MULTI_MODAL_INPUTS: converted}


def from_storage(batch):
    for key in INT_TENSORS:
        if key in batch.batch.keys() and batch.batch[key].dtype != torch.int64:
            batch.batch[key] = batch.batch[key].to(torch.int64)
    return batch
