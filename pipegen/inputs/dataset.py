"""The prompt dataset, read through verl's RLHFDataset exactly as verl's trainer reads it.

Owns: building the dataset from the saved config, checking the data files before verl reads them
(format, readability, rows, the prompt column, an `extra_info.index` in their schema and unique in its one
column, no per-row setting column pipegen does not honour: before any server starts), that every row has a
unique `index` (the unit manifest's content) and that every prompt fits.
Must never: modify a data file, or import verl at its top (the launcher imports it for the footer checks;
verl costs seconds, and is imported only where a dataset or tokenizer is built).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Iterator

import orjson
from omegaconf import DictConfig

from pipegen.run.layout import DatasetFacts


class DatasetError(ValueError):
    """A problem with the user's dataset, reported as one line that names the fix."""


def load_tokenizer(cfg: DictConfig):
    from verl.utils import hf_tokenizer

    model = cfg.actor_rollout_ref.model
    tokenizer = hf_tokenizer(model.get("tokenizer_path") or model.path, trust_remote_code=model.trust_remote_code)
    if model.get("custom_chat_template") is not None:  # as verl's AgentLoopWorker sets it; prompts follow it too
        tokenizer.chat_template = model.custom_chat_template
    return tokenizer


def load_processor(cfg: DictConfig):
    """The model's multimodal processor, loaded as verl's trainer loads it (`hf_processor(path,
    use_fast=True)`, which also binds the model's rope index to it), or None for a text-only model; see
    `pipegen.inputs.media` for what a run with images needs."""
    from pipegen.inputs.media import load_processor as load

    return load(cfg)


