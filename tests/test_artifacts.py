"""The run's artifact as the seed describes it: trajectories.zip holds the output in whichever form the run
wrote it (the merged file, the sharded parts, or the batch files) and is uploaded; upload_artifact=false
writes none; keep_streams=false drops the rollout shards only once --verify passes."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from conftest import FAKE_ENGINE, FAST, launch
from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.config import load_run_config
from pipegen.run.layout import RunDir, list_shards


def _run(tmp_path: Path, tiny_model: str, name: str, *overrides: str) -> RunDir:
    out = tmp_path / name
    result = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, *overrides)  # launch() verifies the run
    assert result.returncode == 0, result.stderr[-3000:]
    return RunDir(out)


def _zipped(run: RunDir) -> set[str]:
    with zipfile.ZipFile(run.artifact) as z:
        assert z.testzip() is None
        return set(z.namelist())


@pytest.fixture(scope="module")
def batches_only(tmp_path_factory, tiny_model) -> RunDir:
    return _run(tmp_path_factory.mktemp("artifacts"), tiny_model, "batches", "generation.final_merge=false")


def test_without_a_merge_the_zip_holds_the_batch_files(batches_only: RunDir) -> None:
    run = batches_only
    ckpt = load_checkpoint(run.checkpoint)
    batches = {run.batch_file(i).relative_to(run.root).as_posix() for i in ckpt.batches.numbers()}
    assert len(batches) >= 3  # FAST's batches of 4 rows
    assert not run.trajectories.exists()
    assert _zipped(run) == batches | {"checkpoint.json", "conf/config.yaml"}


def test_a_sharded_merge_zips_every_part_and_keep_streams_false_drops_the_verified_shards(
        tmp_path: Path, tiny_model: str) -> None:
    run = _run(tmp_path, tiny_model, "sharded", "generation.merge_output=sharded", "generation.merge_shard_rows=5",
               "generation.keep_streams=false")
    parts = sorted(p.relative_to(run.root).as_posix() for p in run.output_shards.glob("part_*.pkl"))
    assert len(parts) == 3  # 12 rows, 5 a part
    assert _zipped(run) == {*parts, "trajectories/index.json", "checkpoint.json", "conf/config.yaml"}
    assert [p for paths in list_shards(run.rollouts).values() for p in paths] == []  # verified, then dropped
    assert list_shards(run.failures) is not None and run.stats.is_dir()  # the rest of streams/ stays
    assert "deleted" in (run.logs / "writer.log").read_text()


def test_upload_artifact_false_writes_no_zip(tmp_path: Path, tiny_model: str) -> None:
    run = _run(tmp_path, tiny_model, "nozip", "generation.upload_artifact=false")
    assert run.trajectories.exists() and not run.artifact.exists()
    assert [p for paths in list_shards(run.rollouts).values() for p in paths]  # keep_streams defaults to true


def test_every_form_of_the_artifact_is_uploaded_when_wandb_is_a_backend(batches_only: RunDir, tmp_path: Path,
                                                                        monkeypatch) -> None:
    from omegaconf import open_dict

    import pipegen.observe.tracking as tracking
    from pipegen.writer.merge import write_artifact

    run = RunDir(tmp_path / "copy")
    shutil.copytree(batches_only.root, run.root)
    cfg = load_run_config(run)
    uploaded = []
    monkeypatch.setattr(tracking, "upload_artifact", lambda cfg, run: uploaded.append(_zipped(run)))
    with open_dict(cfg):
        cfg.trainer.logger = ["console", "wandb"]
    write_artifact(cfg, run, load_checkpoint(run.checkpoint))
    assert len(uploaded) == 1 and any(name.startswith("batches/") or name.endswith(".arrow") for name in uploaded[0])
    with open_dict(cfg):
        cfg.generation.upload_artifact = False
    write_artifact(cfg, run, load_checkpoint(run.checkpoint))
    assert len(uploaded) == 1 and not run.artifact.exists()  # none written, none uploaded, the old one gone


def test_keep_streams_false_keeps_the_shards_of_a_run_that_does_not_verify(batches_only: RunDir,
                                                                           tmp_path: Path) -> None:
    from pipegen.writer.tidy import drop_streams_once_verified

    run = RunDir(tmp_path / "damaged")
    shutil.copytree(batches_only.root, run.root)
    shards = [p for paths in list_shards(run.rollouts).values() for p in paths]
    assert shards
    listed = run.batch_file(next(iter(load_checkpoint(run.checkpoint).batches.numbers())))
    listed.write_bytes(listed.read_bytes()[:100])  # a batch file cut short: its samples live only in the shards now
    assert drop_streams_once_verified(run) is False
    assert all(p.exists() for p in shards)
    shutil.copyfile(batches_only.batch_file(next(iter(load_checkpoint(run.checkpoint).batches.numbers()))), listed)
    assert drop_streams_once_verified(run) is True
    assert not any(p.exists() for p in shards)
