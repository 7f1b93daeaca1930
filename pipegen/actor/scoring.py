"""Scoring a finished trajectory the way verl's reward loop does: the decoded response handed to the
row's reward (rewards/spec.py's RewardOrder decides which), and the answer read as verl's
NaiveRewardManager reads it.

Owns: the row -> reward call mapping (data_source, the decoded text detokenize.py makes, ground_truth,
extra_info with num_turns and rollout_reward_scores as verl adds them) and where the score lands
(`reward_score`, and `extra_fields["reward_extra_info"]`, which verl's `_postprocess` puts into the batch's
non-tensor data).
Must never: give a row a score its reward did not return (a reward that fails raises RewardFailure and the
unit is recorded as failed), or run model-written code to score it (verl's default scorers execute the
generated program for code data sources: those rows stay unscored with one warning).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from pipegen.rewards.protocol import ScoreRequest, parse_result
from pipegen.rewards.spec import RewardOrder
from pipegen.rewards.verifier import VerifierReward


class Scorer:
    """The run's rewards (rewards/spec.py's RewardOrder), applied the way verl's reward loop applies them."""

    def __init__(self, cfg: DictConfig, tokenizer):
        from pipegen.actor.detokenize import response_decoder

        self.decode = response_decoder(tokenizer)  # = tokenizer.decode(ids, skip_special_tokens=True), faster
        task_routes = None
        if cfg.get("tasks"):
            from pipegen.tasks.materialize import task_rewards

            files = cfg.data.train_files
            task_routes = task_rewards(list(cfg.tasks), [files] if isinstance(files, str) else list(files))
        self.order = RewardOrder(cfg, task_routes)

    def applies(self, row: dict[str, Any]) -> bool:
        return self.order.reward_for(row) is not None

    def remote_capacity(self, row: dict[str, Any]) -> int:
        """Samples the row's reward checks at once elsewhere (an HTTP verifier); 0 when this machine scores it."""
        reward = self.order.reward_for(row)
        return reward.capacity if isinstance(reward, VerifierReward) else 0

    async def score(self, output, row: dict[str, Any]) -> None:
        """Set output.reward_score and extra_fields['reward_extra_info']; a RewardFailure propagates."""
        reward = self.order.reward_for(row)
        if reward is None:
            return
        reward_model = row.get("reward_model") or {}
        extra = dict(row.get("extra_info") or {})
        extra.update(num_turns=output.num_turns, rollout_reward_scores={})
        request = ScoreRequest(data_source=row.get("data_source"), solution_str=self.decode(output.response_ids),
                               ground_truth=reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
                               extra_info=extra)
        try:
            result = await reward.score(request)
        except NotImplementedError:
            source = row.get("data_source")
            self.order.warn_once(source, f"verl has no scorer for data_source={source}: its rows stay unscored")
            return  # verl knows no scorer for this data_source: leave the row unscored
        output.reward_score, output.extra_fields["reward_extra_info"] = parse_result(result, reward.describe())

    async def close(self) -> None:
        await self.order.close()
