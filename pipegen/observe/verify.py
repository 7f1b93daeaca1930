"""`python -m pipegen.status DIR --verify`: a run directory checked against its own contract.

The exactly-once proof a user can run on their own data. Problems (exit 1):
- a file of the contract damaged or missing: conf/config.yaml, conf/fingerprint.json, conf/units.json,
  conf/launch.json, checkpoint.json, a batch file the checkpoint lists;
- a batch file on disk that the checkpoint does not list (an orphan), or the merged output missing
  from a run the checkpoint calls merged;
- a row twice (the same index, sample and trajectory), in one batch file or across two;
- the checkpoint inconsistent with the batch files: its committed units are not exactly the units the
  batch files hold, or a file's rows and units are not what its ledger entry says;
- a unit outside the manifest; in a run the checkpoint calls complete, a unit neither committed nor
  failed with a reason;
- a committed unit that still holds progress (streams/progress/, run/unit_progress.py).
Notes (exit 0): units still pending in a run that is not complete, shard lines that cannot be read or
were torn by a crash, committed units whose shard line is gone (the batch files hold them), files set
aside by a recovery.

Reads every batch file's row keys once (through the contract's `rows.batch_rows`) and every shard line's head: the cost
of reading the run's output once.
Owns: the contract check. Must never: write anything under DIR or take the writer lock.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pipegen.run.checkpoint import Checkpoint, failure_reason, load_checkpoint
from pipegen.run.config import load_run_config
from pipegen.run.fingerprint import load_fingerprint
from pipegen.run.integrity import DamagedFile, set_aside_files
from pipegen.run.layout import RunDir, list_shards
from pipegen.run.unit_progress import progress_files
from pipegen.run.rows import batch_rows
from pipegen.run.medium import ROLLOUTS, TOPICS, open_medium
from pipegen.run.stream import parse_unit_label, read_head, unit_label, UnitKeys

SHOWN = 5  # units named per problem


@dataclass
class Verdict:
    root: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)  # what was found consistent, for the report

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        head = (f"pipegen verify {self.root}: OK" if self.ok
                else f"pipegen verify {self.root}: {len(self.problems)} problem(s)")
        lines = [head] + [f"  problem  {p}" for p in self.problems] + [f"  note     {n}" for n in self.notes]
        lines += [f"  ok       {c}" for c in self.checked]
        return "\n".join(lines)


def _units(keys: UnitKeys, unit_keys) -> str:
    shown = ", ".join(unit_label(*keys.unit(k)) for k in sorted(unit_keys)[:SHOWN])
    more = len(unit_keys) - SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def verify_run(run: RunDir) -> Verdict:
    """Check run against its contract (see the module docstring)."""
    verdict = Verdict(run.root)
    problems = verdict.problems
    try:
        n = int(load_run_config(run).actor_rollout_ref.rollout.n)
    except DamagedFile as e:
        problems.append(str(e))
        return verdict
    keys = UnitKeys(n)
    manifest = _readable(problems, run.read_manifest)
    _readable(problems, lambda: load_fingerprint(run) or _missing(run.fingerprint_file))
    _readable(problems, run.read_launch)
    if not run.launch_file.exists():
        problems.append(f"{run.launch_file} is missing (every launch writes it)")
    try:
        ckpt = load_checkpoint(run.checkpoint)
    except DamagedFile as e:
        problems.append(str(e))
        return verdict
    if not run.checkpoint.exists():
        if run.batch_files_on_disk():
            problems.append(f"{run.checkpoint} is missing beside {len(run.batch_files_on_disk())} batch file(s); "
                            f"the next writer rebuilds it from them")
        else:
            verdict.notes.append("no checkpoint yet: nothing committed")

    # the batch files: listed ones readable, no orphan, no row twice, rows and units as the ledger says
    listed = [run.batch_file(i) for i in ckpt.batches.numbers()]
    orphans = sorted(set(run.batch_files_on_disk()) - set(listed))
    for path in orphans:
        problems.append(f"{path.name} is on disk but checkpoint.json does not list it (an orphan)")
    ledger = [(rows, units) for rows, units, repeat in ckpt.batches.sizes for _ in range(repeat)]
    row_seen: dict[tuple[int, int, int], str] = {}
    in_batches: set[int] = set()
    duplicates: list[str] = []
    rows_total = 0
    for path, (rows_expected, units_expected) in zip(listed, ledger):
        try:
            batch = batch_rows(path)
        except DamagedFile as e:
            problems.append(str(e))
            continue
        rows = batch.row_ids()
        units = set(batch.unit_keys(keys).tolist())
        rows_total += len(rows)
        for row in rows:
            if row in row_seen:
                duplicates.append(f"{row[0]}:{row[1]} trajectory {row[2]} in {row_seen[row]} and {path.name}")
            else:
                row_seen[row] = path.name
        if (len(rows), len(units)) != (rows_expected, units_expected):
            problems.append(f"{path.name} holds {len(rows)} rows of {len(units)} units; checkpoint.json says "
                            f"{rows_expected} rows of {units_expected}")
        in_batches |= units
    if duplicates:
        problems.append(f"{len(duplicates)} duplicated row(s): " + "; ".join(duplicates[:SHOWN]))

    committed = set(ckpt.committed)
    if not any("is damaged" in p and ".pkl" in p for p in problems):
        if committed - in_batches:
            problems.append(f"{len(committed - in_batches)} unit(s) committed in checkpoint.json are in no batch file "
                            f"(missing): {_units(keys, committed - in_batches)}")
        if in_batches - committed:
            problems.append(f"{len(in_batches - committed)} unit(s) in batch files are not committed in "
                            f"checkpoint.json: {_units(keys, in_batches - committed)}")
    if not duplicates and committed == in_batches:
        verdict.checked.append(f"{len(listed)} batch file(s), {rows_total} rows: every committed unit exactly once")

    _check_units(verdict, ckpt, keys, manifest, committed | in_batches)
    _check_merged_output(verdict, ckpt, run)
    _check_shards(verdict, run, keys, ckpt)
    _check_progress(verdict, run, keys, committed)
    for path in set_aside_files(run.root):
        verdict.notes.append(f"{path.relative_to(run.root)} was set aside by a recovery (inspect it, then delete it)")
    return verdict


def _readable(problems: list[str], read):
    """read(), or None with the damage added to problems."""
    try:
        return read()
    except DamagedFile as e:
        problems.append(str(e))
        return None


def _missing(path: Path) -> None:
    raise DamagedFile(path, "missing")


def _check_units(verdict: Verdict, ckpt: Checkpoint, keys: UnitKeys, manifest: list[int] | None,
                 present: set[int]) -> None:
    if manifest is None:
        return
    expected = {keys.key(index, s) for index in manifest for s in range(keys.n)}
    unknown = present - expected
    if unknown:
        verdict.problems.append(f"{len(unknown)} committed unit(s) are not in conf/units.json: {_units(keys, unknown)}")
    failed = {keys.key(*parse_unit_label(label)): info for label, info in ckpt.failed.items()}
    no_reason = [k for k, info in failed.items() if not failure_reason(info)]
    if no_reason:
        verdict.problems.append(f"{len(no_reason)} failed unit(s) have no reason: {_units(keys, no_reason)}")
    absent = expected - present - failed.keys()
    if absent and ckpt.complete:
        verdict.problems.append(f"{len(absent)} unit(s) of the manifest are neither committed nor failed though "
                                f"checkpoint.json says complete: {_units(keys, absent)}")
    elif absent:
        verdict.notes.append(f"{len(absent)} of {len(expected)} units pending (the run is not complete; rerun "
                             "its command to finish it)")
    else:
        verdict.checked.append(f"{len(expected)} units of the manifest: {len(expected & present)} committed, "
                               f"{len(failed)} failed with a reason")


def _check_merged_output(verdict: Verdict, ckpt: Checkpoint, run: RunDir) -> None:
    if ckpt.merged and run.merged_output() is None:
        verdict.problems.append(f"checkpoint.json says merged, but neither {run.trajectories.name} nor "
                                f"{run.output_index.relative_to(run.root)} exists")


def _check_progress(verdict: Verdict, run: RunDir, keys: UnitKeys, committed: set[int]) -> None:
    """A committed unit keeps no progress (streams/progress/, run/unit_progress.py): its actor unlinks the file after
    the unit's line, and the next actor start drops any a crash left between the two."""
    held = progress_files(run.progress)
    stale = {keys.key(index, sample) for index, sample in held} & committed
    if stale:
        verdict.problems.append(f"{len(stale)} committed unit(s) still hold progress in "
                                f"{run.progress.relative_to(run.root)}/: {_units(keys, stale)}")
    elif held:
        verdict.notes.append(f"{len(held)} unit(s) hold progress inside their answer (a rerun continues them)")
    else:
        verdict.checked.append("no committed unit holds progress in streams/progress/")


