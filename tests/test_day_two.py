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
import pytest

from conftest import FAKE_ENGINE, FAST, REPO, launch, load_trajectories
from test_status import kill_orphans_of, wait_for
from test_supervision import _committed as committed

from pipegen.inputs.demo import DEMO_PARQUET
from pipegen.run.ownership import lock_holder
from pipegen.run.layout import RunDir

# 12 prompts x 2 samples, ~2.4 s per unit on the fake engine, 8 at a time: long enough to act mid-run.
SLOW = [o for o in FAST if not o.startswith("max_samples=")] + [
    "max_samples=12", FAKE_ENGINE, "llm.engine_args=[--token-latency,0.1,--eos-prob,0]",
]
ALL_UNITS = [(i, s) for i in range(12) for s in range(2)]


def units(data) -> list[tuple[int, int]]:
    return sorted((int(i), int(s)) for i, s in zip(data.non_tensor_batch["index"], data.non_tensor_batch["sample"]))


@pytest.mark.slow  # a whole run plus a second writer start (each writer imports verl): ~45 s on 2 quiet cores
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
            victim = lock_holder(run.writer_lock)
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: lock_holder(run.writer_lock) != victim, 10, "the killed writer's lock to go")
            hand = subprocess.Popen([sys.executable, "-m", "pipegen.writer", f"output_dir={out}"], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            holder = wait_for(lambda: lock_holder(run.writer_lock) or (hand.poll() is not None and -1), 60,
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


@pytest.mark.slow  # two launches, the second a whole run: ~40 s on 2 quiet cores
def test_a_launch_refused_for_a_long_prompt_completes_rerun_with_the_fix(tmp_path, tiny_model):
    out = tmp_path / "run"
    refused = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "max_prompt_length=16")
    assert refused.returncode == 2
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("pipegen: error:") and "raise max_prompt_length" in error, refused.stderr[-2000:]
    fixed = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "max_prompt_length=512")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert units(load_trajectories(out / "trajectories.pkl")) == [(i, s) for i in range(6) for s in range(2)]


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The launcher's error: exactly one `pipegen: error:` line, the last one, and no traceback."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("pipegen: error:")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr[-3000:]
    return errors[0]


def test_user_errors_are_one_line_naming_the_fix(tmp_path, tiny_model):
    import pandas as pd

    demo = pd.read_parquet(DEMO_PARQUET).head(3)
    demo.rename(columns={"prompt": "messages"}).to_parquet(wrong_column := tmp_path / "wrong_column.parquet")
    demo.head(0).to_parquet(empty := tmp_path / "empty.parquet")
    (garbage := tmp_path / "garbage.parquet").write_bytes(b"this is not parquet")
    (a_file := tmp_path / "a_file").write_text("x")
    cases = {
        f"train_files={wrong_column}": ["data.prompt_key", "messages", "extra_info"],
        f"train_files={empty}": ["no rows", str(empty)],
        f"train_files={garbage}": ["not a readable parquet file", str(garbage)],
        "nosuch_key=1": ["unknown key 'nosuch_key'", "--help"],
        # a typo is answered from the known keys; a + there would only be ignored, so it is refused too
        "max_sample=4": ["unknown key 'max_sample'; did you mean max_samples?"],
        "+max_sample=4": ["+max_sample: pipegen has no such key", "would be ignored", "did you mean max_samples?"],
        # the + hint only where a new key means something: a kwargs group
        "custom_reward_function.reward_kwargs.scale=2": ["needs a leading +",
                                                         "+custom_reward_function.reward_kwargs.scale=..."],
        "n=many": ["n=many is not allowed", "an integer >= 1"],  # the schema's line: the key and what it accepts
        "llm=gpu": ["llm=gpu does not exist", "llm=cpu", "llm=sglang"],
        "llm=external": ["llm.urls must be set", "llm.urls=[http://HOST:PORT]"],
    }
    for override, expected in cases.items():
        error = one_line_error(launch(tmp_path / "run", f"model_path={tiny_model}", override, timeout=120))
        for text in expected:
            assert text in error, (override, error)
    # a dataset without extra_info.index is refused from its footer, before any server starts (it used to be
    # refused by the dataset read, once the servers had started)
    demo.drop(columns=["extra_info"]).to_parquet(no_index := tmp_path / "no_index.parquet")
    error = one_line_error(launch(tmp_path / "no_index_run", f"model_path={tiny_model}", f"train_files={no_index}"))
    assert f"train_files: {no_index} has no extra_info.index" in error and "add a unique integer" in error
    assert not list((tmp_path / "no_index_run" / "logs").glob("server_*")), "a server was started"
    assert not (tmp_path / "no_index_run" / "conf" / "launch.json").exists()
    error = one_line_error(subprocess.run([sys.executable, "-m", "pipegen.launch", f"output_dir={a_file}"], cwd=REPO,
                                          capture_output=True, text=True, timeout=60))
    assert "is a file" in error and str(a_file) in error


