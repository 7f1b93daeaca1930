"""A reward function run by the actor: verl's `default_compute_score`, or a function loaded the verl way
(`custom_reward_function.path/.name/.reward_kwargs` as verl's own `get_custom_reward_fn` loads it, which also
loads a task's reward: verl_private.custom_reward_fn, verl's loader without verl's package imports).

Where it runs, measured per data source: its first samples in a worker thread, timed; from then on a
data source whose samples took under INLINE_BUDGET_S on average is scored inline (a regex scorer such as
gsm8k's takes tens of microseconds: any hop would cost more), and any other in a process pool of
`reward.processes` processes (sympy or math_verify hold the GIL for tens of milliseconds: in a thread
they would stall the actor's event loop). Samples go to the pool in batches (batching.py). A coroutine
function (verl allows `async def compute_score`) is awaited on the actor's loop, as verl's reward loop does.

Time limit (`reward.timeout_s`, per sample): a sample that takes longer fails its unit with a RewardFailure
naming the limit (the failures stream; the next launch retries it), so one input on which a function hangs
cannot stall the run unseen. In the pool each sample runs under an interval timer (SIGALRM in the pool
process, whose main thread runs it), and a batch that still overruns, in C code that never lets the signal in,
has its process killed and replaced by pebble's pool, failing that batch's samples. A function in a worker
thread or a coroutine is given up on at the limit (a thread cannot be stopped: it runs on, and the unit
fails). An inline function, proven under INLINE_BUDGET_S on average, has no limit.

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
import signal
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

import orjson
from pebble import ProcessExpired, ProcessPool  # a per-task time limit that kills and replaces a stuck process

from pipegen.rewards.batching import MicroBatcher
from pipegen.rewards.protocol import RewardFailure, ScoreRequest
from pipegen.config.schema import Reward, RewardSpec

log = logging.getLogger("pipegen.actor")

INLINE_BUDGET_S = 0.0005  # a data source scored faster than this on average is scored on the event loop
INLINE_AFTER = 16  # samples timed in a worker thread before a data source is placed
POOL_BATCH = 32  # samples per trip to the process pool
POOL_GRACE_S = 10.0  # a pool batch gets its samples' limits plus this before its process is killed


_loaded: dict[tuple[str, str, bytes], Callable[..., Any]] = {}  # per process: a file's top-level code runs once


def load_function(spec: RewardSpec) -> Callable[..., Any]:
    """The callable verl's trainer would use: `get_custom_reward_fn`'s (reward_kwargs merged into every
    call; verl_private.custom_reward_fn, without importing verl's package), or default_compute_score. A function file is loaded once per process (the launcher checks it, then
    its preflight calls it: the user's top-level code runs once there, as in each actor)."""
    if spec.path:
        key = (spec.path, spec.name, orjson.dumps(spec.reward_kwargs, option=orjson.OPT_SORT_KEYS, default=str))
        if key not in _loaded:
            _loaded[key] = _load(spec)
        return _loaded[key]
    return _load(spec)


def _load(spec: RewardSpec) -> Callable[..., Any]:
    if not spec.path:
        from verl.utils.reward_score import default_compute_score

        return default_compute_score
    from pipegen.verl_private import custom_reward_fn

    return custom_reward_fn(spec.path, spec.name, dict(spec.reward_kwargs))


def is_async(fn: Callable[..., Any]) -> bool:
    """verl wraps an async function in a partial of its async caller (`_call_with_kwargs_async`)."""
    return inspect.iscoroutinefunction(getattr(fn, "func", fn))


# ---- the pool worker's side: each pool process loads the function once (its own state, set by its
# initializer) and scores whole batches, each sample under the interval timer

_worker_fn: Callable[..., Any] | None = None
_worker_limit_s: float = 0.0


class _OverLimit(Exception):
    """Raised in a pool process by its interval timer when a sample overruns reward.timeout_s."""


def _over_limit(signum: int, frame: Any) -> None:
    raise _OverLimit()


def _init_worker(spec: RewardSpec, limit_s: float) -> None:
    global _worker_fn, _worker_limit_s
    _worker_fn = load_function(spec)
    _worker_limit_s = limit_s
    signal.signal(signal.SIGALRM, _over_limit)


def _score_batch(requests: list[dict[str, Any]]) -> list[tuple[bool, Any, float]]:
    """(ok, result or what went wrong as "raised <error>" / "took longer ...", seconds) per request."""
    out = []
    for kwargs in requests:
        started = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, _worker_limit_s)
        try:
            result = _worker_fn(**kwargs)
            out.append((True, result, time.perf_counter() - started))
        except _OverLimit:
            out.append((False, over_limit(_worker_limit_s), time.perf_counter() - started))
        except Exception as e:  # reported back per sample; the actor raises it as that sample's RewardFailure
            out.append((False, f"raised {type(e).__name__}: {e}", time.perf_counter() - started))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return out


