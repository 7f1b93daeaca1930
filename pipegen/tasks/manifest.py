"""A task's manifest: its name, its data (verl-layout parquet files, or a generator with a size and a
seed), how a generated question becomes a prompt, its reward, and its defaults for pipegen's keys.

```yaml
name: gsm_symbolic                       # what tasks=[...] names
description: grade-school maths word problems, symbolic variants (reasoning-gym)
data_source: gsm_symbolic                # every row's data_source (default: the name); rows are scored by it
data:
  generator: reasoning_gym               # or "path/to/gen.py:function" / "pkg://module:function"
  dataset: gsm_symbolic                  # the generator's dataset
  size: 500                              # rows
  seed: 0                                # same seed, same rows
  config: {}                             # the generator's keyword arguments
  # files: [my.parquet]                  # instead of a generator: verl-layout parquet files
prompt:
  system: "..."                          # a system message before the question (none when absent)
  template: "{question}"                 # the user message
reward:                                  # verl's custom_reward_function keys, or url: (an HTTP verifier)
  path: pkg://pipegen.tasks.reasoning_gym
  name: compute_score
defaults: {n: 4, max_response_length: 1024}   # used unless the command line sets the key
```

A task is named on the command line by its manifest's name (the built-in ones, `builtin/*.yaml`) or by
the path of a manifest file (`tasks=[./my_task.yaml]`); relative paths in a manifest are relative to it.

Owns: the manifest's keys and their check (one line naming the file and the key), finding a task by name
or path, and applying a task's defaults to a composed config.
Must never: import verl or torch, or read the data (materialize.py does).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from pipegen.config.overrides import keys_set
from pipegen.config.schema import RewardSpec  # a manifest's reward: is the run's one reward shape

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
MANIFEST_SUFFIXES = (".yaml", ".yml")
# pipegen's keys a task may give a default for (its data's natural settings); the command line wins
DEFAULT_KEYS = ("n", "max_samples", "max_prompt_length", "max_response_length", "temperature")
LENGTH_KEYS = ("max_prompt_length", "max_response_length")  # tasks run together get the longest they give


class TaskError(ValueError):
    """A task that cannot be used, as one line naming the manifest and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataSpec(_Strict):
    files: Optional[list[str]] = None
    generator: Optional[str] = None
    dataset: Optional[str] = None
    size: int = 500
    seed: int = 0
    config: dict[str, Any] = {}

    @model_validator(mode="after")
    def _one_source(self) -> "DataSpec":
        if (self.files is None) == (self.generator is None):
            raise ValueError("data needs either files: [...] or generator: ... (one of them)")
        if self.size < 1:
            raise ValueError("data.size must be >= 1")
        return self


class PromptSpec(_Strict):
    system: Optional[str] = None
    template: str = "{question}"


class TaskManifest(_Strict):
    name: str
    description: str = ""
    data_source: Optional[str] = None
    data: DataSpec
    prompt: Optional[PromptSpec] = None
    reward: Optional[RewardSpec] = None  # None: verl's default_compute_score, by each row's data_source
    defaults: dict[str, Any] = {}
    source: str = ""  # where the manifest was read ("built-in" or its path); set by the loader

    @field_validator("defaults")
    @classmethod
    def _known_defaults(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(DEFAULT_KEYS))
        if unknown:
            raise ValueError(f"defaults: {unknown} are not task defaults; allowed: {list(DEFAULT_KEYS)}")
        return value

    @field_validator("reward")
    @classmethod
    def _reward_named(cls, value: Optional[RewardSpec]) -> Optional[RewardSpec]:
        if value is not None and value.path is None and value.url is None:
            raise ValueError("reward needs either path: (a verl reward function) or url: (a verifier)")
        return value

    @model_validator(mode="after")
    def _prompt_only_for_generated(self) -> "TaskManifest":
        if self.prompt is not None and self.data.files is not None:
            raise ValueError("prompt: applies to generated data; rows of data.files keep their own prompt")
        return self

    @property
    def row_source(self) -> str:
        """The data_source its generated rows carry (files keep theirs unless data_source is set)."""
        return self.data_source or self.name


