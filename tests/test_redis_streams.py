"""streams=redis: the actors' lines through a real redis-server (one per module, on loopback, AOF on), the same
exact output as the files medium, through a Redis restart and through writers killed between reading and
acknowledging; an unreachable Redis and one without AOF refused in one line before anything generates.

The fake engine answers by (seed, sampling seed, context) alone, so one files run is every test's reference.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import orjson
import pytest

from conftest import FAKE_ENGINE, FAST, REPO, assert_same_trajectories, assert_verified, launch, load_trajectories
from support.redis_server import RedisServer, free_port
from pipegen.run.layout import RunDir
from pipegen.run.stream import read_head

UNITS = 12  # FAST: 6 prompts x 2 samples
GROUP = "pipegen-writers"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def overrides(tiny_model) -> list[str]:
    return [f"model_path={tiny_model}", *FAST, FAKE_ENGINE]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, overrides) -> Path:
    """The same run through the files medium (the default)."""
    out = tmp_path_factory.mktemp("files") / "run"
    result = launch(out, *overrides)
    assert result.returncode == 0, result.stderr[-2000:]
    return out / "trajectories.pkl"


def _redis(server: RedisServer) -> list[str]:
    return ["streams=redis", f"streams.redis_url={server.url}"]


def _pending(server: RedisServer, out: Path) -> int:
    return int(server.client().xpending(RunDir(out).stream_key("rollouts"), GROUP)["pending"])


def _same_as_files(out: Path, reference: Path) -> None:
    ckpt = orjson.loads((out / "checkpoint.json").read_bytes())
    assert ckpt["complete"] and ckpt["num_committed"] == UNITS
    assert_verified(out)
    assert_same_trajectories(load_trajectories(out / "trajectories.pkl"), load_trajectories(reference))


def test_a_redis_run_through_a_redis_restart_gives_the_files_runs_exact_output(tmp_path, redis_server, overrides,
                                                                                reference):
    out = tmp_path / "run"
    slow = ["actors.concurrency=2", "llm.engine_args=[--token-latency,0.05]"]  # the same answers, spread out
    cmd = [sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *overrides, *slow, *_redis(redis_server)]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (RunDir(out).streams_file.exists() and redis_server.client().xlen(RunDir(out).stream_key("rollouts"))
                   >= 2):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-2000:]
            time.sleep(0.1)
        redis_server.kill()  # SIGKILL: what it acknowledged is in its AOF (appendfsync always)
        time.sleep(3)  # units finish meanwhile: their actors hold the lines and retry
        redis_server.start()  # the same port and folder
        stdout, stderr = launcher.communicate(timeout=240)
        assert launcher.returncode == 0, stderr[-2000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    _same_as_files(out, reference)
    actor_logs = "".join(p.read_text() for p in (out / "logs").glob("actor_*.log"))
    assert "is unreachable" in actor_logs and "line(s) held in memory" in actor_logs  # the outage was felt
    assert not list((out / "streams").glob("rollouts/*/*.jsonl"))  # nothing went through shard files
    key = RunDir(out).stream_key("rollouts")
    assert key in stdout  # the summary names the stream
    assert redis_server.client().xlen(key) >= UNITS and _pending(redis_server, out) == 0  # every entry acknowledged
    # README's live look: redis-cli XREAD COUNT 10 STREAMS <key> 0 shows the lines as the actors wrote them
    shown = subprocess.run(["redis-cli", "-p", str(redis_server.port), "XREAD", "COUNT", "10", "STREAMS", key, "0"],
                           capture_output=True, text=True, check=True).stdout
    assert shown.count('{"index":') == 10
    from pipegen.observe.run_status import follow

    printed = io.StringIO()
    with redirect_stdout(printed):
        assert follow(RunDir(out), stop_when_complete=True) == 0
    heads = {read_head(line.encode()) for line in printed.getvalue().splitlines()}
    assert len(heads) == UNITS  # --follow shows every finished unit


def test_writers_killed_between_reading_and_acknowledging_commit_each_unit_once(tmp_path, redis_server, overrides,
                                                                                 reference):
    out = tmp_path / "run"
    # every life of the writer is SIGKILLed right after its first durable checkpoint, before its XACK, and the
    # launcher restarts it; full batches only (the default quiet period), so 12 units make at most 3 kills
    whole_batches = [o for o in overrides if not o.startswith("generation.partial_batch_quiet_s")]
    result = launch(out, *whole_batches, *_redis(redis_server), env={"PIPEGEN_WRITER_FAULT": "before_acknowledge:1"})
    assert result.returncode == 0, result.stderr[-2000:]
    _same_as_files(out, reference)
    kills = (out / "logs" / "launch.log").read_text().count("restarting writer")
    reread = re.findall(r"(\d+) entr\(ies\) read by an earlier writer and never acknowledged \(XPENDING\)",
                        (out / "logs" / "writer.log").read_text())
    assert kills >= 2 and len(reread) == kills and all(int(n) > 0 for n in reread), (kills, reread)
    stats = [orjson.loads(line) for line in (out / "streams" / "stats" / "writer.jsonl").read_bytes().splitlines()]
    assert stats[-1]["final"] and stats[-1]["duplicates"] > 0  # what the checkpoint held was read again, dropped
    assert _pending(redis_server, out) == 0


def test_an_unreachable_redis_or_one_without_aof_is_refused_before_generating(tmp_path, overrides):
    closed = f"redis://127.0.0.1:{free_port()}/0"
    no_aof = RedisServer(tmp_path / "no-aof", appendonly=False)
    try:
        for url, words in ((closed, "cannot be reached"), (no_aof.url, "appendonly no")):
            out = tmp_path / url.rsplit(":", 1)[1].split("/")[0]
            result = launch(out, *overrides, "streams=redis", f"streams.redis_url={url}", timeout=120)
            assert result.returncode == 2, result.stderr[-2000:]
            error = [line for line in result.stderr.splitlines() if "error" in line]
            assert len(error) == 1 and words in error[0] and "appendonly yes" in error[0], result.stderr[-2000:]
            assert not (out / "checkpoint.json").exists() and not (out / "conf" / "launch.json").exists()
    finally:
        no_aof.stop()
