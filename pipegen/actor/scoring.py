"""Scoring a finished unit the way verl's reward loop does: each trajectory's decoded response handed to the
row's reward (rewards/spec.py's RewardOrder decides which, looked up once per unit), the answer read as verl's
NaiveRewardManager reads it, and a multi-trajectory unit's pieces scored by the run's one rule
(`rows.reward`): `own`, every piece on its own (the fork's way: a piece whose loop set `reward_score` keeps it),
or `final`, the final piece's reward copied to every piece (verl V1's TQ worker).

Owns: the row -> reward call mapping (data_source, the decoded text detokenize.py makes, ground_truth,
extra_info with num_turns and rollout_reward_scores as verl adds them), the per-piece rule, and where the
score lands (`reward_score`; `extra_fields["reward_extra_info"]`, which verl's `_postprocess` puts into the
batch's non-tensor data; `extra_fields["reward_rule"]`, which rule gave the row its reward: `own`, `loop`
(the loop's own score), `final` (copied from the final piece) or null (unscored)).
Must never: give a row a score its reward did not return (a reward that fails raises RewardFailure and the
unit is recorded as failed), or run model-written code to score it (verl's default scorers execute the
generated program for code data sources: those rows stay unscored with one warning).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, Sequence

from omegaconf import DictConfig

from pipegen.config.schema import Rows
from pipegen.rewards.protocol import ScoreRequest, parse_result
from pipegen.rewards.spec import BuiltReward, RewardOrder
from pipegen.rewards.verifier import VerifierReward
from pipegen.run.provenance import FINAL, LOOP, OWN
from pipegen.run.stream import PieceKeys



class Piece(Protocol):
    """What scoring reads and sets of a trajectory: verl's AgentLoopOutput, or a kept record's (`KeptPiece`)."""

    response_ids: list[int]
    num_turns: int
    reward_score: float | None
    extra_fields: dict[str, Any]


class KeptPiece:
    """A kept record's trajectory (its JSON dict) as a Piece: what scoring sets lands in the dict itself."""

    def __init__(self, trajectory: dict[str, Any]):
        self.trajectory = trajectory
        self.response_ids = trajectory["response_ids"]
        self.num_turns = trajectory.get("num_turns") or 0
        extra = trajectory.get("extra_fields")
        self.extra_fields = trajectory["extra_fields"] = dict(extra) if extra else {}

    @property
    def reward_score(self) -> float | None:
        return self.trajectory.get("reward_score")

    @reward_score.setter
    def reward_score(self, value: float | None) -> None:
        self.trajectory["reward_score"] = value


def unit_rule(cfg: DictConfig) -> str:
    """The run's rows.reward (an older run's saved config lacks the group: its default)."""
    return str((cfg.get("rows") or {}).get("reward", Rows.reward))


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
        self.rule = unit_rule(cfg)

    def reward_for(self, row: dict[str, Any]) -> BuiltReward | None:
        """The row's reward (None: it stays unscored): asked once per unit, then handed to the calls below."""
        return self.order.reward_for(row)

    @staticmethod
    def remote_capacity(reward: BuiltReward) -> int:
        """Samples the reward checks at once elsewhere (an HTTP verifier); 0 when this machine scores it."""
        return reward.capacity if isinstance(reward, VerifierReward) else 0

    async def score_pieces(self, pieces: Sequence[Piece], row: dict[str, Any], reward: BuiltReward | None) -> None:
        """Every piece of one unit scored by the run's rule, each with its `reward_rule`; the pieces are scored
        together (a verifier batches them). A RewardFailure propagates once every piece's call has ended."""
        own = [p for p in pieces if p.reward_score is None]
        if self.rule == FINAL:
            own = own[-1:] if own and own[-1] is pieces[-1] else []
        for p in pieces:
            p.extra_fields[PieceKeys.REWARD_RULE] = LOOP if p.reward_score is not None else None
        if reward is not None and own:
            results = await asyncio.gather(*(self.score(p, row, reward) for p in own), return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:  # the unit keeps no score (its record is scored again, whole, next launch)
                for p in own:
                    p.reward_score = None
                    p.extra_fields.pop("reward_extra_info", None)
                raise failed
        for p in own:
            if p.reward_score is not None:
                p.extra_fields[PieceKeys.REWARD_RULE] = OWN
        if self.rule == FINAL:  # verl V1: every piece takes the final piece's reward, whatever it held
            last = pieces[-1]
            for p in pieces[:-1]:
                p.reward_score = last.reward_score
                p.extra_fields[PieceKeys.REWARD_RULE] = FINAL if last.reward_score is not None else None
                if "reward_extra_info" in last.extra_fields:
                    p.extra_fields["reward_extra_info"] = last.extra_fields["reward_extra_info"]

    async def score(self, output: Piece, row: dict[str, Any], reward: BuiltReward) -> None:
        """Set output.reward_score and extra_fields['reward_extra_info']; a RewardFailure propagates."""
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

