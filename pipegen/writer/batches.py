"""Stream records -> padded verl DataProto batches, exactly as verl's agent-loop postprocessing builds them,
and the batch file format.

Batches are assembled by verl's own `AgentLoopWorker._postprocess`, run without Ray on a worker built
with `__new__` (only the attributes `_postprocess` reads are set). The padding of each trajectory is
verl's `_agent_loop_postprocess` for anything unusual (multimodal, routed experts, over-long sequences,
a processor); for plain text the whole batch is padded at once with numpy (`pad_text_batch`): the same
left-padded prompts, right-padded responses, masks, 0.0-padded log-probs and positions
clip(cumsum(attention) - 1, 0), written into one array per tensor instead of a tensor per token list.
tests/test_verl_parity.py checks the result against verl's real worker tensor for tensor, and
tests/test_writer_batches.py checks the numpy padding against verl's per-trajectory path, so the shortcut
cannot drift silently.

Batch files (`batch_NNNNN.pkl`, internal to a run) hold the batch as numpy arrays in pickle protocol 5
with the array bytes out of band, so writing one is a few large `write()`s and reading one is a single
`readinto` with no copy per tensor (pickling a DataProto instead runs `torch.save` per tensor; it was
a quarter of the writer's time). To keep files small (they are fsynced, and writing them costs the
writer more than any step but the parse), token tensors are int32 and 0/1 masks int8 on disk
(`batch_int32`), a 0/1 response_mask one bit per token, and what `load_batch` can rebuild exactly
is dropped: `input_ids` (prompts ++ responses), 2-D `position_ids`, an attention mask that is verl's
left/right padding of its row's lengths (two lengths per row), and an rm_scores that is zeros with
each row's reward at its last response token (one float per row). Each is checked at encode unless
the caller built it that way (`build_for_storage`); anything else is stored as it is. 64 rows of 1k
tokens: 1066 KB before these, 617 KB after. `load_batch` returns the same DataProto as before this
format: int32 token tensors, which `from_storage` turns back into verl's int64.

Owns: the record -> row mapping (one row per trajectory; a unit's trajectories stay together), and
the batch file format.
Must never: touch the checkpoint or decide what is committed, or share its tokenizer (verl's
padding mutates `tokenizer.padding_side`).
"""

from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from pipegen.run.records import RolloutRecord
from pipegen.verl_private import postprocess_batch, postprocess_trajectory, postprocess_worker

ROW_ORDER = ("index", "sample", "trajectory")  # the non-tensor columns trajectories.pkl is sorted by
INT_TENSORS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")
MASK_TENSORS = ("response_mask", "attention_mask")  # 0/1 values: int8 on disk
INT64_COLUMNS = ("sample", "trajectory", "priority")
_INT32 = np.dtype(np.int32).str
FILE_MAGIC = b"PGBATCH1"
_ALIGN = 64


