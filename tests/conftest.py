"""Shared fixtures: the tiny random-weight model, and running the real launcher as a user would."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from fake_servers import FAKE_ENGINE_CLASS

REPO = Path(__file__).resolve().parent.parent

# The deterministic fake engine of pipegen's CPU server, chosen by import path (pipegen/bench/doubles/).
FAKE_ENGINE = f"llm.engine={FAKE_ENGINE_CLASS}"

# Small, fast defaults for pipeline tests: a handful of demo prompts, short answers, small batches.
# save_batch_size=4 and partial_batch_quiet_s=0.3 (defaults 64 and 300 s) make a 12-row run write several batch
# files, so these tests exercise multi-batch commits and merges; batch boundaries never change what
# trajectories.pkl holds (merge sorts rows by index, sample, trajectory). test_writer_batches.py runs
# the writer with the real defaults.
FAST = [
    "max_samples=6",
    "n=2",
    "max_response_length=24",
    "llm.max_batch=8",
    "actors.concurrency=8",
    "actors.stats_interval_s=0.5",
    "generation.save_batch_size=4",
    "generation.partial_batch_quiet_s=0.3",
    "generation.report=false",  # about a second of CPU per launch; FAST_REPORTED keeps it, for the tests that check it
]
FAST_REPORTED = [o for o in FAST if o != "generation.report=false"]  # FAST with the end-of-run report


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from pipegen.bench.doubles.tiny_models import tiny_model_path

    return tiny_model_path()


def launch(out: Path, *overrides: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m pipegen.launch output_dir=OUT ...` in a subprocess and return its result. A run it
    completes is checked against the run-directory contract (`pipegen.status --verify`) before the test
    sees it: every run directory the suite produces proves every unit exactly once."""
    cmd = [sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *overrides]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if result.returncode == 0 and _complete(Path(out)):
        assert_verified(Path(out))
    return result


def _complete(out: Path) -> bool:
    try:
        return bool(orjson.loads((out / "checkpoint.json").read_bytes()).get("complete"))
    except (OSError, ValueError):
        return False


def assert_verified(out: Path) -> None:
    """`python -m pipegen.status OUT --verify`, in this process (verl is imported once per session)."""
    from pipegen.observe.verify import verify_run
    from pipegen.run.layout import RunDir

    verdict = verify_run(RunDir(Path(out).resolve()))
    assert verdict.ok, verdict.render()


def assert_same_trajectories(a, b) -> None:
    """Two DataProto outputs hold the same rows: every tensor equal, every non-tensor column equal."""
    import torch

    assert len(a) == len(b)
    assert set(a.batch.keys()) == set(b.batch.keys())
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for key in a.non_tensor_batch:
        assert orjson.dumps(a.non_tensor_batch[key].tolist(), option=orjson.OPT_SERIALIZE_NUMPY) == \
               orjson.dumps(b.non_tensor_batch[key].tolist(), option=orjson.OPT_SERIALIZE_NUMPY), key


def load_trajectories(path: Path):
    from verl import DataProto

    return DataProto.load_from_disk(str(path))


def assert_verl_agrees(data, model_path: str, temperature: float) -> None:
    """verl's actor recomputation of trajectories.pkl (a float32 forward over prompt + response, logits /
    temperature, log-softmax of the response tokens) agrees with rollout_log_probs within 1e-3; at a
    temperature other than 1 the unscaled log-softmax is far off, so the check tells the two apart."""
    import torch
    from transformers import AutoModelForCausalLM
    from verl.utils.torch_functional import logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    b = data.batch
    width = b["prompts"].shape[1]
    with torch.inference_mode():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits.float()
    logits = logits[:, width - 1:-1, :]
    mask = b["response_mask"].bool()
    assert mask.sum() > 20
    gap = (logprobs_from_logits(logits / temperature, b["responses"]) - b["rollout_log_probs"]).abs()[mask].max()
    assert gap < 1e-3, f"max |verl - rollout| = {gap:.2e} at temperature {temperature}"
    if temperature != 1.0:
        raw = logprobs_from_logits(logits, b["responses"])
        assert (raw - b["rollout_log_probs"]).abs()[mask].max() > 1e-2


