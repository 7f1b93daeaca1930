"""Batches -> the merged output in verl's layout (`trajectories.pkl`, or sharded parts), and the run's artifact.

Owns: the merge (key alignment across batches, (index, sample, trajectory) order, verl's int64 layout
restored, verl's timing metrics, `meta_info["temperature"]` that verl's log-prob pass reads, and a partial output's
left-out units counted in its meta_info with failed_units.json named), the output
modes (one `trajectories.pkl`, or `trajectories/part_NNNNN.pkl` + `index.json` for runs larger than RAM),
`trajectories.zip` (output + checkpoint + config), uploaded to wandb when it is a tracking backend. The
optional export runs after it, as its own step (`export`: `python -m pipegen.export`, started here).

Bounded memory: a `MergePlan` is the run's `SortedRows` (pipegen/run/rows.py: every batch read once for
its sort keys, then preallocated int64 tensors filled row range by row range) as DataProtos. Files are
written by `save_dataproto`: a pickle that `DataProto.load_from_disk` reads (it rebuilds through verl's own
`DataProto.from_dict`) with tensors as zero-copy protocol-5 buffers, so neither writing nor loading holds a second
copy (verl's own `save_to_disk` consolidates and `torch.save`s the batch into bytes first: about 3x the output).
Must never: decide what is committed (it merges exactly the batches the checkpoint lists) or leave a
half-written output under its final name.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import subprocess
import sys
import time
import zipfile
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional, Sequence

import orjson
import torch
from omegaconf import DictConfig

from pipegen.run.atomic import atomic_write, atomic_write_bytes
from pipegen.run.batchfile import BatchColumns
from pipegen.run.checkpoint import Checkpoint
from pipegen.run.layout import RunDir
from pipegen.run.rows import ROW_ORDER, SortedRows
from pipegen.verl_private import performance_metrics
from pipegen.writer.batches import torch_tensor_dicts

log = logging.getLogger("pipegen.writer")

INDEX_FORMAT = "pipegen.trajectory_shards/1"


class _ZeroCopyPickler(pickle.Pickler):
    """Pickles a DataProto as `DataProto.from_dict(tensors, non_tensors, meta_info)` and each tensor as
    `torch.from_numpy(<protocol-5 buffer>)`: the file needs only verl, torch and numpy to load."""

    def reducer_override(self, obj: Any) -> Any:
        from verl import DataProto

        if isinstance(obj, DataProto):
            tensors = dict(obj.batch.items()) if obj.batch is not None else {}
            return DataProto.from_dict, (tensors, obj.non_tensor_batch, obj.meta_info)
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.dtype != torch.bfloat16:
            return torch.from_numpy, (obj.contiguous().numpy(),)
        return NotImplemented


def save_dataproto(data: Any, f: BinaryIO) -> None:
    """Write a DataProto that `DataProto.load_from_disk` reads back, without copying its tensors."""
    _ZeroCopyPickler(f, protocol=5).dump(data)


@dataclass
class MergePlan(SortedRows):
    """A run's sorted rows (pipegen/run/rows.py, SortedRows) as verl DataProtos, with the run's meta_info."""

    meta: dict[str, Any] = field(default_factory=dict)  # meta_info every output piece carries

    @classmethod
    def scan(cls, paths: Sequence[Path], meta: Optional[dict[str, Any]] = None) -> "MergePlan":
        return super().scan(paths, meta=dict(meta or {}))

    def run_meta(self) -> dict[str, Any]:
        """meta_info of every output piece: the run's (so sharded parts concatenate with DataProto.concat)."""
        if "timing" not in self.meta and self.metrics and BatchColumns.PROMPTS in self.tensor_specs:
            # verl reads the prompt width and the slowest row's attention mask: one row, fetched when asked.
            shim = _Shape({BatchColumns.PROMPTS: torch.empty((0, *self.tensor_specs[BatchColumns.PROMPTS][1])),
                           BatchColumns.ATTENTION_MASK: _LazyRow(self)})
            self.meta["timing"] = performance_metrics([self.metrics], shim)
        meta = dict(self.meta)
        if self.reward_keys is not None and BatchColumns.RM_SCORES in self.tensor_specs:
            meta["reward_extra_keys"] = self.reward_keys
        return meta

    def rows(self, lo: int, hi: int) -> Any:
        """Sorted output rows [lo, hi) as one DataProto in verl's layout (int64 token tensors)."""
        from verl import DataProto

        tensors = {k: torch.from_numpy(v) for k, v in self.tensors(lo, hi).items()}
        return DataProto.from_dict(tensors=tensors, meta_info=self.run_meta(),
                                   non_tensors=torch_tensor_dicts({k: v[lo:hi] for k, v in self.non_tensor.items()}))

    def pieces(self, rows: int) -> Iterator[tuple[int, int, Any]]:
        """(lo, hi, DataProto) for consecutive ranges of at most ``rows`` sorted rows."""
        for lo, hi in self.ranges(rows):
            yield lo, hi, self.rows(lo, hi)
        self.release()