def object_array(values: list[Any]) -> np.ndarray:
    """A 1-D object array even when the values are lists (np.array would build a 2-D array)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


class BatchBuilder:
    def __init__(self, cfg: DictConfig, tokenizer):
        worker = postprocess_worker(cfg, tokenizer)
        self.worker = worker
        self.default_agent = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
        self.prompt_length = int(worker.rollout_config.prompt_length)
        self.response_length = int(worker.rollout_config.response_length)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def plain_text(self, traj: dict[str, Any]) -> bool:
        """Whether verl's per-trajectory postprocessing reduces to plain padding for this trajectory."""
        logprobs = traj.get("response_logprobs")
        return (traj.get("routed_experts") is None and not traj.get("multi_modal_data")
                and self.worker.processor is None
                and len(traj["prompt_ids"]) <= self.prompt_length
                and len(traj["response_ids"]) <= self.response_length
                and len(traj["response_mask"]) == len(traj["response_ids"])
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
        per_row: dict[str, list[Any]] = {"sample": [], "trajectory": [], "seed": []}  # each row's kwargs plus these
        for record in records:
            kwargs = record.agent_kwargs(self.default_agent)
            for t, traj in enumerate(record.trajectories):
                kwargs_of.append(kwargs)
                trajs.append(traj)
                per_row["sample"].append(record.sample)
                per_row["trajectory"].append(t)
                per_row["seed"].append(record.seed)
        has_logprobs = {traj.get("response_logprobs") is not None for traj in trajs}
        if len(has_logprobs) == 1 and all(self.plain_text(traj) for traj in trajs):
            items = pad_text_batch(trajs, kwargs_of, self.prompt_length, self.response_length, self.pad_id,
                                   np.int32 if int32 else np.int64)
            derived = {"input_ids": None, "position_ids": None, "attention_mask": (
                np.array([len(t["prompt_ids"]) for t in trajs], dtype=np.int32),
                np.array([len(t["response_ids"]) for t in trajs], dtype=np.int32))}
        else:
            items = [await self._verl_postprocess(traj, kwargs) for traj, kwargs in zip(trajs, kwargs_of)]
            derived = {}
        # the first row's columns, in its order; dtypes as verl's collate_fn (object arrays) and
        # AgentLoopManager (int64 priority) make them
        non_tensor = {}
        for k in dict.fromkeys([*kwargs_of[0], *per_row]):
            values = per_row[k] if k in per_row else [kwargs.get(k) for kwargs in kwargs_of]
            non_tensor[k] = np.array(values, dtype=np.int64) if k in INT64_COLUMNS else object_array(values)
        return postprocess_batch(self.worker, items, non_tensor), derived

    async def _verl_postprocess(self, traj: dict[str, Any], kwargs: dict[str, Any]):
        from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

        plain = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in traj.items()}
        output = AgentLoopOutput.model_validate(plain)
        return await postprocess_trajectory(self.worker, output, **kwargs)


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
    with_logprobs = trajs[0].get("response_logprobs") is not None
    logprobs = np.zeros((rows, R), dtype=np.float32) if with_logprobs else None
    prompt_lens = np.empty(rows, dtype=np.intp)
    response_lens = np.empty(rows, dtype=np.intp)
    for i, traj in enumerate(trajs):
        p, r = traj["prompt_ids"], traj["response_ids"]
        prompt_lens[i] = n = len(p)
        if n:
            prompts[i, P - n:] = p
        response_lens[i] = n = len(r)
        if n:
            responses[i, :n] = r
            response_mask[i, :n] = traj["response_mask"]
        if with_logprobs:
            lp = traj["response_logprobs"]
            if len(lp):
                # float64 -> float32 rounds to nearest, as torch.tensor(list_of_floats, dtype=float32) does
                logprobs[i, : len(lp)] = lp
    # attention: 1 over each row's prompt (left-padded) and response (right-padded), in one pass; in the
    # storage form (int32 tokens) as int8, the mask's on-disk type, so neither verl's concatenation
    # nor the batch file moves 4 bytes per 0/1 value
    inside = _attention(prompt_lens, response_lens, P, R)
    attention = inside.view(np.int8) if dtype == np.int32 else inside.astype(dtype)
    positions = _positions(attention)
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
        score = traj.get("reward_score")
        out.append(PaddedRow(
            prompt_ids=p, response_ids=r, input_ids=ids, position_ids=pos, response_mask=mask, attention_mask=att,
            response_logprobs=lp[0] if lp else None, reward_score=None if score is None else float(score),
            num_turns=int(traj.get("num_turns", 0)),
            metrics=AgentLoopMetrics.model_validate(traj["metrics"]),
            extra_fields={**(traj.get("extra_fields") or {}), "raw_prompt": kwargs["raw_prompt"]},
        ))
    return out


# ---- the batch file ----


