"""Scoring a finished trajectory the way verl's reward loop does: the decoded response handed to the
row's reward (rewards/spec.py decides which), and the answer read as verl's NaiveRewardManager reads it.

Owns: the row -> reward call mapping (data_source, the decoded text detokenize.py makes, ground_truth,
extra_info with num_turns and rollout_reward_scores as verl adds them) and where the score lands
(`reward_score`, and `extra_fields["reward_extra_info"]`, which verl's `_postprocess` puts into the batch's
non-tensor data).
Must never: give a row a score its reward did not return (a reward that fails raises RewardFailure and the
unit is recorded as failed), or run model-written code to score it (verl's default scorers execute the
generated program for code data sources: those rows stay unscored with one warning).
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from pipegen.rewards.local import FunctionReward, FunctionSpec
from pipegen.rewards.protocol import ScoreRequest, parse_result
from pipegen.rewards.spec import CODE_DATA_SOURCES, RewardSettings, run_reward, task_reward
from pipegen.rewards.verifier import VerifierReward, VerifierSpec

log = logging.getLogger("pipegen.actor")


def build_reward(settings: RewardSettings, processes: int, timeout_s: float):
    if isinstance(settings, VerifierSpec):
        return VerifierReward(settings)
    return FunctionReward(settings, processes, timeout_s)


class Scorer:
    """The run's rewards, applied the way verl's reward loop applies them."""

    def __init__(self, cfg: DictConfig, tokenizer):
        from pipegen.actor.detokenize import response_decoder

        self.decode = response_decoder(tokenizer)  # = tokenizer.decode(ids, skip_special_tokens=True), faster
        processes, timeout_s = int(cfg.reward.processes), float(cfg.reward.timeout_s)
        whole_run = run_reward(cfg)
        self.everything = build_reward(whole_run, processes, timeout_s) if whole_run is not None else None
        self.by_source: dict[str, Any] = {}  # a task's rows: data_source -> its task's reward
        self.default = None  # verl's default_compute_score, built on first use
        self._local = (processes, timeout_s)
        if self.everything is None and cfg.get("tasks"):
            from pipegen.tasks.materialize import task_rewards

            files = cfg.data.train_files
            built: dict[Any, Any] = {}
            for source, spec in task_rewards(list(cfg.tasks), [files] if isinstance(files, str) else list(files)).items():
                settings = task_reward(cfg, spec)
                if settings is not None:
                    if repr(settings) not in built:  # tasks sharing one reward share its pool
                        built[repr(settings)] = build_reward(settings, processes, timeout_s)
                    self.by_source[source] = built[repr(settings)]
        self._warned: set[str] = set()

    def reward_for(self, row: dict[str, Any]):
        """The reward that scores this row, None when it stays unscored."""
        if self.everything is not None:
            return self.everything
        source = row.get("data_source")
        reward = self.by_source.get(source)
        if reward is not None:
            return reward
        reward_model = row.get("reward_model") or {}
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model or not source:
            return None
        if source in CODE_DATA_SOURCES:
            if source not in self._warned:
                self._warned.add(source)
                log.warning("not scoring data_source=%s: verl would execute the generated code on this machine", source)
            return None
        if self.default is None:
            self.default = FunctionReward(FunctionSpec(), *self._local)
        return self.default

    def applies(self, row: dict[str, Any]) -> bool:
        return self.reward_for(row) is not None

    def remote_capacity(self, row: dict[str, Any]) -> int:
        """Samples the row's reward checks at once elsewhere (an HTTP verifier); 0 when this machine scores it."""
        reward = self.reward_for(row)
        return reward.capacity if isinstance(reward, VerifierReward) else 0

    async def score(self, output, row: dict[str, Any]) -> None:
        """Set output.reward_score and extra_fields['reward_extra_info']; a RewardFailure propagates."""
        reward = self.reward_for(row)
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
            source = str(row.get("data_source"))
            if source not in self._warned:
                self._warned.add(source)
                log.warning("verl has no scorer for data_source=%s: its rows stay unscored", source)
            return  # verl knows no scorer for this data_source: leave the row unscored
        output.reward_score, output.extra_fields["reward_extra_info"] = parse_result(result, reward.describe())

    async def close(self) -> None:
        rewards = {id(r): r for r in [self.everything, self.default, *self.by_source.values()] if r is not None}
        for reward in rewards.values():
            await reward.close()
