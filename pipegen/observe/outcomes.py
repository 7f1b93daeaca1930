"""What the generated samples scored and how they ended, for the end-of-run summary: mean reward, pass@n,
and how many responses reached the response limit.

Read from the rollout stream, shards or Redis (run/medium.py; each unit's first complete line, as the writer
keeps it): the mean of every trajectory's `reward_score`, pass@n, the share of prompts with at least one of its n
samples scoring above 0, and each unit's `finish` (run/stream.py). Only the `index`/`sample` head, the `finish` and
the `reward_score` fields of a line are looked at (a regex over the bytes, no JSON parse), so a summary of a
100k-unit run costs about a second.

A store run's lines stay on its nodes: `committed_outcomes` reads the same figures from the committed rows.

Owns: the reward and finish summary. Must never: write anything, or read more than MAX_BYTES of the stream (a
huge run gets no pass@n line rather than a long wait at its end).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from omegaconf import DictConfig

from pipegen.run.layout import RunDir
from pipegen.run.medium import ROLLOUTS, open_medium
from pipegen.run.stream import TrajectoryKeys, read_head

MAX_BYTES = 2 << 30
_REWARD = re.compile(b'"%s":(-?[0-9][0-9.eE+-]*)' % TrajectoryKeys.REWARD_SCORE.encode())
_FINISH = re.compile(rb'"finish":"(\w*)"')


@dataclass
class RewardSummary:
    mean_reward: float
    scored: int  # trajectories with a reward
    prompts: int  # prompts with at least one scored sample
    passed: int  # of those, prompts with a sample scoring above 0

    @property
    def pass_at_n(self) -> float:
        return self.passed / self.prompts if self.prompts else 0.0


@dataclass
class Outcomes:
    rewards: RewardSummary | None  # None when nothing was scored (no ground truth, scoring off)
    finishes: dict[str, int]  # units by their line's `finish` ("stop", "length"); lines of an older pipegen: none


def unit_outcomes(run: RunDir, cfg: DictConfig) -> Outcomes | None:
    """None when the rollout stream holds more than MAX_BYTES (or cannot be read). `cfg`: the run's saved config."""
    seen: set[tuple[int, int]] = set()
    total = 0.0
    scored = 0
    best: dict[int, float] = {}
    finishes: dict[str, int] = {}
    read = 0
    try:
        lines = open_medium(run, cfg).lines(ROLLOUTS)  # the shards, or the run's Redis stream
        for line in lines:  # complete lines only
            read += len(line)
            if read > MAX_BYTES:
                return None
            head = read_head(line)
            if head is None or head in seen:
                continue
            seen.add(head)
            finish = _FINISH.search(line, 0, 400)  # it leads the line, after the head and the reward
            if finish is not None:
                finishes[finish.group(1).decode()] = finishes.get(finish.group(1).decode(), 0) + 1
            rewards = [float(m) for m in _REWARD.findall(line)]
            if not rewards:
                continue
            total += sum(rewards)
            scored += len(rewards)
            best[head[0]] = max(best.get(head[0], float("-inf")), max(rewards))
    except OSError:  # a shard gone meanwhile, or a Redis that stopped answering: no summary rather than a wrong one
        return None
    rewards = RewardSummary(total / scored, scored, len(best), sum(1 for v in best.values() if v > 0)) if scored else None
    return Outcomes(rewards, finishes)


def committed_outcomes(run: RunDir, cfg: DictConfig) -> Outcomes | None:
    """The outcomes of the committed rows as the batch files hold them (a store run, whose lines stay on its nodes):
    the rewards, and each sample's last piece as "length" when its response reached the response limit, else "stop".
    None when there is no row."""
    from pipegen.observe.committed import committed_rows

    rows = committed_rows(run).rows
    if not rows:
        return None
    limit = int(cfg.actor_rollout_ref.rollout.response_length)
    ends: dict[tuple[int, int], tuple[int, int]] = {}
    for r in rows:
        unit = (r.index, r.sample)
        if unit not in ends or r.trajectory > ends[unit][0]:
            ends[unit] = (r.trajectory, r.response_length)
    cut = sum(1 for _, length in ends.values() if length >= limit)
    return Outcomes(committed_rewards(run), {"length": cut, "stop": len(ends) - cut})


def committed_rewards(run: RunDir) -> RewardSummary | None:
    """The reward figures of the committed rows as the batch files hold them (what trajectories.pkl holds): after
    `pipegen rescore` rewrote them, the streams still carry the rewards at generation. None when no row has a
    score."""
    from pipegen.observe.committed import committed_rows

    rows = [r for r in committed_rows(run).rows if r.reward is not None]
    if not rows:
        return None
    best: dict[int, float] = {}
    for r in rows:
        best[r.index] = max(best.get(r.index, float("-inf")), r.reward)
    return RewardSummary(sum(r.reward for r in rows) / len(rows), len(rows), len(best),
                         sum(1 for v in best.values() if v > 0))
