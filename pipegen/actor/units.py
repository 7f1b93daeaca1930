"""Where an actor's units come from: a fixed share of the run (one node), or leases pulled from its node
runner (cluster=ray), so that the actors of a node, and the nodes of a cluster, share work as they free up.

The lease protocol (its routes and messages) is run/lease_protocol.py's; the runner's side is
launch/node_runner.py.

Owns: the actor's view of its pending units and the reports of finished ones.
Must never: decide which units are pending in the cluster (the launcher does), or report a unit done
before its line is written.
"""

from __future__ import annotations

import asyncio
import logging
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
    """One node: the (position, sample) pairs pending_units computed at start."""

    def __init__(self, todo: list[tuple[int, int]]):
        self._todo = deque(todo)
        self.total = len(todo)

    async def next(self, free: int) -> tuple[int, int] | None:
        return self._todo.popleft() if self._todo else None

    def done(self, index: int, sample: int) -> None:
        pass

    async def close(self) -> None:
        pass


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
