"""Which reward scores a row, from the run's config: what the launcher checks before any process starts,
and what each actor builds its rewards from.

In order: `reward.verifier_url` (an HTTP verifier) or `custom_reward_function.path` (a function, loaded by
verl's own loader) score every row, as verl's custom reward function replaces its default for every row;
else a row of a task (`tasks=[...]`) gets its task's reward, by its data_source; else verl's
default_compute_score, for rows with a data_source and a ground truth (never for code data sources, whose
scorers run the generated program).

Owns: the order above and the launch-time check of the reward settings (a relative path made absolute,
since children may run elsewhere; a missing file or function refused in one line).
Must never: load a reward function in a process that does not score (the launcher only checks it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf, open_dict

from pipegen.rewards.local import FunctionSpec, load_function
from pipegen.rewards.verifier import VerifierSpec

# verl's default_compute_score executes the model's code for these unless a sandbox is configured
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")

RewardSettings = FunctionSpec | VerifierSpec


def verifier_spec(cfg: DictConfig, url: str) -> VerifierSpec:
    r = cfg.reward
    return VerifierSpec(url=url, timeout_s=float(r.verifier_timeout_s), attempts=int(r.verifier_attempts),
                        batch=int(r.verifier_batch), concurrency=int(r.verifier_concurrency))


def run_reward(cfg: DictConfig) -> RewardSettings | None:
    """The reward set for every row of the run (None: tasks' rewards, then verl's default)."""
    if cfg.reward.verifier_url:
        return verifier_spec(cfg, str(cfg.reward.verifier_url))
    crf = cfg.custom_reward_function
    if crf.path:
        return FunctionSpec(str(crf.path), str(crf.name), _plain(crf.reward_kwargs))
    return None


def task_reward(cfg: DictConfig, spec: Any) -> RewardSettings | None:
    """A task manifest's reward (tasks/manifest.py RewardSpec) as settings; None: verl's default."""
    if spec is None:
        return None
    if spec.url:
        return verifier_spec(cfg, spec.url)
    return FunctionSpec(spec.path, spec.name, dict(spec.reward_kwargs))


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
        load_function(FunctionSpec(path, str(crf.name), _plain(crf.reward_kwargs)))
    except AttributeError:
        raise ValueError(f"custom_reward_function.name={crf.name}: {path} has no such function; set "
                         "custom_reward_function.name=YOUR_FUNCTION") from None
    except (RuntimeError, ImportError) as e:
        cause = e.__cause__ or e
        raise ValueError(f"custom_reward_function.path={path} cannot be loaded: {type(cause).__name__}: "
                         f"{cause}") from None
    with open_dict(cfg):
        cfg.custom_reward_function.path = path
