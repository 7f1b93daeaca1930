"""Everything the launcher does before a process starts: --help, the config checks, the resume guard
(fingerprint) and the unit manifest read from the dataset through verl.

Owns: DIR/conf/ (the resolved config and the fingerprint) and DIR/units.json.
Must never: start a process, or change a run that already holds generated data (a changed setup is
refused unless resume_with_changes=true).
"""

from __future__ import annotations

import logging
import os
import sys

import orjson
from omegaconf import DictConfig, open_dict

from pipegen.run.config import compose, describe_config_error, help_text, load_run_config, save_run_config
from pipegen.run.checkpoint import check_listed_batches, load_checkpoint
from pipegen.run.fingerprint import (OVERRIDE_KEY, compute_fingerprint, has_output, load_fingerprint, mismatch_message,
                                     run_key_of, save_fingerprint)
from pipegen.run.integrity import DamagedFile, set_aside
from pipegen.run.layout import RunDir

log = logging.getLogger("pipegen.launch")

USAGE = """\
usage: python -m pipegen.launch output_dir=DIR [key=value ...]     (or ./launch.sh output_dir=DIR ...)

Generates trajectories for every (prompt, sample) of a verl-format parquet dataset and writes
DIR/trajectories.pkl (a verl DataProto). Re-running the same command resumes an interrupted run.

Common overrides:
  model_path=PATH|smollm2-135m    model folder (default: the embedded SmolLM2-135M-Instruct)
  train_files=PATH|demo           verl parquet file(s) (default: pipegen's 96 demo arithmetic problems)
  n=4  max_samples=-1              samples per prompt; prompts to use (-1 = all)
  temperature=0.7 max_response_length=512 max_prompt_length=1024
  llm=sglang llm.tp=2              SGLang servers on this node's GPUs (./launch.sh sets SGLang up)
  llm=vllm                         vLLM servers on this node's GPUs, or its CPU (./launch.sh sets vLLM up)
  llm=vllm                         vLLM servers on this node's GPUs, or its CPU (./launch.sh sets vLLM up)
  llm=external 'llm.urls=[http://127.0.0.1:30000]'
  actors.num_actors=2 actors.concurrency=64
  generation.save_batch_size=256 generation.show_progress=false
  actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent
  actor_rollout_ref.rollout.multi_turn.tool_config_path=conf/tools/calculator.yaml
  'trainer.logger=[console,wandb]'  log metrics (and upload the artifact) with verl's Tracking

pipegen's keys, with their current values (overrides given with --help are applied):
"""


def print_help(overrides: list[str]) -> None:
    try:
        print(USAGE)
        try:
            cfg = compose([o for o in overrides if o not in ("--help", "-h")] + ["output_dir=DIR"])
            print(help_text(cfg))
            print("\nEach key's one default, type and rule live in pipegen/run/schema.py.")
        except Exception as e:  # help must print even when an override is broken
            print(f"(could not compose the config: {describe_config_error(e)})")
        sys.stdout.flush()
    except BrokenPipeError:
        # `--help | head` closed the pipe: point stdout at /dev/null so the final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def fail(message: str) -> int:
    print(f"pipegen: error: {message}", file=sys.stderr)
    return 2


def resolve_inputs(cfg: DictConfig) -> None:
    """Short names -> real paths, so every child reads concrete paths from the saved config."""
    from pipegen.inputs.demo import resolve_train_files
    from pipegen.inputs.models import resolve_model_path

    with open_dict(cfg):
        model = resolve_model_path(str(cfg.actor_rollout_ref.model.path))
        cfg.model_path = model
        cfg.actor_rollout_ref.model.path = model
        files = cfg.data.train_files
        if cfg.tasks:  # each task's rows, written into the run directory (pipegen/tasks/materialize.py)
            from pipegen.tasks.materialize import task_train_files

            resolved = task_train_files(cfg)
        else:
            resolved = resolve_train_files(files if isinstance(files, str) else list(files))
        cfg.train_files = resolved[0] if len(resolved) == 1 else resolved
        cfg.data.train_files = cfg.train_files
    from pipegen.rewards.spec import resolve_reward_settings

    resolve_reward_settings(cfg)


