"""Batches -> the merged output in verl's layout (`trajectories.pkl`, or sharded parts), and the run's artifact.

Owns: the merge (key alignment across batches, (index, sample, trajectory) order, verl's int64 layout
restored, verl's timing metrics, `meta_info["temperature"]` that verl's log-prob pass reads), the output
modes (one `trajectories.pkl`, or `trajectories/part_NNNNN.pkl` + `index.json` for runs larger than RAM),
`trajectories.zip` (output + checkpoint + config), uploaded to wandb when it is a tracking backend, and the
optional export at the end of a run.

Bounded memory: a `MergePlan` first reads every batch once for its sort keys and non-tensor columns (tensors
dropped at once), then fills preallocated int64 tensors row range by row range, reading only the batches that
hold rows of that range (a small cache keeps the last few, as the writer commits roughly in order). Files are
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
import time
import zipfile
from collections import OrderedDict
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional, Sequence

import numpy as np
import orjson
import torch
from omegaconf import DictConfig

from pipegen.run.atomic import atomic_write, atomic_write_bytes
from pipegen.run.checkpoint import Checkpoint
from pipegen.run.layout import RunDir
from pipegen.verl_private import performance_metrics
from pipegen.writer.batches import INT_TENSORS, ROW_ORDER, load_batch, object_array

log = logging.getLogger("pipegen.writer")

MERGE_OUTPUTS = ("single", "sharded")
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
class MergePlan:
    """Where every committed row goes in the sorted output: pass one of the merge (keys and non-tensor columns)."""

    paths: list[Path]
    dest: list[np.ndarray]  # per batch: each row's position in the sorted output
    non_tensor: dict[str, np.ndarray]  # whole run, sorted
    metrics: list[dict]  # verl's per-row agent-loop metrics, sorted
    tensor_specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # output dtype and trailing shape per tensor key
    reward_keys: Optional[list[str]]
    meta: dict[str, Any] = field(default_factory=dict)  # meta_info every output piece carries
    cache_size: int = 4
    batch_reads: int = 0
    _cache: OrderedDict = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self._span = [(int(d.min()), int(d.max())) if len(d) else (0, -1) for d in self.dest]

    @property
    def num_rows(self) -> int:
        return sum(len(d) for d in self.dest)

    @classmethod
    def scan(cls, paths: Sequence[Path], meta: Optional[dict[str, Any]] = None) -> "MergePlan":
        """Read each batch once (one at a time) for its sort keys, non-tensor columns, metrics and tensor shapes."""
        paths = list(paths)
        if not paths:
            raise ValueError("no batches to merge")
        columns: list[dict[str, np.ndarray]] = []
        metrics: list[dict] = []
        tensor_sets: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]] = []
        reward_keys = None
        for i, path in enumerate(paths):
            part = load_batch(path)
            columns.append(dict(part.non_tensor_batch))
            metrics.extend(part.meta_info.get("metrics", []))
            if i == 0:
                reward_keys = part.meta_info.get("reward_extra_keys")
            tensor_sets.append({k: (torch.int64 if k in INT_TENSORS else v.dtype, tuple(v.shape[1:]))
                                for k, v in part.batch.items()})
            del part
        # rm_scores exists only where every row was scored: keep the tensors every batch has.
        common = [k for k in tensor_sets[0] if all(k in s for s in tensor_sets)]
        for k in common:
            if any(s[k] != tensor_sets[0][k] for s in tensor_sets):
                raise ValueError(f"batch files disagree on the shape of {k!r}: rerun the writer on a clean run")
        keys: list[str] = []
        for cols in columns:  # custom loops may set extra_fields only sometimes
            keys += [k for k in cols if k not in keys]
        sizes = [len(next(iter(cols.values()))) for cols in columns]
        merged = {k: np.concatenate([cols[k] if k in cols else object_array([None] * n)
                                     for cols, n in zip(columns, sizes)]) for k in keys}
        del columns
        order = np.lexsort([merged[key].astype(np.int64) for key in reversed(ROW_ORDER)])  # last key sorts first
        position = np.empty(len(order), dtype=np.int64)
        position[order] = np.arange(len(order))
        bounds = np.cumsum([0] + sizes)
        return cls(paths=paths, dest=[position[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                   non_tensor={k: v[order] for k, v in merged.items()},
                   metrics=[metrics[i] for i in order] if len(metrics) == len(order) else [],
                   tensor_specs={k: tensor_sets[0][k] for k in common}, reward_keys=reward_keys, meta=dict(meta or {}))

    def _batch(self, i: int) -> Any:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        part = load_batch(self.paths[i])
        self.batch_reads += 1
        self._cache[i] = part
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return part

    def _tensors(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Sorted rows [lo, hi) of every tensor, int64 token tensors, read from the batches that hold them."""
        tensors = {k: torch.empty((hi - lo, *shape), dtype=dtype) for k, (dtype, shape) in self.tensor_specs.items()}
        for i, dest in enumerate(self.dest):
            if not len(dest) or self._span[i][0] >= hi or self._span[i][1] < lo:
                continue  # no row of this batch in [lo, hi)
            hit = np.nonzero((dest >= lo) & (dest < hi))[0]
            if not len(hit):
                continue
            part, at = self._batch(i), dest[hit] - lo
            if hit[-1] - hit[0] + 1 == len(hit) and at[-1] - at[0] + 1 == len(at) and (np.diff(at) == 1).all():
                # the usual case (the writer commits in order): one slice copy per tensor
                for k, out in tensors.items():
                    out[at[0]:at[-1] + 1].copy_(part.batch[k][hit[0]:hit[-1] + 1])
                continue
            at_t, src = torch.from_numpy(at), torch.from_numpy(hit)
            for k, out in tensors.items():
                out[at_t] = part.batch[k][src].to(out.dtype)
        return tensors

    def run_meta(self) -> dict[str, Any]:
        """meta_info of every output piece: the run's (so sharded parts concatenate with DataProto.concat)."""
        if "timing" not in self.meta and self.metrics and "prompts" in self.tensor_specs:
            # verl reads the prompt width and the slowest row's attention mask: one row, fetched when asked.
            shim = _Shape({"prompts": torch.empty((0, *self.tensor_specs["prompts"][1])),
                           "attention_mask": _LazyRow(self)})
            self.meta["timing"] = performance_metrics([self.metrics], shim)
        meta = dict(self.meta)
        if self.reward_keys is not None and "rm_scores" in self.tensor_specs:
            meta["reward_extra_keys"] = self.reward_keys
        return meta

    def rows(self, lo: int, hi: int) -> Any:
        """Sorted output rows [lo, hi) as one DataProto in verl's layout (int64 token tensors)."""
        from verl import DataProto

        return DataProto.from_dict(tensors=self._tensors(lo, hi), meta_info=self.run_meta(),
                                   non_tensors={k: v[lo:hi] for k, v in self.non_tensor.items()})

    def pieces(self, rows: int) -> Iterator[tuple[int, int, Any]]:
        """(lo, hi, DataProto) for consecutive ranges of at most ``rows`` sorted rows."""
        for lo in range(0, self.num_rows, max(1, rows)):
            hi = min(self.num_rows, lo + max(1, rows))
            yield lo, hi, self.rows(lo, hi)
        self._cache.clear()


