"""The batch file, `batch_NNNNN.arrow`: one committed batch of a run, a file that is data and nothing else.

A batch file is an Arrow IPC file (the "Feather v2" format any Arrow reader opens) holding one record
batch with a row per trajectory row of the batch:

  tensor/<key>   each tensor the file stores: an Arrow list of fixed width per row (trailing shape
                 in the metadata), in its on-disk dtype
  column/<key>   each non-tensor column of a plain numpy dtype (sample, trajectory, priority, ...) as
                 Arrow's own type, and a row key of Python ints (index) as int64
  tensors/<key>  a column of dicts of tensors per row (verl's multi_modal_inputs: pixel_values, image_grid_thw,
                 ...): each tensor's name, dtype, shape and raw bytes (run/pictures.py), read back as numpy
  rows/json      every other non-tensor column (the dataset row's fields, uid, ...): one JSON array
                 per row, the columns in the metadata's order
  lengths/prompt, lengths/response, reward/last_token   what the dropped tensors are rebuilt from

and, in the schema's metadata under `pipegen.batch`, a JSON object: the format name, the row count,
the tensor keys in order with the dtype `read_batch` returns for each, which tensors are derived or
bit-packed, each column's kind, and the batch's meta_info. Reading one parses Arrow buffers and JSON:
nothing in a batch file can run code, so a damaged or planted file can only be refused
(`BatchFileError`, naming the file). Chosen by measurement on a 64-row batch of 1k tokens (encode /
decode, ms): the old pickle 0.15 / 0.08, Arrow 0.33 / 0.36, safetensors 0.14 / 0.24 (the dataset rows
only as a JSON blob in its header), `.npz` 0.33 / 0.60 (zip CRCs). Arrow is the one that keeps tensors and
dataset rows in one row-aligned file that any Arrow reader opens, at +0.1 ms of the writer's CPU per
batch once tuned (see `_encode_columns`, `_Chunks`).

To keep files small (they are fsynced, and writing them costs the writer more than any step but the
parse), token tensors are int32 and 0/1 masks int8 on disk, a 0/1 response_mask one bit per token,
and what `read_batch` rebuilds exactly is dropped: `input_ids` (prompts ++ responses), 2-D
`position_ids`, an attention mask that is verl's left/right padding of its row's lengths (two lengths
per row), and an rm_scores that is zeros with each row's reward at its last response token (one float
per row). Each is checked at encode unless the caller built it that way (`derived_known`); anything
else is stored as it is.

Object columns hold what the stream line held: JSON values. A numpy array or scalar inside one is
stored as its JSON list or number; any other Python object is refused at encode, naming the column.

A run's rows are read back through `run/rows.py` (in the output's order, or one batch's row keys).

Owns: the batch file's format (encode, read, the typed error), the names of a batch's columns
(`BatchColumns`: verl's tensor keys and the non-tensor columns pipegen reads by name), which of them
name a row (`ROW_KEYS`), and the layout of verl's padded rows that the format rebuilds
(`attention_mask_of`, `position_ids_of`).
Must never: import verl or torch (status reads batch files), unpickle anything, or know about a run
(which batch files are committed, where they are): it reads and writes one file's content.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson
import pyarrow as pa

from pipegen.run.pictures import is_tensor_dict_column, read_tensor_dict_column, tensor_dict_column


class BatchColumns:
    """The names of a batch's columns, as verl's DataProto holds them and a batch file stores them
    (`tensor/<name>`, `column/<name>`): changing one makes existing run directories unreadable. The dataset
    row's other fields keep their own names."""

    # tensors of verl's agent-loop postprocessing (`AgentLoopWorker._postprocess`), one row per trajectory
    PROMPTS: Final = "prompts"  # prompt ids, left-padded to prompt_length
    RESPONSES: Final = "responses"  # response ids, right-padded to response_length
    INPUT_IDS: Final = "input_ids"  # prompts ++ responses
    ATTENTION_MASK: Final = "attention_mask"
    POSITION_IDS: Final = "position_ids"
    RESPONSE_MASK: Final = "response_mask"
    ROLLOUT_LOG_PROBS: Final = "rollout_log_probs"  # only when the servers returned log-probs
    RM_SCORES: Final = "rm_scores"  # the reward at each row's last response token; only when all were scored
    # non-tensor columns: verl's (the dataset row's index, the agent-loop kwargs) and pipegen's own
    INDEX: Final = "index"
    SAMPLE: Final = "sample"  # 0..n-1
    TRAJECTORY: Final = "trajectory"  # the row's place among its unit's trajectories
    SEED: Final = "seed"  # the unit's sampling seed
    UID: Final = "uid"
    PRIORITY: Final = "priority"
    RAW_PROMPT: Final = "raw_prompt"  # the chat messages sent


