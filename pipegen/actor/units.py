"""Where an actor's units come from: a fixed share of the run (one node), or leases pulled from its node
runner (cluster=ray), so that the actors of a node, and the nodes of a cluster, share work as they free up; and, on
one node, in which order (`LengthEvidence`: longest expected first; `earlier_lengths` reads an earlier run's).

The lease protocol (its routes and messages) is run/lease_protocol.py's; the runner's side is
launch/node_runner.py.

Owns: the actor's view of its pending units and the reports of finished ones.
Must never: decide which units are pending in the cluster (the launcher does), or report a unit done
before its line is written.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
import logging
import math
from collections import deque
from typing import Callable

import orjson

from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.layout import RunDir
from pipegen.run.lease_protocol import DONE_PATH, NEXT_PATH
from pipegen.run.unit_progress import tidy as tidy_progress
from pipegen.run.medium import ROLLOUTS, StreamMedium
from pipegen.run.stream import UnitKeys

log = logging.getLogger("pipegen.actor")

REPORT_INTERVAL_S = 0.5  # finished units reach the runner within this (one fsync per report)


def pending_units(keys: UnitKeys, indices: list[int], run: RunDir, medium: StreamMedium, rank: int,
                  num_actors: int) -> list[tuple[int, int]]:
    """One node: the (position, sample) pairs actor `rank` of `num_actors` still has to run - its share of
    the manifest (every num_actors-th position from rank), minus units the checkpoint has committed and
    units already in a complete line of the run's stream medium past its position - prompt-major, so n samples
    share a prefix."""
    ckpt = load_checkpoint(run.checkpoint)
    in_shards = set(medium.units(ROLLOUTS, ckpt))
    # a crash between a unit's shard line and the unlink of its progress leaves the file: gone now
    tidy_progress(run.progress, lambda index, s: keys.key(index, s) in ckpt.committed or (index, s) in in_shards)
    todo = []
    for pos in range(rank, len(indices), num_actors):
        index = indices[pos]
        for s in range(keys.n):
            if keys.key(index, s) in ckpt.committed or (index, s) in in_shards:
                continue
            todo.append((pos, s))
    return todo


class FixedUnits:
    """One node: the (position, sample) pairs pending_units computed at start, admitted in manifest order, or, with
    `longest_first`, longest-expected first (`LengthEvidence`)."""

    def __init__(self, todo: list[tuple[int, int]], longest_first: bool = False,
                 earlier: dict[int, int] | None = None):
        self._todo = deque(todo)
        self.total = len(todo)
        self.evidence = LengthEvidence(todo, earlier or {}) if longest_first else None

    async def next(self, free: int) -> tuple[int, int] | None:
        if self.evidence is not None:
            return self.evidence.take()
        return self._todo.popleft() if self._todo else None

    def observe(self, pos: int, tokens: int, finished: bool) -> None:
        """A unit of prompt `pos` has generated `tokens` of its answer so far (`finished`: that is its length)."""
        if self.evidence is not None:
            self.evidence.observe(pos, tokens, finished)

    def done(self, index: int, sample: int) -> None:
        pass

    async def close(self) -> None:
        pass


class LengthEvidence:
    """Which pending unit to admit next: the one whose answer is expected longest, so that long answers never start
    last. The evidence, per prompt: its samples already finished (the first to finish predicts the rest: their mean),
    how far its samples in flight have run (a lower bound), and an earlier run's length for the same prompt
    (`earlier`, by position). A prompt with none of them is expected at the median of every length known so far
    (the longest possible before any is known), so a unit without evidence is never starved; among equals, the
    prompt with fewer samples started goes first (one sample of each prompt probes its length), then the one
    that waited longest.

    Three queues, each choice O(log prompts) (a run of a million units must not pay a scan per admission):
    `based`, the prompts with a base length (finished samples or an earlier run's), by that length or how far a
    sample in flight ran, whichever is more; `unbased`, the prompts started but with no sample finished, by how far
    their samples in flight ran (below the median they count as the median, as a prompt without evidence does);
    and the prompts not started yet, in manifest order, at the median. A prompt's entry is pushed again whenever
    its evidence or its started count changes; stale entries are skipped when they come up (`version`)."""

    def __init__(self, todo: list[tuple[int, int]], earlier: dict[int, int]):
        self.pending: dict[int, deque[int]] = {}
        for pos, sample in todo:
            self.pending.setdefault(pos, deque()).append(sample)
        self.earlier = earlier
        self.started: dict[int, int] = {}
        self.finished: dict[int, list[int]] = {}
        self.running: dict[int, int] = {}  # the most tokens a sample in flight has shown
        self.known = sorted(earlier.values())  # every length known: the prior of a prompt without evidence
        self.version: dict[int, int] = {}
        self.order = itertools.count()  # ties: the entry pushed first (the prompt that waited longest) wins
        self.based: list[tuple[float, int, int, int, int]] = []  # (-expected, started, order, pos, version)
        self.unbased: list[tuple[float, int, int, int, int]] = []  # (-running, started, order, pos, version)
        self.unstarted: deque[int] = deque(p for p in self.pending if p not in earlier)  # manifest order
        for pos in self.pending:
            if pos in earlier:
                self._push(pos)

    def _base(self, pos: int) -> float | None:
        done = self.finished.get(pos)
        return sum(done) / len(done) if done else self.earlier.get(pos)

    def _push(self, pos: int) -> None:
        version = self.version[pos] = self.version.get(pos, 0) + 1
        base, started = self._base(pos), self.started.get(pos, 0)
        if base is not None:
            heapq.heappush(self.based, (-max(base, self.running.get(pos, 0)), started, next(self.order), pos, version))
        else:
            heapq.heappush(self.unbased, (-self.running.get(pos, 0), started, next(self.order), pos, version))

    def _top(self, heap: list) -> tuple | None:
        while heap and (heap[0][3] not in self.pending or heap[0][4] != self.version.get(heap[0][3])):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def observe(self, pos: int, tokens: int, finished: bool) -> None:
        if finished:
            self.finished.setdefault(pos, []).append(tokens)
            bisect.insort(self.known, tokens)
        elif tokens > self.running.get(pos, 0):
            self.running[pos] = tokens
        else:
            return
        if pos in self.pending and pos in self.started:
            self._push(pos)

    def take(self) -> tuple[int, int] | None:
        prior = self.known[len(self.known) // 2] if self.known else math.inf
        choices = []  # (expected, -started, rank among the three, pos)
        if (top := self._top(self.based)) is not None:
            choices.append((-top[0], -top[1], 2, top[3]))
        if (top := self._top(self.unbased)) is not None:
            choices.append((max(prior, -top[0]), -top[1], 1, top[3]))
        if self.unstarted:
            choices.append((prior, 0, 0, self.unstarted[0]))
        if not choices:
            return None
        pos = max(choices)[3]
        if self.unstarted and pos == self.unstarted[0] and pos not in self.started:
            self.unstarted.popleft()
        samples = self.pending[pos]
        sample = samples.popleft()
        self.started[pos] = self.started.get(pos, 0) + 1
        if samples:
            self._push(pos)
        else:
            del self.pending[pos]
        return pos, sample


def earlier_lengths(spec: str, indices: list[int]) -> dict[int, int]:
    """An earlier run's answer lengths by position in this run's manifest (`actors.lengths_from`): a run directory
    (the mean response length of each dataset index's samples in its rollout lines) or a JSON file
    {"<dataset index>": tokens}. Raises ValueError naming what it could not read."""
    import json
    from pathlib import Path

    path = Path(spec)
    by_index: dict[int, int] = {}
    if path.is_dir():
        from pipegen.run.medium import open_medium

        run = RunDir(path)
        if not run.config_file.exists():
            raise ValueError(f"actors.lengths_from={spec}: not a pipegen run directory (no conf/config.yaml)")
        sums: dict[int, list[int]] = {}
        for line in open_medium(run).lines(ROLLOUTS):
            record = orjson.loads(line)
            trajectories = record.get("trajectories") or []
            if trajectories:
                sums.setdefault(int(record["index"]), []).append(len(trajectories[-1].get("response_ids") or []))
        by_index = {i: round(sum(v) / len(v)) for i, v in sums.items()}
    else:
        try:
            by_index = {int(k): int(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise ValueError(f"actors.lengths_from={spec}: expected a run directory or a JSON file "
                             f"{{\"<dataset index>\": tokens}} ({e})") from e
    return {pos: by_index[index] for pos, index in enumerate(indices) if index in by_index}


class LeasedUnits:
    """cluster=ray: units pulled from the node runner's lease endpoint at `url`, a few at a time."""

    def __init__(self, url: str, actor: str, session, keys: UnitKeys, indices: list[int],
                 sync_shards: Callable[[], None]):
        self.url = url.rstrip("/")
        self.actor = actor
        self.session = session
        self.keys = keys
        self.position = {index: pos for pos, index in enumerate(indices)}
        self.sync_shards = sync_shards
        self.total = 0  # units received so far
        self._buffer: deque[int] = deque()
        self._done: list[int] = []
        self._finished = False
        self._reporter: asyncio.Task | None = None

    async def next(self, free: int) -> tuple[int, int] | None:
        if self._reporter is None:
            self._reporter = asyncio.create_task(self._report_loop())
        while not self._buffer:
            if self._finished:
                return None
            reply = await self._post(NEXT_PATH, {"want": max(1, free), "done": self._take_done()})
            self._finished = bool(reply.get("finished"))
            self._buffer.extend(reply.get("units") or [])
            self.total += len(reply.get("units") or [])
        index, sample = self.keys.unit(self._buffer.popleft())
        return self.position[index], sample

    def done(self, index: int, sample: int) -> None:
        self._done.append(self.keys.key(index, sample))

    async def close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
        if self._done:
            await self._post(DONE_PATH, {"done": self._take_done()})

    def _take_done(self) -> list[int]:
        if not self._done:
            return []
        self.sync_shards()  # the lines of these units are on disk before the runner hears of them
        done, self._done = self._done, []
        return done

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            if self._done:
                await self._post(DONE_PATH, {"done": self._take_done()})

    async def _post(self, path: str, body: dict) -> dict:
        import aiohttp

        body = {"actor": self.actor, **body}
        while True:  # the runner is this process's parent: while it lives, it answers
            try:
                async with self.session.post(self.url + path, data=orjson.dumps(body),
                                             timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    resp.raise_for_status()
                    return orjson.loads(await resp.read())
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                log.warning("lease endpoint %s%s: %s; retrying in 1s", self.url, path, e)
                await asyncio.sleep(1.0)