def assert_a_resumed_answer_is_one_answer(tmp_path: Path, model_path: str, prompt: list[int], params: dict,
                                          limits, send_one) -> list[int]:
    """Progress inside a sample (pipegen/actor/continuation.py) on a real engine: an answer in chunks of 8 tokens, the
    actor "killed" after its first chunk, then resumed from the durable record by a new UnitProgress. The log-probs of
    the whole answer, across the resume point and the chunk boundaries, are transformers' float32 ones within 2e-3
    (temperature-scaled). `send_one(ids, params, seed)`: the engine's TokenOutput for one request built by the actor's
    own engine code. Returns the answer's ids."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from pipegen.actor.continuation import UnitProgress

    sent: list[int] = []

    async def send(generation, crash_after=None):
        if crash_after is not None and len(sent) >= crash_after:
            raise KeyboardInterrupt("the actor is killed")
        sent.append(len(generation.prompt_ids))
        return send_one(generation.prompt_ids, {**generation.params, "max_new_tokens": generation.max_new_tokens},
                        generation.seed)

    path = tmp_path / "0-0.jsonl"
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(UnitProgress(path, 8, limits).generate(lambda g: send(g, crash_after=1), prompt, params, 11))
    resumed = UnitProgress(path, 8, limits)
    out = asyncio.run(resumed.generate(send, prompt, params, 11))
    ids = list(out.token_ids)
    assert resumed.resumed_at == 8 and sent[1] == len(prompt) + 8 and len(ids) > 8
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    temperature = params["temperature"]
    want = torch.log_softmax(logits / temperature, -1)[torch.arange(len(ids)), torch.tensor(ids)]
    assert (want - torch.tensor(out.log_probs)).abs().max() < 2e-3
    return ids


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM server's python, which `./launch.sh --tests` sets up before pytest starts (its virtualenv, once per
    machine under ~/.cache/pipegen: ~2-5 min, ~0.5 GB from PyPI, too long for a test's time limit) and exports
    as PIPEGEN_VLLM_PYTHON. A pytest started by hand without it fails here in one line naming the command."""
    python = os.environ.get("PIPEGEN_VLLM_PYTHON", "")
    if not python or not os.access(python, os.X_OK):
        pytest.fail("no vLLM server environment (PIPEGEN_VLLM_PYTHON): run the suite with ./launch.sh --tests, or "
                    "export PIPEGEN_VLLM_PYTHON=$(./launch.sh --setup-vllm) first", pytrace=False)
    return python


# The SGLang server-environment resolve (test_gpu_install) spends ~30-80 s waiting on the package index:
# started when that test is collected, so the wait overlaps the rest of the suite.
SERVER_RESOLVE = pytest.StashKey()


# The files that take longest, longest first (seconds on 2 cores, measured with --durations=0). The suite runs
# one file per worker (--dist loadfile) in collection order (launch.sh passes --no-loadscope-reorder: xdist
# would otherwise start the files with the most tests first, and test_vllm.py, few tests and the longest,
# ran alone at the end); every other file follows in its usual order.
LONGEST_FIRST = ("test_vllm.py", "test_reproducible.py", "test_run_damage.py", "test_gateway.py", "test_actor_faults.py", "test_vision.py",
                 "test_cluster.py", "test_install.py", "test_models.py", "test_agent_loops.py", "test_rewards.py",
                 "test_day_two.py",
                 "test_writer_crash.py", "test_partial_progress.py", "test_supervision.py", "test_status.py")


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: never started for a run that will not check it
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    for item in items:
        if item.name == "test_sglang_server_requirements_resolve_against_the_index" and not any(
                m.name == "skipif" and m.args and m.args[0] for m in item.iter_markers()):
            config.stash[SERVER_RESOLVE] = item.module.ServerResolve()


def pytest_unconfigure(config: pytest.Config) -> None:
    job = config.stash.get(SERVER_RESOLVE, None)
    if job is not None and job.proc.poll() is None:  # the run was interrupted before the test collected it
        job.proc.kill()
        shutil.rmtree(job.dir, ignore_errors=True)


def wait_for_lines(launcher: subprocess.Popen, shard: Path, count: int, timeout: float) -> None:
    """Wait until `shard` holds `count` complete lines while `launcher` runs (a crash test's moment to kill)."""
    deadline = time.monotonic() + timeout
    while not (shard.exists() and shard.read_bytes().count(b"\n") >= count):
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the actor never wrote {count} records"
        time.sleep(0.05)


def launch_killing_the_actor(out: Path, overrides: list[str], ready, timeout: float = 180, settle: float = 0.0,
                             env: dict | None = None, kills: int = 1) -> tuple[int, str]:
    """Run the launcher on `out`, SIGKILL its one actor once `ready()` is true (then `settle` seconds more), `kills`
    times (`ready` is asked again for each: it waits for the restarted actor), and let the launcher restart it and
    finish: (its exit code, its stderr)."""
    import signal

    from pipegen.bench.partial_progress import actor_pids

    launcher = subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *overrides], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **(env or {})})
    try:
        for _ in range(kills):
            deadline = time.monotonic() + timeout
            while not ready():
                assert time.monotonic() < deadline and launcher.poll() is None, "the run never reached the kill point"
                time.sleep(0.05)
            time.sleep(settle)
            (pid,) = actor_pids(out)
            os.kill(pid, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
    return launcher.returncode, stderr


def response_texts(data, model_path: str) -> list[tuple[str, int]]:
    """Each row's response as verl decodes it for scoring (its valid tokens, skip_special_tokens=True), with
    its length in tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    width = data.batch["prompts"].shape[1]
    out = []
    for i in range(len(data)):
        length = int(data.batch["attention_mask"][i, width:].sum())
        out.append((tokenizer.decode(data.batch["responses"][i, :length].tolist(), skip_special_tokens=True), length))
    return out


def directory_bytes(root: Path) -> dict[str, str]:
    """Every file and folder under `root`: a file by the digest of its bytes. The launcher lock is left out:
    whoever takes it writes its pid and host there by design (pipegen/run/ownership.py), refused or not."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(root.rglob("*")) if p.name != ".launcher.lock"}