def over_limit(limit_s: float) -> str:
    return f"took longer than reward.timeout_s={limit_s:g} on this sample (raise it if your function needs longer)"


class FunctionReward:
    """One reward function in the actor: placed per data source (inline, thread, or process pool)."""

    def __init__(self, spec: RewardSpec, settings: Reward, fn: Callable[..., Any] | None = None):
        """`spec`: a function's RewardSpec (no path: verl's default); `settings`: reward.processes and
        reward.timeout_s."""
        self.spec = spec
        self.fn = fn if fn is not None else load_function(spec)
        self.coroutine = is_async(self.fn)
        self.processes = int(settings.processes)
        self.timeout_s = float(settings.timeout_s)
        self._cost: dict[Any, tuple[int, float]] = {}  # data_source -> (samples timed, seconds)
        self._pool: ProcessPool | None = None
        self._batcher = MicroBatcher(self._send_to_pool, POOL_BATCH, max_inflight=2 * self.processes)

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
                return await asyncio.wait_for(self.fn(**request.kwargs()), self.timeout_s)
            where = self.placement(request.data_source)
            if where == "inline":
                return self._timed(request)
            if where == "thread":
                return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, self._timed, request),
                                              self.timeout_s)
            return await self._batcher.submit(request)
        except (NotImplementedError, RewardFailure):
            raise
        except asyncio.TimeoutError:
            raise RewardFailure(f"reward {self.describe()} {over_limit(self.timeout_s)}") from None
        except Exception as e:
            raise RewardFailure(f"reward {self.describe()} raised {type(e).__name__}: {e}") from e

    async def _send_to_pool(self, batch: list[ScoreRequest]) -> list[Any]:
        if self._pool is None:
            # spawn: the actor holds threads (aiohttp's resolver, torch's pools) that a fork would copy mid-state
            self._pool = ProcessPool(self.processes, initializer=_init_worker, initargs=(self.spec, self.timeout_s),
                                     context=multiprocessing.get_context("spawn"))
            log.info("reward %s: scoring in %d process(es) (samples of %s took over %.1f ms)", self.describe(),
                     self.processes, batch[0].data_source, INLINE_BUDGET_S * 1e3)
        limit = self.timeout_s * len(batch) + POOL_GRACE_S
        future = self._pool.schedule(_score_batch, args=([r.kwargs() for r in batch],), timeout=limit)
        try:
            answers = await asyncio.wrap_future(future)
        except FutureTimeout:  # pebble killed the process (C code that never let the timer in); a new one follows
            raise RewardFailure(f"reward {self.describe()}: a batch of {len(batch)} samples ran past {limit:g} s "
                                f"(reward.timeout_s={self.timeout_s:g} each); its process was stopped") from None
        except ProcessExpired as e:  # a worker died (killed, out of memory): these samples fail, a new one follows
            raise RewardFailure(f"reward {self.describe()}: a scoring process died ({e})") from e
        outcomes: list[Any] = []
        for request, (ok, value, seconds) in zip(batch, answers):
            self._note(request.data_source, seconds)
            if ok:
                outcomes.append(value)
            elif value.startswith("raised NotImplementedError"):
                outcomes.append(NotImplementedError(value.removeprefix("raised ")))
            else:
                outcomes.append(RewardFailure(f"reward {self.describe()} {value}"))
        return outcomes

    async def close(self) -> None:
        await self._batcher.close()
        if self._pool is not None:
            self._pool.stop()  # what is still scoring belongs to units that are being given up
            self._pool.join()
            self._pool = None
