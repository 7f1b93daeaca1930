"""The run's units: DIR/conf/units.json, read from the dataset the resolved config names (launch/job.py).

`build_manifest` runs while the servers load and the roles import verl, since reading a big dataset takes
minutes: the actors and the writer wait for the manifest.
Owns: DIR/conf/units.json. Must never: start a process, or write a manifest for a dataset that has no rows.
"""

from __future__ import annotations

from omegaconf import DictConfig

from pipegen.inputs.dataset import (check_files, check_prompt_lengths, dataset_facts, dataset_indices, load_dataset,
                                    load_tokenizer)
from pipegen.run.layout import RunDir


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