def test_a_mistyped_key_is_refused_before_the_launcher_imports_its_machinery(tmp_path):
    """A typo is refused from the schema alone (launch/early.py), before numpy, pydantic, torch or
    verl are imported (the seconds a refusal used to take), and nothing is written; it names the command typed."""
    script = ("import sys\nfrom pipegen.launch.launcher import main\n"
              f"rc = main(['output_dir={tmp_path / 'run'}', 'generation.max_attempt=3'])\n"
              "print(rc, sorted(m for m in ('numpy', 'pydantic', 'verl', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[0] == "2 []", done.stdout + done.stderr
    assert done.stderr.strip() == "pipegen: error: unknown key 'generation.max_attempt'; did you mean " \
                                  "generation.max_attempts?"
    assert not (tmp_path / "run").exists()
    # a typo in verl's groups (one composition of the defaults) and a Hub id that is neither cached nor reachable
    # (huggingface_hub offline, its cache empty) are refused before those imports too
    script = ("import sys\nfrom pipegen.launch.launcher import main\n"
              f"print(main(['output_dir={tmp_path / 'run'}', 'actor_rollout_ref.rolout.n=2']))\n"
              f"print(main(['output_dir={tmp_path / 'run'}', 'model_path=acme/not-cached']))\n"
              "print(sorted(m for m in ('numpy', 'pydantic', 'verl', 'torch') if m in sys.modules))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.stdout.split("\n")[:3] == ["2", "2", "[]"], done.stdout + done.stderr
    verl_typo, hub = done.stderr.strip().splitlines()
    assert verl_typo == ("pipegen: error: unknown key 'actor_rollout_ref.rolout.n'; did you mean "
                         "actor_rollout_ref.rollout.n or actor_rollout_ref.rollout.name?")
    assert hub.startswith("pipegen: error: model_path=acme/not-cached: not a local folder") and \
        "`hf download acme/not-cached --local-dir DIR`" in hub, hub
    assert not (tmp_path / "run").exists()
    pipegen = Path(sys.executable).with_name("pipegen")  # the installed command: its messages name it
    typed = subprocess.run([str(pipegen), "run", f"output_dir={tmp_path / 'run'}", "nosuch_key=1"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert typed.returncode == 2 and typed.stderr.strip() == ("pipegen: error: unknown key 'nosuch_key': check its "
                                                              "spelling against pipegen run --help")


def test_unreachable_external_server_fails_fast_naming_it(tmp_path, tiny_model):
    started = time.monotonic()
    result = launch(tmp_path / "run", f"model_path={tiny_model}", "llm=external", "llm.urls=[http://127.0.0.1:9]",
                    timeout=120)
    took = time.monotonic() - started
    error = one_line_error(result)
    assert "connection refused" in error and "http://127.0.0.1:9" in error and "llm.urls" in error
    assert took < 15, f"took {took:.1f}s"  # the bound; the wait itself is 5 s of refusals


def test_a_loading_external_server_is_waited_for():
    """Not listening for 2 s, then 503 until 6 s, then ready: that is a server starting, not a missing one."""
    import http.server
    import socket
    import threading

    from pipegen.launch.servers import check_reachable, wait_ready

    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    t0 = time.monotonic()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if time.monotonic() - t0 > 6 else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    def serve_later():
        time.sleep(2)
        server.append(http.server.ThreadingHTTPServer(("127.0.0.1", port), Health))
        server[0].serve_forever(poll_interval=0.1)

    server: list = []
    threading.Thread(target=serve_later, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{port}"
        check_reachable(url)  # refused for 2 s only: reachable
        waited = wait_ready(url, 120, unreachable_after_s=5)
        assert time.monotonic() - t0 >= 6 and waited > 0
    finally:
        if server:
            server[0].shutdown()


def test_status_piped_into_head_exits_quietly(tmp_path):
    (tmp_path / "conf").mkdir()
    from pipegen.run.config import CONFIG_END

    (tmp_path / "conf" / "config.yaml").write_text(
        f"actor_rollout_ref:\n  rollout:\n    n: 2\ngeneration:\n  save_batch_size: 4\n{CONFIG_END}\n")
    result = subprocess.run(f"'{sys.executable}' -m pipegen.status '{tmp_path}' | head -n 0", shell=True, cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.stderr == "", result.stderr


def test_final_actor_stats_rates_agree_with_the_wall_clock(tmp_path, tiny_model):
    out = tmp_path / "run"
    stats = out / "streams" / "stats" / "actor_0.jsonl"
    launcher = subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir={out}",
                                 f"model_path={tiny_model}", *SLOW], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # the wall clock, read from outside: the actor's stats file appears as it starts generating,
        # its final line when it is done
        wait_for(stats.exists, 120, "the actor to start generating", launcher, poll=0.05)
        began = time.time()

        def final_line():
            lines = [orjson.loads(ln) for ln in stats.read_bytes().splitlines() if ln.strip()]
            return lines[-1] if lines and lines[-1].get("final") else None

        final = wait_for(final_line, 120, "the actor's final stats line", launcher, poll=0.05)
        span = time.time() - began
        assert launcher.wait(timeout=120) == 0, launcher.stderr.read()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        kill_orphans_of(launcher.pid)
    assert final["completed"] == 24 and span > 3
    for counter in ("completed", "output_tokens"):
        truth = final[counter] / span
        assert abs(final[f"{counter}_per_s"] - truth) <= 0.1 * truth, (counter, final[f"{counter}_per_s"], truth)


def test_outputs_count_every_launch():
    from pipegen.observe.stats import across_processes, aggregate
    from pipegen.run.stats_line import ActorStats

    def line(pid, completed, stop, length, reward):
        return ActorStats(pid=pid, host="h", completed=completed, output_tokens=10 * completed,
                          finish_reasons={"stop": stop, "length": length}, mean_reward=reward)

    history = {"actor_0": [line(1, 10, 4, 4, 1.0), line(1, 20, 8, 12, 0.5),  # first launch, killed
                           line(2, 30, 30, 14, 0.0), line(2, 44, 40, 4, 0.25)]}  # the resumed launch
    m = aggregate(across_processes(history))
    assert m["actors/completed"] == 64 and m["actors/output_tokens"] == 640
    assert m["finish_reason/stop"] == 48 and m["finish_reason/length"] == 16
    assert m["reward/mean"] == (20 * 0.5 + 44 * 0.25) / 64
