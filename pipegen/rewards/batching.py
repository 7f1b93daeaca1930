"""Many samples waiting to be scored, sent as one request: what the process pool and the verifier share.

Why by hand: a request per sample costs the actor's one core an HTTP exchange (or a pickle round trip) per
unit, as much as the rest of the unit's bookkeeping; asyncio has no batching queue. Each send takes
whatever is waiting (up to `max_batch`), with at most `max_inflight` sends out at once, so a quiet actor
sends single samples at once and a busy one sends fuller batches, never waiting on a timer.

Owns: grouping waiting samples into sends and handing each sample its own outcome.
Must never: drop a sample's outcome, or give one sample another's.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")

# A send answers one outcome per item, in order: a value, or an Exception instance for that item alone.
Send = Callable[[list[T]], Awaitable[list[Any]]]


class MicroBatcher(Generic[T]):
    def __init__(self, send: Send, max_batch: int, max_inflight: int):
        self.send = send
        self.max_batch = max(1, int(max_batch))
        self.max_inflight = max(1, int(max_inflight))
        self._waiting: list[tuple[T, asyncio.Future]] = []
        self._senders: set[asyncio.Task] = set()

    async def submit(self, item: T) -> Any:
        """The item's outcome (its exception is raised here)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if len(self._senders) < self.max_inflight:
            task = asyncio.create_task(self._drain())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:self.max_batch], self._waiting[self.max_batch:]
            try:
                outcomes = await self.send([item for item, _ in batch])
                if len(outcomes) != len(batch):
                    raise RuntimeError(f"{len(outcomes)} outcomes for {len(batch)} samples")
            except Exception as e:  # the send failed as a whole: every sample of it fails with that reason
                outcomes = [e] * len(batch)
            for (_, future), outcome in zip(batch, outcomes):
                if future.done():  # its unit was cancelled meanwhile
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    async def close(self) -> None:
        for task in list(self._senders):
            task.cancel()
        await asyncio.gather(*self._senders, return_exceptions=True)
