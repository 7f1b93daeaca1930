"""A run read back from its object store alone: the committed segments laid out as a run directory in a local read
cache, so every reader (`pipegen status`, `verify`, `export`, `report`, the merge) runs its own code on it.

`StoreRun(arg)`, the one read-back every reader uses (`pipegen status`, `report`, `export`, the writer's merge from
the store): entered, a run directory (a folder as it is, a storage url materialized); left without an error, the
files the body named (`put_back`) go into the store beside the run.

`materialize(url)` reads every writer's segments, applies the tie-break (run/store.py's `resolve`: a unit in two
segments is kept from the one first by (writer, seq)), downloads each batch object a kept segment names and checks
its size and sha256 (a cached copy with the right digest is not fetched again), numbers them batch_00000.arrow ...
in that order, and writes checkpoint.json from the segments alone (committed ranges, the ledger, the store's
failed_units.json). The run's conf files come from the store; its merged output too when asked (else only whether the store
holds it, which status names). `upload` puts the
files a reader wrote (an export, a report) back into the store. The scratch folders of the nodes are never read.

Owns: the read cache (~/.cache/pipegen/store/<bucket>/<prefix>/, rewritten on every read) and what a reader writes
back. Must never: write to the store anything but a reader's outputs, or count a batch object no segment names.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

import numpy as np
import orjson

from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.batchfile import BatchColumns, encode_batch_file, read_batch
from pipegen.run.checkpoint import Checkpoint, save_checkpoint
from pipegen.run.config import load_run_config
from pipegen.run.layout import RunDir, arg_value
from pipegen.run.store import (CONF_FILES, LATE_CONF_FILES, Segment, StoreError, StoreRefused, conf_key, is_store_url,
                               output_key, read_cache, resolve, sha256)
from pipegen.run.stream import parse_unit_label
from pipegen.transport.object_store import Store


def materialize(url: str, cache: Path | None = None, outputs: bool = False) -> RunDir:
    """The store run at `url` as a run directory in the read cache (see the module docstring). `outputs`: fetch the
    merged output too (trajectories.pkl or the sharded parts). Raises StoreError with one line."""
    store = Store(url)
    run = RunDir(Path(cache or read_cache(url)))
    run.conf.mkdir(parents=True, exist_ok=True)
    for name in CONF_FILES + LATE_CONF_FILES:
        data = store.get(conf_key(name))
        if data is None and name in ("config.yaml", "units.json"):
            raise StoreRefused(f"{url} holds no pipegen run (no {conf_key(name)}): pass the storage url of a run")
        if data is not None:
            atomic_write_bytes(run.conf / name, data)
    n = int(load_run_config(run).actor_rollout_ref.rollout.n)
    ckpt = Checkpoint(run_key=run.run_key(), n=n)
    wanted = set()
    for seg, dropped in resolve(store.segments()):
        keys = [k for k in seg.unit_keys() if k not in dropped]
        if not keys:
            continue  # every unit of it was committed first by an earlier segment
        path = run.batch_file(len(ckpt.batches))
        wanted.add(path)
        rows = _fetch(store, seg, path, dropped, n)
        ckpt.batches.add(rows, len(keys))
        ckpt.committed.add_sorted(keys)
    for stale in set(run.batch_files_on_disk()) - wanted:
        stale.unlink()
    failed = store.get(output_key(run.failed_units.relative_to(run.root)))
    if failed is not None:
        atomic_write_bytes(run.failed_units, failed)
        units = orjson.loads(failed).get("units", {})
        ckpt.failed = {label: {"reason": reason} for label, reason in units.items()
                       if n * parse_unit_label(label)[0] + parse_unit_label(label)[1] not in ckpt.committed}
    else:
        run.failed_units.unlink(missing_ok=True)
    ckpt.complete = ckpt.num_committed == run.total_units(n) and not ckpt.failed
    # merged: the store holds the merged output (fetched with `outputs`, else only looked up: status names it)
    ckpt.merged = _fetch_outputs(store, run) if outputs else _has_outputs(store, run)
    save_checkpoint(run.checkpoint, ckpt)
    return run


def _fetch(store: Store, seg: Segment, path: Path, dropped: set[int], n: int) -> int:
    """The segment's batch object at `path` (checked against the segment; the units `dropped` filtered out).
    Returns its rows."""
    if not dropped and path.exists() and path.stat().st_size == seg.size and sha256(path.read_bytes()) == seg.sha256:
        return seg.rows
    data = store.get(seg.batch)
    if data is None or len(data) != seg.size or sha256(data) != seg.sha256:
        problem = "missing" if data is None else "not the bytes it commits (size or sha256 differ)"
        raise StoreError(f"{store.url}: the batch object {seg.batch} that segment {seg.seq} of writer {seg.writer} "
                         f"commits is {problem}: the store lost or changed it; its units are in that node's shards")
    rows = seg.rows
    if dropped:
        data, rows = _without_units(data, dropped, n)
    atomic_write_bytes(path, data)
    return rows


def _without_units(data: bytes, dropped: set[int], n: int) -> tuple[bytes, int]:
    """A batch file's bytes without the rows of `dropped` units (kept from an earlier segment): read and encoded
    again by run/batchfile.py, the one owner of the format. Returns the bytes and their rows."""
    with tempfile.NamedTemporaryFile(suffix=".arrow") as f:
        f.write(data)
        f.flush()
        batch = read_batch(Path(f.name))
    units = batch.non_tensor[BatchColumns.INDEX].astype(np.int64) * n + batch.non_tensor[BatchColumns.SAMPLE]
    keep = np.array([int(k) not in dropped for k in units], dtype=bool)
    int32 = batch.tensors[BatchColumns.RESPONSES].dtype == np.int32
    chunks = encode_batch_file({k: v[keep] for k, v in batch.tensors.items()},
                               {k: v[keep] for k, v in batch.non_tensor.items()}, batch.meta_info, int32)
    return b"".join(memoryview(c).cast("B").tobytes() for c in chunks if len(c)), int(keep.sum())


def _has_outputs(store: Store, run: RunDir) -> bool:
    """Whether the store holds the merged output (trajectories.pkl, or the sharded parts' index), without fetching."""
    single = output_key(run.trajectories.relative_to(run.root))
    index = output_key(run.output_index.relative_to(run.root))
    return store.exists(single) or store.exists(index)


def store_output(url: str, run: RunDir) -> str:
    """The merged output's address in the store (what status names for a store run): trajectories.pkl, or the
    sharded parts' index with generation.merge_output=sharded."""
    sharded = str(load_run_config(run).generation.merge_output) == "sharded"
    target = run.output_index if sharded else run.trajectories
    return f"{url.rstrip('/')}/{output_key(target.relative_to(run.root))}"


def _fetch_outputs(store: Store, run: RunDir) -> bool:
    """The merged output into the cache, when the store has it. Returns whether it has."""
    single = output_key(run.trajectories.relative_to(run.root))
    data = store.get(single)
    if data is not None:
        atomic_write_bytes(run.trajectories, data)
        return True
    run.trajectories.unlink(missing_ok=True)
    shards = output_key(run.output_shards.relative_to(run.root))
    keys = store.list(shards)
    if run.output_shards.exists():
        shutil.rmtree(run.output_shards)
    for key in keys:
        data = store.get(key)
        if data is not None:
            target = run.root / key
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(target, data)
    return run.output_index.exists()


def upload(url: str, run: RunDir, paths: list[Path]) -> list[str]:
    """Files a reader wrote under the cache's run directory (an export, a report), put into the store under the
    same relative names. Returns their object names."""
    store = Store(url)
    keys = []
    for path in paths:
        if Path(path).is_dir():
            keys += upload(url, run, sorted(p for p in Path(path).rglob("*") if p.is_file()))
            continue
        key = output_key(Path(path).relative_to(run.root))
        store.put_file(key, Path(path))
        keys.append(key)
    return keys


class StoreRun:
    """`with StoreRun(arg) as run:` the run that `arg` names (a run directory, `output_dir=DIR`, or a storage url read
    back from the store alone into the read cache; `cache`, `outputs`: as `materialize`). Leaving the block without
    an error puts the files the body named with `put_back` into the store (those under the run directory; a folder
    run keeps them local); `keys` then holds their object names. StoreError (one line) from either end: `run` is
    None when the read failed, set when the put did."""

    def __init__(self, arg: str | os.PathLike, cache: Path | None = None, outputs: bool = False):
        text = arg_value([str(arg)], "output_dir", str(arg))  # `output_dir=DIR` as a role takes it, or DIR
        self.url = text if is_store_url(text) else None
        self.arg, self.cache, self.outputs = text, cache, outputs
        self.run: RunDir | None = None
        self.keys: list[str] = []
        self._back: list[Path] = []

    def __enter__(self) -> RunDir:
        self.run = (materialize(self.url, self.cache, self.outputs) if self.url
                    else RunDir(Path(self.arg).expanduser().resolve()))
        return self.run

    def put_back(self, *paths: Path) -> None:
        """Files the body wrote, for the store (a store run's only)."""
        self._back += paths

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is None and self.url and self._back:
            inside = [p for p in self._back if Path(p).resolve().is_relative_to(self.run.root)]
            self.keys = upload(self.url, self.run, inside)