def string_prompts(files: list[str], prompt_key: str) -> bool:
    """Whether the prompt column holds plain strings, not chat messages (from the parquet footers; json: no)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def is_string(path: str) -> bool:
        if not path.endswith(".parquet"):
            return False
        field = pq.read_schema(path).field(prompt_key) if prompt_key in pq.read_schema(path).names else None
        return field is not None and (pa.types.is_string(field.type) or pa.types.is_large_string(field.type))

    return bool(files) and all(is_string(f) for f in files)


def as_user_messages(dataframe, prompt_key: str):
    """A `datasets.Dataset` whose prompt column holds plain strings, each as one user message (verl's format)."""
    return dataframe.map(lambda row: {prompt_key: [{"role": "user", "content": row[prompt_key]}]},
                         desc="plain-string prompts as user messages")


def with_string_prompts(dataset_cls: type) -> type:
    """verl's dataset class (or data.custom_cls) reading a plain-string prompt column as one user message: the
    column is converted before verl's length filter and row reads see it (RLHFDataset's
    maybe_filter_out_long_prompts is the step after its files are read)."""

    class StringPrompts(dataset_cls):
        def maybe_filter_out_long_prompts(self, dataframe=None):
            return super().maybe_filter_out_long_prompts(as_user_messages(dataframe, self.prompt_key))

    StringPrompts.__name__ = f"StringPrompts{dataset_cls.__name__}"
    return StringPrompts


def load_dataset(cfg: DictConfig, tokenizer, processor=None):
    """verl's RLHFDataset over data.train_files (honours data.custom_cls like verl's main_ppo, as its
    create_rl_dataset does); `processor`: the model's (`load_processor`), which verl needs for rows with images.
    A plain-string prompt column becomes one user message per row (`with_string_prompts`)."""
    from verl.utils.dataset.rl_dataset import get_dataset_class

    files = check_files(cfg)
    prompt_key = str(cfg.data.prompt_key)
    dataset_cls = get_dataset_class(cfg.data)
    if string_prompts(files, prompt_key):
        dataset_cls = with_string_prompts(dataset_cls)
    try:
        with _quiet_row_selection(bool(cfg.data.get("shuffle"))):
            dataset = dataset_cls(data_files=files, tokenizer=tokenizer, processor=processor, config=cfg.data,
                                  max_samples=cfg.data.get("train_max_samples", -1))
    except KeyError as e:
        raise DatasetError(_missing_column(str(e).strip("'\""), prompt_key, _columns(files[0]))) from None
    columns = list(getattr(getattr(dataset, "dataframe", None), "column_names", None) or [])
    if columns and prompt_key not in columns:  # json files are not checked before verl reads them
        raise DatasetError(_missing_column(prompt_key, prompt_key, columns))
    return dataset


def check_files(cfg: DictConfig) -> list[str]:
    """data.train_files as a list, each checked by `check_file`."""
    files = list(cfg.data.train_files) if not isinstance(cfg.data.train_files, str) else [cfg.data.train_files]
    for f in files:
        check_file(Path(f), str(cfg.data.prompt_key))
    if all(str(f).endswith(".parquet") for f in files):  # one column read: seconds before any server starts
        seen: dict[int, int] = {}
        pos = 0
        for f in files:
            for i in _file_indices(Path(f)):
                if i is not None and int(i) in seen:
                    raise DatasetError(f"train_files: extra_info.index {i} appears at rows {seen[int(i)]} and "
                                       f"{pos}; indices must be unique")
                if i is not None:
                    seen[int(i)] = pos
                pos += 1
    return files


def _file_indices(path: Path) -> list:
    """The file's extra_info.index column alone (None where a row has none: dataset_indices names those)."""
    import pyarrow.parquet as pq

    try:
        column = pq.read_table(path, columns=["extra_info"]).column("extra_info").combine_chunks()
        return column.field("index").to_pylist()
    except Exception:  # noqa: BLE001 (a layout this reading does not know: dataset_indices checks every row)
        return []


# verl's per-row settings, columns of the dataset its agent loop worker reads per row: pipegen honours these and
# refuses any other `__name__` column, which verl's code would read and pipegen would ignore
PER_ROW_HONOURED = ("__do_sample__",)
PER_ROW = re.compile(r"^__\w+__$")


def per_row_refusal(columns: list[str]) -> str:
    """One line refusing a per-row setting column pipegen does not honour ('' when none)."""
    other = [c for c in columns if PER_ROW.match(c) and c not in PER_ROW_HONOURED]
    if not other:
        return ""
    return (f"train_files: column '{other[0]}' is a per-row setting pipegen does not honour (it honours "
            f"{', '.join(PER_ROW_HONOURED)}: false makes that row greedy); drop the column")


def _missing_column(column: str, prompt_key: str, columns: list[str]) -> str:
    shown = ", ".join(columns[:12]) + (", ..." if len(columns) > 12 else "")
    if column == prompt_key:
        return (f"train_files: no column '{prompt_key}' (data.prompt_key) with the chat messages; the file has "
                f"columns [{shown}]: set data.prompt_key=COLUMN to the one holding the messages")
    return f"train_files: column '{column}' is missing (the file has [{shown}]); verl's format needs it"


def _columns(path: str) -> list[str]:
    try:
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    except Exception:  # only for the message; json files have no cheap schema
        return []


def check_file(path: Path, prompt_key: str) -> None:
    """One line naming the fix for a data file verl could only answer with a traceback: missing, of an
    unknown format, not readable as parquet, empty, without the prompt column, or without extra_info.index.
    Reads only the parquet footer (its schema and row count), never the rows (of JSON lines, the first)."""
    if not path.exists():
        raise DatasetError(f"train_files: {path} does not exist; pass an existing verl-format parquet file")
    if path.suffix not in (".parquet", ".json", ".jsonl"):
        raise DatasetError(f"train_files: {path} is neither .parquet nor .json/.jsonl, the formats verl reads; "
                           "convert it to verl's parquet format")
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            first = f.readline().strip()
        try:
            row = orjson.loads(first) if first else None
        except orjson.JSONDecodeError:
            row = None  # verl's reader names a line that is not JSON
        if isinstance(row, dict) and per_row_refusal(list(row)):
            raise DatasetError(per_row_refusal(list(row)))
        info = row.get("extra_info") if isinstance(row, dict) else None
        if isinstance(row, dict) and not (isinstance(info, dict) and "index" in info):
            raise DatasetError(no_index(path))
    if path.suffix != ".parquet":
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
        schema = pq.read_schema(path)
        columns = list(schema.names)
    except Exception as e:  # pyarrow says ArrowInvalid / OSError; either way the file cannot be read
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DatasetError(f"train_files: {path} is not a readable parquet file ({reason}); "
                           "pass a verl-format parquet file") from None
    if meta.num_rows == 0:
        raise DatasetError(f"train_files: {path} has no rows; pass a parquet file with at least one prompt")
    if prompt_key not in columns:
        raise DatasetError(_missing_column(prompt_key, prompt_key, columns))
    if per_row_refusal(columns):
        raise DatasetError(per_row_refusal(columns))
    info = schema.field("extra_info").type if "extra_info" in columns else None
    if info is None or (pa.types.is_struct(info) and info.get_field_index("index") < 0):
        raise DatasetError(no_index(path))  # a map or a JSON string column: dataset_indices reads every row's


def no_index(path: Path) -> str:
    return (f"train_files: {path} has no extra_info.index; pipegen keys every unit by it: add a unique integer "
            f"extra_info.index to each row (as verl's data preprocessing scripts write it)")


@contextlib.contextmanager
def _quiet_row_selection(shuffle: bool) -> Iterator[None]:
    """verl prints "selected N random samples" even when shuffle is off and rows 0..N-1 are taken:
    drop that one untrue line (kept when shuffle is on); every other line passes through."""
    if shuffle:
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        for line in captured.getvalue().splitlines():
            if not _RANDOM_SAMPLES.match(line):
                print(line)


_RANDOM_SAMPLES = re.compile(r"^selected \d+ random samples out of \d+$")


def dataset_indices(dataset) -> list[int]:
    """Every row's `index` (extra_info.index), checked present and unique."""
    frame = getattr(dataset, "dataframe", None)
    if frame is not None and "extra_info" in frame.column_names:
        infos = frame["extra_info"]
        indices = [info.get("index") if isinstance(info, dict) else None for info in infos]
    else:
        indices = [None] * len(dataset)
    missing = [pos for pos, i in enumerate(indices) if i is None]
    if missing:
        raise DatasetError(
            f"train_files: {len(missing)} row(s) have no extra_info.index (first at row {missing[0]}); "
            "pipegen keys every unit by it: add a unique integer extra_info.index to each row"
        )
    seen: dict[int, int] = {}
    for pos, i in enumerate(indices):
        if int(i) in seen:
            raise DatasetError(
                f"train_files: extra_info.index {i} appears at rows {seen[int(i)]} and {pos}; indices must be unique"
            )
        if int(i) < 0:
            raise DatasetError(f"train_files: extra_info.index {i} at row {pos} is negative; use indices >= 0")
        seen[int(i)] = pos
    return [int(i) for i in indices]


def file_rows(cfg: DictConfig) -> int | None:
    """Rows in data.train_files from the parquet footers (None when a file is json: counted only by reading it)."""
    import pyarrow.parquet as pq

    files = list(cfg.data.train_files) if not isinstance(cfg.data.train_files, str) else [cfg.data.train_files]
    if not all(str(f).endswith(".parquet") for f in files):
        return None
    return sum(pq.read_metadata(f).num_rows for f in files)


def selected_rows(rows: int, max_samples: int | None) -> int:
    """The rows verl's RLHFDataset keeps of `rows` under data.train_max_samples (before any length filter)."""
    return min(rows, int(max_samples)) if max_samples is not None and int(max_samples) > 0 else rows


def dataset_facts(cfg: DictConfig, prompts: int) -> DatasetFacts:
    """Where the run's `prompts` came from: the rows of the files, and the rows max_samples and verl's
    filter_overlong_prompts left out (verl selects max_samples rows first, then filters)."""
    rows = file_rows(cfg)
    if rows is None:
        return DatasetFacts(rows=None, skipped_by_max_samples=0, skipped_too_long=0)
    kept = selected_rows(rows, cfg.data.get("train_max_samples"))
    return DatasetFacts(rows=rows, skipped_by_max_samples=rows - kept, skipped_too_long=max(0, kept - prompts))


def check_prompt_lengths(cfg: DictConfig, dataset, tokenizer) -> None:
    """Fail before any server starts if a prompt cannot fit, naming the row and the fix."""
    limit = int(cfg.actor_rollout_ref.rollout.prompt_length)
    kwargs = dict(cfg.data.get("apply_chat_template_kwargs") or {})
    from verl.utils.tokenizer import normalize_token_ids

    for pos in range(len(dataset)):
        messages = dataset[pos]["raw_prompt"]
        ids = normalize_token_ids(
            tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **kwargs)
        )
        if len(ids) > limit:
            raise DatasetError(
                f"row {pos}: the prompt is {len(ids)} tokens, longer than max_prompt_length={limit}; "
                f"raise max_prompt_length or set data.filter_overlong_prompts=true to drop such rows"
            )
