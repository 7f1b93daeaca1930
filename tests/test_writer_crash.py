"""The writer's exactly-once promise: SIGKILL it anywhere, restart it alone, get the same output.

The actors keep generating (launcher with generation.run_writer=false) while the test kills the writer
6 times: 3 times at random moments, and once deliberately inside each step of the commit cycle through
the writer's fault hook (mid batch write, between batch rename and checkpoint, mid checkpoint write).
The final trajectories.pkl must equal an uninterrupted run's, unit for unit, on a deterministic server.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from conftest import FAKE_ENGINE, FAST, REPO, assert_same_trajectories, launch, load_trajectories
from pipegen.run.layout import BATCH_GLOB, batch_file_name

# The fake engine's output depends only on (seed, sampling_seed, context), not on its latency, so the
# reference run can be instant while the killed run generates slowly enough to be killed 6 times.
RUN = [FAKE_ENGINE, "max_samples=16", "n=2", "actors.concurrency=4", "generation.save_batch_size=2",
       "generation.partial_batch_quiet_s=0.2"]
# Slow enough that the actors generate through most of the kills below (a writer start costs ~3 s of imports).
SLOW = ["llm.engine_args=[--token-latency,0.4]"]


def _writer(out: Path, fault: str | None = None, capture: bool = False) -> subprocess.Popen:
    env = {**os.environ}
    env.pop("PIPEGEN_WRITER_FAULT", None)
    if fault:
        env["PIPEGEN_WRITER_FAULT"] = fault
    # a file, not a pipe, for long-lived writers: nobody reads the pipe and a full one would block them
    log = subprocess.PIPE if capture else open(out / "logs" / "test-writers.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "pipegen.writer", f"output_dir={out}"], cwd=REPO, env=env,
                            stdout=log, stderr=log)


@pytest.mark.slow
def test_writer_killed_over_and_over_gives_the_uninterrupted_output(tmp_path, tiny_model):
    overrides = [f"model_path={tiny_model}", *FAST, *RUN]
    reference = tmp_path / "reference"
    ref = launch(reference, *overrides)
    assert ref.returncode == 0, ref.stderr[-2000:]

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *overrides, *SLOW,
           "generation.run_writer=false"]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rng = random.Random(1234)
    kills = {"random": 0, "batch_write": 0, "after_batch_rename": 0, "checkpoint_write": 0}
    kills_while_generating = 0
    cycle = ["batch_write", "random", "after_batch_rename", "random", "checkpoint_write", "random"]
    try:
        while not (out / "conf" / "launch.json").exists():
            assert launcher.poll() is None, launcher.stderr.read()[-2000:]
            time.sleep(0.2)
        for i in range(60):
            # 6 kills, each commit point once and 3 random moments: every crash point is hit (each writer
            # start imports verl for ~6 s of CPU, and more kills only repeat the same points)
            if sum(kills.values()) >= 6 and min(kills.values()) >= 1:
                break
            mode = cycle[i % len(cycle)]
            if mode == "random":
                w = _writer(out)
                time.sleep(rng.uniform(1.0, 7.0))
                if w.poll() is None:
                    w.send_signal(signal.SIGKILL)
                    kills["random"] += 1
                w.wait()
            else:
                w = _writer(out, fault=f"{mode}:1")
                try:
                    rc = w.wait(timeout=30)
                except subprocess.TimeoutExpired:  # nothing reached the point: not a kill of this kind
                    w.kill()
                    w.wait()
                    rc = None
                if rc == -signal.SIGKILL:
                    kills[mode] += 1
            if launcher.poll() is None:
                kills_while_generating = sum(kills.values())
        assert launcher.wait(timeout=240) == 0, launcher.stderr.read()[-2000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # the actors are done; one last writer finishes the job
    final = _writer(out)
    assert final.wait(timeout=120) == 0, (out / "logs" / "test-writers.log").read_text()[-2000:]

    assert sum(kills.values()) >= 6, kills
    assert kills_while_generating >= 5, (kills_while_generating, kills)
    for point in ("batch_write", "after_batch_rename", "checkpoint_write"):
        assert kills[point] >= 1, kills
    ckpt = orjson.loads((out / "checkpoint.json").read_bytes())
    assert ckpt["complete"] and ckpt["num_committed"] == 32
    listed = {batch_file_name(i) for i in range(ckpt["batches"]["count"])}
    assert {p.name for p in out.glob(BATCH_GLOB)} == listed  # no orphan batch survived
    assert not list(out.glob(".*.tmp-*"))  # no temporary left behind
    assert_same_trajectories(load_trajectories(out / "trajectories.pkl"),
                              load_trajectories(reference / "trajectories.pkl"))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and p.name != ".writer.lock" and "stats" not in p.parts}


def _has_a_line(path) -> bool:
    return path.exists() and path.stat().st_size > 0


def test_second_writer_is_refused_and_changes_nothing(tmp_path, tiny_model):
    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "generation.run_writer=false")
    assert result.returncode == 0, result.stderr[-2000:]
    # Hide the streams so the first writer finds nothing to finish, and stand in for a live launcher (its lock,
    # held by this process) so that writer waits for actors and keeps owning the directory.
    (out / "streams" / "rollouts").rename(tmp_path / "hidden")
    from pipegen.run.ownership import DirectoryLock

    launcher_lock = DirectoryLock(out / ".launcher.lock", "launcher", name_host=True)
    launcher_lock.acquire()
    first = _writer(out)
    try:
        deadline = time.time() + 60
        while not _has_a_line(out / "streams" / "stats" / "writer.jsonl"):  # past its start-up and resume log
            assert first.poll() is None and time.time() < deadline, "first writer died"
            time.sleep(0.1)
        assert (out / ".writer.lock").read_text().strip() == str(first.pid)
        before = _files(out)
        second = _writer(out, capture=True)
        assert second.wait(timeout=60) == 3
        err = second.stderr.read().decode()
        assert f"pid {first.pid}" in err and "already owns" in err, err
        assert _files(out) == before
        assert first.poll() is None  # the owner is untouched
    finally:
        first.kill()
        first.wait()
        launcher_lock.release()
