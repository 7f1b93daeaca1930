"""A run's trajectories as Parquet or JSON lines: one row per trajectory, for SFT and best-of-n without verl.

Columns, in order: index, sample, trajectory, uid, raw_prompt (the chat messages sent), response_text (the response
tokens decoded with the run's tokenizer, its special tokens such as `<|im_end|>` left out), prompt_ids,
response_ids, response_mask, rollout_log_probs, reward (the row's summed rm_scores, null when unscored),
finish_reason ("stop" when the last model token is an EOS id, else "length": verl's rows keep no finish reason, so
it is derived), messages
(what SFT loaders read: the prompt's messages, then an `assistant` message per run of model tokens, decoded
without special tokens, and the tokens between two runs (a tool's reply or a user turn as the chat template
rendered them) as a `tool` message; a gateway row's own messages as the harness held them), then every other
field of the row (the dataset row's fields, verl's uid/priority/__num_turns__, pipegen's session_id,
loss_weight and reward_rule, a loop's is_snapshot/snapshot_index; a field named like a built column, e.g. an
SFT set's own `messages`, gives way to it). verl's internal columns (`VERL_INTERNAL`,
and a multi_modal_inputs with nothing in it) are left out unless `rows.export_verl_columns=true`.
Nested fields keep their structure (Arrow lists and structs) when one Arrow type fits the whole column;
otherwise they are JSON strings, named in the file's `pipegen.json_columns` metadata.

Owns: the export row, its schema, and writing it in row groups from a run's `SortedRows` (pipegen/run/: rows
in the merged output's order, read batch by batch, so memory is one row group plus a few batch files).
Must never: write anything but its one output file, leave it half-written under its final name, or import
the writer (the export is a step after the merge, reading only the run directory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orjson
from omegaconf import DictConfig

from pipegen.run.atomic import atomic_write
from pipegen.run.batchfile import ROW_KEYS, BatchColumns
from pipegen.run.rows import SortedRows

FORMATS = ("parquet", "jsonl")
ROW_GROUP_ROWS = 1024
LEADING = (*ROW_KEYS, BatchColumns.UID, BatchColumns.RAW_PROMPT)
# what verl's agent loop adds to every row for its trainer's bookkeeping, not the sample's data
VERL_INTERNAL = ("global_steps", "min_global_steps", "max_global_steps", "extras", "tool_rewards", "turn_scores")
MULTI_MODAL_INPUTS = "multi_modal_inputs"
GATEWAY_FIELD = "gateway"  # the external loop's per-trajectory record (pipegen/gateway/loop.py), with its messages
MESSAGES = "messages"
BUILT = ("response_text", "prompt_ids", "response_ids", "response_mask", "rollout_log_probs", "reward",
         "finish_reason", MESSAGES)  # the columns built from the row's tensors, between LEADING and the rest


def exported_fields(cfg: DictConfig, non_tensor: dict[str, np.ndarray]) -> list[str]:
    """The run's non-tensor columns the export keeps: verl's internal ones only with rows.export_verl_columns."""
    rows = cfg.get("rows")
    if rows is not None and rows.get("export_verl_columns", False):
        return list(non_tensor)
    empty_media = MULTI_MODAL_INPUTS in non_tensor and not any(v for v in non_tensor[MULTI_MODAL_INPUTS])
    return [k for k in non_tensor if k not in VERL_INTERNAL and not (k == MULTI_MODAL_INPUTS and empty_media)]


def plain(value: Any) -> Any:
    """Python values Arrow and orjson take: numpy arrays and scalars become lists and numbers."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _writable(t: Any) -> bool:
    """Parquet cannot store structs without fields or null-typed children."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        return t.num_fields > 0 and all(_writable(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _writable(t.value_type)
    return not pa.types.is_null(t)


class RowSchema:
    """The export's columns and their Arrow types, fixed once from the whole run's non-tensor columns."""

    def __init__(self, plan: SortedRows, kept: list[str] | None = None):
        """kept: the non-tensor columns to export (`exported_fields`; None: all of them)."""
        import pyarrow as pa

        kept = list(plan.non_tensor) if kept is None else kept
        # a dataset field named like a column the export builds (an SFT set's `messages`, the prompt verl
        # rendered into raw_prompt) gives way to it: one column per name
        kept = [k for k in kept if k not in BUILT]
        self.fields = [k for k in LEADING if k in kept] + [k for k in kept if k not in LEADING]
        self.types: dict[str, Any] = {**{key: pa.int64() for key in ROW_KEYS}, BatchColumns.UID: pa.string()}
        self.json_columns: list[str] = []
        for key in self.fields:
            if key in self.types:
                continue
            try:
                t = pa.array([plain(v) for v in plan.non_tensor[key]]).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
                t = None
            if t is not None and pa.types.is_null(t):
                t = pa.string()  # every value is None: a null string column
            if t is None or not _writable(t):
                self.json_columns.append(key)
                t = pa.string()
            self.types[key] = t
        self.has_logprobs = BatchColumns.ROLLOUT_LOG_PROBS in plan.tensor_specs
        self.has_reward = BatchColumns.RM_SCORES in plan.tensor_specs

    def arrow(self) -> Any:
        import pyarrow as pa

        cols = [(k, self.types[k]) for k in self.fields if k in LEADING]
        cols += [("response_text", pa.string()), ("prompt_ids", pa.list_(pa.int32())),  # BUILT, in order
                 ("response_ids", pa.list_(pa.int32())), ("response_mask", pa.list_(pa.int8())),
                 ("rollout_log_probs", pa.list_(pa.float32())), ("reward", pa.float32()),
                 ("finish_reason", pa.string()),
                 (MESSAGES, pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))]
        cols += [(k, self.types[k]) for k in self.fields if k not in LEADING]
        meta = {"pipegen.json_columns": orjson.dumps(self.json_columns)}
        return pa.schema(cols, metadata=meta)


@dataclass
class RowGroup:
    """Consecutive sorted rows of a run: what `RowBuilder` reads (a DataProto's fields for them, as numpy)."""

    batch: dict[str, np.ndarray]
    non_tensor_batch: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.non_tensor_batch.values())))


