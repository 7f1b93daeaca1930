"""`pipegen rescore DIR [--only-unscored] [reward overrides]`: the CLI, its checks, and the order of the rescore.

Reward overrides are the reward's own keys only (`custom_reward_function.path|name|reward_kwargs.*`,
`reward.*`), checked as a launch checks them (rewards/spec.py's `resolve_reward_settings`); without any, the
run's saved reward is used, its file as it is on disk now. Every refusal is one line naming the fix.

Owns: the command (see pipegen/rescore/__init__.py for what it does, in order). Must never: generate, run
beside a launcher or a writer of the same directory (it holds the launcher lock and the writer lock while it
rewrites batch files, and refuses while either is held), or import the writer (it starts it as a process).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from omegaconf import DictConfig, OmegaConf, open_dict

from pipegen.run.provenance import PREVIOUS_REWARD_BY, PREVIOUS_SCORE, REWARD_BY, current_reward, generation_reward

log = logging.getLogger("pipegen.rescore")

REWARD_KEYS = ("custom_reward_function.", "reward.")  # the overrides rescore takes: the reward's own keys
RESCORE_SHARDS = "actor_rescore"  # the rollout shard folder of the failed units' kept samples, scored here
USAGE = ("pipegen rescore DIR [--only-unscored] [custom_reward_function.path=FILE custom_reward_function.name=FN | "
         "reward.verifier_url=URL ...]")


@dataclass
class Outcome:
    rows: int = 0
    rescored: int = 0
    skipped: int = 0
    kept_scored: int = 0  # failed units whose kept samples were scored now (committed by the writer)
    failed: dict[str, str] = field(default_factory=dict)  # unit -> the reward's failure


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipegen rescore", usage=USAGE,
                                description="score a run's rows again with the current reward (its function, as "
                                            "fixed on disk, or a verifier), generating nothing; old scores are "
                                            "kept beside the new ones, with the reward that gave each")
    p.add_argument("run_dir", help="the run directory (output_dir of the launch)")
    p.add_argument("--only-unscored", action="store_true",
                   help="score only the rows without a score and the units whose reward failed (default: every row)")
    p.add_argument("overrides", nargs="*", help="the reward's keys, as on the launch command line")
    return p.parse_args(argv)


def with_reward_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The run's config with the reward overrides applied and checked (ValueError: one line naming the fix)."""
    for item in overrides:
        key = item.lstrip("+").split("=", 1)[0]
        if "=" not in item or not key.startswith(REWARD_KEYS):
            raise ValueError(f"{item}: rescore takes only the reward's keys (custom_reward_function.*, reward.*) "
                             "as KEY=VALUE; to change anything else, start a new run")
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.merge_with(OmegaConf.from_dotlist([item.lstrip("+") for item in overrides]))
    from pipegen.rewards.spec import resolve_reward_settings

    resolve_reward_settings(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    from pipegen.observe.logs import setup_logging
    from pipegen.run.layout import RunDir
    from pipegen.run.ownership import DirectoryLock, LockHeld, lock_status

    run = RunDir(Path(args.run_dir).expanduser().resolve())

    def refuse(line: str) -> int:
        print(f"pipegen rescore: error: {line}", file=sys.stderr)
        return 2

    if not run.config_file.exists():
        return refuse(f"{run.root} is not a pipegen run directory (no conf/config.yaml): pass a run's output_dir")
    from pipegen.run.batchfile import BatchFileError
    from pipegen.run.checkpoint import load_checkpoint
    from pipegen.run.config import load_run_config
    from pipegen.run.integrity import DamagedFile

    try:
        cfg = with_reward_overrides(load_run_config(run), args.overrides)
        ckpt = load_checkpoint(run.checkpoint)
    except (ValueError, DamagedFile) as e:
        return refuse(str(e))
    # both locks while the batch files are rewritten: no launch starts and no writer commits meanwhile
    launch_lock, lock = DirectoryLock(run.launcher_lock, "launcher", name_host=True), DirectoryLock(run.writer_lock)
    try:
        launch_lock.acquire()
    except LockHeld:
        holder = lock_status(run.launcher_lock)
        return refuse(f"a launch (pid {holder.pid}) is running on {run.root}: rescore once it has ended "
                      "(Ctrl-C it, or wait)")
    try:
        lock.acquire()
    except LockHeld as e:
        launch_lock.release()
        return refuse(str(e))
    setup_logging("rescore")
    import logging

    handler = logging.FileHandler(run.role_log("rescore"))  # the rescore's log lines kept, as every role's are
    handler.setFormatter(logging.getLogger().handlers[0].formatter)
    logging.getLogger().addHandler(handler)
    started = time.monotonic()
    try:
        reward_by = current_reward(cfg)
        try:
            outcome = asyncio.run(rescore_run(cfg, run, ckpt, reward_by, args.only_unscored))
        except (BatchFileError, DamagedFile) as e:  # the files rescored so far are whole; a rerun skips their rows
            return refuse(f"{e}; python -m pipegen.writer output_dir={run.root} --rebuild sets a damaged batch file "
                          "aside, then rerun pipegen rescore")
        settle_setup(cfg, run)
        # the merged output holds the old scores: the writer below merges again (and marks the run complete)
        from pipegen.run.checkpoint import save_checkpoint

        ckpt.merged = ckpt.complete = False
        save_checkpoint(run.checkpoint, ckpt)
    finally:
        lock.release()
        launch_lock.release()  # before the writer: with no launcher alive it commits, merges and exits (writer/alone.py)
    # the writer commits the failed units' scored samples and merges (the output now holds the new scores)
    writer = subprocess.run([sys.executable, "-m", "pipegen.writer", f"output_dir={run.root}"],
                            capture_output=True, text=True)
    if writer.returncode not in (0, 4):  # 4: units still failed (EXIT_FAILED_UNITS); said below
        tail = (writer.stderr.strip().splitlines() or ["no output"])[-1]
        return refuse(f"the rows are rescored, but the writer that merges them failed ({tail}); rerun "
                      f"python -m pipegen.writer output_dir={run.root}")
    print(f"pipegen rescore: {outcome.rescored} of {outcome.rows} committed row(s) rescored and "
          f"{outcome.kept_scored} failed unit(s) scored from their kept samples with {reward_by}; "
          f"{outcome.skipped} left as they were; 0 generation requests ({time.monotonic() - started:.1f}s). Old "
          f"scores are in the columns {PREVIOUS_SCORE} and {PREVIOUS_REWARD_BY}, the reward of each row in "
          f"{REWARD_BY}: {run.merged_output() or run.root}")
    from pipegen.report import end_of_run

    if outcome.failed:
        from pipegen.run.checkpoint import failure_summary

        print(f"pipegen rescore: {len(outcome.failed)} unit(s) failed their reward again and keep their old "
              "score (or stay failed); fix the reward and rerun pipegen rescore:", file=sys.stderr)
        for line in failure_summary({u: {"reason": r} for u, r in outcome.failed.items()}):
            print(f"  {line[:300]}", file=sys.stderr)
        return end_of_run(cfg, run, 1)  # the report names the new rewards and the units still failed
    return end_of_run(cfg, run, 0)  # report.html and report.json: the rescored rows, the run's state now


async def rescore_run(cfg: DictConfig, run, ckpt, reward_by: str, only_unscored: bool) -> Outcome:
    """Every committed batch file rescored, then the failed units' kept samples scored into a shard of their own."""
    from pipegen.actor.scoring import Scorer
    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.rescore.batch_file import rescore_batch
    from pipegen.run.fingerprint import load_fingerprint

    generated_by = generation_reward(load_fingerprint(run))
    scorer = Scorer(cfg, load_tokenizer(cfg))
    outcome = Outcome()
    try:
        for number in ckpt.batches.numbers():
            done = await rescore_batch(run.batch_file(number), scorer, reward_by, generated_by, only_unscored)
            outcome.rows += done.rows
            outcome.rescored += done.rescored
            outcome.skipped += done.skipped
            outcome.failed.update(done.failed)
            log.info("%s: %d of %d row(s) rescored", run.batch_file(number).name, done.rescored, done.rows)
        await score_kept(cfg, run, ckpt, scorer, reward_by, outcome)
    finally:
        await scorer.close()
    return outcome


async def score_kept(cfg: DictConfig, run, ckpt, scorer, reward_by: str, outcome: Outcome) -> None:
    """The units of this launch that generated but whose reward failed (their samples kept in the failures
    stream): scored now as an actor's relaunch scores them, and appended as rollout lines to a shard of
    their own, which the writer commits. A unit whose reward fails again stays failed."""
    from pipegen.rescore.batch_file import RowOutput
    from pipegen.rewards.protocol import RewardFailure
    from pipegen.run.medium import FAILURES, ROLLOUTS, open_medium
    from pipegen.run.stream import RolloutRecord, TrajectoryKeys, UnitKeys, kept_unscored, unit_label

    keys = UnitKeys(int(cfg.actor_rollout_ref.rollout.n))
    medium = open_medium(run, cfg)  # the run's shards, or its Redis streams
    kept = {unit: record for unit, record in kept_unscored(medium.lines(FAILURES)).items()
            if unit_label(*unit) in ckpt.failed and keys.key(*unit) not in ckpt.committed}
    if not kept:
        return
    shard = medium.appender(ROLLOUTS, RESCORE_SHARDS.removeprefix("actor_"), ckpt, 1 << 30, 1.0)
    try:
        for unit, data in sorted(kept.items()):
            record = RolloutRecord(**{k: v for k, v in data.items() if k in RolloutRecord.__dataclass_fields__})
            last = record.trajectories[-1]
            output = RowOutput(list(last[TrajectoryKeys.RESPONSE_IDS]), int(last.get(TrajectoryKeys.NUM_TURNS) or 0))
            reward = scorer.reward_for(record.row)  # asked once per unit, as the actor asks it
            try:
                if reward is not None:
                    await scorer.score(output, record.row, reward)
            except RewardFailure as e:
                outcome.failed[unit_label(*unit)] = f"{type(e).__name__}: {e}"
                continue
            for trajectory in record.trajectories:  # the unit's trajectories share its final reward, as an actor's
                trajectory[TrajectoryKeys.REWARD_SCORE] = output.reward_score
                if "reward_extra_info" in output.extra_fields:
                    trajectory[TrajectoryKeys.EXTRA_FIELDS] = {**(trajectory.get(TrajectoryKeys.EXTRA_FIELDS) or {}),
                                                               "reward_extra_info": output.extra_fields["reward_extra_info"]}
            record.reward = output.reward_score
            # which reward scored it, and that it had no score before (its reward failed), in the row's columns
            failure = ckpt.failed[unit_label(*unit)].get("reason", "")
            record.row = {**record.row, REWARD_BY: reward_by, PREVIOUS_SCORE: None,  # the reason's end: the error
                          PREVIOUS_REWARD_BY: f"none (its reward failed: ...{failure[-160:]})"}
            await shard.append(record.to_line())
            outcome.kept_scored += 1
    finally:
        shard.close()


def settle_setup(cfg: DictConfig, run) -> None:
    """The run's saved config and fingerprint name the reward that scored it now, so the same launch command
    resumes the run (as resume_with_changes=true would save them) and the writer accepts it."""
    from pipegen.run.config import save_run_config
    from pipegen.run.fingerprint import compute_fingerprint, load_fingerprint, save_fingerprint, with_kept_run_key

    current = orjson.loads(orjson.dumps(compute_fingerprint(cfg)))
    save_run_config(run, cfg)
    save_fingerprint(run.fingerprint_file, with_kept_run_key(load_fingerprint(run), current))  # its uids stay