@dataclass
class _Shape:
    """What verl's `_performance_metrics` reads of an output: `.batch`."""

    batch: dict


@dataclass
class _LazyRow:
    """`attention_mask[i]` of the sorted output, read on demand."""

    plan: MergePlan

    def __getitem__(self, i: Any) -> torch.Tensor:
        return torch.from_numpy(self.plan.tensors(int(i), int(i) + 1)[BatchColumns.ATTENTION_MASK][0])


def output_meta(cfg: DictConfig) -> dict[str, Any]:
    """What verl's trainer reads from a rollout's meta_info and is not in the rows: the sampling temperature."""
    return {"temperature": float(cfg.actor_rollout_ref.rollout.temperature)}


def partial_meta(run: RunDir) -> dict[str, Any]:
    """A partial output says so in its meta_info: the units left out (failed, and pending when a writer alone
    delivered), out of how many, and the file naming each one (failed_units.json, written before the merge). A
    complete output carries none of these keys."""
    if not run.failed_units.exists():
        return {}
    listing = orjson.loads(run.failed_units.read_bytes())
    return {"complete": False, "committed_units": int(listing["committed"]), "total_units": int(listing["total"]),
            "failed_units": int(listing["failed"]), "pending_units": int(listing.get("pending", 0)),
            "failed_units_file": run.failed_units.name}


def plan_run(cfg: DictConfig, run: RunDir, ckpt: Checkpoint) -> MergePlan:
    """The merge plan of a run: exactly the batches the checkpoint lists."""
    return MergePlan.committed(run, ckpt, meta={**output_meta(cfg), **partial_meta(run)})


def merge_run(cfg: DictConfig, run: RunDir, ckpt: Checkpoint) -> None:
    """Merge the checkpoint's batches into the configured output, write (and upload) the artifact."""
    started = time.monotonic()
    gen = cfg.generation
    mode = str(gen.merge_output)  # "single" or "sharded": the schema checked it before any process started
    plan = plan_run(cfg, run, ckpt)
    if mode == "sharded":
        run.trajectories.unlink(missing_ok=True)  # the other mode's output of an earlier launch
        write_shards(plan, run, int(gen.merge_shard_rows))
        target = run.output_index
    else:
        if run.output_shards.exists():
            shutil.rmtree(run.output_shards)
        merged = plan.rows(0, plan.num_rows)
        plan.release()
        atomic_write(run.trajectories, partial(save_dataproto, merged))
        del merged
        target = run.trajectories
    write_artifact(cfg, run, ckpt)
    log.info("merged %d rows into %s in %.1fs", plan.num_rows, target, time.monotonic() - started)