@dataclass
class _Shape:
    """What verl's `_performance_metrics` reads of an output: `.batch`."""

    batch: dict


@dataclass
class _LazyRow:
    """`attention_mask[i]` of the sorted output, read on demand."""

    plan: MergePlan

    def __getitem__(self, i: Any) -> torch.Tensor:
        return self.plan._tensors(int(i), int(i) + 1)["attention_mask"][0]


def output_meta(cfg: DictConfig) -> dict[str, Any]:
    """What verl's trainer reads from a rollout's meta_info and is not in the rows: the sampling temperature."""
    return {"temperature": float(cfg.actor_rollout_ref.rollout.temperature)}


def plan_run(cfg: DictConfig, run: RunDir, ckpt: Checkpoint) -> MergePlan:
    """The merge plan of a run: exactly the batches the checkpoint lists."""
    return MergePlan.scan([run.batch_file(i) for i in ckpt.batches.numbers()], output_meta(cfg))


def merge_run(cfg: DictConfig, run: RunDir, ckpt: Checkpoint) -> None:
    """Merge the checkpoint's batches into the configured output, write (and upload) the artifact, export."""
    started = time.monotonic()
    gen = cfg.generation
    mode = str(gen.get("merge_output", "single"))
    if mode not in MERGE_OUTPUTS:
        raise ValueError(f"generation.merge_output={mode!r}: use one of {', '.join(MERGE_OUTPUTS)}")
    plan = plan_run(cfg, run, ckpt)
    if mode == "sharded":
        run.trajectories.unlink(missing_ok=True)  # the other mode's output of an earlier launch
        write_shards(plan, run, int(gen.get("merge_shard_rows", 65536)))
        target = run.output_index
    else:
        if run.output_shards.exists():
            shutil.rmtree(run.output_shards)
        merged = plan.rows(0, plan.num_rows)
        plan._cache.clear()
        atomic_write(run.trajectories, partial(save_dataproto, merged))
        del merged
        target = run.trajectories
    write_artifact(cfg, run)
    log.info("merged %d rows into %s in %.1fs", plan.num_rows, target, time.monotonic() - started)
    fmt = gen.get("export_format")
    if fmt:
        from pipegen.export.writers import export_plan

        started = time.monotonic()
        try:
            export_plan(cfg, plan, run.export_file(str(fmt)), str(fmt))
        except Exception as exc:  # the merged output is complete: report, never fail the run over the export
            log.error("export to %s failed (%s); retry with: python -m pipegen.export %s --format %s",
                      run.export_file(str(fmt)), exc, run.root, fmt)
            return
        log.info("exported %d rows to %s in %.1fs", plan.num_rows, run.export_file(str(fmt)),
                 time.monotonic() - started)


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


def write_artifact(cfg: DictConfig, run: RunDir) -> None:
    """trajectories.zip: the output (the index alone for a sharded one), the checkpoint and the config."""

    def write(f) -> None:
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
            if run.trajectories.exists():
                z.write(run.trajectories, run.trajectories.name)
            if run.output_index.exists():
                z.write(run.output_index, run.output_index.relative_to(run.root).as_posix())
            if run.checkpoint.exists():
                z.write(run.checkpoint, run.checkpoint.name)
            z.write(run.config_file, run.config_file.relative_to(run.root).as_posix())

    atomic_write(run.artifact, write)
    if cfg.generation.upload_artifact and "wandb" in list(cfg.trainer.logger):
        from pipegen.observe.tracking import upload_artifact

        upload_artifact(cfg, run)