FORMAT = "pipegen.batch/2"
META_KEY = b"pipegen.batch"
FILE_MAGIC = b"ARROW1"  # Arrow IPC files start (and end) with it
LEGACY_MAGIC = b"PGBATCH1"  # pipegen's pickle-framed batch files before FORMAT 2
INT_TENSORS = (BatchColumns.PROMPTS, BatchColumns.RESPONSES, BatchColumns.RESPONSE_MASK, BatchColumns.INPUT_IDS,
               BatchColumns.ATTENTION_MASK, BatchColumns.POSITION_IDS)
MASK_TENSORS = (BatchColumns.RESPONSE_MASK, BatchColumns.ATTENTION_MASK)  # 0/1 values: int8 on disk
ROW_KEYS = (BatchColumns.INDEX, BatchColumns.SAMPLE, BatchColumns.TRAJECTORY)  # the non-tensor columns that name a row
CONVERT_FLAG = "--convert-pickle-batches"
_INT32 = np.dtype(np.int32).str
_JSON, _INT = "json", "int"  # kinds of object columns: JSON values, or Python ints stored as int64
_TENSORS = "tensors"  # an object column of dicts of tensors (multi_modal_inputs): run/pictures.py's Arrow encoding
_JSON_ROWS = "rows/json"  # per row: the JSON-kind columns' values as one JSON array, in the metadata's order
_TENSOR, _COLUMN, _TENSOR_DICT = "tensor/", "column/", "tensors/"
_PROMPT_LENS, _RESPONSE_LENS, _LAST_TOKEN_REWARD = "lengths/prompt", "lengths/response", "reward/last_token"


class BatchFileError(ValueError):
    """A batch file that cannot be read as one: damaged, foreign, or in the old pickle format."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


@dataclass
class StoredBatch:
    """A batch file's content as numpy: tensors in their returned dtypes (int32 tokens when the writer
    stored them so), non-tensor columns as verl's DataProto holds them, and meta_info."""

    tensors: dict[str, np.ndarray]
    non_tensor: dict[str, np.ndarray]
    meta_info: dict[str, Any]
    rows: int
    tensor_shapes: dict[str, tuple[str, tuple[int, ...]]]  # key -> (dtype, trailing shape), even when not read

    def __len__(self) -> int:
        return self.rows


def legacy_format_message(root: Path, legacy: list[Path]) -> str:
    """The one line that refuses a run directory whose batch files are pickles (pipegen before FORMAT 2)."""
    return (f"{root} holds batch files in pipegen's old pickle format ({legacy[0].name}"
            f"{f' and {len(legacy) - 1} more' if len(legacy) > 1 else ''}), which can run code when loaded: "
            f"if you trust this run, convert them once with python -m pipegen.writer output_dir={root} "
            f"{CONVERT_FLAG}, or start a new output_dir")


# ---- writing ----


