"""A damaged run directory: every file, every way, after a partial run.

One partial run is made once (the actors generate everything with the writer off, then a writer is
SIGKILLed right after renaming its last batch file: one or two batch files committed, the rest written
but unlisted). Each case copies it, damages one file one way (truncated, empty, zero-filled,
garbage, missing) and relaunches the same command as a user would. The answer must be a full recovery
(output equal to a clean run's) or one `pipegen: error:` line naming the file and a fix; then the fix
and the same command again must give a clean run's output. Never a traceback, never a batch file lost
(a recovery sets files aside, it does not delete them), never a row twice (`--verify` passes at the end).
"""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from conftest import FAKE_ENGINE, FAST, REPO, assert_same_trajectories, assert_verified, launch, load_trajectories
from pipegen.run.layout import BATCH_GLOB, batch_file_name

FILES = {
    "checkpoint": "checkpoint.json",
    "config": "conf/config.yaml",
    "fingerprint": "conf/fingerprint.json",
    "units": "conf/units.json",
    "launch": "conf/launch.json",
    "batch": batch_file_name(0),  # the one batch file the checkpoint lists
    "shard": "streams/rollouts/actor_0/000000.jsonl",  # committed and uncommitted lines
}
MODES = ("truncated", "empty", "zero-filled", "garbage", "missing")


def damage(path: Path, mode: str) -> None:
    data = path.read_bytes()
    if mode == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif mode == "empty":
        path.write_bytes(b"")
    elif mode == "zero-filled":
        path.write_bytes(bytes(len(data)))
    elif mode == "garbage":
        path.write_bytes(random.Random(f"{path.name}:{len(data)}").randbytes(len(data)))
    else:
        path.unlink()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    """(overrides, the clean run's directory, the partial run's directory)."""
    base = tmp_path_factory.mktemp("damage")
    overrides = [f"model_path={tiny_model}", *FAST, FAKE_ENGINE]
    clean = launch(base / "clean", *overrides)
    assert clean.returncode == 0, clean.stderr[-2000:]
    partial = base / "partial"
    actors = launch(partial, *overrides, "generation.run_writer=false")
    assert actors.returncode == 0, actors.stderr[-2000:]
    writer = subprocess.run([sys.executable, "-m", "pipegen.writer", f"output_dir={partial}"], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PIPEGEN_WRITER_FAULT": "after_batch_rename:3"})
    # killed as its third (last) batch file got its name: the first was committed alone (the commit thread
    # takes the first batch at once), the last is not listed yet, so every unit is in a batch file
    assert writer.returncode == -9, writer.stderr[-2000:]
    listed = orjson.loads((partial / "checkpoint.json").read_bytes())["batches"]["count"]
    assert 1 <= listed < len(list(partial.glob(BATCH_GLOB))) == 3
    return overrides, base / "clean", partial


def batch_files(root: Path) -> set[str]:
    """Every batch file's bytes under root, set aside or not (a name change is no loss)."""
    import hashlib

    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in root.glob("batch_*")}


def assert_one_line(result: subprocess.CompletedProcess, path: Path) -> str:
    """The refusal: one `pipegen: error:` line naming the file, what is intact and the fix; no traceback."""
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    assert "Task exception was never retrieved" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("pipegen: error: ") and str(path) in line, result.stderr[-2000:]
    assert "intact: " in line and "fix: " in line, line
    return line


def fix_command(line: str) -> list[str]:
    """The command a refusal names (the rebuild), as this interpreter runs it."""
    m = re.search(r"fix: (python -m pipegen\.writer \S+ --rebuild)", line)
    assert m, line
    return [sys.executable, *shlex.split(m.group(1))[1:]]


def first_answer(cfg, out: Path) -> str | None:
    """What the launcher does with a run directory before it starts any process (launcher.main): the
    refusal line's text, or None when it goes on (having re-derived what it owns)."""
    from pipegen.launch.resume import check_run_files, guard_resume as prepare_run
    from pipegen.run.layout import RunDir

    return prepare_run(cfg, RunDir(out)) or check_run_files(RunDir(out))


