"""Which reward scored a row: the reward's fingerprint, and the columns a rescored run carries.

The fingerprint is the reward's part of the resume guard's fingerprint (run/fingerprint.py: the verifier URL,
or the function's path, name, kwargs and file digest, and the task names), digested. A row rescored by
`pipegen rescore` carries it in `reward_by` ("<what> @ <digest>"), with the score it had before in
`previous_score` and the reward that gave that in `previous_reward_by`. A row without `reward_by` was scored
when it was generated, by the reward `generation_reward` names.

A row whose agent loop scored it itself (an external harness's returned reward, a verl loop's `reward_score`)
carries `reward_rule` `loop` (the values of a row's `reward_rule` are named here: `OWN`, `FINAL`, `LOOP`), and
`loop_reward` names who scored it.

Owns: those three column names and the text in them (written by `pipegen rescore`, read by the report and the
dataset card), the reward_rule values, and how the external loop's harness is named in them. Must never: read or
write a run's data files.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from omegaconf import DictConfig

from pipegen.config.schema import uses_external_loop
from pipegen.run.fingerprint import compute_fingerprint

REWARD_BY = "reward_by"  # the reward that gave the row its current score
PREVIOUS_SCORE = "previous_score"  # the row's score before its last rescore (None: it had none)
PREVIOUS_REWARD_BY = "previous_reward_by"  # the reward that gave previous_score
COLUMNS = (REWARD_BY, PREVIOUS_SCORE, PREVIOUS_REWARD_BY)
AT_GENERATION = "at generation"
OWN, FINAL, LOOP = "own", "final", "loop"  # the values of a row's reward_rule (null: unscored), set by actor/scoring.py


def reward_part(fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """The reward's part of a run fingerprint (empty: verl's default scorer, no task)."""
    fp = fingerprint or {}
    return {k: fp[k] for k in ("reward", "tasks") if k in fp}


def digest(part: dict[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(part, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]


def describe(part: dict[str, Any]) -> str:
    """The reward in words, then its fingerprint: what a person reads in reward_by."""
    reward = part.get("reward") or {}
    if reward.get("verifier_url"):
        what = f"verifier {reward['verifier_url']}"
    elif reward.get("reward_function"):
        fn = reward["reward_function"]
        what = f"{fn.get('name')} in {str(fn.get('path')).rsplit('/', 1)[-1]}"
    elif part.get("tasks"):
        what = f"the rewards of tasks {', '.join(map(str, part['tasks']))}"
    else:
        what = "verl's default_compute_score"
    return f"{what} @ {digest(part)}"


def current_reward(cfg: DictConfig) -> str:
    """reward_by for a row scored now, with this config's reward (its file as it is on disk now)."""
    return describe(reward_part(orjson.loads(orjson.dumps(compute_fingerprint(cfg)))))


def generation_reward(stored: dict[str, Any] | None) -> str:
    """previous_reward_by for a row scored when it was generated: the run's stored fingerprint's reward."""
    return f"{describe(reward_part(stored))} ({AT_GENERATION})"


def harness_named(cfg: DictConfig) -> str:
    """The external loop's harness as the user set it: `external.harness=...`, or `external.command`."""
    return f"external.harness={cfg.external.harness}" if cfg.external.harness else "external.command"


def loop_reward(cfg: DictConfig) -> str:
    """Who scored a row its agent loop scored itself (reward_rule `loop`), at generation."""
    own = f"what {harness_named(cfg)} returned" if uses_external_loop(cfg) else "the agent loop's own reward_score"
    return f"{own} ({AT_GENERATION})"
