"""The launcher owns every process: a killed server is replaced, Ctrl-C leaves nothing behind, a crash
loop ends the run with the failing role's log, and the same command resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from conftest import FAKE_ENGINE, FAST, REPO, launch, load_trajectories
from fake_servers import read_records


def _run_processes(out: Path, launcher_pid: int | None = None) -> list[int]:
    """Every live process of the run: its command line names the run directory, or the launcher
    started it (children carry PIPEGEN_PARENT_PID in their environment)."""
    pids = []
    marker = f"PIPEGEN_PARENT_PID={launcher_pid}\0".encode() if launcher_pid else None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat.split(") ", 1)[-1].startswith("Z"):
            continue  # a zombie is already dead
        try:
            environ = (entry / "environ").read_bytes() + b"\0" if marker else b""
        except OSError:
            environ = b""
        if str(out).encode() in cmd or (marker and marker in environ):
            pids.append(int(entry.name))
    return pids


def _server_pid(out: Path, launcher_pid: int) -> int | None:
    for pid in _run_processes(out, launcher_pid):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"pipegen.cpu_server" in cmd:
            return pid
    return None


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _committed(out: Path) -> int:
    try:
        return orjson.loads((out / "checkpoint.json").read_bytes())["num_committed"]
    except (FileNotFoundError, orjson.JSONDecodeError):
        return 0


SLOWISH = [FAKE_ENGINE, "llm.engine_args=[--token-latency,0.05]", "max_samples=12"]


def _start(out: Path, tiny_model: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipegen.launch", f"output_dir={out}", f"model_path={tiny_model}", *FAST, *SLOWISH,
           *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _units(data) -> list[tuple[int, int]]:
    return sorted(zip((int(i) for i in data.non_tensor_batch["index"]), (int(s) for s in data.non_tensor_batch["sample"])))


@pytest.mark.slow
def test_server_killed_mid_run_is_restarted_and_run_completes_exactly_once(tmp_path, tiny_model):
    out = tmp_path / "run"
    proc = _start(out, tiny_model)
    try:
        _wait_for(lambda: _committed(out) > 0, 120, "a first commit")
        victim = _server_pid(out, proc.pid)
        assert victim
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "server_0 exited with code -9; restarting" in stderr  # replaced, not a dead run
    data = load_trajectories(out / "trajectories.pkl")
    assert _units(data) == [(i, s) for i in range(12) for s in range(2)]
    assert _run_processes(out, proc.pid) == []


@pytest.mark.slow
def test_sigint_stops_every_process_and_the_same_command_finishes(tmp_path, tiny_model):
    out = tmp_path / "run"
    # ~5 s per unit: the run is still generating when Ctrl-C comes (only the pace of the fake engine changes)
    run = [FAKE_ENGINE, "llm.engine_args=[--token-latency,0.2]", "max_samples=12"]
    cmd = [sys.executable, "-m", "pipegen.launch", f"output_dir={out}", f"model_path={tiny_model}", *FAST, *run]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # mid-run: a first sample is on disk (the writer commits full batches, so its first commit may come late)
        _wait_for(lambda: read_records(out), 120, "a first sample in a shard")
        children = [p for p in _run_processes(out, proc.pid) if p != proc.pid]
        assert len(children) >= 3  # server, writer, actor
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "resume" in stderr
    time.sleep(0.5)
    assert _run_processes(out, proc.pid) == [], "processes of the run survived Ctrl-C"
    assert 0 < len(read_records(out)) < 24  # stopped part way

    again = launch(out, f"model_path={tiny_model}", *FAST, *run)
    assert again.returncode == 0, again.stderr[-3000:]
    data = load_trajectories(out / "trajectories.pkl")
    assert _units(data) == [(i, s) for i in range(12) for s in range(2)]


def _commands(pids: list[int]) -> list[str]:
    commands = []
    for pid in pids:
        try:
            commands.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160])
        except OSError:
            pass
    return commands


# What is left after a launcher's SIGKILL, found by the launcher's pid in the environment: its roles (server,
# writer, actors; each exits within ~1 s through its orphan guard, observe/logs.watch_parent) and two processes
# pipegen starts through Python's multiprocessing to fork the roles (launch/forks.py): the forkserver and its
# resource tracker. Neither has an orphan guard: the forkserver first finishes importing its preload list
# (transformers, verl: ~15 s on 2 quiet cores, a minute and more at a load of 4), forks any role the launcher had
# asked for (which exits at once, orphaned), then reads its closed socket and exits, and the tracker follows.
# That wait is what the former 15 s deadline cut short. The test waits for each process's exit (an event), with a
# deadline far past that import on a loaded machine: the property is that nothing is left behind.
ORPHANS_GONE_S = 180


@pytest.mark.timeout(420)  # the start (up to 120 s) plus the orphans' exit (up to ORPHANS_GONE_S) under load
def test_launcher_killed_with_sigkill_takes_its_children_along(tmp_path, tiny_model):
    out = tmp_path / "run"
    proc = _start(out, tiny_model)
    try:
        _wait_for(lambda: len(_run_processes(out, proc.pid)) >= 4, 120, "server, writer and actor to start")
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + ORPHANS_GONE_S
        while (left := _run_processes(out, proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], f"still running {ORPHANS_GONE_S} s after the launcher's SIGKILL: {_commands(left)}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_crash_loop_ends_the_run_naming_the_role_log(tmp_path, tiny_model):
    out = tmp_path / "run"
    # a server that dies on its first request, every time it is restarted
    result = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "llm.engine_args=[--crash-after,0]",
                    "generation.restart_limit=2")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "server_0" in last and "server_0.log" in last, last
    assert _run_processes(out) == []


def test_one_crash_looping_server_is_given_up_while_the_other_finishes_the_run(tmp_path, tiny_model):
    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "llm.num_servers=2",
                    "llm.server_args=[[],[--crash-after,0]]", "generation.restart_limit=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "server_1 keeps crashing" in result.stderr
    data = load_trajectories(out / "trajectories.pkl")
    assert _units(data) == [(i, s) for i in range(6) for s in range(2)]


class _Placement:
    """A placement with nothing to place: done from the start, or failing its check."""

    def __init__(self, problem: Exception | None = None):
        self.problem = problem

    def check(self) -> None:
        if self.problem is not None:
            raise self.problem

    def done(self) -> bool:
        return True


def test_supervise_returns_what_ended_the_launch(tmp_path):
    from omegaconf import OmegaConf

    from pipegen.config.schema import fill_defaults
    from pipegen.launch.launcher import supervise
    from pipegen.launch.run_writer import RunWriter
    from pipegen.launch.supervise import CrashLoop
    from pipegen.observe.console import Console
    from pipegen.run.handshake import EXIT_DAMAGED, EXIT_FAILED_UNITS
    from pipegen.run.layout import LaunchRecord, RunDir

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": 1}}, "trainer": {"logger": []},
                            "generation": {"restart_limit": 0, "restart_window_s": 600.0,
                                           "show_progress": False}})
    fill_defaults(cfg)  # every other key at its one default, as a saved config is read back
    run = RunDir(tmp_path / "run")
    run.launch_file.parent.mkdir(parents=True)
    run.write_launch(LaunchRecord(launch="l", run_key="k"))

    def writer_exiting(code: int) -> RunWriter:
        writer = RunWriter(cfg, run)
        writer.role.argv = [sys.executable, "-c", f"import sys; sys.exit({code})"]  # the writer's exit, alone
        writer.start()
        return writer

    with Console(cfg, run, total=1, actors=0, tracked=False) as console:
        # the writer's exit code says how the run ended: complete, units failed, a damaged file refused
        for code in (0, EXIT_FAILED_UNITS, EXIT_DAMAGED):
            assert supervise(_Placement(), writer_exiting(code), console) == code
        # no writer here: the launch ends when its placement is done, and says it has no writer's word
        assert supervise(_Placement(), None, console) is None
        # a writer that crashes past generation.restart_limit ends the launch naming it
        with pytest.raises(CrashLoop, match="writer"):
            supervise(_Placement(), writer_exiting(1), console)
        # so does a placement that cannot go on
        with pytest.raises(RuntimeError, match="every node failed"):
            supervise(_Placement(RuntimeError("every node failed")), writer_exiting(0), console)


def test_the_restart_budget_counts_crashes_within_its_window_not_over_the_whole_run(tmp_path):
    """generation.restart_limit=2 in a 10-minute window: crashes hours apart are restarted all week long; the
    third within ten minutes stops the run naming the role. A real child that exits 3 each time; the
    supervisor's clock is the test's, so hours pass at no cost."""
    from pipegen.launch.supervise import CrashLoop, Role, Supervisor
    from pipegen.run.layout import RunDir

    now = [0.0]
    sup = Supervisor(RunDir(tmp_path / "run"), clock=lambda: now[0])
    role = sup.add(Role("actor_0", ["sh", "-c", "exit 3"], {}, tmp_path / "run" / "logs" / "actor_0.log",
                        max_restarts=2, restart_window_s=600.0))

    def crash_at(t: float) -> None:
        now[0] = t
        sup.start(role)
        role.proc.wait(timeout=60)
        sup.poll()  # reaps the exit: a restart is scheduled, or CrashLoop

    for day in range(7):  # two crashes 30 s apart each day: 2 in any window, within the budget
        crash_at(day * 86400.0)
        crash_at(day * 86400.0 + 30.0)
    assert role.restarts == 14 and role.restart_at is not None  # fourteen crashes over a week: all restarted
    with pytest.raises(CrashLoop, match=r"actor_0 crashed 3 times within 10 min .*exit code 3.*actor_0.log"):
        crash_at(6 * 86400.0 + 60.0)