def encode_batch_file(tensors: dict[str, np.ndarray], non_tensor: dict[str, np.ndarray], meta_info: dict[str, Any],
                      int32: bool, derived_known: dict[str, Any] | None = None) -> list[Any]:
    """A batch as the bytes of its file: a list of buffers (views of the arrays, no copy), written one
    after the other.

    tensors: in the batch's key order. int32: token tensors are stored as int32 (and read back so).
    derived_known: tensors the caller built as `read_batch` derives them (for attention_mask its (prompt
    lengths, response lengths)); the others are compared with their derivation and dropped only when equal."""
    stored: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    keys = list(tensors)
    derived_known = derived_known or {}
    prompts, responses, input_ids, attention, positions = (
        BatchColumns.PROMPTS, BatchColumns.RESPONSES, BatchColumns.INPUT_IDS, BatchColumns.ATTENTION_MASK,
        BatchColumns.POSITION_IDS)
    derived = [key for key in (input_ids, positions) if key in derived_known and key in keys]
    binary: set[str] = set()  # masks with only 0 and 1
    for key, arr in tensors.items():
        if int32 and key in INT_TENSORS:
            dtypes[key] = _INT32  # what read_batch returns; the writer's from_storage restores verl's int64
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
            stored[key] = np.ascontiguousarray(arr)
    if input_ids not in derived and {prompts, responses, input_ids} <= stored.keys() and np.array_equal(
            stored[input_ids], np.concatenate([stored[prompts], stored[responses]], axis=1)):
        derived.append(input_ids)
    if positions not in derived and {attention, positions} <= stored.keys() and \
            stored[positions].ndim == 2 and np.array_equal(stored[positions], position_ids_of(stored[attention])):
        derived.append(positions)
    spans = derived_known[attention] if attention in derived_known else _spans(stored)
    scores = _last_token_scores(stored, None if spans is None else spans[1])
    extra: dict[str, np.ndarray] = {}
    if scores is not None:
        derived.append(BatchColumns.RM_SCORES)
        extra[_LAST_TOKEN_REWARD] = scores
    if spans is not None:
        derived.append(attention)
        extra[_PROMPT_LENS], extra[_RESPONSE_LENS] = (np.asarray(s, dtype=np.int32) for s in spans)
    packed = [key for key in (BatchColumns.RESPONSE_MASK,) if key in binary and key not in derived]  # a bit each
    for key in packed:
        stored[key] = np.packbits(stored[key], axis=-1)
    rows = len(next(iter(non_tensor.values()))) if non_tensor else len(next(iter(tensors.values())))
    names, arrays = [], []
    on_disk = {}  # each stored tensor's trailing shape in the file (a bit-packed one is narrower)
    for key, arr in stored.items():
        if key in derived:
            continue
        names.append(_TENSOR + key)
        arrays.append(_tensor_column(arr))
        on_disk[key] = list(arr.shape[1:])
    for name, arr in extra.items():
        names.append(name)
        arrays.append(pa.array(arr))
    kinds, column_names, columns = _encode_columns(non_tensor)
    names += column_names
    arrays += columns
    info = {"format": FORMAT, "rows": rows, "keys": keys, "dtypes": dtypes,
            "shapes": {k: list(v.shape[1:]) for k, v in tensors.items()}, "on_disk": on_disk, "derived": derived,
            "bit_packed": packed, "columns": kinds}
    try:
        info["meta_info"] = orjson.loads(orjson.dumps(meta_info, option=orjson.OPT_SERIALIZE_NUMPY))
    except TypeError as exc:
        raise ValueError(f"meta_info holds a value a batch file cannot store ({exc}): JSON values and numpy "
                         "only") from None
    record = pa.RecordBatch.from_arrays(arrays, names=names).replace_schema_metadata(
        {META_KEY: orjson.dumps(info, option=orjson.OPT_SERIALIZE_NUMPY)})
    sink = _Chunks()
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), record.schema) as writer:
        writer.write_batch(record)
    return sink.chunks


class _Chunks:
    """A file-like sink that keeps what Arrow writes as a list of chunks: Arrow hands over each column's
    data as a zero-copy view of the numpy array, so encoding copies no tensor bytes (one copy of the
    whole batch, ~3 MB at 4k tokens, showed in the writer's CPU); the committer writes them with writev."""

    def __init__(self) -> None:
        self.chunks: list[Any] = []
        self.position = 0
        self.closed = False

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.chunks.append(data)
        self.position += size
        return size

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _tensor_column(arr: np.ndarray) -> pa.Array:
    flat = pa.array(arr.reshape(-1))  # zero-copy for numeric dtypes
    return flat if arr.ndim == 1 else pa.FixedSizeListArray.from_arrays(flat, math.prod(arr.shape[1:]))


def _encode_columns(non_tensor: dict[str, np.ndarray]) -> tuple[dict[str, str], list[str], list[pa.Array]]:
    """(each column's kind, Arrow names, Arrow columns): a plain numpy dtype as itself, a row key column
    of Python ints as int64 (so the row keys are read without JSON), every other object column in one JSON
    array per row (one `orjson.dumps` per row: an Arrow column per object column cost the writer's main
    loop 0.2 ms more per 64-row batch, as much as the rest of the encoding)."""
    kinds: dict[str, str] = {}
    names, arrays, as_json = [], [], []
    for key, values in non_tensor.items():
        if values.dtype != object:
            kinds[key] = values.dtype.str
            names.append(_COLUMN + key)
            arrays.append(pa.array(values))
        elif key in ROW_KEYS and all(type(v) is int for v in values) and _fits_int64(values):
            kinds[key] = _INT
            names.append(_COLUMN + key)
            arrays.append(pa.array(values.astype(np.int64)))
        elif is_tensor_dict_column(values):
            kinds[key] = _TENSORS
            names.append(_TENSOR_DICT + key)
            arrays.append(tensor_dict_column(values))
        else:
            kinds[key] = _JSON
            as_json.append(values.tolist())
    if as_json:
        try:
            texts = [orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) for row in zip(*as_json)]
        except TypeError:
            raise _unstorable(non_tensor, kinds) from None
        names.append(_JSON_ROWS)
        arrays.append(pa.array(texts, pa.binary()))
    return kinds, names, arrays


