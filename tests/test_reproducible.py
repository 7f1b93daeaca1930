"""Same command, same data (generation.reproducible): on the real SmolLM2-135M, a unit's token ids and log-probs are
the same bit for bit alone or in a batch, continued after a crash or not, at another concurrency and server count;
`pipegen replay` says so, and names the setting when one changed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO


def smollm2_path() -> str:
    from pipegen.inputs.models import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2() -> str:
    return smollm2_path()


PROMPTS = [[1, 9690, 198] + [100 + 7 * i + j for j in range(20 + 3 * i)] for i in range(10)]


async def _generate(session, url: str, ids: list[int], seed: int, n: int) -> tuple[list[int], list[float]]:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}}
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    return answer["output_ids"], [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]


def test_a_row_is_the_same_alone_in_a_batch_and_continued(smollm2: str, tmp_path: Path) -> None:
    """The server's canonical mode: one prompt's answer alone, among nine others of other lengths and seeds, and
    continued from its 9th token (alone and amid others): the same ids and the same log-prob bits."""
    import aiohttp

    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "pipegen.cpu_server", "--model-path", smollm2, "--port", "0",
                             "--port-file", str(port_file), "--reproducible"], cwd=REPO,
                            stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"

        async def scenario():
            async with aiohttp.ClientSession() as session:
                for _ in range(600):
                    try:
                        async with session.get(f"{url}/health_generate") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.3)
                async with session.get(f"{url}/get_server_info") as r:
                    assert (await r.json())["enable_deterministic_inference"] is True
                alone = await _generate(session, url, PROMPTS[0], 7, 20)
                batch = await asyncio.gather(*[_generate(session, url, p, 7 + i, 20) for i, p in enumerate(PROMPTS)])
                k = 9
                rest = await _generate(session, url, PROMPTS[0] + alone[0][:k], 7, 20 - k)
                mixed = await asyncio.gather(_generate(session, url, PROMPTS[0] + alone[0][:k], 7, 20 - k),
                                             *[_generate(session, url, p, 99, 12) for p in PROMPTS[3:8]])
                return alone, batch[0], rest, mixed[0], k

        alone, batched, rest, rest_mixed, k = asyncio.run(scenario())
    finally:
        proc.terminate()
        proc.wait(30)
    assert batched == alone  # ids and log-probs, as Python floats (every bit)
    assert rest == (alone[0][k:], alone[1][k:])
    assert rest_mixed == rest


def _replay(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipegen.replay", str(run), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ})


STORIES = ["Write a long story about a lighthouse keeper.", "Tell me a story about a dragon who learns to cook.",
           "Write a story about two friends lost in a forest."]


def _progress_lines(out: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (out / "streams" / "progress").glob("*.jsonl")) \
        if (out / "streams" / "progress").is_dir() else 0


@pytest.mark.timeout(900)  # three launches, the first one's actor killed twice
def test_an_actor_killed_twice_mid_answer_gives_the_run_nobody_killed_at_any_concurrency_and_server_count(
        tmp_path: Path, tiny_model: str) -> None:
    """Story prompts on the tiny model (a real model on the CPU server's reproducible path; the embedded model's rows are
    checked for batch invariance above), answers of up to 640 tokens (the tiny model is fast: a kill must land mid-answer) kept as they stream (actors.progress_chunk_tokens=32, so an answer is
    continued from its kept tokens after a kill), with every other default: the actor SIGKILLed twice mid-answer.
    `pipegen replay --all` with another concurrency and two servers (a run nobody kills) finds every unit identical,
    ids and log-prob bits; a replay in another dtype fails, naming the first differing unit and the dtype."""
    from conftest import assert_verified, launch_killing_the_actor, load_trajectories
    from fake_servers import write_dataset
    from pipegen.bench.partial_progress import actor_pids

    data = write_dataset(tmp_path / "stories.parquet", [{"content": s} for s in STORIES])
    out = tmp_path / "run"
    overrides = [f"model_path={tiny_model}", f"train_files=[{data}]", "n=1", "max_response_length=640", "actors.progress_chunk_tokens=32",
                 "generation.report=false"]
    kills: list[int] = []

    def mid_answer() -> bool:  # an actor not killed yet, with more kept tokens than at the last kill
        pids = [p for p in actor_pids(out) if p not in kills]
        if pids and _progress_lines(out) >= (2 if not kills else 8):
            kills.append(pids[0])
            return True
        return False

    returncode, stderr = launch_killing_the_actor(out, overrides, mid_answer, timeout=300, kills=2)
    assert returncode == 0, stderr[-3000:]
    assert (out / "logs" / "actor_0.log").read_text().count("starting actor_0") == 3
    assert_verified(out)
    rows = load_trajectories(out / "trajectories.pkl")
    assert any(rows.non_tensor_batch["resumed"])
    again = _replay(out, "--all", "actors.concurrency=3", "llm.num_servers=2")
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert "3 of 3 units identical (token ids: 3 of 3; largest log-prob difference where the ids agree: 0)" \
        in again.stdout
    changed = _replay(out, "--units", "1", "--pick-seed", "0", "llm.dtype=float32")
    assert changed.returncode == 1, changed.stdout + changed.stderr[-3000:]
    assert "0 of 1 units identical" in changed.stdout and "first difference: unit (index " in changed.stdout
    assert "differs from the run: dtype: bfloat16 in the run, float32 in the replay" in changed.stdout, changed.stdout


def test_no_two_units_of_a_run_share_a_seed() -> None:
    """320,000 units (20,000 prompts x 16 samples): every seed distinct (a 31-bit hash of the same units collides
    about 24 times), none of a retry equal to its first try's, and every one a valid int64 sampling seed."""
    from pipegen.run.stream import unit_seed

    seeds = [unit_seed(0, i, s) for i in range(20_000) for s in range(16)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    assert all(unit_seed(0, i, 0, 1) != unit_seed(0, i, 0) for i in range(1000))
    assert unit_seed(1, 0, 0) != unit_seed(0, 0, 0)


def test_a_tool_loops_turns_draw_their_own_seeds_where_the_engine_keys_a_request_not_a_position() -> None:
    """A unit's first model call takes its seed; on an engine with a per-request random stream (vLLM) each later
    turn of a tool loop gets its own seed (never the first turn's draws again), the same on every rerun; where the
    engine keys draws on (seed, position) (SGLang, the CPU server) every turn keeps the unit's seed."""
    from pipegen.engines.request import turn_seed
    from pipegen.run.stream import unit_seed

    seed = unit_seed(0, 7, 1)
    per_request = [turn_seed(seed, t) for t in range(6)]
    assert per_request[0] == seed and len(set(per_request)) == 6
    assert per_request == [turn_seed(seed, t) for t in range(6)]
    assert all(0 <= s < 2**63 for s in per_request)
    assert [turn_seed(seed, t, draws_by_position=True) for t in range(6)] == [seed] * 6
