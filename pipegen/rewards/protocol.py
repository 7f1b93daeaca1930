"""What a reward is asked and what it answers: one definition for the actor, the process pool, the verifier
client and `python -m pipegen.rewards.serve`.

A request is verl's reward call, as verl's reward manager makes it: `compute_score(data_source=,
solution_str=, ground_truth=, extra_info=)`. An answer is what verl accepts from that call: a number, or a
dict holding "score" and any extras (verl puts every key of the dict, "score" included, into the batch's
non-tensor data; a bare number becomes {"acc": score}).

The verifier's wire format (HTTP POST to `reward.verifier_url`, JSON both ways):
  request  {"requests": [{"data_source": ..., "solution_str": ..., "ground_truth": ..., "extra_info": {...}}, ...]}
  answer   {"results": [0.0 | {"score": 1.0, ...} | {"error": "why this one could not be scored"}, ...]}
one result per request, in order. A non-2xx status fails the whole request (retried if it may pass later).

Owns: the request and answer shapes, turning an answer into (score, extras) as verl's NaiveRewardManager
does, and `RewardFailure`.
Must never: invent a score for a sample that was not scored.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any


class RewardFailure(RuntimeError):
    """A sample's reward could not be computed (the function raised, the verifier failed or timed out)."""


@dataclass(slots=True)
class ScoreRequest:
    """verl's reward call for one trajectory (the keyword arguments of compute_score)."""

    data_source: Any
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        return asdict(self)


def parse_result(result: Any, where: str) -> tuple[float, dict[str, Any]]:
    """verl's reading of compute_score's return (NaiveRewardManager.run_single): a dict gives its "score"
    and every key as an extra; a number gives itself and {"acc": score}. Anything else, an {"error": ...}
    answer, or a score that is not a finite number, is a RewardFailure naming `where`."""
    if isinstance(result, dict):
        if "error" in result and "score" not in result:
            raise RewardFailure(f"{where}: {result['error']}")
        if "score" not in result:
            raise RewardFailure(f"{where} returned a dict without 'score' (keys: {sorted(result)[:8]}); "
                                "verl reads result['score']")
        score, extras = result["score"], dict(result)
    else:
        score, extras = result, None
    if not isinstance(score, numbers.Real) or not math.isfinite(float(score)):  # bools too, as verl takes them
        raise RewardFailure(f"{where} returned {score!r} as the score; a reward is a finite number")
    score = float(score)
    return score, extras if extras is not None else {"acc": score}
