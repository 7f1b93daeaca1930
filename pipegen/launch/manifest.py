"""The run's units: its inputs named by real paths (a task's rows written out, its reward settings resolved),
and DIR/conf/units.json read from the dataset.

`resolve_inputs` runs before the config is saved (every child then reads concrete paths); `build_manifest`
runs while the servers load and the roles import verl, since reading a big dataset takes minutes: the
actors and the writer wait for the manifest.
Owns: DIR/conf/units.json. Must never: start a process, or write a manifest for a dataset that has no rows.
"""

from __future__ import annotations

from omegaconf import DictConfig, open_dict

from pipegen.inputs.dataset import (check_files, check_prompt_lengths, dataset_facts, dataset_indices, load_dataset,
                                    load_tokenizer)
from pipegen.inputs.demo import resolve_train_files
from pipegen.inputs.models import resolve_model_path
from pipegen.run.layout import RunDir


def resolve_inputs(cfg: DictConfig) -> None:
    """Short names -> real paths, so every child reads concrete paths from the saved config."""
    with open_dict(cfg):
        model = resolve_model_path(str(cfg.actor_rollout_ref.model.path))
        cfg.model_path = model
        cfg.actor_rollout_ref.model.path = model
        files = cfg.data.train_files
        if cfg.tasks:  # each task's rows, written into the run directory (pipegen/tasks/materialize.py)
            from pipegen.tasks.materialize import task_train_files

            resolved = task_train_files(cfg)
        else:
            resolved = resolve_train_files(files if isinstance(files, str) else list(files))
        cfg.train_files = resolved[0] if len(resolved) == 1 else resolved
        cfg.data.train_files = cfg.train_files
    from pipegen.rewards.spec import resolve_reward_settings

    resolve_reward_settings(cfg)


def build_manifest(cfg: DictConfig, run: RunDir) -> int:
    """Load the dataset once through verl, check it, and record its unit indices."""
    from pipegen.inputs.media import check_media

    files = check_files(cfg)  # seconds before verl is imported
    processor = check_media(cfg, files)  # images the model or the engine cannot take: refused here, in one line
    tokenizer = load_tokenizer(cfg)
    dataset = load_dataset(cfg, tokenizer, processor)
    indices = dataset_indices(dataset)
    if not indices:
        raise ValueError("train_files: the dataset has no rows (after max_samples / filtering)")
    check_prompt_lengths(cfg, dataset, tokenizer)
    run.write_manifest(indices, dataset_facts(cfg, len(indices)))
    return len(indices)
