"""A reward function run by the actor: verl's `default_compute_score`, or a function loaded the verl way
(`custom_reward_function.path/.name/.reward_kwargs` through verl's own `get_custom_reward_fn`, which also
loads a task's reward).

Where it runs, measured per data source: its first samples in a worker thread, timed; from then on a
data source whose samples took under INLINE_BUDGET_S on average is scored inline (a regex scorer such as
gsm8k's takes tens of microseconds: any hop would cost more), and any other in a process pool of
`reward.processes` processes (sympy or math_verify hold the GIL for tens of milliseconds: in a thread
they would stall the actor's event loop). Samples go to the pool in batches (batching.py). A coroutine
function (verl allows `async def compute_score`) is awaited on the actor's loop, as verl's reward loop does.

Owns: loading the function, the process pool and where each sample is scored.
Must never: catch a function's error without raising RewardFailure (the unit is then recorded as
failed), or execute model-written code unasked (verl's default scorer runs the generated program for code
data sources: spec.py leaves those rows unscored).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable

from pipegen.rewards.batching import MicroBatcher
from pipegen.rewards.protocol import RewardFailure, ScoreRequest

log = logging.getLogger("pipegen.actor")

INLINE_BUDGET_S = 0.0005  # a data source scored faster than this on average is scored on the event loop
INLINE_AFTER = 16  # samples timed in a worker thread before a data source is placed
POOL_BATCH = 32  # samples per trip to the process pool


@dataclass(frozen=True)
class FunctionSpec:
    """A reward function as verl's config names it: `path` None = verl's default_compute_score."""

    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.path}:{self.name}" if self.path else "verl's default_compute_score"


def load_function(spec: FunctionSpec) -> Callable[..., Any]:
    """The callable verl's trainer would use: `get_custom_reward_fn` (reward_kwargs merged into every
    call), or default_compute_score."""
    if not spec.path:
        from verl.utils.reward_score import default_compute_score

        return default_compute_score
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    config = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": spec.path, "name": spec.name, "reward_kwargs": dict(spec.reward_kwargs)}}})
    return get_custom_reward_fn(config)


def is_async(fn: Callable[..., Any]) -> bool:
    """verl wraps an async function in a partial of its async caller (`_call_with_kwargs_async`)."""
    return inspect.iscoroutinefunction(getattr(fn, "func", fn))


# ---- the pool worker's side: each pool process loads the function once (its own state, set by its
# initializer) and scores whole batches

_worker_fn: Callable[..., Any] | None = None


def _init_worker(spec: FunctionSpec) -> None:
    global _worker_fn
    _worker_fn = load_function(spec)


def _score_batch(requests: list[dict[str, Any]]) -> list[tuple[bool, Any, float]]:
    """(ok, result or the error's text, seconds) per request."""
    out = []
    for kwargs in requests:
        started = time.perf_counter()
        try:
            result = _worker_fn(**kwargs)
            out.append((True, result, time.perf_counter() - started))
        except Exception as e:  # reported back per sample; the actor raises it as that sample's RewardFailure
            out.append((False, f"{type(e).__name__}: {e}", time.perf_counter() - started))
    return out


class FunctionReward:
    """One reward function in the actor: placed per data source (inline, thread, or process pool)."""

    def __init__(self, spec: FunctionSpec, processes: int, fn: Callable[..., Any] | None = None):
        self.spec = spec
        self.fn = fn if fn is not None else load_function(spec)
        self.coroutine = is_async(self.fn)
        self.processes = processes
        self._cost: dict[Any, tuple[int, float]] = {}  # data_source -> (samples timed, seconds)
        self._pool: ProcessPoolExecutor | None = None
        self._batcher = MicroBatcher(self._send_to_pool, POOL_BATCH, max_inflight=2 * processes)

    def describe(self) -> str:
        return self.spec.describe()

    def _timed(self, request: ScoreRequest) -> Any:
        started = time.perf_counter()
        try:
            return self.fn(**request.kwargs())
        finally:
            self._note(request.data_source, time.perf_counter() - started)

    def _note(self, source: Any, seconds: float) -> None:
        count, total = self._cost.get(source, (0, 0.0))
        self._cost[source] = (count + 1, total + seconds)

    def placement(self, source: Any) -> str:
        count, total = self._cost.get(source, (0, 0.0))
        if count < INLINE_AFTER:
            return "thread"
        return "inline" if total / count < INLINE_BUDGET_S else "pool"

    async def score(self, request: ScoreRequest) -> Any:
        """The function's raw result; NotImplementedError passes through (verl has no scorer for that
        data source); any other error is a RewardFailure."""
        try:
            if self.coroutine:
                return await self.fn(**request.kwargs())
            where = self.placement(request.data_source)
            if where == "inline":
                return self._timed(request)
            if where == "thread":
                return await asyncio.get_running_loop().run_in_executor(None, self._timed, request)
            return await self._batcher.submit(request)
        except (NotImplementedError, RewardFailure):
            raise
        except Exception as e:
            raise RewardFailure(f"reward {self.describe()} raised {type(e).__name__}: {e}") from e

    async def _send_to_pool(self, batch: list[ScoreRequest]) -> list[Any]:
        if self._pool is None:
            # spawn: the actor holds threads (aiohttp's resolver, torch's pools) that a fork would copy mid-state
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=(self.spec,))
            log.info("reward %s: scoring in %d process(es) (samples of %s took over %.1f ms)", self.describe(),
                     self.processes, batch[0].data_source, INLINE_BUDGET_S * 1e3)
        try:
            answers = await asyncio.wrap_future(self._pool.submit(_score_batch, [r.kwargs() for r in batch]))
        except BrokenProcessPool as e:  # a worker died (killed, out of memory): these samples fail, a new pool follows
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            raise RewardFailure(f"reward {self.describe()}: a scoring process died ({e})") from e
        outcomes: list[Any] = []
        for request, (ok, value, seconds) in zip(batch, answers):
            self._note(request.data_source, seconds)
            if ok:
                outcomes.append(value)
            elif value.startswith("NotImplementedError"):
                outcomes.append(NotImplementedError(value))
            else:
                outcomes.append(RewardFailure(f"reward {self.describe()} raised {value}"))
        return outcomes

    async def close(self) -> None:
        await self._batcher.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
