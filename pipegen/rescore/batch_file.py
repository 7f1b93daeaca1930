"""One committed batch file rescored: its rows scored with the current reward, the file replaced whole.

A row is handed to the reward exactly as an actor hands it (actor/scoring.py's `Scorer`: the decoded
response, the row's data_source, ground truth and extra_info with its turns). The new score goes where
the writer puts one (verl's `rm_scores`: the reward at the row's last response token, present only when
every row of the batch has a score), a dict reward's extra keys into their columns (`reward_extra_keys`),
and the old score and the reward names into run/provenance.py's columns (every scored row of a rewritten file
names its reward, a row left as it was the reward at generation). The file is written beside the old
one, fsynced and renamed over it (run/atomic.py): after a crash it is the old file or the new one, whole;
its rows, units and size in rows do not change, so the checkpoint that lists it stays true.

Owns: that rewrite. Must never: change which rows a file holds, score a row with a number its reward did
not return (a row whose reward fails keeps its old score and is counted), or edit the file in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipegen.rewards.protocol import RewardFailure
from pipegen.run.atomic import atomic_write
from pipegen.run.batchfile import BatchColumns, encode_batch_file, object_array, read_batch
from pipegen.run.stream import unit_label
from pipegen.run.provenance import PREVIOUS_REWARD_BY, PREVIOUS_SCORE, REWARD_BY

NUM_TURNS = "__num_turns__"  # verl's _postprocess keeps each row's turns in this column
REWARD_EXTRA_KEYS = "reward_extra_keys"  # meta_info: the columns a dict reward's extra keys went to


@dataclass
class RowOutput:
    """The part of verl's AgentLoopOutput that the actor's Scorer reads and sets, for a committed row."""

    response_ids: list[int]
    num_turns: int
    reward_score: float | None = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchRescore:
    """What rescoring one batch file did."""

    rows: int = 0
    rescored: int = 0
    skipped: int = 0  # scored already by this reward, or scored and --only-unscored
    failed: dict[str, str] = field(default_factory=dict)  # unit label -> the reward's failure (old score kept)


async def rescore_batch(path: Path, scorer, reward_by: str, generated_by: str, only_unscored: bool) -> BatchRescore:
    """Rescore the rows of one batch file (see the module header) and replace the file when a row changed."""
    stored = read_batch(path)
    t, nt = stored.tensors, stored.non_tensor
    n = stored.rows
    outcome = BatchRescore(rows=n)
    responses = t[BatchColumns.RESPONSES]
    width = responses.shape[1]
    lengths = t[BatchColumns.ATTENTION_MASK][:, -width:].sum(axis=1).astype(int)
    old = (t[BatchColumns.RM_SCORES].sum(axis=1).astype(float).tolist() if BatchColumns.RM_SCORES in t
           else [None] * n)  # a batch holds rm_scores only when every row of it was scored
    by = list(nt[REWARD_BY]) if REWARD_BY in nt else [None] * n
    previous = list(nt[PREVIOUS_SCORE]) if PREVIOUS_SCORE in nt else [None] * n
    previous_by = list(nt[PREVIOUS_REWARD_BY]) if PREVIOUS_REWARD_BY in nt else [None] * n
    scores: list[float | None] = list(old)
    extras: dict[int, dict[str, Any]] = {}
    for i in range(n):
        if by[i] == reward_by or (only_unscored and old[i] is not None):
            outcome.skipped += 1  # this reward scored it already (a rerun after a crash), or it has a score
            continue
        row = {k: v[i] for k, v in nt.items()}
        output = RowOutput(responses[i, : lengths[i]].tolist(), int(row.get(NUM_TURNS) or 0))
        reward = scorer.reward_for(row)  # the row's reward, asked once, as the actor asks it per unit
        try:
            if reward is not None:
                await scorer.score(output, row, reward)
        except RewardFailure as e:
            outcome.failed[unit_label(int(row[BatchColumns.INDEX]), int(row[BatchColumns.SAMPLE]))] = \
                f"{type(e).__name__}: {e}"
            continue
        if output.reward_score is None:  # no reward applies to this row any more (scorer.applies): as it was
            outcome.skipped += 1
            continue
        previous[i], previous_by[i] = old[i], by[i] or generated_by
        scores[i], by[i] = float(output.reward_score), reward_by
        extras[i] = dict(output.extra_fields.get("reward_extra_info") or {})
        outcome.rescored += 1
    # a scored row not rescored (its reward failed again, or it was skipped) names the reward of its score too: the
    # run's fingerprint names the new reward from now on, so "at generation" could no longer be read from it
    unnamed = [i for i in range(n) if scores[i] is not None and by[i] is None]
    for i in unnamed:
        by[i] = generated_by
    if not outcome.rescored and not unnamed:
        return outcome
    tensors = dict(t)
    if all(s is not None for s in scores):
        rm = np.zeros(responses.shape, dtype=t[BatchColumns.RM_SCORES].dtype if BatchColumns.RM_SCORES in t
                      else np.float32)
        rm[np.arange(n), np.maximum(lengths - 1, 0)] = scores  # verl's place for a score: the last response token
        tensors[BatchColumns.RM_SCORES] = rm
    else:
        tensors.pop(BatchColumns.RM_SCORES, None)
    non_tensor = dict(nt)
    meta = dict(stored.meta_info)
    keys = list(meta.get(REWARD_EXTRA_KEYS) or [])
    for key in dict.fromkeys(k for info in extras.values() for k in info):
        if key not in keys:
            keys.append(key)
    for key in keys:  # a rescored row's extra keys are its new reward's (None where it returned none)
        column = list(non_tensor[key]) if key in non_tensor else [None] * n
        for i, info in extras.items():
            column[i] = info.get(key)
        non_tensor[key] = object_array(column)
    if keys:
        meta[REWARD_EXTRA_KEYS] = keys
    non_tensor[REWARD_BY] = object_array(by)
    non_tensor[PREVIOUS_SCORE] = object_array(previous)
    non_tensor[PREVIOUS_REWARD_BY] = object_array(previous_by)
    int32 = responses.dtype == np.int32
    chunks = encode_batch_file(tensors, non_tensor, meta, int32)
    atomic_write(path, lambda f: [f.write(chunk) for chunk in chunks])
    return outcome
