"""Batches -> the merged `trajectories.pkl` in verl's layout, and the run's artifact.

Owns: the merge (key alignment across batches, (index, sample, trajectory) order, verl's int64 layout
restored, verl's timing metrics recomputed over the whole run) and `trajectories.zip`
(trajectories + checkpoint + config), uploaded to wandb when it is a tracking backend.
Must never: decide what is committed (it merges exactly the batches the checkpoint lists) or leave a
half-written output under its final name.
"""

from __future__ import annotations

import logging
import pickle
import time
import zipfile
from functools import partial
from pathlib import Path
from typing import Iterable

import numpy as np
from omegaconf import DictConfig

from pipegen.run.atomic import atomic_write
from pipegen.run.checkpoint import Checkpoint
from pipegen.run.layout import RunDir
from pipegen.writer.batches import ROW_ORDER, from_storage, load_batch, object_array

log = logging.getLogger("pipegen.writer")


def merge_run(cfg: DictConfig, run: RunDir, ckpt: Checkpoint) -> None:
    """Merge the checkpoint's batches into trajectories.pkl, then write (and upload) the artifact."""
    started = time.monotonic()
    merged = merge_batches([run.batch_file(i) for i in ckpt.batches.numbers()])
    atomic_write(run.trajectories, partial(pickle.dump, merged))
    del merged
    write_artifact(cfg, run)
    log.info("merged %d rows into %s in %.1fs", ckpt.num_rows, run.trajectories, time.monotonic() - started)


def write_artifact(cfg: DictConfig, run: RunDir) -> None:
    def write(f) -> None:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
            z.write(run.trajectories, run.trajectories.name)
            if run.checkpoint.exists():
                z.write(run.checkpoint, run.checkpoint.name)
            z.write(run.config_file, run.config_file.relative_to(run.root).as_posix())

    atomic_write(run.artifact, write)
    if cfg.generation.upload_artifact and "wandb" in list(cfg.trainer.logger):
        from pipegen.observe.tracking import upload_artifact

        upload_artifact(cfg, run)


def merge_batches(paths: Iterable[Path]):
    """Concatenate batch files into verl's layout, sorted by (index, sample, trajectory).

    Peak memory is about two copies of the output: the loaded parts, then their concatenation
    (the parts are dropped before the sort's gather).
    """
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.protocol import DataProto

    parts = [from_storage(load_batch(p)) for p in paths]
    if not parts:
        raise ValueError("no batches to merge")
    _align_keys(parts)
    metrics = [m for part in parts for m in part.meta_info.pop("metrics", [])]
    reward_keys = parts[0].meta_info.get("reward_extra_keys")
    for part in parts:
        part.meta_info = {}
    merged = DataProto.concat(parts)
    del parts
    nt = merged.non_tensor_batch
    order = np.lexsort([nt[key].astype(np.int64) for key in reversed(ROW_ORDER)])  # lexsort: last key sorts first
    merged = merged.select_idxs(order)
    metrics = [metrics[i] for i in order]
    merged.meta_info = {"timing": AgentLoopManager._performance_metrics(None, [metrics], merged)}
    if reward_keys is not None and "rm_scores" in merged.batch.keys():
        merged.meta_info["reward_extra_keys"] = reward_keys
    return merged


def _align_keys(parts: list) -> None:
    """DataProto.concat needs identical key sets; custom loops may set extra_fields only sometimes."""
    all_keys: list[str] = []
    for part in parts:
        for k in part.non_tensor_batch:
            if k not in all_keys:
                all_keys.append(k)
    for part in parts:
        n = len(part)
        part.non_tensor_batch = {
            k: part.non_tensor_batch[k] if k in part.non_tensor_batch else object_array([None] * n) for k in all_keys
        }
    tensor_sets = [set(part.batch.keys()) for part in parts]
    common = set.intersection(*tensor_sets)
    if any(s != common for s in tensor_sets):
        # rm_scores exists only where every row was scored; keep the merge consistent.
        for part in parts:
            for k in set(part.batch.keys()) - common:
                del part.batch[k]
