"""Metrics through verl's Tracking and the wandb artifact, offline; the stats stream they come from."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from omegaconf import OmegaConf

from conftest import FAKE_ENGINE, FAST, launch

from pipegen.run.layout import RunDir
from pipegen.observe.progress import Snapshot
from pipegen.observe.stats import HOST, Rates, StatsAppender, aggregate, read_stats
from pipegen.run.stats_line import ActorStats, WriterStats
from pipegen.observe.tracking import RunTracker, upload_artifact


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file (leveldb log format: 32 KiB blocks of
    crc32(4) length(2) type(1) chunks after a 7-byte ':W&B' header)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def history_of(records) -> list[dict]:
    rows = []
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): orjson.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def minimal_cfg(loggers: list[str], show_progress: bool = True):
    return OmegaConf.create({
        "trainer": {"project_name": "pgtest", "experiment_name": "unit", "logger": loggers},
        "generation": {"show_progress": show_progress},
    })


def actor_line(pid: int, t: float, completed: int, tokens: int, **extra) -> ActorStats:
    return ActorStats(**{"time": t, "pid": pid, "host": HOST, "completed": completed, "output_tokens": tokens,
                         "requests": completed, "in_flight": 3, "requests_in_flight": 2, "latency_p50_s": 0.5,
                         "latency_p95_s": 1.0, "finish_reasons": {"stop": completed}, "mean_turns": 2.0,
                         "mean_response_length": 10.0, "errors": {}, **extra})


@pytest.fixture
def live_pid():
    """A live process whose command line names pipegen (what stats.pid_alive accepts as one of ours)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "pipegen-test-sleeper"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_aggregate_weights_actors_and_ignores_dead_ones_in_flight(live_pid):
    now = time.time()
    roles = {
        "actor_0": actor_line(live_pid, now, 10, 100, latency_p50_s=1.0, latency_p95_s=2.0, mean_reward=1.0,
                              errors={"RetriesExhausted": 1}),
        "actor_1": actor_line(2 ** 22 + 12345, now, 30, 300, latency_p50_s=3.0, latency_p95_s=5.0, mean_reward=0.0,
                              finish_reasons={"length": 30}),  # a pid that does not exist
        "writer": WriterStats(time=now, pid=live_pid, duplicates=2, torn_lines=1, buffered=0),
    }
    m = aggregate(roles)
    assert m["actors/completed"] == 40 and m["actors/output_tokens"] == 400
    assert m["actors/in_flight"] == 3 and m["actors/requests_in_flight"] == 2  # only the live actor counts
    assert m["actors/alive"] == 1 and m["actors/total"] == 2
    assert m["latency/p50_s"] == (1.0 * 10 + 3.0 * 30) / 40 and m["latency/p95_s"] == 5.0
    assert m["reward/mean"] == 0.25  # weighted by completed units
    assert m["finish_reason/stop"] == 10 and m["finish_reason/length"] == 30
    assert m["errors/RetriesExhausted"] == 1 and m["errors/total"] == 1
    assert m["writer/duplicates"] == 2 and m["writer/torn_lines"] == 1


def test_rates_restart_with_a_new_process():
    r = Rates(window_s=60)
    assert r.observe("x", 0.0, 0, identity=1) is None
    assert r.observe("x", 2.0, 10, identity=1) == 5.0
    assert r.observe("x", 2.0, 10, identity=1) == 5.0  # the same line seen twice adds nothing
    assert r.observe("x", 3.0, 0, identity=2) is None  # restarted: counters began again
    assert r.observe("x", 4.0, 4, identity=2) == 4.0


def test_stats_appender_adds_identity_and_rates(tmp_path):
    a = StatsAppender(tmp_path, "actor_0")
    a.append(ActorStats(completed=1, output_tokens=10))
    time.sleep(0.05)
    a.append(ActorStats(completed=3, output_tokens=50))
    first, second = read_stats(a.path)
    assert first["pid"] == os.getpid() and first["host"] == HOST and first["role"] == "actor_0"
    assert "completed_per_s" not in first  # no rate before a second line
    assert second["seq"] == 1 and second["completed_per_s"] > 0
    assert abs(second["output_tokens_per_s"] / second["completed_per_s"] - 20) < 0.01


