"""Batch files are data: a planted pickle never runs, a damaged file is refused naming it (damage to the
structure: Arrow keeps no checksum of the values), a run in the old
pickle format is refused in one line until the user converts it, and the Arrow format gives back every
column exactly (tests/test_writer_batches.py holds the tensors to verl's own rows)."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from test_writer_batches import _assert_same


class _Payload:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _python(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def committed_run(tmp_path_factory, tiny_model):
    """A run folder with one committed batch: config, manifest, checkpoint, and the batch as a DataProto."""
    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.bench import common as c
    from pipegen.run.checkpoint import Checkpoint, save_checkpoint
    from pipegen.run.fingerprint import compute_fingerprint, save_fingerprint
    from pipegen.writer.batches import BatchBuilder

    cfg, run = c.prepare_run(tmp_path_factory.mktemp("run"), "n=2", "max_samples=4", "max_response_length=16")
    batch = asyncio.run(BatchBuilder(cfg, load_tokenizer(cfg)).build(c.RecordFactory(cfg).records(8, 16)))
    save_fingerprint(run.fingerprint_file, compute_fingerprint(cfg))  # as the launcher leaves a run
    ckpt = Checkpoint(run_key=run.run_key())
    ckpt.batches.add(len(batch), 8)
    save_checkpoint(run.checkpoint, ckpt)
    return cfg, run, batch


def _clear_batches(run):
    for path in [*run.batch_files_on_disk(), *run.legacy_batch_files(), run.export_file("parquet")]:
        path.unlink(missing_ok=True)


def test_a_planted_pickle_never_runs_and_the_error_names_the_file(committed_run, tmp_path):
    from pipegen.run.batchfile import BatchFileError, read_batch, read_row_keys
    from pipegen.writer.batches import load_batch

    _, run, _ = committed_run
    _clear_batches(run)
    marker = tmp_path / "payload-ran"
    planted = run.batch_file(0)
    for payload in (pickle.dumps(_Payload(marker)), b"PGBATCH1" + pickle.dumps(_Payload(marker)),
                    b"ARROW1\0\0" + pickle.dumps(_Payload(marker))):
        planted.write_bytes(payload)
        for read in (read_batch, read_row_keys, load_batch):
            with pytest.raises(BatchFileError) as caught:
                read(planted)
            assert caught.value.path == planted and str(planted) in str(caught.value)
        if payload.startswith(b"\x80"):  # the case, through the real command
            result = _python("pipegen.export", str(run.root))
            assert result.returncode == 2
            assert str(planted) in _one_line(result.stderr)
        assert not marker.exists()
    assert not run.export_file("parquet").exists()


def test_a_damaged_batch_file_is_refused_naming_it(committed_run):
    from pipegen.run.batchfile import BatchFileError, read_batch, read_row_keys
    from pipegen.writer.batches import encode_batch

    _, run, batch = committed_run
    _clear_batches(run)
    whole = b"".join(bytes(c) for c in encode_batch(batch, True))
    path = run.batch_file(0)
    damaged = {"truncated": whole[: len(whole) // 2], "empty": b"",
               "zeroed tail": whole[: len(whole) - 64] + bytes(64),
               "zeroed head": bytes(4096) + whole[4096:], "foreign": b"PAR1" + whole[4:]}
    for name, data in damaged.items():
        path.write_bytes(data)
        for read in (read_batch, read_row_keys):
            with pytest.raises(BatchFileError) as caught:
                read(path)
            assert caught.value.path == path, name
    path.write_bytes(whole)
    keys = read_row_keys(path)
    assert list(keys) == ["index", "sample", "trajectory"] and len(keys["index"]) == len(batch)
    assert keys["sample"].tolist() == batch.non_tensor_batch["sample"].tolist()


def _framed_pickle(batch) -> bytes:
    """A batch file as pipegen wrote it before the Arrow format: PGBATCH1, lengths, a pickled header with the
    arrays out of band, then the arrays at 64-byte aligned offsets."""
    header = {"batch_size": len(batch), "keys": list(batch.batch.keys()),
              "dtypes": {k: t.numpy().dtype.str for k, t in batch.batch.items()}, "derived": [],
              "tensors": {k: t.numpy() for k, t in batch.batch.items()},
              "non_tensor_batch": batch.non_tensor_batch, "meta_info": batch.meta_info}
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(header, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    out = bytearray(b"PGBATCH1" + struct.pack(f"<{2 + len(raws)}Q", len(head), len(raws), *(r.nbytes for r in raws)))
    out += head
    for raw in raws:
        out += bytes(-len(out) % 64)
        out += raw
    return bytes(out)


@pytest.mark.parametrize("old_format", ["framed", "pickled DataProto"])
def test_a_run_in_the_old_pickle_format_is_refused_until_converted(committed_run, old_format, capsys):
    from pipegen.export.__main__ import main as export_main
    from pipegen.launch.resume import guard_resume as prepare_run
    from pipegen.observe.run_status import gather
    from pipegen.writer.batches import from_storage, load_batch

    cfg, run, batch = committed_run
    _clear_batches(run)
    run.legacy_batch_file(0).write_bytes(_framed_pickle(batch) if old_format == "framed" else pickle.dumps(batch))
    fix = f"python -m pipegen.writer output_dir={run.root} --convert-pickle-batches"
    assert export_main([str(run.root)]) == 2 and fix in _one_line(capsys.readouterr().err)
    if old_format == "framed":  # the writer's own refusal (a process: it sets up logging and watches its parent)
        result = _python("pipegen.writer", f"output_dir={run.root}")
        assert result.returncode == 2 and fix in _one_line(result.stderr)
    assert fix in prepare_run(cfg, run)  # the launcher refuses before any process starts
    assert fix in gather(run).hint
    assert run.legacy_batch_files() and not run.batch_files_on_disk()  # nothing on disk was touched

    result = _python("pipegen.writer", f"output_dir={run.root}", "--convert-pickle-batches")
    assert result.returncode == 0, result.stderr[-2000:]
    assert not run.legacy_batch_files() and run.batch_files_on_disk() == [run.batch_file(0)]
    _assert_same(from_storage(load_batch(run.batch_file(0))), from_storage(batch))
    assert prepare_run(cfg, run) is None
    assert export_main([str(run.root)]) == 0 and run.export_file("parquet").exists()


def test_columns_round_trip_exactly_and_unstorable_values_are_refused(tmp_path):
    from pipegen.run.batchfile import encode_batch_file, object_array, read_batch, read_row_keys

    rows = 4
    tensors = {"responses": np.arange(rows * 6, dtype=np.int64).reshape(rows, 6),
               "scores": np.linspace(0, 1, rows * 2 * 3, dtype=np.float32).reshape(rows, 2, 3),
               "flat": np.arange(rows, dtype=np.float64)}
    non_tensor = {
        "index": object_array([3, 1, 2, 0]), "sample": np.array([0, 1, 0, 1]), "trajectory": np.zeros(rows, np.int64),
        "row": object_array([{"a": [1, 2.5, None]}, {}, {"nested": {"x": "é"}}, {"a": []}]),
        "big": object_array([2 ** 40, 1, -3, 0]), "maybe": object_array([None, 1, "x", [1]]),
        "flag": np.array([True, False, True, True]), "acc": np.array([0.5, 1.0, 0.0, 0.25]),
    }
    meta = {"metrics": [{"generate_sequences": 0.5}] * rows, "reward_extra_keys": ["acc"]}
    path = tmp_path / "batch_00000.arrow"
    path.write_bytes(b"".join(bytes(c) for c in encode_batch_file(tensors, non_tensor, meta, int32=False)))
    back = read_batch(path)
    assert list(back.tensors) == list(tensors) and list(back.non_tensor) == list(non_tensor)
    for key, arr in tensors.items():
        assert back.tensors[key].dtype == arr.dtype and np.array_equal(back.tensors[key], arr), key
        assert back.tensors[key].flags.writeable
    for key, values in non_tensor.items():
        assert back.non_tensor[key].dtype == values.dtype, key
        assert repr(back.non_tensor[key].tolist()) == repr(values.tolist()), key
        assert back.non_tensor[key].flags.writeable, key
    assert back.meta_info == meta
    assert read_row_keys(path)["index"].tolist() == [3, 1, 2, 0]
    with pytest.raises(ValueError, match="'row'"):
        encode_batch_file(tensors, {**non_tensor, "row": object_array([object()] * rows)}, meta, int32=False)