def _unstorable(non_tensor: dict[str, np.ndarray], kinds: dict[str, str]) -> ValueError:
    """The error for a value orjson cannot write, naming its column (found again value by value)."""
    for key, kind in kinds.items():
        for row, value in enumerate(non_tensor[key] if kind == _JSON else ()):
            try:
                orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
            except TypeError as exc:
                return ValueError(f"non-tensor column {key!r}, row {row}, holds a value a batch file cannot store "
                                  f"({exc}): JSON values and numpy arrays only")
    return ValueError("a non-tensor column holds a value a batch file cannot store")


def _fits_int64(values: np.ndarray) -> bool:
    return not len(values) or (-(2 ** 63) <= min(values) and max(values) < 2 ** 63)


# ---- reading ----


def object_array(values: list[Any]) -> np.ndarray:
    """A 1-D object array even when the values are lists (np.array would build a 2-D array)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def read_batch(path: Path, tensors: bool = True) -> StoredBatch:
    """A batch file's content. tensors=False skips the tensors (their dtypes and shapes are still given):
    enough to sort, count or list a run's rows. Raises BatchFileError for anything that is not a
    complete batch file of this format, the old pickle format included; never executes anything."""
    path = Path(path)
    record, info, data = _open(path, whole=tensors)
    try:
        non_tensor = _decode_columns(record, info["columns"])
        arrays = _restore_tensors(record, info, _Backing(data)) if tensors else {}
        shapes = {k: (info["dtypes"][k], tuple(info["shapes"][k])) for k in info["keys"]}
        return StoredBatch(tensors=arrays, non_tensor=non_tensor, meta_info=info.get("meta_info") or {},
                           rows=int(info["rows"]), tensor_shapes=shapes)
    except (KeyError, TypeError, ValueError, IndexError, pa.ArrowException) as exc:
        raise BatchFileError(path, f"not a complete pipegen batch file ({type(exc).__name__}: {exc})") from None


def read_row_keys(path: Path) -> dict[str, np.ndarray]:
    """The (index, sample, trajectory) of every row of a batch file, without reading its tensors."""
    path = Path(path)
    record, info, _ = _open(path, whole=False)
    try:
        columns = _decode_columns(record, info["columns"], ROW_KEYS)
        return {key: values.astype(np.int64) for key, values in columns.items()}
    except (KeyError, TypeError, ValueError, IndexError, pa.ArrowException) as exc:
        raise BatchFileError(path, f"not a complete pipegen batch file ({type(exc).__name__}: {exc})") from None


def _open(path: Path, whole: bool) -> tuple[pa.RecordBatch, dict[str, Any], bytearray | None]:
    """The file's one record batch (checked in full), its metadata, and the bytes it was read from.
    whole: read the file into memory in one go (its tensors are wanted); else memory-map it, so only
    the columns used are read."""
    data = None
    try:
        if whole:
            with open(path, "rb") as f:
                data = bytearray(f.seek(0, 2))  # writable: the tensors handed out are views of it
                f.seek(0)
                f.readinto(data)
            source = pa.py_buffer(data)
        else:
            source = pa.memory_map(str(path))
    except OSError as exc:
        raise BatchFileError(path, f"cannot be read ({exc.strerror or exc})") from None
    head = bytes(source[: len(LEGACY_MAGIC)]) if whole else source.read_at(len(LEGACY_MAGIC), 0)
    if head.startswith(LEGACY_MAGIC) or head[:1] == b"\x80":
        raise BatchFileError(path, "a batch file in pipegen's old pickle format, which can run code when loaded: "
                                   f"if you trust this run, convert it with python -m pipegen.writer "
                                   f"output_dir={path.parent} {CONVERT_FLAG}")
    if not head.startswith(FILE_MAGIC):
        raise BatchFileError(path, "not a pipegen batch file (an Arrow IPC file starts with ARROW1): "
                                   "damaged or written by something else")
    try:
        reader = pa.ipc.open_file(source)
        if reader.num_record_batches != 1:
            raise ValueError(f"{reader.num_record_batches} record batches, expected 1")
        record = reader.get_batch(0)
        record.validate(full=True)
        info = orjson.loads((record.schema.metadata or {})[META_KEY])
        if info.get("format") != FORMAT:
            raise ValueError(f"format {info.get('format')!r}, expected {FORMAT}")
    except (OSError, KeyError, TypeError, ValueError, orjson.JSONDecodeError, pa.ArrowException) as exc:
        # pyarrow reports a bad footer or message as OSError or ArrowInvalid
        raise BatchFileError(path, f"damaged or not a pipegen batch file ({type(exc).__name__}: {exc})") from None
    return record, info, data


@dataclass
class _Backing:
    """The bytearray a file was read into: arrays handed out are writable views of it (Arrow's own views
    are read-only, and torch warns on those)."""

    data: bytearray

    def array(self, buffer: pa.Buffer, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        start = buffer.address - pa.py_buffer(self.data).address + offset
        return np.frombuffer(self.data, dtype=dtype, count=count, offset=start)


def _numpy(column: pa.Array, backing: _Backing) -> np.ndarray:
    """A primitive Arrow column as a writable numpy view of the bytes the file was read into."""
    if column.null_count or not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise ValueError(f"a tensor column of type {column.type}")
    dtype = np.dtype(column.type.to_pandas_dtype())
    return backing.array(column.buffers()[1], dtype, len(column), column.offset * dtype.itemsize)


def _decode_columns(record: pa.RecordBatch, kinds: dict[str, str],
                    wanted: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The non-tensor columns (all, or those wanted) as the writer had them: object columns hold fresh
    Python values per row. kinds: every column's kind, in the file's order."""
    wanted = tuple(kinds) if wanted is None else wanted
    position = {key: i for i, key in enumerate(k for k, kind in kinds.items() if kind == _JSON)}
    rows_json = None
    if any(kinds[key] == _JSON for key in wanted):
        rows_json = [orjson.loads(text) for text in record.column(_JSON_ROWS).to_pylist()]
    out = {}
    for key in wanted:
        kind = kinds[key]
        if kind == _JSON:
            at = position[key]
            out[key] = object_array([row[at] for row in rows_json])
        elif kind == _INT:
            out[key] = object_array(record.column(_COLUMN + key).to_pylist())
        elif kind == _TENSORS:
            out[key] = object_array(read_tensor_dict_column(record.column(_TENSOR_DICT + key)))
        else:
            # a copy (one value per row): Arrow's views are read-only, and verl's users may write in place
            out[key] = np.array(record.column(_COLUMN + key).to_numpy(zero_copy_only=False), dtype=np.dtype(kind))
    return out