def finish_in_process(cfg, out: Path) -> str | None:
    """The rest of a relaunch whose actors have nothing to generate, in this process: the launcher's
    manifest and launch record, then the real Writer to the end. The writer's refusal text, or None."""
    import asyncio
    import uuid

    import torch

    from pipegen.launch.unit_manifest import build_manifest
    from pipegen.run.config import load_run_config
    from pipegen.run.integrity import DamagedFile
    from pipegen.run.layout import LaunchRecord, RunDir
    from pipegen.writer.commit import Writer
    from pipegen.writer.modes import LauncherWriter

    run = RunDir(out)
    if not run.units_file.exists():
        build_manifest(cfg, run)
    run.write_launch(LaunchRecord(launch=uuid.uuid4().hex, run_key=run.run_key()))
    threads = torch.get_num_threads()
    writer = Writer(load_run_config(run), run, LauncherWriter())
    try:
        # every unit of these cases is in a batch file or a shard line: the writer settles in seconds
        assert asyncio.run(asyncio.wait_for(writer.main(), 120)) == 0
    except DamagedFile as e:
        return str(e)
    finally:
        writer.committer.close()
        torch.set_num_threads(threads)
    return None


@pytest.fixture(scope="module")
def launch_cfg(runs):
    """The config the launcher resolves for the runs' command (what it saved for the partial run)."""
    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir

    return load_run_config(RunDir(runs[2]))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(FILES))
def test_every_damage_is_recovered_or_refused_with_a_fix_that_works(runs, launch_cfg, tmp_path, name, mode):
    """All 35 cases through the launcher's and the writer's own code, in this process (a process per
    case would cost the suite ~12 minutes: the end-to-end test below runs each recovery path once)."""
    from omegaconf import open_dict

    from pipegen.run.layout import RunDir
    from pipegen.writer.rebuild import rebuild

    _, clean, partial = runs
    out = tmp_path / "run"
    shutil.copytree(partial, out)
    cfg = launch_cfg.copy()
    with open_dict(cfg):
        cfg.output_dir = str(out)
    target = out / FILES[name]
    damage(target, mode)
    before = batch_files(out)

    answer = first_answer(cfg, out)
    if answer is None:
        answer = finish_in_process(cfg, out)
    if answer is not None:
        assert len(answer.splitlines()) == 1 and str(target) in answer, answer
        assert "intact: " in answer and "fix: " in answer, answer
        assert f"python -m pipegen.writer output_dir={out} --rebuild" in answer, answer
        rebuild(RunDir(out), int(cfg.actor_rollout_ref.rollout.n))
        assert first_answer(cfg, out) is None
        assert finish_in_process(cfg, out) is None

    assert before <= batch_files(out)  # every batch file is still there, listed or set aside
    assert_same_trajectories(load_trajectories(out / "trajectories.pkl"), load_trajectories(clean / "trajectories.pkl"))
    assert_verified(out)


# Each recovery path once, as a user meets it: the same command again, real processes (a config.yaml is written
# again by every launch, before any process reads it: the in-process test covers it). The three files a launch
# recovers without a word are damaged together, in one run directory: one launch recovers all three.
END_TO_END = {
    "checkpoint-garbage": [("checkpoint", "garbage")],  # refused before any process starts; --rebuild; the same command
    "recovered-in-one-launch": [
        ("checkpoint", "missing"),  # the writer rebuilds it from the batch files
        ("fingerprint", "zero-filled"),  # restored: this launch's setup reproduces the recorded run key
        ("units", "garbage"),  # set aside, read again from the dataset
    ],
    "batch-truncated": [("batch", "truncated")],  # refused when the merge reads it; --rebuild; its units from the shards
    "shard-garbage": [("shard", "garbage")],  # its uncommitted units generated again (no orphan batch holds them here)
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(END_TO_END))
def test_a_damaged_file_end_to_end(runs, tmp_path, case):
    overrides, clean, partial = runs
    out = tmp_path / "run"
    shutil.copytree(partial, out)
    damaged = END_TO_END[case]
    if ("shard", "garbage") in damaged:  # as if the writer died before writing its unlisted batch files
        listed = orjson.loads((out / "checkpoint.json").read_bytes())["batches"]["count"]
        for orphan in sorted(out.glob(BATCH_GLOB))[listed:]:
            orphan.unlink()
    targets = [out / FILES[name] for name, _ in damaged]
    for target, (_, mode) in zip(targets, damaged):
        damage(target, mode)
    before = batch_files(out)

    result = launch(out, *overrides)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    if len(damaged) > 1:  # the silent recoveries: the first launch finishes the run, each file recovered its way
        assert result.returncode == 0, result.stderr[-3000:]
        assert list(out.glob("conf/fingerprint.json.damaged-*")) and list(out.glob("conf/units.json.damaged-*"))
        assert "no checkpoint.json beside 3 batch file(s): rebuilding it" in (out / "logs" / "writer.log").read_text()
    if result.returncode != 0:
        (target,) = targets
        line = assert_one_line(result, target)
        fix = fix_command(line)
        fixed = subprocess.run(fix, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert fixed.returncode == 0 and "Traceback" not in fixed.stderr, fixed.stderr[-2000:]
        assert "the old checkpoint is kept as" in fixed.stdout or "set aside" in fixed.stdout, fixed.stdout
        result = launch(out, *overrides)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]

    assert before <= batch_files(out)
    assert_same_trajectories(load_trajectories(out / "trajectories.pkl"), load_trajectories(clean / "trajectories.pkl"))
    assert_verified(out)


