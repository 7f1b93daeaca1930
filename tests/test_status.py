"""`python -m pipegen.status DIR` on real runs: live, finished, with a killed writer, crashed, and with
failed units; plus the launcher forwarding the roles' warnings to its console."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from conftest import FAKE_ENGINE, FAST, REPO, assert_verified, launch, load_trajectories
from fake_servers import pids_where, read_records

from pipegen.run.layout import RunDir
from pipegen.observe.progress import LogWatcher
from pipegen.observe.run_status import gather, render

# A run slow enough to watch: 12 prompts x 2 samples, ~2.4 s per unit on the fake engine, 8 at a time.
SLOW = [o for o in FAST if not o.startswith(("max_samples=",))] + [
    "max_samples=12", FAKE_ENGINE, "llm.engine_args=[--token-latency,0.1,--eos-prob,0]",
]


def status_cli(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipegen.status", str(out), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=30)


def status_json(out: Path) -> dict:
    result = status_cli(out, "--json")
    assert result.returncode == 0, result.stderr
    return orjson.loads(result.stdout)


def start_launcher(out: Path, *overrides: str) -> subprocess.Popen:
    log = open(out.parent / f"{out.name}.launcher.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *overrides], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited with {proc.returncode} while waiting for {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def try_gather(run: RunDir):
    """gather(), or None while the launcher has not written the run's config yet."""
    from pipegen.observe.run_status import NotARun

    try:
        return gather(run)
    except NotARun:
        return None


def role(st, name: str):
    return next((r for r in st.roles if r.name == name), None)


def writer_pid(out: Path) -> int:
    return int((out / ".writer.lock").read_text().strip())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/cmdline").exists() and Path(f"/proc/{pid}/cmdline").read_bytes() != b""


