"""Which reward scores a row, from the run's config: what the launcher checks before any process starts,
and the order each actor picks a row's reward in.

The order (`RewardOrder`): `reward.verifier_url` (an HTTP verifier) or `custom_reward_function.path` (a
function, loaded by verl's own loader) score every row, as verl's custom reward function replaces its default
for every row; else a row of a task (`tasks=[...]`) gets its task's reward, by its data_source; else verl's
default_compute_score, for rows with a data_source and a ground truth (never for code data sources, whose
scorers run the generated program). Each is a `RewardSpec` (pipegen/config/schema.py), built here into a
verifier client or a function's pool.

Owns: the order above, building a RewardSpec into a reward, and the launch-time check of the reward settings
(a relative path made absolute, since children may run elsewhere; a missing file or function refused in one
line: the launcher loads the function once for this, as verl's trainer loads it in its driver).
Must never: score a sample outside an actor or the verifier (the launcher's load is only that check).
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping, Protocol
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf, open_dict

from pipegen.rewards.local import FunctionReward, load_function
from pipegen.rewards.protocol import ScoreRequest
from pipegen.rewards.verifier import VerifierReward
from pipegen.config.schema import Reward, RewardSpec

log = logging.getLogger("pipegen.actor")

# verl's default_compute_score executes the model's code for these unless a sandbox is configured
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")


class BuiltReward(Protocol):
    """A RewardSpec built: a function's pool or a verifier's client."""

    def describe(self) -> str: ...

    async def score(self, request: ScoreRequest) -> Any: ...

    async def close(self) -> None: ...


def reward_settings(cfg: DictConfig) -> Reward:
    """The run's reward.* as the schema's dataclass (a key an older run's saved config lacks keeps its default)."""
    given = OmegaConf.to_container(cfg.reward, resolve=True) if OmegaConf.is_config(cfg.get("reward")) else {}
    return Reward(**{f.name: given[f.name] for f in fields(Reward) if f.name in given})


def run_reward(cfg: DictConfig) -> RewardSpec | None:
    """The reward set for every row of the run (None: tasks' rewards, then verl's default)."""
    if cfg.reward.verifier_url:
        return RewardSpec(url=str(cfg.reward.verifier_url))
    crf = cfg.custom_reward_function
    if crf.path:
        return RewardSpec(str(crf.path), str(crf.name), _plain(crf.reward_kwargs))
    return None


def build_reward(spec: RewardSpec, settings: Reward) -> BuiltReward:
    """A verifier's client for a url, else the function's pool (no path: verl's default)."""
    if spec.url is not None:
        return VerifierReward(spec, settings)
    return FunctionReward(spec, settings)


class RewardOrder:
    """The reward of each row, in the order above: the whole run's, a task's by data_source, verl's default.

    `task_routes`: data_source -> its task's RewardSpec (None: verl's default), as tasks/materialize.py's
    task_rewards reads them from the run's task files; unused when the run sets a reward for every row."""

    def __init__(self, cfg: DictConfig, task_routes: Mapping[str, RewardSpec | None] | None = None):
        self.settings = reward_settings(cfg)
        whole_run = run_reward(cfg)
        self.everything = build_reward(whole_run, self.settings) if whole_run is not None else None
        self.by_source: dict[str, BuiltReward] = {}
        self.default: BuiltReward | None = None  # verl's default_compute_score, built on first use
        self._warned: set[str] = set()
        if self.everything is None:
            built: dict[str, BuiltReward] = {}
            for source, spec in (task_routes or {}).items():
                if spec is not None:
                    if repr(spec) not in built:  # tasks sharing one reward share its pool
                        built[repr(spec)] = build_reward(spec, self.settings)
                    self.by_source[source] = built[repr(spec)]

    def reward_for(self, row: Mapping[str, Any]) -> BuiltReward | None:
        """The reward that scores this row, None when it stays unscored. An actor asks once per unit and scores
        every piece of the unit with the answer (actor/scoring.py)."""
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
            self.warn_once(source, f"not scoring data_source={source}: verl would execute the generated code on "
                                   "this machine")
            return None
        if self.default is None:
            self.default = build_reward(RewardSpec(), self.settings)
        return self.default

    def warn_once(self, source: Any, line: str) -> None:
        if str(source) not in self._warned:
            self._warned.add(str(source))
            log.warning("%s", line)

    async def close(self) -> None:
        rewards = {id(r): r for r in [self.everything, self.default, *self.by_source.values()] if r is not None}
        for reward in rewards.values():
            await reward.close()


def _plain(value: Any) -> dict[str, Any]:
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    if not isinstance(value, dict):
        raise ValueError(f"custom_reward_function.reward_kwargs={value} is not a mapping: use "
                         "'+custom_reward_function.reward_kwargs.KEY=VALUE'")
    return value


def check_verifier_url(url: str, key: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{key}={url} is not an http(s) URL: use e.g. http://127.0.0.1:8000/score")


def resolve_reward_settings(cfg: DictConfig) -> None:
    """At launch: the reward function's file as an absolute path that exists, with the function in it
    (loaded with verl's loader, as verl's trainer loads it in its driver), and a well-formed verifier URL;
    otherwise one line naming the key and the fix."""
    if cfg.reward.verifier_url:
        check_verifier_url(str(cfg.reward.verifier_url), "reward.verifier_url")
        return
    crf = cfg.custom_reward_function
    if not crf.path:
        return
    path = str(crf.path)
    if not path.startswith("pkg://"):
        local = Path(os.path.expandvars(os.path.expanduser(path.removeprefix("file://"))))
        if not local.is_file():
            raise ValueError(f"custom_reward_function.path={path}: no such file; give the .py file holding "
                             f"{crf.name} (or pkg://your.module)")
        path = str(local.resolve())

    try:
        load_function(RewardSpec(path, str(crf.name), _plain(crf.reward_kwargs)))
    except AttributeError:
        raise ValueError(f"custom_reward_function.name={crf.name}: {path} has no such function; set "
                         "custom_reward_function.name=YOUR_FUNCTION") from None
    except (RuntimeError, ImportError) as e:
        cause = e.__cause__ or e
        raise ValueError(f"custom_reward_function.path={path} cannot be loaded: {type(cause).__name__}: "
                         f"{cause}") from None
    with open_dict(cfg):
        cfg.custom_reward_function.path = path
