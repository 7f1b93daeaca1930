"""trajectories.pkl goes into verl's trainer unchanged: its log-prob pass agrees with rollout_log_probs at any
temperature, it finds meta_info["temperature"], and GRPO's advantage groups the samples of a prompt by uid.

One real run per temperature (the launcher, pipegen's CPU server with the transformers engine on the tiny model,
actors, writer). The CPU server runs in float32 (`llm.dtype=float32`, what `auto` picks on a CPU without native
bf16 anyway) so both sides compute with the same numerics and 1e-3 is a fair bound.
Marked slow: two whole-pipeline launches with the transformers engine (40-55 s each on the shared 2-core box);
the server's side of the convention (temperature, top-k/top-p, penalties) is checked fast in
tests/test_reference_server.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import FAST, assert_verl_agrees, launch, load_trajectories

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[0.7, 1.0], ids=["t0.7", "t1.0"])
def run_at(request, tmp_path_factory, tiny_model):
    out = tmp_path_factory.mktemp(f"temp{request.param}") / "run"
    result = launch(out, f"model_path={tiny_model}", *FAST, "max_samples=4", f"temperature={request.param}",
                    "llm.dtype=float32")
    assert result.returncode == 0, result.stderr[-3000:]
    return request.param, load_trajectories(out / "trajectories.pkl")


def test_rollout_log_probs_equal_verls_recomputation(run_at, tiny_model):
    temperature, data = run_at
    # What verl's log-prob pass reads (DataProto.to_tensordict hands meta_info to the engine as non-tensor data).
    assert data.meta_info["temperature"] == temperature
    from verl.utils import tensordict_utils as tu

    assert tu.get_non_tensor_data(data.to_tensordict(), "temperature", None) == temperature
    assert_verl_agrees(data, tiny_model, temperature)


def test_grpo_advantage_runs_on_trajectories_unchanged(run_at):
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage, compute_response_mask
    from verl.trainer.ppo.reward import extract_reward

    _, data = run_at
    n = 2
    assert torch.equal(compute_response_mask(data), data.batch["response_mask"])  # single turn: every token
    scores, _ = extract_reward(data)  # rm_scores, as the trainer takes them
    data.batch["token_level_scores"] = scores
    data.batch["token_level_rewards"] = scores
    data = compute_advantage(data, adv_estimator=AdvantageEstimator.GRPO, num_repeat=n)
    adv = data.batch["advantages"]
    assert adv.shape == data.batch["responses"].shape and torch.isfinite(adv).all()
    # Groups are the n samples of one prompt: one uid each, consecutive in the output.
    uids = data.non_tensor_batch["uid"]
    assert len(set(uids)) == len(uids) // n and all(uids[i] == uids[i - i % n] for i in range(len(uids)))
    total = scores.sum(-1)
    for uid in set(uids):
        rows = np.nonzero(uids == uid)[0]
        group = total[rows]
        want = (group - group.mean()) / (group.std() + 1e-6)
        got = (adv[rows] * data.batch["response_mask"][rows]).sum(-1) / data.batch["response_mask"][rows].sum(-1)
        assert torch.allclose(got, want, atol=1e-5), uid
