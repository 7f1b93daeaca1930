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
