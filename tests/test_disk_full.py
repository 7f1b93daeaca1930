"""A full disk mid-run: one closing line that says where and what, then the same command finishes the run.

The run directory is a small tmpfs (mounted for the test; skipped where the machine does not allow it),
too small for the run's shards and batch files, so a role's write fails with ENOSPC mid-run.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest

from conftest import FAKE_ENGINE, FAST, launch


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_names_the_directory_and_the_role_and_the_rerun_finishes(small_disk, tiny_model):
    out = small_disk / "run"
    overrides = [f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "max_samples=48"]
    full = launch(out, *overrides)
    assert full.returncode != 0
    console = full.stdout + full.stderr
    for noise in ("Traceback", "Task exception was never retrieved", "OSError", "Errno"):
        assert noise not in console, console[-3000:]
    line = full.stderr.strip().splitlines()[-1]
    assert line.startswith(f"pipegen: error: no space left on the device of {out} ("), line
    assert any(f"): {role} could not write there" in line for role in ("actor_0", "writer", "launcher")), line
    assert "Nothing already on disk was lost" in line and "rerun the same command" in line, line

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    rerun = launch(out, *overrides)  # launch() also checks every unit is there exactly once (--verify)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "done: 96 samples" in rerun.stdout
