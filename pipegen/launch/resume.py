"""The resume guard: a new run's config and fingerprint saved, a resumed run's checked against them, and the
small files a launch finds checked before any process starts.

A changed setup is refused unless resume_with_changes=true. A larger n alone adds samples: the checkpoint's units
are numbered by the new n (the same units, `Checkpoint.renumber`), the run keeps its run key (its prompts' uids) and
only the new samples are generated, each with the seed a run made with that n gives it; a smaller n, or a larger one
beside another change, is refused even with resume_with_changes=true; a change of the reward alone is refused naming
`pipegen rescore DIR`, which scores the rows already generated with the new reward and generates nothing (and
resume_with_changes=true only where units are still to generate); a damaged fingerprint is restored only when this
launch reproduces the run key the run recorded. What the launcher can write again (the config, the launch
record, the unit manifest) is set aside when damaged; what it cannot re-derive (the checkpoint, the batch
files it lists) is refused with the rebuild command, never overwritten or deleted.
Owns: DIR/conf/config.yaml and DIR/conf/fingerprint.json, and the n checkpoint.json's unit keys are numbered by.
Must never: start a process, or change what a run already generated (renumbering keeps every committed unit).
"""

from __future__ import annotations

import logging
from typing import Mapping

import orjson
from omegaconf import DictConfig

from pipegen.run.checkpoint import check_listed_batches, load_checkpoint, save_checkpoint
from pipegen.run.config import load_run_config, save_run_config
from pipegen.run.fingerprint import (KEPT_RUN_KEY, OVERRIDE_KEY, compute_fingerprint, describe_changes, has_output,
                                     load_fingerprint, mismatch_message, run_key_of, save_fingerprint,
                                     with_kept_run_key)
from pipegen.run.integrity import DamagedFile, set_aside
from pipegen.run.layout import RunDir

log = logging.getLogger("pipegen.launch")


def guard_resume(cfg: DictConfig, run: RunDir, pending: Mapping[str, bytes] | None = None) -> str | None:
    """Save config + fingerprint for a new run, or check them for a resumed one. Returns an error, having
    written nothing (a launch that adds samples renumbers the checkpoint first). `pending`: the task files this
    launch writes once the guard has passed ({path: bytes})."""
    legacy = run.legacy_batch_files()
    if legacy:
        from pipegen.run.batchfile import legacy_format_message  # numpy and pyarrow: only when needed

        return legacy_format_message(run.root, legacy)
    current = orjson.loads(orjson.dumps(compute_fingerprint(cfg, pending)))
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
        current = with_kept_run_key(stored, current)
        added = has_output(run) and adds_samples(stored, current)
        problem = None if added else (reward_only_message(stored, current, run)
                                      or mismatch_message(stored, current, run.root))
        if has_output(run) and not added and samples_message(stored, current, run):
            return samples_message(stored, current, run)  # not even with resume_with_changes=true
        if added:
            problem = add_samples(cfg, run, stored, current)
            if problem:
                return problem
            current = {**current, KEPT_RUN_KEY: run_key_of(stored)}  # its prompts' uids stay
        elif problem and not has_output(run):
            # nothing generated yet (an earlier launch was refused or stopped early): the new
            # settings replace the old ones, and the unit manifest is read again from them
            log.info("%s holds no generated data yet: using this launch's settings", run.root)
            run.units_file.unlink(missing_ok=True)
        elif problem and not cfg.get(OVERRIDE_KEY):
            return problem
        elif problem:
            log.warning("%s=true: continuing despite: %s", OVERRIDE_KEY, problem)
        if has_output(run):
            problem = align_checkpoint(run, int(current["n"]), int(current["n"]))
            if problem:
                return problem
    run.root.mkdir(parents=True, exist_ok=True)
    run.logs.mkdir(parents=True, exist_ok=True)
    set_aside_if_damaged(run.config_file, lambda: load_run_config(run), "this launch writes it again")
    save_run_config(run, cfg)  # also what restores a damaged or missing config.yaml
    save_fingerprint(run.fingerprint_file, current)
    return None