def _restore_tensors(record: pa.RecordBatch, info: dict[str, Any], backing: _Backing) -> dict[str, np.ndarray]:
    """Every tensor of the batch, the dropped ones rebuilt, in the dtypes the file says."""
    rows = int(info["rows"])
    stored = {}
    for key, trailing in info["on_disk"].items():
        column = record.column(_TENSOR + key)
        if trailing:
            width = column.type.list_size
            flat = _numpy(column.values, backing)[column.offset * width:][: rows * width]
            stored[key] = flat.reshape(rows, *trailing)
        else:
            stored[key] = _numpy(column, backing)
    if _PROMPT_LENS in record.schema.names:
        stored["_spans"] = (_numpy(record.column(_PROMPT_LENS), backing),
                            _numpy(record.column(_RESPONSE_LENS), backing))
    if _LAST_TOKEN_REWARD in record.schema.names:
        stored["_scores"] = _numpy(record.column(_LAST_TOKEN_REWARD), backing)
    return restore_tensors(stored, info)


def restore_tensors(stored: dict[str, Any], info: dict[str, Any]) -> dict[str, np.ndarray]:
    """The batch's tensors from what a file stores: `info` names the derived and bit-packed ones and each
    tensor's dtype; `stored` holds the stored tensors, and `_spans` (prompt and response lengths) and
    `_scores` (each row's reward) when attention_mask and rm_scores were dropped."""
    arrays = dict(stored)
    derived = info["derived"]
    prompts, responses, attention = BatchColumns.PROMPTS, BatchColumns.RESPONSES, BatchColumns.ATTENTION_MASK
    for key in info.get("bit_packed", ()):
        arrays[key] = np.unpackbits(arrays[key], axis=-1, count=arrays[responses].shape[-1]).view(np.int8)
    if attention in derived:
        prompt_lens, response_lens = arrays["_spans"]
        arrays[attention] = attention_mask_of(prompt_lens, response_lens, arrays[prompts].shape[1],
                                              arrays[responses].shape[1]).view(np.int8)
    if BatchColumns.INPUT_IDS in derived:
        arrays[BatchColumns.INPUT_IDS] = np.concatenate([arrays[prompts], arrays[responses]], axis=1)
    if BatchColumns.POSITION_IDS in derived:
        arrays[BatchColumns.POSITION_IDS] = position_ids_of(arrays[attention])
    if BatchColumns.RM_SCORES in derived:
        scores = arrays["_scores"]
        rm_scores = np.zeros((len(scores), arrays[responses].shape[1]), dtype=scores.dtype)
        rm_scores[np.arange(len(scores)), _score_columns(arrays[attention], arrays[prompts].shape[1])] = scores
        arrays[BatchColumns.RM_SCORES] = rm_scores
    return {k: arrays[k].astype(np.dtype(info["dtypes"][k]), copy=False) for k in info["keys"]}