# ---- --verify: the exactly-once proof fails, naming the problem ----

def verify(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipegen.status", str(out), "--verify"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def complete_copy(runs, tmp_path) -> Path:
    _, clean, _ = runs
    out = tmp_path / "run"
    shutil.copytree(clean, out)
    return out


@pytest.mark.slow
def test_verify_passes_a_clean_run_and_fails_on_a_duplicated_row(complete_copy):
    ok = verify(complete_copy)
    assert ok.returncode == 0 and ok.stdout.startswith(f"pipegen verify {complete_copy}: OK"), ok.stdout + ok.stderr
    # batch 0 again, as a fourth batch the checkpoint lists: its rows are there twice
    shutil.copy(complete_copy / batch_file_name(0), complete_copy / batch_file_name(3))
    ckpt_path = complete_copy / "checkpoint.json"
    ckpt = orjson.loads(ckpt_path.read_bytes())
    ckpt["batches"]["sizes"].append(list(ckpt["batches"]["sizes"][0][:2]) + [1])
    ckpt_path.write_bytes(orjson.dumps(ckpt))
    bad = verify(complete_copy)
    assert bad.returncode == 1, bad.stdout
    assert "duplicated row(s): " in bad.stdout and f"in {batch_file_name(0)} and {batch_file_name(3)}" in bad.stdout, bad.stdout


def verify_in_process(out: Path) -> str:
    """The --verify report of out, which must find a problem (the CLI's exit 1 is tested above)."""
    from pipegen.observe.verify import verify_run
    from pipegen.run.layout import RunDir

    verdict = verify_run(RunDir(out))
    assert not verdict.ok, verdict.render()
    return verdict.render()


@pytest.mark.slow
def test_verify_fails_on_a_missing_unit(complete_copy):
    import numpy as np

    from pipegen.writer.batches import encode_batch, load_batch

    path = complete_copy / batch_file_name(0)
    batch = load_batch(path)
    index, sample = batch.non_tensor_batch["index"], batch.non_tensor_batch["sample"]
    lost = (int(index[0]), int(sample[0]))
    keep = np.array([i for i in range(len(batch)) if (int(index[i]), int(sample[i])) != lost])
    path.write_bytes(b"".join(bytes(chunk) for chunk in encode_batch(batch.select_idxs(keep), True)))
    report = verify_in_process(complete_copy)
    assert f"in no batch file (missing): {lost[0]}:{lost[1]}" in report, report


@pytest.mark.slow
def test_verify_fails_on_a_batch_file_the_checkpoint_does_not_list(complete_copy):
    shutil.copy(complete_copy / batch_file_name(1), complete_copy / batch_file_name(3))
    report = verify_in_process(complete_copy)
    assert f"{batch_file_name(3)} is on disk but checkpoint.json does not list it (an orphan)" in report, report


def test_a_new_shard_never_reuses_the_name_of_a_read_shard_that_is_gone(tmp_path):
    """An actor's newest shard deleted after the writer read it: the next shard must get a new number,
    or the writer would skip its first bytes as read (units in a shard, never committed: a hang)."""
    from pipegen.run.stream import encode_record
    from pipegen.run.stream import ShardAppender, ShardTailer, next_free_seq

    topic = tmp_path / "rollouts"
    first = ShardAppender(topic, 0, 1 << 20, 1.0)
    first.append(encode_record(0, 0, {"text": "read by the writer"}))
    first.close()
    tailer = ShardTailer(topic)
    assert len(list(tailer.lines())) == 1
    first.path.unlink()  # lost in a copy
    second = ShardAppender(topic, 0, 1 << 20, 1.0, next_free_seq(tailer.offsets, tailer.sealed, "actor_0"))
    second.append(encode_record(1, 0, {"text": "new"}))
    second.close()
    assert second.path.name != first.path.name
    assert [line for _, _, line in tailer.lines()] == [encode_record(1, 0, {"text": "new"})]