def test_status_refuses_a_directory_that_is_not_a_run(tmp_path):
    result = status_cli(tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a pipegen run directory" in lines[0], result.stderr
    missing = status_cli(tmp_path / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_status_live_run_with_killed_writer_then_finished(tmp_path, tiny_model):
    out = tmp_path / "run"
    run = RunDir(out)
    proc = start_launcher(out, f"model_path={tiny_model}", *SLOW)
    try:
        # live: units committed, actors generating, the writer holding its lock
        def live():
            s = try_gather(run)
            if s is None:
                return None
            actor, writer = role(s, "actor_0"), role(s, "writer")
            return s if s.progress["committed"] >= 2 and actor and actor.alive and writer and writer.pid else None

        st = wait_for(live, 120, "a live run with commits", proc)
        assert st.state == "running"
        assert st.progress["total"] == 24 and st.progress["committed"] < 24
        actor = role(st, "actor_0")
        assert actor.alive and alive(actor.pid) and actor.stats_age_s < 10
        assert st.writer_lock.held and st.writer_lock.pid == writer_pid(out) == role(st, "writer").pid
        assert any(s["answering"] for s in st.servers)
        text = status_cli(out).stdout
        assert "RUNNING" in text and f"pid {actor.pid} alive" in text and f"held by pid {st.writer_lock.pid}" in text
        assert actor.cpu_busy is not None and 0 <= actor.cpu_busy <= 1.5 and "% busy" in text
        assert str(out / "logs") in text

        # kill the writer: status names its pid as not running while the actors go on
        killed = writer_pid(out)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: not alive(killed), 10, "the writer to die")
        st = gather(run)
        w = role(st, "writer")
        assert w.pid == killed and w.alive is False, w
        assert st.state == "running"  # actors (and soon the restarted writer) are alive
        assert f"pid {killed} not running" in render(st)

        # the launcher restarts the writer, which finishes the run
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            kill_orphans_of(proc.pid)
    st = gather(run)
    assert st.state == "finished", render(st)
    assert st.progress["committed"] == 24 and st.progress["pending"] == 0 and st.progress["in_flight"] == 0
    assert role(st, "writer").pid != killed and not role(st, "writer").alive
    assert st.writer_lock.held is False
    assert st.rates and st.rates["overall_units_per_s"] > 0 and st.rates["overall_output_tokens_per_s"] > 0
    assert st.metrics["latency/p95_s"] >= st.metrics["latency/p50_s"] > 0
    text = status_cli(out).stdout
    assert "FINISHED" in text and "24/24 samples committed" in text and "trajectories.pkl" in text
    assert "finish reasons:" in text and "latency p50" in text
    assert "mean assistant turns 1.00" in text  # a single-turn loop answers once (verl's num_turns says 2)
    # what the actor and the writer wrote is what their typed records read: no key dropped or missing
    from pipegen.observe.stats import read_stats
    from pipegen.run.stats_line import ACTOR_PHASES, parse_stats_line

    for name in ("actor_0", "writer"):
        for raw in read_stats(run.stats / f"{name}.jsonl"):
            assert parse_stats_line(name, raw).body() == written_keys(raw), raw
    last = parse_stats_line("actor_0", read_stats(run.stats / "actor_0.jsonl")[-1])
    assert last.final and last.completed == last.units_total and last.requests_by_server and last.cpu_busy is not None
    assert all(last.startup.phase(phase) is not None for phase in ACTOR_PHASES), last.startup
    data = load_trajectories(out / "trajectories.pkl")
    assert len(data) == 24
    assert len({(int(i), int(s)) for i, s in zip(data.non_tensor_batch["index"], data.non_tensor_batch["sample"])}) == 24


def kill_orphans_of(launcher_pid: int) -> None:
    """SIGKILL of the launcher leaves its reference server behind (servers have no orphan guard yet):
    stop exactly the processes that launcher started (PIPEGEN_PARENT_PID=<its pid> in their environment)."""
    marker = f"PIPEGEN_PARENT_PID={launcher_pid}".encode()
    for pid in pids_where("environ", lambda environ: marker in environ):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_after_ctrl_c_status_counts_the_shards_and_the_writer_alone_commits_merges_and_exits(tmp_path, tiny_model):
    """The day-two journey of a Ctrl-C: nothing committed yet (batches of 64), some units finished in the shards.
    status and the resumed bar count them as done; the writer run alone commits every one of them at once (no
    quiet period: nothing of the run is alive), merges a partial output, lists what is pending, and exits 0."""
    from pipegen.observe.console import Console
    from pipegen.observe.progress import snapshot
    from pipegen.run.config import load_run_config

    out = tmp_path / "run"
    run = RunDir(out)
    proc = start_launcher(out, f"model_path={tiny_model}", *SLOW, "generation.save_batch_size=64",
                          "generation.partial_batch_quiet_s=300")
    try:
        wait_for(lambda: len(read_records(out)) >= 3, 120, "three finished units in the shards", proc)
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops every process of the run
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_orphans_of(proc.pid)
    st = wait_for(lambda: (s := gather(run)).state not in ("running", "writer only") and s, 30, "children to exit")
    in_shards = {(r["index"], r["sample"]) for r in read_records(out)}
    assert 3 <= len(in_shards) < 24
    assert st.state == "stopped before completion", render(st)
    assert st.progress["committed"] == 0 and st.progress["buffered"] == st.progress["done"] == len(in_shards)
    assert st.progress["pending"] == 24 - len(in_shards)
    text = render(st)
    assert f"{len(in_shards)}/24 samples done" in text and "0 committed yet" in text, text
    # the resumed progress bar starts at what is durable, not at 0
    console = Console(load_run_config(run), run, total=24, actors=0, tracked=False)
    try:
        assert console.bar is not None and console.bar.bar.n == len(in_shards)
    finally:
        console.bar.close()

    # the writer alone: nothing of the run is alive, so it commits what the shards hold, merges and exits 0
    writer = subprocess.run([sys.executable, "-m", "pipegen.writer", f"output_dir={out}"], cwd=REPO,
                            capture_output=True, text=True, timeout=180)
    assert writer.returncode == 0, writer.stderr[-3000:]
    assert f"{24 - len(in_shards)} still pending" in writer.stderr, writer.stderr[-3000:]
    data = load_trajectories(out / "trajectories.pkl")
    assert sorted((int(i), int(s)) for i, s in zip(data.non_tensor_batch["index"], data.non_tensor_batch["sample"])) \
        == sorted(in_shards)  # every finished unit, once
    listing = orjson.loads((out / "failed_units.json").read_bytes())
    pending = {tuple(int(x) for x in u.split(":")) for u in listing["pending_units"]}
    assert listing["pending"] == len(pending) == 24 - len(in_shards) and not pending & in_shards
    assert_verified(out)  # every committed unit once; the pending ones are a note, not a problem
    st = gather(run)
    assert st.progress["committed"] == len(in_shards) and st.progress["buffered"] == 0, render(st)
    assert st.state == "stopped before completion" and "partial output" in st.hint, st.hint
    assert st.writer_lock.held is False and role(st, "writer").alive is False


def test_failed_units_in_status_and_warnings_on_the_launcher_console(tmp_path, tiny_model):
    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_model}", *[o for o in FAST if not o.startswith("max_samples")],
                    "max_samples=2", FAKE_ENGINE, "llm.engine_args=[--fail-rate,1.0]",
                    "generation.max_attempts=1")
    assert result.returncode == 1, result.stderr[-3000:]
    # the actor's warnings reach the launcher's console, prefixed with the role
    forwarded = [ln for ln in result.stderr.splitlines() if "[actor_0]" in ln and "failed" in ln]
    assert forwarded, result.stderr[-3000:]
    assert "WARNING" in forwarded[0] and "503" in forwarded[0]
    st = gather(RunDir(out))
    assert st.state == "finished with failures", render(st)
    assert st.progress["failed"] == 4 and len(st.failed_units) == 4
    assert all("503" in u["reason"] for u in st.failed_units.values())  # the server's answer, kept as the reason
    assert st.metrics["errors/total"] >= 4
    text = status_cli(out).stdout
    assert "failed units (4" in text and "503" in text and "relaunch" in text