# ---- verl's padded layout, which the format rebuilds ----


def _binary(arr: np.ndarray) -> bool:
    return bool(arr.size) and arr.min() >= 0 and arr.max() <= 1


def attention_mask_of(prompt_lens: np.ndarray, response_lens: np.ndarray, prompt_length: int,
              response_length: int) -> np.ndarray:
    """verl's attention mask for left-padded prompts and right-padded responses, as bool."""
    columns = np.arange(prompt_length + response_length)
    return (columns >= (prompt_length - prompt_lens)[:, None]) & (columns < (prompt_length + response_lens)[:, None])


def position_ids_of(attention_mask: np.ndarray) -> np.ndarray:
    """verl's compute_position_id_with_mask: clip(cumsum(mask) - 1, 0), in the mask's integer width."""
    dtype = attention_mask.dtype if attention_mask.dtype.itemsize >= 4 else np.int32
    out = np.cumsum(attention_mask, axis=1, dtype=dtype)
    out -= 1
    return np.maximum(out, 0, out=out)  # in place: np.clip allocates twice


def _spans(tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """(prompt lengths, response lengths) when the attention mask is exactly `attention_mask_of` of them."""
    mask, prompts, responses = (tensors.get(k) for k in
                                (BatchColumns.ATTENTION_MASK, BatchColumns.PROMPTS, BatchColumns.RESPONSES))
    if mask is None or prompts is None or responses is None or mask.ndim != 2 or \
            mask.shape != (len(prompts), prompts.shape[1] + responses.shape[1]):
        return None
    P = prompts.shape[1]
    lens = mask[:, :P].sum(axis=1, dtype=np.int32), mask[:, P:].sum(axis=1, dtype=np.int32)
    return lens if np.array_equal(mask, attention_mask_of(*lens, P, responses.shape[1])) else None


def _score_columns(attention_mask: np.ndarray, prompt_length: int) -> np.ndarray:
    """Where verl's `_postprocess` puts each row's reward in rm_scores: its last response token,
    attention_mask[:, P:].sum(1) - 1 (-1, the last column, for an empty response, as torch indexes)."""
    return attention_mask[:, prompt_length:].sum(axis=1) - 1


def _last_token_scores(tensors: dict[str, np.ndarray], response_lens: np.ndarray | None) -> np.ndarray | None:
    """rm_scores as one value per row when it is exactly verl's layout (zeros, each row's reward at
    `_score_columns`; compared bit for bit, so -0.0 or NaN elsewhere keeps the full tensor): a quarter
    of a batch file's bytes at 1k tokens, for one float per row."""
    rm, mask, prompts = (tensors.get(k) for k in
                         (BatchColumns.RM_SCORES, BatchColumns.ATTENTION_MASK, BatchColumns.PROMPTS))
    if rm is None or mask is None or prompts is None or rm.dtype != np.float32 or rm.ndim != 2 \
            or mask.ndim != 2 or prompts.ndim != 2 or rm.shape != (len(mask), mask.shape[1] - prompts.shape[1]):
        return None
    columns = _score_columns(mask, prompts.shape[1]) if response_lens is None else response_lens - 1
    scores = rm[np.arange(len(rm)), columns]
    if np.count_nonzero(rm.view(np.int32)) != np.count_nonzero(scores.view(np.int32)):
        return None
    return scores