def encode_batch(batch, int32: bool, derived_known: dict[str, Any] | None = None) -> list[bytes | memoryview]:
    """A DataProto as the chunks of a batch file, in order (write them one after the other).

    derived_known: tensors the caller built as `load_batch` derives them (`build_for_storage`; for
    attention_mask its (prompt lengths, response lengths)); the others are compared with their
    derivation and dropped only when equal.

    Layout: magic, header length and buffer lengths (little-endian u64), the pickled header (numpy
    arrays out of band), then each array's bytes at a 64-byte aligned offset."""
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    keys = list(batch.batch.keys())
    derived_known = derived_known or {}
    derived = [key for key in ("input_ids", "position_ids") if key in derived_known and key in keys]
    binary: set[str] = set()  # masks with only 0 and 1
    for key, tensor in batch.batch.items():
        arr = tensor.numpy()
        if int32 and key in INT_TENSORS:
            dtypes[key] = _INT32  # what load_batch returns; from_storage restores verl's int64
            if key in derived:
                pass
            elif arr.dtype == np.int8:  # already in its disk form (pad_text_batch's attention mask)
                if key in MASK_TENSORS and _binary(arr):
                    binary.add(key)
            else:
                arr = arr.astype(np.int32, copy=False)  # ids and positions < 2**31
                if key in MASK_TENSORS and _binary(arr):
                    arr = arr.astype(np.int8)
                    binary.add(key)
        else:
            dtypes[key] = arr.dtype.str
        if key not in derived:
            tensors[key] = np.ascontiguousarray(arr)
    if "input_ids" not in derived and {"prompts", "responses", "input_ids"} <= tensors.keys() and np.array_equal(
            tensors["input_ids"], np.concatenate([tensors["prompts"], tensors["responses"]], axis=1)):
        derived.append("input_ids")
    if "position_ids" not in derived and {"attention_mask", "position_ids"} <= tensors.keys() and \
            tensors["position_ids"].ndim == 2 and \
            np.array_equal(tensors["position_ids"], _positions(tensors["attention_mask"])):
        derived.append("position_ids")
    spans = derived_known["attention_mask"] if "attention_mask" in derived_known else _spans(tensors)
    scores = _last_token_scores(tensors, None if spans is None else spans[1])
    if scores is not None:
        derived.append("rm_scores")
    if spans is not None:
        derived.append("attention_mask")
    packed = [key for key in ("response_mask",) if key in binary and key not in derived]  # 0/1: a bit each
    for key in packed:
        tensors[key] = np.packbits(tensors[key], axis=-1)
    header = {"batch_size": len(batch), "keys": keys, "dtypes": dtypes, "derived": derived,
              "tensors": {k: v for k, v in tensors.items() if k not in derived},
              "non_tensor_batch": batch.non_tensor_batch, "meta_info": batch.meta_info}
    if scores is not None:
        header["rm_scores_at_last_token"] = scores
    if spans is not None:
        header["attention_spans"] = spans
    if packed:
        header["bit_packed"] = packed
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(header, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    chunks: list[bytes | memoryview] = [FILE_MAGIC, struct.pack(f"<{2 + len(raws)}Q", len(head), len(raws),
                                                                  *(r.nbytes for r in raws)), head]
    offset = sum(len(c) for c in chunks)
    for raw in raws:
        pad = -offset % _ALIGN
        if pad:
            chunks.append(bytes(pad))
        chunks.append(raw)
        offset += pad + raw.nbytes
    return chunks


def load_batch(path: Path):
    """A batch file as a DataProto, token tensors as stored (int32 when batch_int32; from_storage
    restores verl's int64)."""
    from tensordict import TensorDict
    from verl.protocol import DataProto

    with open(path, "rb") as f:
        data = bytearray(f.seek(0, 2))
        f.seek(0)
        f.readinto(data)
    if not data.startswith(FILE_MAGIC):
        return pickle.loads(data)  # a DataProto pickled by an older pipegen
    view = memoryview(data)
    pos = len(FILE_MAGIC)
    head_len, count = struct.unpack_from("<2Q", view, pos)
    sizes = struct.unpack_from(f"<{count}Q", view, pos + 16)
    pos += 16 + 8 * count
    head = view[pos : pos + head_len]
    pos += head_len
    buffers = []
    for size in sizes:
        pos += -pos % _ALIGN
        buffers.append(view[pos : pos + size])
        pos += size
    header = pickle.loads(head, buffers=buffers)
    arrays = header["tensors"]
    for key in header.get("bit_packed", ()):
        arrays[key] = np.unpackbits(arrays[key], axis=-1, count=arrays["responses"].shape[-1]).view(np.int8)
    if "attention_mask" in header["derived"]:
        prompt_lens, response_lens = header["attention_spans"]
        arrays["attention_mask"] = _attention(prompt_lens, response_lens, arrays["prompts"].shape[1],
                                              arrays["responses"].shape[1]).view(np.int8)
    if "input_ids" in header["derived"]:
        arrays["input_ids"] = np.concatenate([arrays["prompts"], arrays["responses"]], axis=1)
    if "position_ids" in header["derived"]:
        arrays["position_ids"] = _positions(arrays["attention_mask"])
    if "rm_scores" in header["derived"]:
        scores = header["rm_scores_at_last_token"]
        rm_scores = np.zeros((len(scores), arrays["responses"].shape[1]), dtype=scores.dtype)
        rm_scores[np.arange(len(scores)), _score_columns(arrays["attention_mask"], arrays["prompts"].shape[1])] = scores
        arrays["rm_scores"] = rm_scores
    tensors = {k: torch.from_numpy(arrays[k].astype(np.dtype(header["dtypes"][k]), copy=False))
               for k in header["keys"]}
    return DataProto(batch=TensorDict(tensors, batch_size=[header["batch_size"]]),
                     non_tensor_batch=header["non_tensor_batch"], meta_info=header["meta_info"])


def _binary(arr: np.ndarray) -> bool:
    return bool(arr.size) and arr.min() >= 0 and arr.max() <= 1


def _attention(prompt_lens: np.ndarray, response_lens: np.ndarray, prompt_length: int,
               response_length: int) -> np.ndarray:
    """verl's attention mask for left-padded prompts and right-padded responses, as bool."""
    columns = np.arange(prompt_length + response_length)
    return (columns >= (prompt_length - prompt_lens)[:, None]) & (columns < (prompt_length + response_lens)[:, None])


def _spans(tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """(prompt lengths, response lengths) when the attention mask is exactly `_attention` of them."""
    attention, prompts, responses = (tensors.get(k) for k in ("attention_mask", "prompts", "responses"))
    if attention is None or prompts is None or responses is None or attention.ndim != 2 or \
            attention.shape != (len(prompts), prompts.shape[1] + responses.shape[1]):
        return None
    P = prompts.shape[1]
    lens = attention[:, :P].sum(axis=1, dtype=np.int32), attention[:, P:].sum(axis=1, dtype=np.int32)
    return lens if np.array_equal(attention, _attention(*lens, P, responses.shape[1])) else None


def _score_columns(attention_mask: np.ndarray, prompt_length: int) -> np.ndarray:
    """Where verl's `_postprocess` puts each row's reward in rm_scores: its last response token,
    attention_mask[:, P:].sum(1) - 1 (-1, the last column, for an empty response, as torch indexes)."""
    return attention_mask[:, prompt_length:].sum(axis=1) - 1


def _last_token_scores(tensors: dict[str, np.ndarray], response_lens: np.ndarray | None) -> np.ndarray | None:
    """rm_scores as one value per row when it is exactly verl's layout (zeros, each row's reward at
    `_score_columns`; compared bit for bit, so -0.0 or NaN elsewhere keeps the full tensor): a quarter
    of a batch file's bytes at 1k tokens, for one float per row."""
    rm, attention, prompts = (tensors.get(k) for k in ("rm_scores", "attention_mask", "prompts"))
    if rm is None or attention is None or prompts is None or rm.dtype != np.float32 or rm.ndim != 2 \
            or attention.ndim != 2 or prompts.ndim != 2 or rm.shape != (len(attention), attention.shape[1] - prompts.shape[1]):
        return None
    columns = _score_columns(attention, prompts.shape[1]) if response_lens is None else response_lens - 1
    scores = rm[np.arange(len(rm)), columns]
    if np.count_nonzero(rm.view(np.int32)) != np.count_nonzero(scores.view(np.int32)):
        return None
    return scores


def _positions(attention_mask: np.ndarray) -> np.ndarray:
    """verl's compute_position_id_with_mask: clip(cumsum(mask) - 1, 0), in the mask's integer width."""
    dtype = attention_mask.dtype if attention_mask.dtype.itemsize >= 4 else np.int32
    positions = np.cumsum(attention_mask, axis=1, dtype=dtype)
    positions -= 1
    return np.maximum(positions, 0, out=positions)  # in place: np.clip allocates twice


def from_storage(batch):
    for key in INT_TENSORS:
        if key in batch.batch.keys() and batch.batch[key].dtype != torch.int64:
            batch.batch[key] = batch.batch[key].to(torch.int64)
    return batch