def _resolve_relative(manifest: dict[str, Any], base: Path) -> dict[str, Any]:
    """Paths in a manifest file are relative to the file (pkg:// and absolute paths stay)."""
    def fix(p: str) -> str:
        if p.startswith("pkg://") or os.path.isabs(os.path.expanduser(p)):
            return os.path.expanduser(p)
        if p.startswith("file://"):
            p = p[len("file://"):]
        return str((base / p).resolve())

    data = dict(manifest.get("data") or {})
    if isinstance(data.get("files"), list):
        data["files"] = [fix(str(f)) for f in data["files"]]
    gen = data.get("generator")
    if isinstance(gen, str) and ":" in gen and not gen.startswith("pkg://"):
        path, _, func = gen.rpartition(":")
        data["generator"] = f"{fix(path)}:{func}"
    reward = dict(manifest.get("reward") or {})
    if isinstance(reward.get("path"), str):
        reward["path"] = fix(reward["path"])
    out = dict(manifest)
    if data:
        out["data"] = data
    if reward:
        out["reward"] = reward
    return out


def read_manifest(path: Path, source: str | None = None) -> TaskManifest:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise TaskError(f"task manifest {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise TaskError(f"task manifest {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise TaskError(f"task manifest {path}: a manifest is a mapping (name:, data:, reward: ...)")
    raw = _resolve_relative(raw, path.resolve().parent)
    try:
        return TaskManifest.model_validate({**raw, "source": source or str(path.resolve())})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "manifest"
        raise TaskError(f"task manifest {path}: {where}: {err['msg']}") from None


def builtin_manifests() -> dict[str, TaskManifest]:
    out = {}
    for path in sorted(BUILTIN_DIR.glob("*.yaml")):
        m = read_manifest(path, source="built-in")
        out[m.name] = m
    return out


def is_manifest_path(item: str) -> bool:
    return item.endswith(MANIFEST_SUFFIXES) or os.sep in item


def find_task(item: str) -> TaskManifest:
    """A task by its built-in name or by its manifest file's path."""
    item = str(item).strip()
    if is_manifest_path(item):
        path = Path(os.path.expandvars(os.path.expanduser(item)))
        if not path.is_file():
            raise TaskError(f"tasks: no manifest file {item}; name a built-in task (python -m pipegen.tasks) "
                            "or an existing .yaml manifest")
        return read_manifest(path)
    builtin = builtin_manifests()
    if item not in builtin:
        raise TaskError(f"tasks: no task named '{item}'; built-in: {', '.join(sorted(builtin))} "
                        "(python -m pipegen.tasks lists them; a manifest file adds yours: tasks=[./my_task.yaml])")
    return builtin[item]


def find_tasks(items: list[str]) -> list[TaskManifest]:
    tasks = [find_task(i) for i in items]
    names = [t.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TaskError(f"tasks: {repeated[0]} is named twice; name each task once")
    return tasks


def task_defaults(tasks: list[TaskManifest], given: set[str]) -> dict[str, Any]:
    """The tasks' defaults for keys the command line does not set: the longest of their lengths; two tasks
    that disagree on any other key the command line leaves open are refused, naming it."""
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for task in tasks:
        for key, value in task.defaults.items():
            if key in given:
                continue
            if key in out and key in LENGTH_KEYS:
                value = max(out[key], value)
            elif key in out and out[key] != value:
                raise TaskError(f"tasks {owner[key]} and {task.name} set different defaults for {key} "
                                f"({out[key]} vs {value}): set {key}=... on the command line")
            out[key], owner[key] = value, task.name
    return out


def overridden_keys(overrides: list[str]) -> set[str]:
    """The keys a Hydra override list sets (`key=value`, `+key=value`, `++key=value`)."""
    return keys_set(overrides)


def apply_task_defaults(cfg, overrides: list[str]) -> None:
    """Set the tasks' defaults on a composed config (pipegen's root keys, which verl's keys follow by
    interpolation), unless an override sets them."""
    items = list(cfg.get("tasks") or [])
    if not items:
        return
    for key, value in task_defaults(find_tasks(items), overridden_keys(overrides)).items():
        cfg[key] = value

