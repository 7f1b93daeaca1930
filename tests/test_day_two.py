"""What a user meets on the second day: the writer restarted by hand under a live launcher, a refused
launch fixed in the same directory, and true rates in the final stats line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from conftest import FAKE_ENGINE, FAST, REPO, launch, load_trajectories
from test_status import kill_orphans_of

from pipegen.observe.status import writer_lock_holder
from pipegen.run.layout import RunDir

# 12 prompts x 2 samples, ~2.4 s per unit on the fake engine, 8 at a time: long enough to act mid-run.
SLOW = [o for o in FAST if not o.startswith("max_samples=")] + [
    "max_samples=12", FAKE_ENGINE, "llm.engine_args=[--token-latency,0.1,--eos-prob,0]",
]
ALL_UNITS = [(i, s) for i in range(12) for s in range(2)]


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launcher exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def committed(out: Path) -> int:
    try:
        return orjson.loads((out / "checkpoint.json").read_bytes())["num_committed"]
    except (FileNotFoundError, orjson.JSONDecodeError):
        return 0


def units(data) -> list[tuple[int, int]]:
    return sorted((int(i), int(s)) for i, s in zip(data.non_tensor_batch["index"], data.non_tensor_batch["sample"]))


def test_writer_started_by_hand_under_a_live_launcher_finishes_the_run(tmp_path, tiny_model):
    out = tmp_path / "run"
    run = RunDir(out)
    launcher_log = open(tmp_path / "launcher.log", "w+")
    launcher = subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir={out}",
                                 f"model_path={tiny_model}", *SLOW], cwd=REPO, stdout=launcher_log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    hand = None
    try:
        wait_for(lambda: committed(out) > 0, 120, "a first commit", launcher)
        for _ in range(3):
            # kill the launcher's writer, start one by hand; the launcher restarts its own after a
            # backoff, so the hand-started one usually wins the lock, and is refused (exit 3) if not
            victim = writer_lock_holder(run)
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: writer_lock_holder(run) != victim, 10, "the killed writer's lock to go")
            hand = subprocess.Popen([sys.executable, "-m", "pipegen.writer", f"output_dir={out}"], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            holder = wait_for(lambda: writer_lock_holder(run) or (hand.poll() is not None and -1), 60,
                              "a writer to take the lock")
            if holder == hand.pid:
                break
            assert hand.wait(timeout=60) == 3  # lost the race to the launcher's writer: refused, harmless
        else:
            raise AssertionError("the hand-started writer never got the lock")
        assert launcher.wait(timeout=240) == 0
        assert hand.wait(timeout=60) == 0, hand.stdout.read()[-3000:]
    finally:
        for proc in (launcher, hand):
            if proc is not None and proc.poll() is None:
                proc.kill()
        kill_orphans_of(launcher.pid)
    launcher_log.seek(0)
    console = launcher_log.read()
    assert "crashed" not in console and "started outside the launcher" in console, console[-3000:]
    assert units(load_trajectories(out / "trajectories.pkl")) == ALL_UNITS  # every unit exactly once


def test_a_launch_refused_for_a_long_prompt_completes_rerun_with_the_fix(tmp_path, tiny_model):
    out = tmp_path / "run"
    refused = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "max_prompt_length=16")
    assert refused.returncode == 2
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("pipegen: error:") and "raise max_prompt_length" in error, refused.stderr[-2000:]
    fixed = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "max_prompt_length=512")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert units(load_trajectories(out / "trajectories.pkl")) == [(i, s) for i in range(6) for s in range(2)]