def prepare_run(cfg: DictConfig, run: RunDir) -> str | None:
    """Save config + fingerprint for a new run, or check them for a resumed one. Returns an error."""
    legacy = run.legacy_batch_files()
    if legacy:
        from pipegen.run.batchfile import legacy_format_message  # numpy and pyarrow: only when needed

        return legacy_format_message(run.root, legacy)
    current = orjson.loads(orjson.dumps(compute_fingerprint(cfg)))
    try:
        stored = load_fingerprint(run)
    except DamagedFile as e:
        stored, damage = None, e
    else:
        damage = None
    if stored is None and has_output(run):
        problem = restore_fingerprint(cfg, run, current, damage)
        if problem:
            return problem
    elif stored is not None:
        problem = mismatch_message(stored, current, run.root)
        if problem and not has_output(run):
            # nothing generated yet (an earlier launch was refused or stopped early): the new
            # settings replace the old ones, and the unit manifest is read again from them
            log.info("%s holds no generated data yet: using this launch's settings", run.root)
            run.units_file.unlink(missing_ok=True)
        elif problem and not cfg.get(OVERRIDE_KEY):
            return problem
        elif problem:
            log.warning("%s=true: continuing despite: %s", OVERRIDE_KEY, problem)
    run.root.mkdir(parents=True, exist_ok=True)
    run.logs.mkdir(parents=True, exist_ok=True)
    set_aside_if_damaged(run.config_file, lambda: load_run_config(run), "this launch writes it again")
    save_run_config(run, cfg)  # also what restores a damaged or missing config.yaml
    save_fingerprint(run.fingerprint_file, current)
    return None


def recorded_run_keys(run: RunDir) -> set[str]:
    """The run keys the run recorded where they survive: the checkpoint's and the last launch's."""
    keys = set()
    for read in (lambda: load_checkpoint(run.checkpoint).run_key, lambda: run.read_launch().run_key):
        try:
            keys.add(read())
        except DamagedFile:
            pass
    return keys - {""}


def restore_fingerprint(cfg: DictConfig, run: RunDir, current: dict, damage: DamagedFile | None) -> str | None:
    """The fingerprint is damaged or missing in a run that holds data. This launch's fingerprint
    restores it when its digest is the run key the run recorded (the same setup, byte for byte, so
    uids and the resume guard stay what they were); otherwise the launch is refused. Returns an error."""
    what = str(damage.problem) if damage else "missing"
    recorded = recorded_run_keys(run)
    if run_key_of(current) in recorded:
        if damage is not None:
            log.warning("%s was damaged (%s): kept as %s; restored from this launch's setup, which matches the run "
                        "key %s recorded in the checkpoint", run.fingerprint_file, what,
                        set_aside(run.fingerprint_file).name, run_key_of(current))
        else:
            log.warning("%s was missing: restored from this launch's setup, which matches the run key %s recorded "
                        "in the checkpoint", run.fingerprint_file, run_key_of(current))
        return None
    if cfg.get(OVERRIDE_KEY):
        log.warning("%s=true: %s is %s and this setup's run key is new; continuing with it", OVERRIDE_KEY,
                    run.fingerprint_file, what)
        return None
    if not recorded:
        log.warning("%s is %s and no run key survives to check this launch against; continuing with this "
                    "launch's setup", run.fingerprint_file, what)
        return None
    return (f"{run.fingerprint_file} is {'damaged (' + what + ')' if damage else 'missing'}, and this launch's setup "
            f"does not reproduce the run key {sorted(recorded)[0]} that the run recorded; intact: the checkpoint, "
            f"batch files and shards; fix: rerun the exact command that started this run (it restores the file), "
            f"or add {OVERRIDE_KEY}=true to continue with this setup (its output would mix both setups)")


def set_aside_if_damaged(path, read, what_next: str) -> None:
    """A file the launcher writes anyway: when read() finds it damaged, keep it beside (never delete)."""
    if not path.exists():
        return
    try:
        read()
    except DamagedFile as e:
        log.warning("%s is damaged (%s): kept as %s; %s", path, e.problem, set_aside(path).name, what_next)


def check_run_files(run: RunDir) -> str | None:
    """Before any process starts: what the launcher cannot re-derive is checked (the checkpoint and
    the batch files it lists: a damaged one is refused with the rebuild command, never overwritten or
    deleted); what it can is set aside and written again (a damaged unit manifest is read again from
    the dataset; launch.json is written by every launch). Returns an error."""
    set_aside_if_damaged(run.units_file, run.read_manifest, "reading the dataset again for it")
    set_aside_if_damaged(run.launch_file, run.read_launch, "this launch writes it again")
    try:
        check_listed_batches(run.root, load_checkpoint(run.checkpoint))
    except DamagedFile as e:
        return str(e)
    return None


def build_manifest(cfg: DictConfig, run: RunDir) -> int:
    """Load the dataset once through verl, check it, and record its unit indices."""
    from pipegen.inputs.dataset import (check_files, check_prompt_lengths, dataset_facts, dataset_indices, load_dataset,
                                        load_tokenizer)

    check_files(cfg)  # seconds before verl is imported
    tokenizer = load_tokenizer(cfg)
    dataset = load_dataset(cfg, tokenizer)
    indices = dataset_indices(dataset)
    if not indices:
        raise ValueError("train_files: the dataset has no rows (after max_samples / filtering)")
    check_prompt_lengths(cfg, dataset, tokenizer)
    run.write_manifest(indices, dataset_facts(cfg, len(indices)))
    return len(indices)
