"""The actors, the writer and the CPU server are forks of a forkserver that imported verl once (pipegen/launch/forks.py): each must
be the `python -m` command it stands for, as `ps`, a kill, its log and its exit code show."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from conftest import FAST, FAKE_ENGINE, REPO, launch
from fake_servers import pids_where
from pipegen.launch.forks import ForkedRole, forkable
from test_status import wait_for


def test_only_pipegens_own_roles_are_forked():
    assert forkable([sys.executable, "-m", "pipegen.actor", "output_dir=X", "rank=0"])
    assert forkable([sys.executable, "-m", "pipegen.writer", "output_dir=X"])
    assert forkable([sys.executable, "-m", "pipegen.cpu_server", "--port", "1"])  # pipegen's own server, torch loaded
    assert forkable([sys.executable, "-m", "pipegen.cpu_server", "--engine", "hf", "--port", "1"])
    # a backend by import path imports no torch: it answers sooner as its own command than after the preload
    assert not forkable([sys.executable, "-m", "pipegen.cpu_server", "--engine", "pkg.mod:Backend", "--port", "1"])
    assert not forkable([sys.executable, "-m", "sglang.launch_server", "--port", "1"])  # another engine is a command
    assert not forkable(["/other/env/bin/python", "-m", "pipegen.actor", "output_dir=X"])  # another interpreter


def test_a_forked_role_refuses_exactly_as_its_command_does(tmp_path):
    argv = [sys.executable, "-m", "pipegen.writer", f"output_dir={tmp_path / 'not-a-run'}"]
    command = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    log = tmp_path / "writer.log"
    forked = ForkedRole(argv, dict(os.environ), log)
    assert forked.wait(timeout=120) == command.returncode != 0
    assert log.read_text().strip().splitlines()[-1] == command.stderr.strip().splitlines()[-1]


def test_a_forked_role_has_its_command_line_its_own_session_and_dies_by_the_signal_sent(tmp_path):
    # a real run directory whose manifest never comes: the writer imports, then waits for it
    done = tmp_path / "done"
    assert launch(done, *FAST, FAKE_ENGINE).returncode == 0
    waiting = tmp_path / "waiting"
    (waiting / "conf").mkdir(parents=True)
    config = (done / "conf" / "config.yaml").read_text().replace(str(done), str(waiting))
    (waiting / "conf" / "config.yaml").write_text(config)
    shutil.copy(done / "conf" / "fingerprint.json", waiting / "conf" / "fingerprint.json")
    argv = [sys.executable, "-m", "pipegen.writer", f"output_dir={waiting}"]
    log = tmp_path / "writer.log"
    forked = ForkedRole(argv, {**os.environ, "PIPEGEN_TEST_MARK": "1"}, log)
    try:
        wait_for(lambda: log.exists() and "waiting for the launcher to write" in log.read_text(), 120,
                  "the writer's wait")
        assert forked.poll() is None
        # ps and pgrep -f read the command, not the forkserver's
        assert pids_where("cmdline", lambda words: words == [a.encode() for a in argv]) == [forked.pid]
        assert os.getsid(forked.pid) == forked.pid  # its own session: a stop kills its whole group
        os.killpg(forked.pid, signal.SIGKILL)
        assert forked.wait(timeout=30) == -signal.SIGKILL
    finally:
        if forked.poll() is None:
            os.kill(forked.pid, signal.SIGKILL)