def reward_only_message(stored: dict, current: dict, run: RunDir) -> str | None:
    """The refusal when the reward alone changed: the fix for that is a rescore, not a mixed resume."""
    changes = describe_changes(stored, current)
    if not changes or not all(change.startswith("reward.") for change in changes):
        return None
    shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
    line = (f"{run.root} was scored with another reward ({shown}), and only the reward changed: score its rows "
            f"with the new one, generating nothing, with pipegen rescore {run.root} (the old scores are kept beside "
            f"the new ones)")
    try:
        ckpt = load_checkpoint(run.checkpoint)
        to_generate = run.total_units(int(stored["n"])) - ckpt.num_committed - len(ckpt.failed)
    except (OSError, ValueError, KeyError, TypeError):
        to_generate = 0
    if to_generate > 0:  # units never generated: rescore does not make them, a resume with the new reward does
        line += (f"; then generate the {to_generate} unit(s) still missing with the new reward by adding "
                 f"{OVERRIDE_KEY}=true")
    return line


def adds_samples(stored: dict, current: dict) -> bool:
    """Whether this launch only adds samples to the run: a larger n, and nothing else changed."""
    old, new = stored.get("n"), current.get("n")
    if not isinstance(old, int) or not isinstance(new, int) or new <= old:
        return False
    return describe_changes({**stored, "n": new}, current) == []


def samples_message(stored: dict, current: dict, run: RunDir) -> str | None:
    """The refusal of another n on a run that holds data, where it does not only add samples: fewer samples would
    drop committed ones, and more beside another change would mix two setups in one prompt's samples."""
    old, new = stored.get("n"), current.get("n")
    if old is None or new is None or old == new:
        return None
    if new < old:
        return (f"n={new} on a run made with n={old}: a run keeps every sample it committed, so n cannot shrink; "
                f"keep n={old} here, or generate n={new} into a new output_dir")
    others = [c for c in describe_changes({**stored, "n": new}, current)]
    shown = "; ".join(others[:3]) + (f"; and {len(others) - 3} more" if len(others) > 3 else "")
    return (f"n={new} on a run made with n={old} adds samples only when nothing else changes, and this launch also "
            f"changes {shown}: keep the rest as the run has it to add samples here, or generate into a new output_dir")


def add_samples(cfg: DictConfig, run: RunDir, stored: dict, current: dict) -> str | None:
    """n grew alone: the checkpoint's units numbered by the new n, and one line saying what this launch generates.
    Returns an error (a store run, whose committed segments are numbered by the old n, cannot be renumbered)."""
    old, new = int(stored["n"]), int(current["n"])
    if cfg.storage.url:
        return (f"n={new} on a run made with n={old}: samples cannot be added to a store run (the commits in "
                f"{cfg.storage.url} number their units by n={old}); generate n={new} into a new output_dir, or keep "
                f"n={old} here")
    problem = align_checkpoint(run, old, new)
    if problem:
        return problem
    prompts = len(run.read_manifest()) if run.units_file.exists() else None
    added = f"samples {old}..{new - 1}" if new - old > 1 else f"sample {old}"
    which = "prompt" if prompts is None else f"of its {prompts} prompts: {prompts * (new - old)} units"
    print(f"pipegen: n={new} on a run made with n={old}: generating only the new samples ({added} of each {which}); "
          f"the units it committed, their seeds and their prompts' uids stay as they are", flush=True)
    return None


def align_checkpoint(run: RunDir, numbered_by: int, n: int) -> str | None:
    """checkpoint.json's unit keys numbered by `n` (it records the n it was numbered by; `numbered_by` where it
    does not): a launch that added samples, or one after such a launch was interrupted. Returns an error."""
    if not run.checkpoint.exists():
        return None
    try:
        ckpt = load_checkpoint(run.checkpoint)
    except DamagedFile as e:
        return str(e)
    if (ckpt.n or numbered_by) == n:
        return None
    try:
        ckpt.renumber(ckpt.n or numbered_by, n)
    except ValueError as e:
        return f"{run.checkpoint}: {e}; relaunch with n={ckpt.n or numbered_by}"
    save_checkpoint(run.checkpoint, ckpt)
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
