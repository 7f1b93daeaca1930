"""A run's committed rows read back from its batch files: in the merged output's order (`SortedRows`), or
one batch file's row keys (`batch_rows`).

`SortedRows` reads a run in the output's order, (index, sample, trajectory), with bounded memory.
`SortedRows.scan` reads every batch once for its sort keys and non-tensor columns (tensors are not read),
then `tensors(lo, hi)` fills preallocated arrays row range by row range, reading only the batches that
hold rows of that range (a small cache keeps the last few, as the writer commits roughly in order). The
merge (pipegen/writer/merge.py) and the export (pipegen/export/) both read a run through it: the export
runs after the merge and needs nothing from it. `batch_rows` is what the writer's recovery and
`status --verify` read of one batch file: its rows' keys, a file that cannot be read being the run's
`DamagedFile`.

Owns: the order of a run's rows when read back and which batch file holds each.
Must never: decide which batch files are committed (the checkpoint does; readers are given its list),
hold more than a few batches' tensors at once, or know the file format (run/batchfile.py does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
from cachetools import LRUCache

from pipegen.run.batchfile import (INT_TENSORS, ROW_KEYS, BatchFileError, StoredBatch, object_array, read_batch,
                                   read_row_keys)
from pipegen.run.checkpoint import Checkpoint, damaged_batch
from pipegen.run.layout import RunDir
from pipegen.run.stream import UnitKeys


@dataclass(frozen=True)
class BatchRows:
    """The rows of one batch file by their keys: what the writer's recovery and `status --verify` need."""

    index: np.ndarray
    sample: np.ndarray
    trajectory: np.ndarray

    def unit_keys(self, keys: UnitKeys) -> np.ndarray:
        """Each row's unit key (a unit with several trajectories has several rows)."""
        return self.index * keys.n + self.sample

    def row_ids(self) -> list[tuple[int, int, int]]:
        """Each row's (index, sample, trajectory): what no two rows of a run may share."""
        return list(zip(self.index.tolist(), self.sample.tolist(), self.trajectory.tolist()))


def batch_rows(path: Path, whole: bool = False) -> BatchRows:
    """A batch file's row keys; any way it cannot be read is the run's DamagedFile, naming the file and the
    fix. whole=True reads its tensors too (a file damaged inside a tensor column fails here as well)."""
    if not Path(path).exists():
        raise damaged_batch(path, "missing")
    try:
        if whole:
            columns = {k: np.asarray(v).astype(np.int64) for k, v in read_batch(path).non_tensor.items() if k in ROW_KEYS}
        else:
            columns = read_row_keys(path)
        return BatchRows(*(columns[k] for k in ROW_KEYS))
    except (BatchFileError, KeyError, OSError) as e:
        raise damaged_batch(path, f"cannot be read: {getattr(e, 'reason', e)}") from None



ROW_ORDER = ROW_KEYS  # the non-tensor columns the merged output is sorted by


@dataclass
class SortedRows:
    """Where every committed row goes in the sorted output: pass one of the merge (keys and non-tensor columns)."""

    paths: list[Path]
    dest: list[np.ndarray]  # per batch: each row's position in the sorted output
    non_tensor: dict[str, np.ndarray]  # whole run, sorted
    metrics: list[dict]  # verl's per-row agent-loop metrics, sorted
    tensor_specs: dict[str, tuple[np.dtype, tuple[int, ...]]]  # output dtype (int64 tokens) and trailing shape
    reward_keys: Optional[list[str]]
    cache_size: int = 4
    batch_reads: int = 0
    _cache: LRUCache = field(init=False, repr=False)  # the last `cache_size` batches read

    def __post_init__(self) -> None:
        self._cache = LRUCache(maxsize=max(1, self.cache_size))
        self._span = [(int(d.min()), int(d.max())) if len(d) else (0, -1) for d in self.dest]

    @property
    def num_rows(self) -> int:
        return sum(len(d) for d in self.dest)

    @classmethod
    def scan(cls, paths: Sequence[Path], **kwargs: Any) -> "SortedRows":
        """Read each batch once (one at a time, tensors left out) for its sort keys, non-tensor columns,
        metrics and tensor shapes. Raises BatchFileError naming a batch file that cannot be read."""
        paths = list(paths)
        if not paths:
            raise ValueError("no batches to merge")
        columns: list[dict[str, np.ndarray]] = []
        metrics: list[dict] = []
        tensor_sets: list[dict[str, tuple[np.dtype, tuple[int, ...]]]] = []
        reward_keys = None
        for i, path in enumerate(paths):
            part = read_batch(path, tensors=False)
            columns.append(part.non_tensor)
            metrics.extend(part.meta_info.get("metrics", []))
            if i == 0:
                reward_keys = part.meta_info.get("reward_extra_keys")
            tensor_sets.append({k: (np.dtype(np.int64) if k in INT_TENSORS else np.dtype(dtype), shape)
                                for k, (dtype, shape) in part.tensor_shapes.items()})
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
                   tensor_specs={k: tensor_sets[0][k] for k in common}, reward_keys=reward_keys, **kwargs)

    @classmethod
    def committed(cls, run: RunDir, ckpt: Checkpoint, **kwargs: Any) -> "SortedRows":
        """The rows of exactly the batches the checkpoint lists."""
        return cls.scan([run.batch_file(i) for i in ckpt.batches.numbers()], **kwargs)

    def _batch(self, i: int) -> StoredBatch:
        part = self._cache.get(i)
        if part is None:
            part = self._cache[i] = read_batch(self.paths[i])
            self.batch_reads += 1
        return part

    def tensors(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Sorted rows [lo, hi) of every tensor, int64 token tensors, read from the batches that hold them."""
        tensors = {k: np.empty((hi - lo, *shape), dtype=dtype) for k, (dtype, shape) in self.tensor_specs.items()}
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
                    out[at[0]:at[-1] + 1] = part.tensors[k][hit[0]:hit[-1] + 1]
                continue
            for k, out in tensors.items():
                out[at] = part.tensors[k][hit]
        return tensors

    def ranges(self, rows: int) -> Iterator[tuple[int, int]]:
        """Consecutive [lo, hi) ranges of at most ``rows`` sorted rows, covering the run."""
        step = max(1, rows)
        for lo in range(0, self.num_rows, step):
            yield lo, min(self.num_rows, lo + step)

    def release(self) -> None:
        """Drop the cached batches (after the last range)."""
        self._cache.clear()
