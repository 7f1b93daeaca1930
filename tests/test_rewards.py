"""Rewards the verl way and beyond it: a user's reward file (custom_reward_function.path/.name/
.reward_kwargs, loaded by verl's own loader), the same function behind an HTTP verifier
(python -m pipegen.rewards.serve, a real aiohttp server on loopback), a verifier that fails (recorded as
the unit's failure, nothing faked, retried by the next launch), and the verifier client's retries and
time limit against a real server."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson
import pytest

from conftest import FAKE_ENGINE, FAST, launch, load_trajectories, response_texts
from fake_servers import Proc

REWARD_FILE = '''
import os


def my_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, fail_unless=None, **kwargs):
    """A reward a user writes: depends on the text, the row and reward_kwargs; a dict with extras."""
    index = extra_info["index"]
    if fail_unless is not None and index % 2 == 1 and not os.path.exists(fail_unless):
        raise ValueError(f"cannot verify row {index} yet")
    return {"score": scale * (len(solution_str) % 7) / 6 + index / 1000, "length": len(solution_str),
            "source_seen": data_source}
'''


def expected_scores(data, model_path: str, scale: float) -> list[tuple[float, int]]:
    """What the reward file returns for each row's decoded response (verl decodes the valid response
    tokens with skip_special_tokens=True)."""
    out = []
    for i, (text, _) in enumerate(response_texts(data, model_path)):
        index = int(data.non_tensor_batch["extra_info"][i]["index"])
        out.append((scale * (len(text) % 7) / 6 + index / 1000, len(text)))
    return out


def assert_scores_are_the_files(data, model_path: str, scale: float) -> None:
    import torch

    want = expected_scores(data, model_path, scale)
    width = data.batch["prompts"].shape[1]
    assert "rm_scores" in data.batch.keys()
    for i, (score, length) in enumerate(want):
        row = data.batch["rm_scores"][i]
        last = int(data.batch["attention_mask"][i, width:].sum()) - 1
        assert row[last].item() == pytest.approx(score, abs=1e-6)  # float32, at the last response token
        assert torch.count_nonzero(row) <= 1
        # the dict's extras land in the non-tensor data, as verl's reward loop puts them
        assert data.non_tensor_batch["length"][i] == length
        assert data.non_tensor_batch["source_seen"][i] == data.non_tensor_batch["data_source"][i]
    assert len({round(s, 6) for s, _ in want}) > 1, "the scores must vary, or the check proves little"
    assert data.meta_info["reward_extra_keys"] == ["score", "length", "source_seen"]


@pytest.fixture
def reward_file(tmp_path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


def test_user_reward_file_gives_rm_scores_equal_to_what_it_returns(tmp_path, tiny_model, reward_file):
    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_model}", FAKE_ENGINE, *FAST, f"custom_reward_function.path={reward_file}",
                    "custom_reward_function.name=my_score", "+custom_reward_function.reward_kwargs.scale=2.0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_scores_are_the_files(load_trajectories(out / "trajectories.pkl"), tiny_model, scale=2.0)
    # verl's and datasets' own prints while the launcher reads the dataset go to its log, not the terminal
    log = (out / "logs" / "launch.log").read_text()
    for printed in ("Using dataset class", "dataset len"):
        assert printed not in result.stdout + result.stderr and printed in log
    assert "server_0 ready at http://" in log and "(pipegen's CPU server, SGLang's protocol)" in log  # the engine


def test_reward_settings_that_cannot_work_are_refused_in_one_line(tmp_path, tiny_model, reward_file):
    """Including the preflight's (launch/preflight.py): a reward of the wrong signature, one that raises and a
    dead verifier are refused before the first unit, so 0 units are generated."""
    wrong = tmp_path / "wrong_reward.py"
    wrong.write_text("def compute_score(text):\n    return 1.0\n\n"
                     "def raises(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    return {'score': int(solution_str)}\n")
    import socket

    with socket.socket() as s:  # a port nothing listens on: the verifier is down
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    external = "actor_rollout_ref.rollout.agent.default_agent_loop=external"
    cases = [
        ([f"custom_reward_function.path={tmp_path / 'nope.py'}"], "custom_reward_function.path=", "no such file"),
        ([f"custom_reward_function.path={reward_file}"], "custom_reward_function.name=compute_score",
         "has no such function"),
        (["reward.verifier_url=localhost:9"], "reward.verifier_url=localhost:9", "is not an http(s) URL"),
        ([f"custom_reward_function.path={wrong}"], "cannot take verl's reward call", "missing a required argument: 'text'"),
        ([f"custom_reward_function.path={wrong}", "custom_reward_function.name=raises"], "raised ValueError",
         "generation.preflight=false"),
        ([f"reward.verifier_url={dead}"], f"verifier {dead} failed 1 tries", "start the verifier"),
        ([external, "external.harness=no_such_harness_mod:run"], "external.harness=no_such_harness_mod:run",
         "No module named 'no_such_harness_mod'"),
        ([external, "external.command='no-such-program-xyz --go'"], "external.command",
         "'no-such-program-xyz' is not found"),
    ]
    for overrides, named, why in cases:
        result = launch(tmp_path / "refused", f"model_path={tiny_model}", FAKE_ENGINE, *FAST, *overrides)
        assert result.returncode == 2, result.stderr[-2000:]
        lines = [ln for ln in result.stderr.splitlines() if ln.startswith("pipegen: error:")]
        assert len(lines) == 1 and named in lines[0] and why in lines[0], result.stderr[-2000:]
        assert not (tmp_path / "refused" / "streams").exists()


def test_the_reward_function_is_verls_get_custom_reward_fn_without_importing_verl(tmp_path, reward_file):
    """verl_private.custom_reward_fn (the launcher checks the file before verl is imported) gives what verl's
    get_custom_reward_fn gives: the same scores with reward_kwargs winning over a call's, the async wrapper for a
    coroutine function, the same error for a missing name."""
    import inspect

    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    from pipegen.verl_private import custom_reward_fn

    def verls(path, name, kwargs):
        return get_custom_reward_fn(OmegaConf.create({"reward": {"custom_reward_function": {
            "path": str(path), "name": name, "reward_kwargs": kwargs}}}))

    call = dict(data_source="d", solution_str="abcd", ground_truth="1", extra_info={"index": 3}, scale=9.0)
    ours, theirs = custom_reward_fn(str(reward_file), "my_score", {"scale": 2.0}), verls(reward_file, "my_score",
                                                                                          {"scale": 2.0})
    assert ours(**call) == theirs(**call) == {"score": 2.0 * 4 / 6 + 0.003, "length": 4, "source_seen": "d"}
    async_file = tmp_path / "async_reward.py"
    async_file.write_text("async def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                          "    return 1.0\n")
    assert inspect.iscoroutinefunction(custom_reward_fn(str(async_file), "score", {}).func)
    assert inspect.iscoroutinefunction(verls(async_file, "score", {}).func)
    for load in (lambda: custom_reward_fn(str(reward_file), "nope", {}), lambda: verls(reward_file, "nope", {})):
        with pytest.raises(AttributeError):
            load()


def test_the_launcher_runs_a_reward_files_top_level_code_once(tmp_path, tiny_model):
    """The launch checks the reward file (loaded with verl's loader) and its preflight calls the function: one load,
    so the file's own top-level code (a model load, a print, a counter) runs once in the launcher. The launch is
    refused afterwards (a dataset without extra_info.index), before any process starts."""
    import pandas as pd

    from pipegen.config.schema import DEMO_PARQUET

    loads = tmp_path / "loads.txt"
    reward = tmp_path / "counted_reward.py"
    reward.write_text(f"with open({str(loads)!r}, 'a') as f:\n    f.write('loaded\\n')\n\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    pd.read_parquet(DEMO_PARQUET).head(2).drop(columns=["extra_info"]).to_parquet(rows := tmp_path / "rows.parquet")
    result = launch(tmp_path / "run", f"model_path={tiny_model}", f"train_files={rows}",
                    f"custom_reward_function.path={reward}")
    assert result.returncode == 2 and "has no extra_info.index" in result.stderr, result.stderr[-2000:]
    assert "scored the first row" in result.stdout  # the preflight called it
    assert loads.read_text() == "loaded\n"


class Verifier(Proc):
    """python -m pipegen.rewards.serve on a loopback port."""

    def __init__(self, name: str, tmp: Path, *args: str):
        super().__init__(name, tmp, [sys.executable, "-m", "pipegen.rewards.serve", "--port", "0",
                                     "--port-file", str(tmp / f"{name}.port"), *args])


def test_http_verifier_scores_as_the_file_and_a_failing_one_is_recorded_not_faked(tmp_path, tiny_model, reward_file):
    flag = tmp_path / "verifier_ready"
    verifier = Verifier("verifier", tmp_path, "--path", str(reward_file), "--name", "my_score",
                        "--reward-kwargs", orjson.dumps({"scale": 3.0, "fail_unless": str(flag)}).decode())
    try:
        url = f"http://127.0.0.1:{verifier.port}/score"
        out = tmp_path / "run"
        args = (f"model_path={tiny_model}", FAKE_ENGINE, *FAST, f"reward.verifier_url={url}")
        first = launch(out, *args)
        # rows with an odd index fail at the verifier: their units are recorded as failed, not scored
        assert first.returncode == 1, first.stderr[-3000:]
        ckpt = orjson.loads((out / "checkpoint.json").read_bytes())
        failed = ckpt["failed"]
        assert failed and all(int(u.split(":")[0]) % 2 == 1 for u in failed)
        assert all("cannot verify row" in info["reason"] and url in info["reason"] for info in failed.values())
        lines = [orjson.loads(ln) for f in (out / "streams" / "failures").glob("actor_*/*.jsonl")
                 for ln in f.read_bytes().splitlines()]
        assert {f"{r['index']}:{r['sample']}" for r in lines} == set(failed)
        rollouts = [orjson.loads(ln) for f in (out / "streams" / "rollouts").glob("actor_*/*.jsonl")
                    for ln in f.read_bytes().splitlines()]
        assert rollouts and all(r["index"] % 2 == 0 for r in rollouts)  # no odd row got a made-up score
        assert all(t["reward_score"] is not None for r in rollouts for t in r["trajectories"])

        # the samples the verifier could not score are kept, unscored, in their failure lines; the partial output
        # holds only scored rows (rm_scores complete, never made up)
        kept = {f"{r['index']}:{r['sample']}": r["unscored"] for r in lines}
        assert all(k["reward"] is None and k["trajectories"][0]["response_ids"] for k in kept.values())
        assert "not scored" in first.stderr and "partial output" in first.stderr
        # the closing line says one thing to do about them: no "rerun ... with a fresh seed" (nothing is generated
        # again), the rescore that scores them without generating
        closing = next(ln for ln in first.stderr.splitlines() if ln.startswith("pipegen: partial output:"))
        assert "fresh seed" not in closing and "failed to generate" not in closing, closing
        assert (f"{len(failed)} unit(s) generated but not scored (the reward raised or gave no score; their samples "
                f"are kept): fix the reward, then ") in closing and (
            f"rescore {out.resolve()} scores them without generating. Listed in "
            f"{out.resolve() / 'failed_units.json'}.") in closing, closing
        assert "rerun" not in closing and "same command" not in closing, closing
        # failed_units.json and the reasons printed under the closing line say the same: a rescore, no fresh seed
        listing = orjson.loads((out / "failed_units.json").read_bytes())
        assert listing["retry"] == ("the units not scored keep their samples: fix the reward, then pipegen rescore "
                                    "DIR scores them without generating"), listing
        assert all("next launch" not in line and "fresh seed" not in line for line in first.stderr.splitlines()
                   if "not scored" in line), first.stderr[-3000:]

        # the verifier recovers: the same command scores exactly the kept samples, generating nothing
        flag.write_text("ok")
        second = launch(out, *args)
        assert second.returncode == 0, second.stderr[-3000:]
        from pipegen.observe.stats import latest_stats

        actors = [line for role, line in latest_stats(out / "streams" / "stats").items() if role.startswith("actor")]
        assert actors and all(a.requests == 0 and not a.output_tokens for a in actors), "the rescore generated"
        rescored = [orjson.loads(ln) for f in (out / "streams" / "rollouts").glob("actor_*/*.jsonl")
                    for ln in f.read_bytes().splitlines() if orjson.loads(ln)["index"] % 2 == 1]
        assert {f"{r['index']}:{r['sample']}" for r in rescored} == set(failed)
        for r in rescored:  # the very tokens generated by the first launch
            assert r["trajectories"][0]["response_ids"] == kept[f"{r['index']}:{r['sample']}"]["trajectories"][0][
                "response_ids"] and r["reward"] is not None
        assert_scores_are_the_files(load_trajectories(out / "trajectories.pkl"), tiny_model, scale=3.0)
    finally:
        verifier.stop()


# ---- the verifier client against a real aiohttp server in this process


async def _serve(handler):
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/score", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/score"


def _request(i: int):
    from pipegen.rewards.protocol import ScoreRequest

    return ScoreRequest(data_source="d", solution_str=f"answer {i}", ground_truth=str(i), extra_info={"index": i})


def test_verifier_client_retries_then_scores_and_fails_after_its_tries():
    from aiohttp import web

    from pipegen.rewards.protocol import RewardFailure, parse_result
    from pipegen.rewards.verifier import VerifierReward
    from pipegen.config.schema import Reward, RewardSpec

    async def scenario():
        seen = {"flaky": 0, "down": 0, "slow": 0}

        async def flaky(request):  # two 503s, then answers every sample of the batch
            seen["flaky"] += 1
            if seen["flaky"] <= 2:
                return web.Response(status=503, text="warming up")
            body = orjson.loads(await request.read())
            return web.json_response({"results": [{"score": float(r["ground_truth"]), "ok": True}
                                                  for r in body["requests"]]})

        async def down(request):
            seen["down"] += 1
            return web.Response(status=500, text="boom")

        async def slow(request):
            seen["slow"] += 1
            await asyncio.sleep(5)
            return web.json_response({"results": []})

        servers = [await _serve(h) for h in (flaky, down, slow)]
        try:
            (_, flaky_url), (_, down_url), (_, slow_url) = servers
            client = VerifierReward(RewardSpec(url=flaky_url), Reward(verifier_timeout_s=10, verifier_attempts=3,
                                                                      verifier_batch=8, verifier_concurrency=1))
            results = await asyncio.gather(*(client.score(_request(i)) for i in range(5)))
            assert [parse_result(r, "v") for r in results] == [(float(i), {"score": float(i), "ok": True})
                                                               for i in range(5)]
            await client.close()

            client = VerifierReward(RewardSpec(url=down_url), Reward(verifier_timeout_s=10, verifier_attempts=3))
            with pytest.raises(RewardFailure, match="failed 3 tries, the last: HTTP 500: boom"):
                await client.score(_request(1))
            assert seen["down"] == 3
            await client.close()

            client = VerifierReward(RewardSpec(url=slow_url), Reward(verifier_timeout_s=0.3, verifier_attempts=2))
            with pytest.raises(RewardFailure, match="no answer within reward.verifier_timeout_s=0.3"):
                await client.score(_request(1))
            assert seen["slow"] == 2
            await client.close()

            client = VerifierReward(RewardSpec(url="http://127.0.0.1:9/score"),
                                    Reward(verifier_timeout_s=5, verifier_attempts=2))
            with pytest.raises(RewardFailure, match="failed 2 tries"):  # nothing listens there
                await client.score(_request(1))
            await client.close()
        finally:
            for runner, _ in servers:
                await runner.cleanup()
        assert seen["flaky"] == 3  # five samples went as one batch, tried three times

    asyncio.run(scenario())


def test_a_result_that_is_not_a_score_is_a_failure_never_a_number():
    from pipegen.rewards.protocol import RewardFailure, parse_result

    assert parse_result(0.5, "f") == (0.5, {"acc": 0.5})  # verl: a number's extras are {"acc": score}
    assert parse_result(True, "f") == (1.0, {"acc": True})
    assert parse_result({"score": 1, "pred": "4"}, "f") == (1.0, {"score": 1, "pred": "4"})
    for bad in (None, "1.0", float("nan"), {"pred": "4"}, {"error": "timeout"}):
        with pytest.raises(RewardFailure):
            parse_result(bad, "f")


SLOW_REWARD_FILE = '''
import signal
import time


def slow_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """10 ms a sample (so it is scored in the process pool), except on the inputs a test makes it hang on."""
    if solution_str == "hang":
        time.sleep(5)
    elif solution_str == "hang in C":  # a C call that never lets the interval timer's signal in
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    time.sleep(0.01)
    return 1.0
'''


def test_a_reward_that_hangs_fails_its_sample_at_the_limit_and_scoring_goes_on(tmp_path):
    """reward.timeout_s, in each place a local function runs: a worker thread (its first samples), the process
    pool (the interval timer in the pool process), and C code that blocks the timer (pebble kills the process).
    The limit is what is under test, so it is set to 1 s."""
    from pipegen.rewards.local import INLINE_AFTER, FunctionReward
    from pipegen.config.schema import Reward, RewardSpec
    from pipegen.rewards.protocol import RewardFailure, ScoreRequest

    path = tmp_path / "slow_reward.py"
    path.write_text(SLOW_REWARD_FILE)
    reward = FunctionReward(RewardSpec(str(path), "slow_score"), Reward(processes=1, timeout_s=1.0))

    def sample(text: str) -> ScoreRequest:
        return ScoreRequest(data_source="slow", solution_str=text, ground_truth="x")

    async def scenario() -> None:
        try:
            with pytest.raises(RewardFailure, match=r"took longer than reward\.timeout_s=1 "):
                await reward.score(sample("hang"))  # a worker thread: given up on at the limit
            for _ in range(INLINE_AFTER):
                assert await reward.score(sample("ok")) == 1.0
            assert reward.placement("slow") == "pool"
            with pytest.raises(RewardFailure, match=r"took longer than reward\.timeout_s=1 "):
                await reward.score(sample("hang"))  # in the pool process: its interval timer (else 1.0 after 5 s)
            assert await reward.score(sample("ok")) == 1.0  # the same process goes on scoring
            with pytest.raises(RewardFailure, match="its process was stopped"):
                await reward.score(sample("hang in C"))  # the timer blocked: pebble kills the process
            assert await reward.score(sample("ok")) == 1.0  # a new process took its place
        finally:
            await reward.close()

    asyncio.run(scenario())


def test_the_reward_order_is_the_whole_run_then_a_task_by_data_source_then_verls_default(reward_file):
    """rewards/spec.py's RewardOrder, the one place the order lives: a run-wide reward scores every row; without
    one a task's row gets its task's reward by data_source; else verl's default where the row has a ground truth
    (never for a code data source, and never for a row without a ground truth)."""
    from omegaconf import OmegaConf

    from pipegen.rewards.local import FunctionReward
    from pipegen.rewards.spec import RewardOrder
    from pipegen.rewards.verifier import VerifierReward
    from pipegen.config.schema import Reward, RewardSpec

    def cfg(verifier_url=None, path=None):
        return OmegaConf.create({"reward": {"verifier_url": verifier_url},
                                 "custom_reward_function": {"path": path, "name": "my_score", "reward_kwargs": {}}})

    mine = RewardSpec(str(reward_file), "my_score")
    routes = {"task_a": mine, "task_b": RewardSpec(url="http://127.0.0.1:9/score"), "task_c": None}
    row = lambda source, truth=True: {"data_source": source, **({"reward_model": {"ground_truth": "1"}} if truth else {})}

    async def scenario():
        run_wide = RewardOrder(cfg(verifier_url="http://127.0.0.1:9/score"), routes)
        assert all(run_wide.reward_for(row(s)) is run_wide.everything for s in ("task_a", "gsm8k", "apps"))
        assert isinstance(run_wide.everything, VerifierReward) and not run_wide.by_source
        await run_wide.close()

        order = RewardOrder(cfg(), routes)
        assert order.everything is None
        a, b = order.reward_for(row("task_a", truth=False)), order.reward_for(row("task_b"))
        assert isinstance(a, FunctionReward) and a.spec == mine and isinstance(b, VerifierReward)
        default = order.reward_for(row("task_c"))  # a task without its own reward: verl's default, by data_source
        assert isinstance(default, FunctionReward) and default.spec == RewardSpec()
        assert order.reward_for(row("gsm8k")) is default
        assert order.reward_for(row("gsm8k", truth=False)) is None
        assert order.reward_for(row("apps")) is None  # verl would run the generated program
        await order.close()

        function = RewardOrder(cfg(path=str(reward_file)), routes)
        assert function.everything.spec == mine and function.reward_for(row("task_b")) is function.everything
        assert function.settings == Reward()
        await function.close()

    asyncio.run(scenario())
