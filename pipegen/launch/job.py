"""A command line turned into the job's one resolved config: what a launch runs and what `--help` lists.

In order: a config file's keys (`--config-path/--config-name`, config/config_file.py) put before the command
line's; the engine chosen (launch/engine_choice.py: llm= as given, else verl's rollout.name, else what this
machine has); verl's own keys translated (config/verl_keys.py); pipegen's and verl's keys composed with the
overrides (config/compose.py), then the named tasks' defaults wherever an override does not set the key
(`compose_job`, which `--help` lists too); every key's type and rule checked; output_dir=s3://... made storage.url
with this node's scratch folder as output_dir (a scheme pipegen does not speak is refused); output_dir made
absolute (a file is refused); the inputs' short names made real paths (the model, the demo set, each task's file in
the run, computed in memory; a harness's file made absolute); the config resolved (`resolve_job`). Each refusal is
one line naming the fix.

Owns: the order above. Must never: write into the run directory (the task files are handed to prepare, which
writes them once it holds the run's lock and the resume guard has passed), load the user's reward function
(prepare does), or import verl.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, open_dict
from omegaconf.errors import OmegaConfBaseException

from pipegen.config.compose import check_types, compose, describe_config_error, resolved
from pipegen.config.config_file import expand as expand_config_file
from pipegen.config.verl_keys import translate_with_notes
from pipegen.gateway.harness import absolute_target
from pipegen.inputs.demo import resolve_train_files
from pipegen.inputs.models import resolve_model_path
from pipegen.launch.engine_choice import choose_engine
from pipegen.run.layout import RunDir
from pipegen.run.store import StoreRefused, StoreUrl, default_scratch, is_store_url
from pipegen.tasks.manifest import apply_task_defaults
from pipegen.tasks.materialize import TaskData, task_files


class JobRefused(ValueError):
    """A command line that names no runnable job: one line naming the fix."""


@dataclass
class Job:
    """The job a command line names: its resolved config, its run directory, and the task files the config
    names, computed but not yet written."""

    cfg: DictConfig  # every key a value, every input a real path
    run: RunDir
    tasks: list[TaskData]  # [] without tasks=[...]
    engine_reason: str = ""  # why this engine, for the plan line (launch/engine_choice.py)
    notes: tuple[str, ...] = ()  # what verl's (or the seed's) keys were taken to mean, under the plan line

    @property
    def pending(self) -> dict[str, bytes]:
        """{path: bytes} of the task files, for the fingerprint of a launch that has not written them."""
        return {str(t.path): t.data for t in self.tasks}


def compose_job(argv: list[str]) -> DictConfig:
    """The config as the command line composes it: its engine chosen, verl's keys translated, pipegen's and verl's keys with the
    overrides, then the named tasks' defaults (n, lengths) wherever an override does not set the key. Raises
    ValueError (a refused verl key, a task) or Hydra's and OmegaConf's errors."""
    return with_task_defaults(translate_with_notes(choose_engine(expand_config_file(list(argv))).overrides)[0])


def with_task_defaults(overrides: list[str]) -> DictConfig:
    cfg = compose(overrides)
    if cfg.get("tasks"):
        apply_task_defaults(cfg, overrides)
    return cfg


def resolve_job(argv: list[str]) -> Job:
    """The launch's one resolved config from its command line (`key=value` overrides; without output_dir or
    trainer.default_local_dir the run's folder is verl's outputs/<project_name>/<experiment_name>).
    Raises JobRefused with one line naming the fix."""
    try:
        argv = expand_config_file(list(argv))  # --config-path/--config-name: the file's keys, as overrides
        choice = choose_engine(argv)  # llm= as given, else verl's rollout.name, else what this machine has
        overrides, notes = translate_with_notes(choice.overrides)  # verl's keys: pipegen's equivalents, or refused
    except ValueError as e:
        raise JobRefused(str(e)) from None
    try:
        cfg = with_task_defaults(overrides)
    except Exception as e:  # Hydra's override errors are long: one line naming the key and the fix
        raise JobRefused(describe_config_error(e, overrides)) from None
    try:
        check_types(cfg)  # every key, output_dir first among them, before any path is resolved
        with open_dict(cfg):
            cfg.output_dir = scratch_for_store(cfg)
        run = RunDir(Path(cfg.output_dir).expanduser().resolve())
        if run.root.exists() and not run.root.is_dir():
            raise JobRefused(f"output_dir={run.root} is a file; output_dir names a directory (new or a run's): "
                             f"pick another path")
        with open_dict(cfg):
            cfg.output_dir = str(run.root)
        tasks = resolve_inputs(cfg)
        return Job(resolved(cfg), run, tasks, choice.reason, tuple(dict.fromkeys(notes)))
    except (ValueError, RuntimeError) as e:
        raise JobRefused(str(e)) from None
    except OmegaConfBaseException as e:  # an interpolation that cannot resolve, a missing value (llm.urls)
        raise JobRefused(describe_config_error(e, overrides)) from None


def scratch_for_store(cfg: DictConfig) -> str:
    """output_dir=s3://bucket/prefix alone: the store becomes storage.url and output_dir this node's scratch folder
    (storage.scratch_dir, or a default under ~/.cache). A URL pipegen does not speak is refused in one line."""
    output_dir, url = str(cfg.output_dir), cfg.storage.url
    try:
        if url:
            StoreUrl.parse(str(url))
        if not is_store_url(output_dir):
            return output_dir
        StoreUrl.parse(output_dir)
    except StoreRefused as e:
        raise JobRefused(str(e)) from None
    if url and str(url).rstrip("/") != output_dir.rstrip("/"):
        raise JobRefused(f"output_dir={output_dir} and storage.url={url} name two stores: give one of them (with "
                         "storage.url, output_dir is this node's scratch folder)")
    cfg.storage.url = output_dir
    return str(cfg.storage.scratch_dir or default_scratch(output_dir))


def resolve_inputs(cfg: DictConfig) -> list[TaskData]:
    """Short names -> real paths, so every child reads concrete paths from the saved config. Returns the
    task files the config now names (computed, not written)."""
    tasks: list[TaskData] = []
    with open_dict(cfg):
        model = resolve_model_path(str(cfg.actor_rollout_ref.model.path))
        cfg.model_path = model
        cfg.actor_rollout_ref.model.path = model
        files = cfg.data.train_files
        if cfg.tasks:  # each task's rows, as a file of the run directory (pipegen/tasks/materialize.py)
            tasks = task_files(cfg)
            paths = [str(t.path) for t in tasks]
        else:
            paths = resolve_train_files(files if isinstance(files, str) else list(files))
        cfg.train_files = paths[0] if len(paths) == 1 else paths
        cfg.data.train_files = cfg.train_files
        if cfg.external.harness:  # a harness's file, as every actor must find it wherever it runs
            cfg.external.harness = absolute_target(str(cfg.external.harness))
    return tasks