def write_shards(plan: MergePlan, run: RunDir, shard_rows: int) -> None:
    """`trajectories/part_NNNNN.pkl` (sorted rows, `shard_rows` each) and, last, `index.json` naming them."""
    if run.output_shards.exists():
        shutil.rmtree(run.output_shards)  # a crash mid-merge: the index was never written, redo all of it
    run.output_shards.mkdir(parents=True)
    shards = []
    for number, (lo, hi, piece) in enumerate(plan.pieces(shard_rows)):
        path = run.output_shard(number)
        atomic_write(path, partial(save_dataproto, piece))
        nt = piece.non_tensor_batch
        shards.append({"file": path.name, "rows": hi - lo, "first_row": lo,
                       "first": [int(nt[k][0]) for k in ROW_ORDER], "last": [int(nt[k][-1]) for k in ROW_ORDER]})
        del piece
    index = {"format": INDEX_FORMAT, "rows": plan.num_rows, "order": list(ROW_ORDER), "meta_info": plan.run_meta(),
             "shards": shards}
    atomic_write_bytes(run.output_index, orjson.dumps(index, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
                                                      default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def read_index(run: RunDir) -> dict[str, Any]:
    """The sharded output's index; a clear error when the run has none."""
    if not run.output_index.exists():
        raise FileNotFoundError(f"{run.output_index} not found: the run has no sharded output "
                                "(generation.merge_output=sharded, and the run must be complete)")
    return orjson.loads(run.output_index.read_bytes())


def load_shards(run: RunDir) -> Iterator[Any]:
    """Every part of a sharded output in order, each loaded with verl's `DataProto.load_from_disk`."""
    from verl import DataProto

    for shard in read_index(run)["shards"]:
        yield DataProto.load_from_disk(str(run.output_shards / shard["file"]))


def artifact_files(cfg: DictConfig, run: RunDir, ckpt: Checkpoint) -> list[Path]:
    """What trajectories.zip holds: the output (trajectories.pkl; or the sharded parts and their index; or, with
    final_merge=false, the batch files the checkpoint lists), the failed units of a partial output, then the
    checkpoint and the config."""
    if not cfg.generation.final_merge:
        output = [run.batch_file(i) for i in ckpt.batches.numbers()]
    elif run.output_index.exists():
        output = [run.output_shards / shard["file"] for shard in read_index(run)["shards"]] + [run.output_index]
    else:
        output = [run.trajectories]
    return [p for p in (*output, run.failed_units, run.checkpoint, run.config_file) if p.exists()]


def write_artifact(cfg: DictConfig, run: RunDir, ckpt: Checkpoint) -> None:
    """trajectories.zip (artifact_files), uploaded to wandb when it is a tracking backend; none with
    generation.upload_artifact=false."""
    if not cfg.generation.upload_artifact:
        run.artifact.unlink(missing_ok=True)  # an earlier launch's zip would not match this output
        return
    files = artifact_files(cfg, run, ckpt)

    def write(f) -> None:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
            for path in files:
                z.write(path, path.relative_to(run.root).as_posix())

    atomic_write(run.artifact, write)
    if "wandb" in list(cfg.trainer.logger):
        from pipegen.observe.tracking import upload_artifact

        upload_artifact(cfg, run)


def export(run: RunDir, fmt: str | None, merged: bool, only_if_missing: bool = False) -> None:
    """generation.export_format: after the merge, `python -m pipegen.export` as a step of its own (it reads the
    run directory, nothing of the writer's). A failed export never fails the run: the merged output is complete,
    and the log names the command that retries it."""
    if not fmt or not merged or (only_if_missing and run.export_file(str(fmt)).exists()):
        return
    command = [sys.executable, "-m", "pipegen.export", str(run.root), "--format", str(fmt)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        log.error("export to %s failed (%s); retry with: python -m pipegen.export %s --format %s",
                  run.export_file(str(fmt)), (done.stderr.strip().splitlines() or ["no output"])[-1], run.root, fmt)
    else:
        log.info("%s", done.stdout.strip())