class Detokenizer:
    """The run's tokenizer, for decoding only. A fast tokenizer's `tokenizer.json` goes through `tokenizers`, the
    library transformers' fast tokenizer wraps (the same decode), so the export imports neither verl, torch nor
    transformers: those imports were ~6 of a 64-row export's ~8 s here (idle; ~20 s on a busy 2-core box), the
    rows themselves ~0.1 s. A model folder without one loads the tokenizer as the run did (`load_tokenizer`)."""

    def __init__(self, cfg: DictConfig):
        model = cfg.actor_rollout_ref.model
        folder = Path(str(model.get("tokenizer_path") or model.path)).expanduser()
        self.fast: Any = None
        self.slow: Any = None
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self.fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
            eos = _json_file(folder / "tokenizer_config.json").get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            eos_id = self.fast.token_to_id(eos) if isinstance(eos, str) else None
        else:
            from pipegen.inputs.dataset import load_tokenizer

            self.slow = load_tokenizer(cfg)
            eos_id = self.slow.eos_token_id
        from pipegen.inputs.models import eos_ids  # as the servers stop on them

        self.eos_ids = set(eos_ids(folder, eos_id))

    def decode_batch(self, rows: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        if self.fast is not None:
            return self.fast.decode_batch(rows, skip_special_tokens=skip_special_tokens)
        return self.slow.batch_decode(rows, skip_special_tokens=skip_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.decode_batch([ids], skip_special_tokens)[0]


def _json_file(path: Path) -> dict[str, Any]:
    """A model folder's small JSON file, {} when it is missing or not a JSON object."""
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


class RowBuilder:
    """Row groups -> export columns (python lists / numpy per column, shared by both formats)."""

    def __init__(self, cfg: DictConfig, plan: SortedRows):
        self.tokenizer = Detokenizer(cfg)
        self.eos_ids = self.tokenizer.eos_ids
        self.schema = RowSchema(plan, exported_fields(cfg, plan.non_tensor))

    def columns(self, piece: RowGroup, json_strings: bool = True) -> dict[str, Any]:
        """Column name -> values for the piece's rows. Token lists are (flat values, offsets) pairs.
        ``json_strings``: nested fields no Arrow type fits become JSON text (Parquet); JSON lines keep them."""
        b, nt = piece.batch, piece.non_tensor_batch
        p = b[BatchColumns.PROMPTS].shape[1]
        attn = b[BatchColumns.ATTENTION_MASK].astype(bool)
        prompt_att, resp_att = attn[:, :p], attn[:, p:]
        prompt_off = _offsets(prompt_att.sum(1))
        resp_len = resp_att.sum(1)
        resp_off = _offsets(resp_len)
        response_ids = b[BatchColumns.RESPONSES][resp_att].astype(np.int32)
        mask = b[BatchColumns.RESPONSE_MASK][resp_att].astype(np.int8)
        per_row = np.split(response_ids, resp_off[1:-1])
        out: dict[str, Any] = {}
        for k in self.schema.fields:
            if k in LEADING:
                out[k] = self._values(k, nt[k], json_strings)
        out["response_text"] = self._decode([r.tolist() for r in per_row], skip_special_tokens=True)
        out["prompt_ids"] = (b[BatchColumns.PROMPTS][prompt_att].astype(np.int32), prompt_off)
        out["response_ids"] = (response_ids, resp_off)
        out["response_mask"] = (mask, resp_off)
        if self.schema.has_logprobs:
            logprobs = b[BatchColumns.ROLLOUT_LOG_PROBS][resp_att].astype(np.float32)
            out["rollout_log_probs"] = (logprobs, resp_off)
        else:
            out["rollout_log_probs"] = [None] * len(piece)
        out["reward"] = (b[BatchColumns.RM_SCORES].sum(-1, dtype=np.float32) if self.schema.has_reward
                         else [None] * len(piece))
        masks = np.split(mask, resp_off[1:-1])
        out["finish_reason"] = [self._finish(r, m) for r, m in zip(per_row, masks)]
        out[MESSAGES] = self._messages(nt, per_row, masks)
        for k in self.schema.fields:
            if k not in LEADING:
                out[k] = self._values(k, nt[k], json_strings)
        return out

    def _messages(self, nt: dict[str, np.ndarray], responses: list[np.ndarray], masks: list[np.ndarray]) -> list:
        """Each row's messages (see the header): the prompt's, then its response split at the mask's edges."""
        prompts = nt.get(BatchColumns.RAW_PROMPT)
        gateway = nt.get(GATEWAY_FIELD)
        pieces, roles = [], []  # every row's response pieces, decoded together in one batch call
        for ids, mask in zip(responses, masks):
            edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
            parts = np.split(ids, edges)
            starts = [0, *edges.tolist()]
            pieces.append([p.tolist() for p in parts if len(p)])
            roles.append(["assistant" if mask[s] else "tool" for s, p in zip(starts, parts) if len(p)])
        texts = iter(self._decode([p for row in pieces for p in row], skip_special_tokens=True))
        out = []
        for i, row_roles in enumerate(roles):
            answer = [{"role": role, "content": next(texts)} for role in row_roles]
            kept = gateway[i].get("messages") if gateway is not None and isinstance(gateway[i], dict) else None
            if isinstance(kept, list):
                out.append([_message(m) for m in kept])
                continue
            prompt = list(prompts[i]) if prompts is not None and prompts[i] is not None else []
            out.append([_message(m) for m in prompt] + answer)
        return out

    def _decode(self, rows: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return self.tokenizer.decode_batch(rows, skip_special_tokens=skip_special_tokens)

    def _values(self, key: str, values: np.ndarray, json_strings: bool) -> list[Any]:
        if key in ROW_KEYS:
            return [int(v) for v in values]
        if json_strings and key in self.schema.json_columns:
            return [orjson.dumps(plain(v)).decode() for v in values]
        return [plain(v) for v in values]

    def _finish(self, ids: np.ndarray, mask: np.ndarray) -> str:
        model = ids[mask.astype(bool)]
        return "stop" if len(model) and int(model[-1]) in self.eos_ids else "length"

    def table(self, piece: RowGroup) -> Any:
        import pyarrow as pa

        schema = self.schema.arrow()
        arrays = []
        for f, (name, values) in zip(schema, self.columns(piece).items()):
            assert f.name == name, (f.name, name)
            if isinstance(values, tuple):
                flat, off = values
                arrays.append(pa.ListArray.from_arrays(pa.array(off, pa.int32()), pa.array(flat, f.type.value_type)))
            else:
                arrays.append(pa.array(values, f.type))
        return pa.Table.from_arrays(arrays, schema=schema)

    def json_lines(self, piece: RowGroup) -> bytes:
        cols = self.columns(piece, json_strings=False)
        lists = {}
        for name, values in cols.items():
            if isinstance(values, tuple):
                flat, off = values
                lists[name] = [a.tolist() for a in np.split(flat, off[1:-1])] if len(off) > 1 else []
            else:
                lists[name] = values.tolist() if isinstance(values, np.ndarray) else values
        names = list(lists)
        return b"".join(orjson.dumps(dict(zip(names, row)), option=orjson.OPT_APPEND_NEWLINE)
                        for row in zip(*(lists[n] for n in names)))


def _message(m: Any) -> dict[str, str]:
    """A chat message as the messages column holds it: its role, and its content as text (a list of parts joined;
    anything else as JSON)."""
    if not isinstance(m, dict):
        return {"role": "user", "content": str(m)}
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    elif content is not None and not isinstance(content, str):
        content = orjson.dumps(plain(content)).decode()
    return {"role": str(m.get("role", "user")), "content": content or ""}


def _offsets(lengths: np.ndarray) -> np.ndarray:
    off = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    return off


def export_plan(cfg: DictConfig, plan: SortedRows, path: Path, fmt: str, row_group_rows: int = ROW_GROUP_ROWS) -> int:
    """Write the run's sorted rows to ``path`` in ``fmt`` (parquet or jsonl), atomically; returns the row count."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    builder = RowBuilder(cfg, plan)

    def pieces() -> Iterator[RowGroup]:
        for lo, hi in plan.ranges(row_group_rows):
            yield RowGroup(plan.tensors(lo, hi), {k: v[lo:hi] for k, v in plan.non_tensor.items()})
        plan.release()

    def write(f) -> None:
        if fmt == "jsonl":
            for piece in pieces():
                f.write(builder.json_lines(piece))
            return
        import pyarrow.parquet as pq

        with pq.ParquetWriter(f, builder.schema.arrow(), compression="zstd") as writer:
            for piece in pieces():
                writer.write_table(builder.table(piece), row_group_size=row_group_rows)

    atomic_write(Path(path), write)
    return plan.num_rows
