"""`python -m pipegen.bench` produces its table (no timing is judged here: benchmarks report, tests don't)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_bench_quick_checkpoint_writes_the_table(tmp_path):
    out = tmp_path / "BENCH.md"
    result = subprocess.run(
        [sys.executable, "-m", "pipegen.bench", "--quick", "--only", "checkpoint", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# pipegen benchmarks")
    for expected in ("**Machine:**", "**Versions:**", "python ", "torch ", "verl ", "orjson ", "aiohttp ",
                     "| scenario | measurement | ratio |", "5. Checkpoint write",
                     "checkpoint write (save_checkpoint), 1M vs 1k committed units", "restart scan"):
        assert expected in text, expected
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) >= 3  # header + at least two measurements
    assert "error" not in text.lower()


def test_bench_rejects_an_unknown_scenario(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pipegen.bench", "--only", "nope", "--out", str(tmp_path / "x.md")],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
    assert not (tmp_path / "x.md").exists()


def test_bench_outputs_builds_its_run_in_the_writers_batch_format(tmp_path, tiny_model):
    """The `outputs` scenario measures the merge on batch files as the writer writes them: its run folder
    loads through the writer's own `load_batch` (the full scenario takes minutes; its set-up is what broke
    when the batch format changed)."""
    from pipegen.bench.outputs import BATCH, prepare
    from pipegen.run.batchfile import FILE_MAGIC
    from pipegen.writer.batches import from_storage, load_batch

    cfg, run, ckpt = prepare(tmp_path / "run", 2 * BATCH)
    files = run.batch_files_on_disk()
    assert len(files) == 2 == len(ckpt.batches) and all(p.read_bytes().startswith(FILE_MAGIC) for p in files)
    batches = [from_storage(load_batch(p)) for p in files]
    assert all(len(b) == BATCH for b in batches)
    assert set(batches[0].non_tensor_batch["index"]).isdisjoint(set(batches[1].non_tensor_batch["index"]))
