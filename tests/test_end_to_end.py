"""The spine: the real launcher, CPU reference server, actors and writer on a tiny random-weight model."""

from __future__ import annotations

import orjson
import pytest
import torch

from conftest import FAST_REPORTED, launch, load_trajectories

VERL_TENSORS = ["prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                "rollout_log_probs"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model):
    """One small run, launched once for the module: (its directory, the launch's result)."""
    out = tmp_path_factory.mktemp("spine") / "run"
    return out, launch(out, f"model_path={tiny_model}", *FAST_REPORTED)


def test_launch_produces_verl_trajectories(finished):
    out, result = finished
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trajectories" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == f"  report:       {out / 'report.html'}"  # the summary's last line

    data = load_trajectories(out / "trajectories.pkl")
    assert len(data) == 6 * 2  # one row per (prompt, sample)
    for key in VERL_TENSORS:
        assert key in data.batch.keys(), key
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert data.batch[key].dtype == torch.int64
    assert data.batch["rollout_log_probs"].dtype == torch.float32
    for key in ("index", "raw_prompt", "__num_turns__", "uid", "data_source", "reward_model"):
        assert key in data.non_tensor_batch, key

    # sorted by (index, sample); the n samples of a prompt share uid, seeds differ
    index = [int(i) for i in data.non_tensor_batch["index"]]
    sample = [int(s) for s in data.non_tensor_batch["sample"]]
    assert list(zip(index, sample)) == sorted(zip(index, sample))
    assert len(set(zip(index, sample))) == 12
    uids = data.non_tensor_batch["uid"]
    assert uids[0] == uids[1] and uids[1] != uids[2]

    # verl's layout: left-padded prompts, right-padded responses, logprobs only on real tokens
    P = data.batch["prompts"].shape[1]
    attn = data.batch["attention_mask"]
    resp_len = attn[:, P:].sum(1)
    assert (resp_len > 0).all()
    assert ((data.batch["rollout_log_probs"] != 0).sum(1) <= resp_len).all()
    assert (data.batch["response_mask"].sum(1) == resp_len).all()  # single turn: every token is the model's
    assert torch.equal(data.batch["input_ids"], torch.cat([data.batch["prompts"], data.batch["responses"]], 1))

    # the run directory a user looks at
    ckpt = orjson.loads((out / "checkpoint.json").read_bytes())
    assert ckpt["complete"] and ckpt["num_committed"] == 12 and ckpt["merged"]
    assert (out / "conf" / "config.yaml").exists()
    assert (out / "trajectories.zip").exists()
    shards = list((out / "streams" / "rollouts").glob("actor_*/*.jsonl"))
    lines = [l for s in shards for l in s.read_bytes().splitlines()]
    assert len(lines) == 12 and all(l.startswith(b'{"index":') for l in lines)
    for role in ("launch", "writer", "actor_0", "server_0"):
        if role != "launch":
            assert (out / "logs" / f"{role}.log").exists(), role
            assert (out / "logs" / f"{role}.cmd.sh").exists(), role


def test_relaunch_of_a_complete_run_is_a_no_op(finished, tiny_model):
    out, first = finished
    assert first.returncode == 0, first.stderr[-3000:]
    before = (out / "trajectories.pkl").read_bytes()
    again = launch(out, f"model_path={tiny_model}", *FAST_REPORTED)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete" in again.stdout
    assert (out / "trajectories.pkl").read_bytes() == before
