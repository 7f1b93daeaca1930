"""The writer's state re-derived from what is on disk: `python -m pipegen.writer output_dir=DIR --rebuild`.

checkpoint.json is metadata. Every committed sample is a row of a batch file, and every row names its
unit (`index`, `sample`); every generated sample is also a line of a stream shard that names its unit.
So the checkpoint can be rebuilt: read each batch file once, set aside the ones that cannot be read or
that repeat units of an earlier one, number the rest 0..k-1 (renames, in order, so no file is ever
overwritten), and write a checkpoint listing them, their units committed, and no shard offsets. The next
writer then reads every shard from its start, drops the lines of units already committed (by their
head, unparsed) and commits the rest; actors skip every unit that has a shard line, so nothing on disk
is generated again. The old checkpoint is kept beside the new one (`integrity.set_aside`).

The writer's start (`recover`, step 5 of writer/commit.py's protocol) runs the same rebuild on its own when the
checkpoint is missing and batch files exist (a run directory copied without it, or a crash between the first
batch file and the first checkpoint), and adopts the batch files a crash left unlisted (`adopt_orphans`) instead
of deleting them.

Owns: the rebuild, orphan adoption and the writer's recovery at its start. A batch file is read through the run contract's
`rows.batch_rows` (its row keys only, or the run's DamagedFile), as `status --verify` reads it.
Must never: delete a file (a damaged or repeated batch file is set aside), or run beside a live writer
(the CLI holds the writer lock).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path


from pipegen.run.atomic import remove_stale_temporaries
from pipegen.run.checkpoint import Checkpoint, check_listed_batches, load_checkpoint, save_checkpoint
from pipegen.run.integrity import DamagedFile, set_aside
from pipegen.run.layout import RunDir
from pipegen.run.rows import batch_rows
from pipegen.run.stream import UnitKeys, unit_label

log = logging.getLogger("pipegen.writer")


@dataclass
class Rebuilt:
    checkpoint: Checkpoint
    kept: int = 0
    set_aside: list[str] = field(default_factory=list)  # "batch_00002.arrow -> batch_00002.arrow.damaged-...: why"
    old_checkpoint: Path | None = None

    def summary(self, run: RunDir) -> str:
        ckpt = self.checkpoint
        lines = [f"rebuilt {run.checkpoint} from {self.kept} batch file(s): {ckpt.num_rows} rows, "
                 f"{ckpt.num_committed} units committed"]
        if self.old_checkpoint is not None:
            lines.append(f"  the old checkpoint is kept as {self.old_checkpoint}")
        for entry in self.set_aside:
            lines.append(f"  set aside {entry}")
        lines.append("  the next writer reads every shard from its start and commits the units no batch file holds")
        return "\n".join(lines)


def _accept(path: Path, keys: UnitKeys, seen: set[int], aside: list[str]) -> tuple[int, set[int]] | None:
    """(rows, units) of a batch file whose rows are unique and whose units are not in seen; otherwise
    the file is set aside (noted in aside) and None returned."""
    try:
        batch = batch_rows(path)
        units, rows = set(batch.unit_keys(keys).tolist()), batch.row_ids()
    except DamagedFile as e:
        aside.append(f"{path.name} -> {set_aside(path).name}: {e.problem}")
        return None
    if len(set(rows)) != len(rows) or units & seen:
        why = "repeats rows of its own" if len(set(rows)) != len(rows) else "repeats units committed elsewhere"
        aside.append(f"{path.name} -> {set_aside(path).name}: {why}")
        return None
    return len(rows), units


def rebuild(run: RunDir, n: int) -> Rebuilt:
    """Rebuild checkpoint.json from the batch files on disk (see the module docstring)."""
    keys = UnitKeys(n)
    ckpt = Checkpoint(run_key=run.run_key(), n=n)
    result = Rebuilt(ckpt)
    kept: list[Path] = []
    seen: set[int] = set()
    for path in run.batch_files_on_disk():
        accepted = _accept(path, keys, seen, result.set_aside)
        if accepted is not None:
            seen |= accepted[1]
            kept.append(path)
            ckpt.batches.add(accepted[0], len(accepted[1]))
    for number, path in enumerate(kept):  # ascending: batch_<number> is free by the time it is the target
        target = run.batch_file(number)
        if path != target:
            os.replace(path, target)
            log.warning("renumbered %s -> %s", path.name, target.name)
    ckpt.committed.add_sorted(sorted(seen))
    result.kept = len(kept)
    if run.checkpoint.exists():
        result.old_checkpoint = set_aside(run.checkpoint)
    save_checkpoint(run.checkpoint, ckpt)
    return result


def adopt_orphans(run: RunDir, ckpt: Checkpoint, orphans: list[Path], n: int) -> list[str]:
    """Batch files the checkpoint does not list, left by a crash between a batch file's rename and the
    checkpoint that lists it (commit steps 3-4): each was fsynced before its rename, so it is whole.
    The next in the ledger's numbering (batch_<count>, batch_<count+1>, ...) whose units nothing
    committed are added to ckpt (the caller saves it); any other is set aside. Returns what was set aside."""
    keys = UnitKeys(n)
    aside: list[str] = []
    committed = set(ckpt.committed)
    for path in sorted(orphans):
        if path != run.batch_file(len(ckpt.batches)):
            aside.append(f"{path.name} -> {set_aside(path).name}: not the next batch number after the checkpoint's")
            continue
        accepted = _accept(path, keys, committed, aside)
        if accepted is None:
            continue
        rows, units = accepted
        committed |= units
        ckpt.batches.add(rows, len(units))
        ckpt.committed.add_sorted(sorted(units))
        for key in units:  # a unit that failed earlier in this launch, then succeeded after all
            ckpt.failed.pop(unit_label(*keys.unit(key)), None)
        log.warning("adopted %s (%d units): written before a crash, never listed by the checkpoint", path.name,
                    len(units))
    return aside


def recover(run: RunDir, ckpt: Checkpoint, n: int) -> Checkpoint:
    """The writer's start: the checkpoint rebuilt when it is missing beside batch files, its listed batch files
    checked (DamagedFile when one is missing), the unlisted ones adopted, stale temporaries removed."""
    if not run.checkpoint.exists() and run.batch_files_on_disk():
        # batch files without a checkpoint: it was lost (a copy without it) or never written (a crash
        # before the first one). Either way the batch files are the truth: rebuild, never delete.
        log.warning("no %s beside %d batch file(s): rebuilding it from them", run.checkpoint.name,
                    len(run.batch_files_on_disk()))
        log.warning("%s", rebuild(run, n).summary(run))
        ckpt = load_checkpoint(run.checkpoint)
    check_listed_batches(run.root, ckpt)
    listed = {run.batch_file(i) for i in ckpt.batches.numbers()}
    orphans = [p for p in run.batch_files_on_disk() if p not in listed]
    if orphans:
        for entry in adopt_orphans(run, ckpt, orphans, n):
            log.warning("set aside %s", entry)
        save_checkpoint(run.checkpoint, ckpt)
    remove_stale_temporaries(run.root)
    return ckpt