def test_log_watcher_forwards_warnings_errors_and_tracebacks(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    old = "2025-01-01 00:00:00 WARNING [writer] pipegen.writer: from an earlier launch\n"
    (logs / "writer.log").write_text(f"\n===== 2025-01-01 00:00:00 starting writer =====\n{old}"
                                     "\n===== 2025-01-01 00:01:00 starting writer =====\n"
                                     "2025-01-01 00:01:01 INFO [writer] pipegen.writer: fine\n"
                                     "2025-01-01 00:01:02 WARNING [writer] pipegen.writer: disk almost full\n")
    watcher = LogWatcher(logs, max_lines_per_log=3)
    assert watcher.poll() == ["2025-01-01 00:01:02 WARNING [writer] pipegen.writer: disk almost full"]
    assert watcher.poll() == []
    with open(logs / "actor_0.log", "a") as f:  # a new role's log: read from its start banner
        f.write("\n===== 2025-01-01 00:01:00 starting actor_0 =====\nTraceback (most recent call last):\n"
                '  File "x.py", line 1, in <module>\nValueError: bad row\n'
                "ERROR:    Exception in ASGI application\n"
                "2025-01-01 00:01:03 WARNING [actor_0] verl.plugin: No supported accelerator detected.\n")
    got = watcher.poll()
    assert got[0].startswith("[actor_0] ValueError: bad row") and "traceback in" in got[0]
    assert got[1] == "[actor_0] ERROR:    Exception in ASGI application"
    assert len(got) == 2  # the known-harmless CPU warning is muted
    with open(logs / "actor_0.log", "a") as f:  # a partial line waits for its newline; duplicates are dropped
        f.write("2025-01-01 00:01:04 ERROR [actor_0] pipegen.actor: boom")
    assert watcher.poll() == []
    with open(logs / "actor_0.log", "a") as f:
        f.write("\n2025-01-01 00:01:05 ERROR [actor_0] pipegen.actor: boom\n"
                + "".join(f"2025-01-01 00:01:06 ERROR [actor_0] pipegen.actor: e{i}\n" for i in range(5)))
    got = watcher.poll()
    assert got[0] == "2025-01-01 00:01:04 ERROR [actor_0] pipegen.actor: boom"
    assert got[-1].startswith("[actor_0] ... more warnings and errors in") and len(got) == 2


@pytest.mark.parametrize("garbage", [b"", b'{"time": 1, "pid"', b"not json\n"])
def test_status_survives_partial_stats_lines(tmp_path, garbage):
    from pipegen.observe.stats import latest_stats

    stats = tmp_path / "stats"
    stats.mkdir()
    (stats / "actor_0.jsonl").write_bytes(b'{"time": 1.0, "pid": 1, "completed": 3}\n' + garbage)
    assert latest_stats(stats)["actor_0"].completed == 3


# An actor's and the writer's last stats lines as pipegen wrote them before the lines were typed records
# (copied from a real run): a run directory from then reads the same, and today's lines keep these keys.
OLDER_ACTOR_LINE = (
    b'{"time":1795591827.4552927,"role":"actor_0","pid":15894,"host":"vm","seq":0,"uptime_s":0.1,"final":true,'
    b'"units_total":12,"completed":12,"failed":0,"in_flight":0,"trajectories":12,"requests":12,"retries":0,"re'
    b'quests_in_flight":0,"output_tokens":255,"latency_p50_s":0.012524190000021918,"latency_p95_s":0.022857663'
    b'999957367,"finish_reasons":{"length":9,"stop":3},"mean_turns":2.0,"mean_response_length":21.25,"mean_rew'
    b'ard":0.0,"errors":{},"servers_out_of_rotation":[],"stalled":0,"aborts_sent":0,"hedges":0,"hedge_wins":0,'
    b'"concurrency":8,"concurrency_by_server":{},"server_load":{},"requests_by_server":{"http://127.0.0.1:3674'
    b'1":12},"cpu_busy":0.346,"startup/process_started":1795591798.4137738,"startup/server_answered_first_poll'
    b'":true,"startup/ready":1795591825.6229804,"startup/server_ready":1795591827.359754,"startup/first_reques'
    b't":1795591827.4144635,"startup/first_unit":1795591827.4486072,"completed_per_s":120.0,"output_tokens_per'
    b'_s":2549.996,"requests_per_s":120.0}'
)
OLDER_WRITER_LINE = (
    b'{"time":1795591827.579233,"role":"writer","pid":15895,"host":"vm","seq":1,"uptime_s":2.12,"final":true,"'
    b'committed":12,"units_total":12,"batches":3,"buffered":0,"failed":0,"duplicates":0,"unknown_units":0,"tor'
    b'n_lines":0,"lines":12,"committed_per_s":5.66,"lines_per_s":5.66}'
)


def written_keys(raw: dict) -> dict:
    """A stats line less what the appender adds (the identity head and the `_per_s` rates)."""
    from pipegen.run.stats_line import HEAD, RATE_SUFFIX

    return {k: v for k, v in raw.items() if k not in HEAD and not k.endswith(RATE_SUFFIX)}


def test_stats_lines_of_an_older_run_read_the_same_and_keep_their_keys(tmp_path):
    from pipegen.observe.startup import startup_phases
    from pipegen.observe.stats import aggregate, latest_stats

    stats = tmp_path / "stats"
    stats.mkdir()
    (stats / "actor_0.jsonl").write_bytes(OLDER_ACTOR_LINE + b"\n")
    (stats / "writer.jsonl").write_bytes(OLDER_WRITER_LINE + b"\n")
    roles = latest_stats(stats)
    for name, raw in (("actor_0", OLDER_ACTOR_LINE), ("writer", OLDER_WRITER_LINE)):
        # the typed record writes back every key, value and order it read (`tail -f` shows what it did), and a key
        # added since (an older line lacks it) at its default
        read = written_keys(orjson.loads(raw))
        assert [kv for kv in roles[name].body().items() if kv[0] in read] == list(read.items())
    m = aggregate(roles)
    assert m["actors/completed"] == 12 and m["actors/output_tokens"] == 255 and m["finish_reason/length"] == 9
    assert m["response_length/mean"] == 21.25 and m["writer/lines"] == 12 and m["writer/duplicates"] == 0
    phases = startup_phases(roles, launch_started=roles["actor_0"].startup.process_started)
    assert phases is not None and phases.complete and phases.server_was_first
    assert "first unit in a shard +29.0s" in phases.render()


def test_status_names_an_actor_that_is_cpu_bound_and_the_fix():
    """An actor whose event loop is near 100% of its core is the run's limit: status says so and names
    the key; a busy-but-keeping-up actor, or one that finished, gets no note."""
    from pipegen.observe.run_status import LockStatus, RoleStatus, RunStatus

    def text(busy: float, final: bool = False) -> str:
        actor = RoleStatus("actor_0", pid=1, alive=True, stats_age_s=1.0, final=final, cpu_busy=busy)
        progress = {"total": 8, "committed": 2, "batches": 0, "pending": 6, "in_flight": 2, "failed": 0}
        return render(RunStatus("/r", "running", "live", progress, {}, {}, [actor], LockStatus("/r/lock"), {}, "/r/logs"))

    assert "actor_0 near 100% CPU" in text(0.97) and "actors.num_actors" in text(0.97)
    assert "CPU 97% busy" in text(0.97)
    assert "near 100% CPU" not in text(0.40) and "near 100% CPU" not in text(0.97, final=True)


def test_a_cpu_bound_actor_warns_once_with_the_fix(caplog):
    """Two stats intervals near 100% CPU while units still wait to start: one warning naming the key;
    a single busy interval, or busy in the tail (nothing left to start), says nothing."""
    from pipegen.actor.worker import Actor

    actor = Actor.__new__(Actor)
    actor.rank, actor.num_actors, actor._busy_intervals = 0, 1, 0
    with caplog.at_level("WARNING", logger="pipegen.actor"):
        for busy, draining in ((0.97, False), (0.30, False), (0.97, False), (0.99, True), (0.97, False)):
            actor.warn_if_cpu_bound(busy, draining)
        assert not caplog.records
        for _ in range(4):
            actor.warn_if_cpu_bound(0.95, False)
    assert len(caplog.records) == 1 and "actors.num_actors=2" in caplog.records[0].getMessage()


def test_follow_waits_for_the_first_shard_and_keeps_following_across_a_relaunch(tmp_path, capsys):
    """status --follow (docs/outputs.md's watch recipe): started on an empty directory, it prints each unit's line as
    it lands, including the new shard a relaunch opens, and stops (here) once the run is complete."""
    import threading

    from pipegen.observe.run_status import follow
    from pipegen.run.checkpoint import Checkpoint, save_checkpoint
    from pipegen.run.layout import shard_path
    from pipegen.run.stream import encode_record, read_head

    run = RunDir(tmp_path / "run")
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(follow(run, stop_when_complete=True)), daemon=True)
    thread.start()
    time.sleep(1.0)  # nothing there yet: it waits
    actor = run.rollouts / "actor_0"
    actor.mkdir(parents=True)
    shard_path(actor, 0).write_bytes(b"".join(encode_record(i, 0, {"reward": 1.0, "text": "x" * 500})
                                              for i in range(2)))
    time.sleep(1.0)
    shard_path(actor, 1).write_bytes(encode_record(2, 0, {"reward": 0.0}))  # a relaunch's new shard
    save_checkpoint(run.checkpoint, Checkpoint(complete=True))
    thread.join(timeout=10)
    assert done == [0]
    lines = capsys.readouterr().out.splitlines()
    assert [read_head(ln.encode())[0] for ln in lines] == [0, 1, 2]
    assert all(len(ln) <= 200 for ln in lines)
