"""Scoring a finished trajectory with verl's `default_compute_score`, the way verl's reward loop does.

Owns: deciding whether a row can be scored (a `data_source` and a `reward_model.ground_truth`), the
decoded text handed to verl's scorer (detokenize.py makes it), and where the score lands (`reward_score`, and
`extra_fields["reward_extra_info"]` as verl's reward loop sets it).
Must never: run model-written code to score it: verl's scorers execute the generated program for
code data sources, so those rows stay unscored with one warning.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("pipegen.actor")

# verl's default_compute_score executes the model's code for these unless a sandbox is configured
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
INLINE_BUDGET_S = 0.0005  # a data source scored faster than this on average is scored on the event loop
INLINE_AFTER = 16  # scorings timed (in a worker thread) before a data source may be scored inline


class Scorer:
    """verl's default_compute_score, applied the way verl's reward loop applies it."""

    def __init__(self, tokenizer):
        from verl.utils.reward_score import default_compute_score

        from pipegen.actor.detokenize import response_decoder

        self.tokenizer = tokenizer
        self.decode = response_decoder(tokenizer)  # = tokenizer.decode(ids, skip_special_tokens=True), faster
        self.compute = default_compute_score
        self._warned: set[str] = set()
        self._cost: dict[str, tuple[int, float]] = {}  # data_source -> (scorings, seconds)

    def cheap(self, row: dict[str, Any]) -> bool:
        """Whether this row's data source has proven cheap enough to score without a thread hop (regex
        scorers such as gsm8k take tens of microseconds; sympy-based ones do not)."""
        count, seconds = self._cost.get(row.get("data_source"), (0, 0.0))
        return count >= INLINE_AFTER and seconds / count < INLINE_BUDGET_S

    def applies(self, row: dict[str, Any]) -> bool:
        reward_model = row.get("reward_model") or {}
        source = row.get("data_source")
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model or not source:
            return False
        if source in CODE_DATA_SOURCES:
            if source not in self._warned:
                self._warned.add(source)
                log.warning("not scoring data_source=%s: verl would execute the generated code on this machine", source)
            return False
        return True

    def score(self, output, row: dict[str, Any]) -> None:
        """Set output.reward_score and extra_fields['reward_extra_info'] (NotImplementedError: unscored)."""
        if not self.applies(row):
            return
        started = time.perf_counter()
        try:
            self._score(output, row)
        finally:
            count, seconds = self._cost.get(row["data_source"], (0, 0.0))
            self._cost[row["data_source"]] = (count + 1, seconds + time.perf_counter() - started)

    def _score(self, output, row: dict[str, Any]) -> None:
        reward_model = row["reward_model"]
        text = self.decode(output.response_ids)
        extra = dict(row.get("extra_info") or {})
        extra.update(num_turns=output.num_turns, rollout_reward_scores={})
        try:
            result = self.compute(row["data_source"], text, reward_model["ground_truth"], extra_info=extra)
        except NotImplementedError:
            if row["data_source"] not in self._warned:
                self._warned.add(row["data_source"])
                log.warning("verl has no scorer for data_source=%s: its rows stay unscored", row["data_source"])
            return  # verl knows no scorer for this data_source: leave the row unscored
        if isinstance(result, dict):
            output.reward_score = float(result["score"])
            output.extra_fields["reward_extra_info"] = result
        else:
            output.reward_score = float(result)
            output.extra_fields["reward_extra_info"] = {"acc": float(result)}