def _read_from_store(run: RunDir) -> bool:
    """A store run read back into the read cache (run/store_read.py): its streams are on the nodes, not here."""
    from pipegen.run.config import load_run_config

    try:
        return bool(load_run_config(run).storage.url) and not run.rollouts.exists()
    except Exception:  # noqa: BLE001 (the config's own check names a damaged one)
        return False


def _check_shards(verdict: Verdict, run: RunDir, keys: UnitKeys, ckpt: Checkpoint) -> None:
    """The stream is the raw material: what is wrong there is a note when the batch files hold the units."""
    committed = set(ckpt.committed)
    medium = open_medium(run)  # the shards, or the run's Redis streams
    for topic in TOPICS:
        tailer = medium.tail(topic)
        unreadable: Counter[str] = Counter()
        seen: set[int] = set()
        for where, _, line in tailer.lines():
            head = read_head(line)
            if head is None:
                unreadable[where] += 1
            elif topic == ROLLOUTS:
                seen.add(keys.key(*head))
        for where, count in unreadable.items():
            verdict.notes.append(f"{topic}/{where}: {count} line(s) cannot be read (damaged; their units are "
                                 "committed from elsewhere or generated again)")
        if tailer.stats.torn_lines:
            verdict.notes.append(f"{topic}: {tailer.stats.torn_lines} torn last line(s) from a crash (skipped)")
        if topic == ROLLOUTS and not seen and _read_from_store(run):
            verdict.notes.append("the shards stay in each node's scratch folder (the store holds the committed "
                                 "segments, checked above): verify a node's folder to check its shards")
        elif topic == ROLLOUTS and committed - seen:
            verdict.notes.append(f"{len(committed - seen)} committed unit(s) have no line in {medium.where(ROLLOUTS)} "
                                 "(a shard or the stream was damaged or removed; the batch files hold them)")
    sizes = {f"{actor}/{path.name}": path.stat().st_size
             for actor, shards in list_shards(run.rollouts).items() for path in shards}
    for rel, offset in ckpt.rollout_offsets.items():
        size = sizes.get(rel)
        if size is None or size < offset:
            verdict.notes.append(f"rollouts/{rel} is {'missing' if size is None else f'{size} bytes'}, shorter than "
                                 f"the {offset} bytes checkpoint.json has read from it")


def main(run: RunDir) -> int:
    """The --verify mode of pipegen.status: the report, exit 1 on any problem."""
    verdict = verify_run(run)
    print(verdict.render())
    sys.stdout.flush()
    return 0 if verdict.ok else 1
