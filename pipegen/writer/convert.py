"""`python -m pipegen.writer output_dir=DIR --convert-pickle-batches`: a run's old pickle batch files, trusted
and rewritten once as Arrow batch files (pipegen/run/batchfile.py).

pipegen wrote batch files as pickles before the Arrow format (`batch_NNNNN.pkl`: a pickled DataProto, or the
framed `PGBATCH1` format whose header is a pickle). Loading a pickle can run any code, so every reader
refuses them; this opt-in is the one place that unpickles one, because the user says the run is theirs.
Each file is converted on its own: the Arrow file is written under its final name atomically, then the
pickle is deleted, so a crash leaves every batch in one format or the other and a rerun finishes the job.

Owns: reading the old formats and the conversion.
Must never: run without the user's explicit flag, or delete a pickle before its Arrow file is durable.
"""

from __future__ import annotations

import logging
import pickle
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from pipegen.run.atomic import atomic_write, fsync_dir
from pipegen.run.batchfile import INT_TENSORS, LEGACY_MAGIC, encode_batch_file, restore_tensors
from pipegen.run.layout import RunDir

log = logging.getLogger("pipegen.writer")

_ALIGN = 64  # the framed format's buffer alignment


def convert_pickle_batches(run: RunDir) -> int:
    """Convert every `batch_NNNNN.pkl` of the run into `batch_NNNNN.arrow`; returns how many."""
    converted = 0
    for old in run.legacy_batch_files():
        number = int(re.fullmatch(r"batch_(\d+)\.pkl", old.name).group(1))
        tensors, non_tensor, meta_info = _unpickle_trusted(old)
        int32 = any(a.dtype == np.int32 for k, a in tensors.items() if k in INT_TENSORS)
        chunks = encode_batch_file(tensors, non_tensor, meta_info, int32)

        def write(f, chunks=chunks) -> None:
            for chunk in chunks:
                f.write(chunk)

        atomic_write(run.batch_file(number), write)
        old.unlink()
        converted += 1
        log.info("converted %s -> %s", old.name, run.batch_file(number).name)
    if converted:
        fsync_dir(run.root)
    return converted


def _unpickle_trusted(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, non-tensor columns, meta_info) of an old batch file. Unpickles: only for a trusted run."""
    data = bytearray(path.read_bytes())
    if not data.startswith(LEGACY_MAGIC):
        batch = pickle.loads(data)  # a DataProto pickled whole, by the oldest pipegen
        return ({k: t.numpy() for k, t in batch.batch.items()}, dict(batch.non_tensor_batch),
                dict(batch.meta_info))
    view = memoryview(data)
    pos = len(LEGACY_MAGIC)
    head_len, count = struct.unpack_from("<2Q", view, pos)
    sizes = struct.unpack_from(f"<{count}Q", view, pos + 16)
    pos += 16 + 8 * count
    head = view[pos: pos + head_len]
    pos += head_len
    buffers = []
    for size in sizes:
        pos += -pos % _ALIGN
        buffers.append(view[pos: pos + size])
        pos += size
    header = pickle.loads(head, buffers=buffers)
    stored = dict(header["tensors"])
    if "attention_spans" in header:
        stored["_spans"] = header["attention_spans"]
    if "rm_scores_at_last_token" in header:
        stored["_scores"] = header["rm_scores_at_last_token"]
    tensors = restore_tensors(stored, header)
    return tensors, dict(header["non_tensor_batch"]), dict(header["meta_info"])
