"""The prompt dataset, read through verl's RLHFDataset exactly as verl's trainer reads it.

Owns: building the dataset from the saved config, checking that every row has a unique `index` (the
unit manifest's content) and that every prompt fits.
Must never: modify a data file, or be imported by the launcher before the config is validated
(importing verl costs seconds).
"""

from __future__ import annotations

from pathlib import Path
from omegaconf import DictConfig


class DatasetError(ValueError):
    """A problem with the user's dataset, reported as one line that names the fix."""


def load_tokenizer(cfg: DictConfig):
    from verl.utils import hf_tokenizer

    model = cfg.actor_rollout_ref.model
    return hf_tokenizer(model.get("tokenizer_path") or model.path, trust_remote_code=model.trust_remote_code)


def load_dataset(cfg: DictConfig, tokenizer):
    """verl's RLHFDataset over data.train_files (honours data.custom_cls like verl's main_ppo)."""
    from verl.trainer.ppo.utils import create_rl_dataset

    files = list(cfg.data.train_files) if not isinstance(cfg.data.train_files, str) else [cfg.data.train_files]
    for f in files:
        if not Path(f).exists():
            raise DatasetError(f"train_files: {f} does not exist; pass an existing verl-format parquet file")
    try:
        return create_rl_dataset(
            files, cfg.data, tokenizer, None, is_train=True, max_samples=cfg.data.get("train_max_samples", -1)
        )
    except KeyError as e:
        raise DatasetError(
            f"train_files: column {e} is missing; verl's format needs data.prompt_key "
            f"(now '{cfg.data.prompt_key}') with chat messages. Set data.prompt_key=YOUR_COLUMN"
        ) from None


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
