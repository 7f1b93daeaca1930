"""A run's committed rows as the statistics read them: every row of the batch files the checkpoint lists, with its
index, sample, source, reward (the batch file's rm_scores: after `pipegen rescore`, the new one), length and where it
is. The report's numbers and the closing summary's rewards line read it, so both say what trajectories.pkl holds.

Owns: `RowFacts`, `Rows`, `committed_rows`. Must never: write anything, or read the streams (what the actors wrote
at generation, which a rescore does not change).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipegen.run.layout import RunDir
from pipegen.run.provenance import REWARD_BY
from pipegen.run.stream import PieceKeys


@dataclass
class RowFacts:
    """One committed row (one trajectory) as the statistics need it."""

    index: int
    sample: int
    source: str
    reward: float | None  # None: the row's batch has no rm_scores (not every row of it was scored)
    response_length: int  # response tokens, model and tool tokens alike (what response_length limits)
    trajectory: int = 0  # the piece's place in its sample (0, 1, ...; the last is the final one)
    reward_rule: str | None = None  # which rule gave its reward (actor/scoring.py), None: unscored or older run
    batch: int = -1  # where the row is: its batch file's number and its place in it (for its answer's text)
    position: int = -1
    reward_by: str | None = None  # the reward that scored it when rescored (None: the reward at generation)
    extras: dict[str, Any] = field(default_factory=dict)  # a dict reward's extra keys for this row


@dataclass
class Rows:
    rows: list[RowFacts] = field(default_factory=list)
    batches: int = 0


def committed_rows(run: RunDir) -> Rows:
    """Every row of the batch files the checkpoint lists (a batch that cannot be read is left out)."""
    from pipegen.run.batchfile import BatchColumns, BatchFileError, read_batch
    from pipegen.run.checkpoint import load_checkpoint

    out = Rows()
    try:
        ckpt = load_checkpoint(run.checkpoint)
    except (OSError, ValueError):
        return out
    for number in ckpt.batches.numbers():
        try:
            part = read_batch(run.batch_file(number))
        except BatchFileError:
            continue
        out.batches += 1
        t, nt = part.tensors, part.non_tensor
        width = t[BatchColumns.PROMPTS].shape[1]
        lengths = t[BatchColumns.ATTENTION_MASK][:, width:].astype(np.int64).sum(axis=1)
        scores = t[BatchColumns.RM_SCORES].sum(axis=1) if BatchColumns.RM_SCORES in t else None
        sources, rules = nt.get("data_source"), nt.get(PieceKeys.REWARD_RULE)
        extra_keys = [k for k in part.meta_info.get("reward_extra_keys") or [] if k in nt and k != "score"]
        by = nt.get(REWARD_BY)
        for i in range(part.rows):
            out.rows.append(RowFacts(
                index=int(nt[BatchColumns.INDEX][i]), sample=int(nt[BatchColumns.SAMPLE][i]),
                source=str(sources[i]) if sources is not None and sources[i] is not None else "unknown",
                reward=float(scores[i]) if scores is not None else None, response_length=int(lengths[i]),
                trajectory=int(nt[BatchColumns.TRAJECTORY][i]),
                reward_rule=str(rules[i]) if rules is not None and rules[i] is not None else None,
                batch=number, position=i, reward_by=str(by[i]) if by is not None and by[i] is not None else None,
                extras={k: nt[k][i] for k in extra_keys}))
    return out