def test_run_tracker_logs_to_the_file_backend_and_the_stats_stream(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    run = RunDir(tmp_path / "run")
    tracker = RunTracker(minimal_cfg(["console", "file"]), run, interval_s=3600)
    assert tracker.backends == ["file"]  # the progress bar is the console view
    now = time.time()
    snap = Snapshot(total=10, committed=4, batches=2, roles={"actor_0": actor_line(os.getpid(), now - 2, 4, 40)})
    snap.metrics = aggregate(snap.roles)
    first = tracker.update(snap)  # logs at once (step 1), then waits for the interval
    snap.roles = {"actor_0": actor_line(os.getpid(), now, 6, 100)}
    snap.committed = 6
    snap.metrics = aggregate(snap.roles)
    second = tracker.update(snap)
    assert second["throughput/output_tokens_per_s"] == (100 - 40) / 2
    assert snap.tokens_per_s == 30.0 and "30.0 tok/s" in snap.postfix()
    assert "throughput/units_per_s" in second and "throughput/units_per_s" not in first
    tracker.finish(snap)
    files = list(run.logs.glob("metrics-*.jsonl"))
    assert len(files) == 1, list(run.logs.iterdir())
    steps = [orjson.loads(line) for line in files[0].read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[-1]["data"]["progress/committed"] == 6 and steps[-1]["data"]["progress/pending"] == 4
    assert steps[-1]["data"]["latency/p95_s"] == 1.0
    launch_lines = read_stats(run.stats / "launch.jsonl")
    assert [ln["step"] for ln in launch_lines] == [1, 2] and launch_lines[-1]["progress/committed"] == 6


def test_upload_artifact_never_raises(tmp_path, caplog):
    run = RunDir(tmp_path / "run")
    upload_artifact(minimal_cfg(["wandb"]), run)  # no trajectories.zip: logged, not raised
    assert "no " in caplog.text and "trajectories.zip" in caplog.text


def test_wandb_offline_run_holds_metrics_and_artifact(tmp_path, tiny_model):
    out = tmp_path / "run"
    wandb_dir = tmp_path / "wandb-home"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    result = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "trainer.logger=[console,wandb]",
                    "trainer.project_name=pgtest", "trainer.experiment_name=offline-check", env=env)
    assert result.returncode == 0, result.stderr[-3000:]

    runs = {}
    for path in (wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        records = read_wandb_records(path)
        run_rec = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert run_rec.project == "pgtest" and run_rec.display_name == "offline-check"
        runs[run_rec.job_type] = records
    assert set(runs) == {"generate", "upload"}, runs.keys()

    # the launcher's run: the aggregated metrics, the last step with the whole run committed
    history = history_of(runs["generate"])
    assert history, "no metrics logged"
    last = history[-1]
    assert last["progress/committed"] == 12 and last["progress/total"] == 12 and last["progress/failed"] == 0
    for key in ("throughput/units_per_s_launch_avg", "latency/p50_s", "latency/p95_s", "actors/output_tokens",
                "response_length/mean", "turns/mean", "writer/duplicates", "writer/torn_lines", "progress/batches"):
        assert any(key in row for row in history), key
    assert any(k.startswith("finish_reason/") for row in history for k in row)

    # the writer's upload run: trajectories.zip as seed 000's artifact, which a trainer's
    # use_artifact("trajectories:latest", type="trajectories") finds
    artifacts = [r.artifact for r in runs["upload"] if r.WhichOneof("record_type") == "artifact"]
    assert len(artifacts) == 1
    art = artifacts[0]
    assert art.name == "trajectories" and art.type == "trajectories"
    assert {"latest", "offline-check"} <= set(art.aliases), art.aliases
    assert [e.path for e in art.manifest.contents] == ["trajectories.zip"]
    assert orjson.loads(art.metadata)["rows"] == 12
    assert art.manifest.contents[0].size == (out / "trajectories.zip").stat().st_size

    # the stats stream the metrics came from
    actor = read_stats(out / "streams" / "stats" / "actor_0.jsonl")[-1]
    for key in ("in_flight", "requests_in_flight", "completed", "output_tokens", "latency_p50_s", "latency_p95_s",
                "finish_reasons", "mean_turns", "mean_response_length", "mean_reward", "errors", "pid", "host"):
        assert key in actor, key
    assert actor["completed"] == 12
    writer = read_stats(out / "streams" / "stats" / "writer.jsonl")[-1]
    for key in ("committed", "batches", "duplicates", "torn_lines", "pid"):
        assert key in writer, key
    assert writer["committed"] == 12
