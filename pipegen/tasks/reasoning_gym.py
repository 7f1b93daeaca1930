"""The reward of reasoning-gym tasks, as a verl reward function (`compute_score`): reasoning-gym's own
scorer for the entry's dataset, on the answer the model put inside <answer>...</answer> (reasoning-gym's
answer format, which its default system prompt asks for).

The generated entry travels in the row's `extra_info.entry` (JSON text: reasoning-gym's metadata differs
per dataset, and some scorers read it), so the score needs nothing but the row.

Owns: reading a reasoning-gym answer and scoring it.
Must never: download anything.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import orjson


@lru_cache(maxsize=None)
def _scorer(dataset: str) -> Callable[[str, dict], float]:
    """reasoning-gym builds a dataset object per get_score_answer_fn call: once per dataset here."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **_: Any) -> float:
    from reasoning_gym.utils import extract_answer

    entry = orjson.loads((extra_info or {})["entry"])
    answer = extract_answer(solution_str)
    if answer is None:  # no <answer> tag: reasoning-gym's scorers give nothing for a missing answer
        return 0.0
    return float(_scorer(entry["metadata"]["source_dataset"])(answer, entry))
