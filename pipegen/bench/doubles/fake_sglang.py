"""A fake SGLang server that speaks SGLang 0.5.12's batched, streamed `/generate` and charges its front end per
HTTP request: what grouped requests, streamed members and long-tailed answers are tested and measured against
without a GPU.

    python -m pipegen.bench.doubles.fake_sglang --port 0 --port-file F [--front-ms 1.25] [--item-ms 0.02]
        [--step-ms 10] [--step-ms-per-running 0] [--max-running 160] [--answer-tokens N]
        [--lengths lognormal:MEDIAN:SIGMA | pareto:XM:ALPHA | grouped:MEDIAN:SIGMA:SAMPLE_SIGMA] [--incremental-streaming-output] [--eos-id ID]
        [--crash-on-request K] [--crash-delay-s S]

The protocol, as SGLang's `http_server.py` and `TokenizerManager` serve it: `input_ids` one list (single) or a
list of lists (batch); `sampling_params` one dict or one per member; `rid` a string or one per member
(duplicates in flight: 400); `return_logprob`; `stream`. A single answer is one object, a batch a list in input
order. Streamed, every chunk is `data: <json>\\n\\n` carrying the member's `index` (batch only) and the stream ends
with `data: [DONE]`. Each member sends a chunk by SGLang's scheduler rule (`stream_output_generation`): with its
`stream_interval` I > 1 when `len(output_ids) % I == 1` (its 1st, (I+1)th, (2I+1)th... token), with I = 1 (the
default when the key is absent) at every token, and always at its finish; an intermediate chunk has
`finish_reason: null`. A chunk holds the answer so far (cumulative `output_ids` and `output_token_logprobs`), or,
with `--incremental-streaming-output`, only the ids and triples since the member's previous chunk; in both,
`meta_info.completion_tokens` is the answer's length so far. An interval at least the answer's length gives the
first token's chunk and the final one. `meta_info` holds `id`, `finish_reason` (`stop` with `matched` = the last
id when the answer ends before `max_new_tokens`, `length` at it; `abort` shapes on abort), `prompt_tokens`,
`completion_tokens`, `output_token_logprobs` as `[logprob, id, null]` triples. `POST /abort_request {rid}` aborts
every member in flight whose rid starts with it; a client that disconnects aborts its members.
`/get_server_info` reports `max_running_requests` and `max_total_num_tokens`; `/get_load` SGLang's per-DP list;
`/health`, `/health_generate`, `/get_model_info`; `/fake_stats` its counters (for tests and the bench), among
them `output_tokens` (every token the scheduler generated, aborted members' included), `chunks` (intermediate
chunks sent), `members_per_call` and `calls_per_answer` (how many /generate members carried each answer: a
re-send, a hedge copy or a recognised continuation adds one).

The costs, modelled on SGLang's processes: the front end (SGLang's one tokenizer-manager process) spends
`--front-ms` per HTTP request plus `--item-ms` per member, blocking, one request after another (a sleep on
the event loop: it uses no CPU, so the model holds on a busy machine); the scheduler (SGLang's GPU process)
runs `--max-running` members at once on its own clock (the front end never slows it; its answers wait for the
front end to be free, as SGLang's do). Two scheduler models:
- `--step-ms-per-running 0` (the default): each member takes `--step-ms` per output token from when it gets a
  slot (closed form: a slot freed at t is refilled at t);
- `--step-ms-per-running B`, GPU-like: a batched decode loop; each step takes `--step-ms + B x running`
  milliseconds and gives every running member one token; a member admitted during a step joins it. Its ceiling is
  `max_running / (step_ms + B x max_running)` tokens per ms.

Answers are `min(max_new_tokens, --answer-tokens)` tokens long (finish `length`), or, with `--lengths`, drawn from
a long-tailed distribution (lognormal with that median and sigma, Pareto with that minimum and shape, or grouped:
a lognormal median per prompt, each sample lognormal around it), at least 1, as a pure function of the prompt ids and `sampling_seed`, and cut at `max_new_tokens`. With `--lengths`
a request whose ids are an earlier answer's prompt (at least PREFIX_IDS ids long) plus the start of that answer
(a continuation, whatever its seed) continues that answer: same total length, same ids. Ids (in
`[100, --vocab - 100)`, the last one `--eos-id` when given and the answer stops) and log-probs are a pure function
of the prompt, the member's `sampling_seed` and the position.

Owns: that protocol and that cost model. Must never: import torch, verl or pipegen's product code (it starts
in well under a second and is a stand-in for someone else's server).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import itertools
import logging
import math
import os
import random
import time
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson
from aiohttp import web

log = logging.getLogger("pipegen.fake_sglang")

TOKEN_LO = 100  # answer ids stay clear of the special ids at both ends of a vocabulary
CRASH_EXIT_CODE = 86
PREFIX_IDS = 16  # a continuation is looked for among the answers whose prompt starts with the same ids


def token(ids: list[int], seed: int, pos: int, vocab: int) -> int:
    return TOKEN_LO + (ids[-1] * 131 + seed * 31 + pos * 7 + 11) % (vocab - 2 * TOKEN_LO)


def logprob_of(tok: int) -> float:
    return -0.5 - (tok % 7) * 0.125


@dataclass(frozen=True)
class LengthModel:
    """A long-tailed answer length: `lognormal` (a = median, b = sigma), `pareto` (a = minimum, b = shape), or
    `grouped` (lengths that correlate within a prompt's samples, as real models' do: the prompt's own median drawn
    lognormal around a with sigma b, each sample lognormal around that median with sigma c)."""

    kind: str
    a: float
    b: float
    c: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthModel:
        kind, _, rest = spec.partition(":")
        parts = rest.split(":")
        wanted = 3 if kind == "grouped" else 2
        if kind not in ("lognormal", "pareto", "grouped") or len(parts) != wanted or not all(parts):
            raise ValueError(f"--lengths {spec!r}: expected lognormal:MEDIAN:SIGMA, pareto:XM:ALPHA or "
                             f"grouped:MEDIAN:SIGMA:SAMPLE_SIGMA")
        return cls(kind, *map(float, parts))

    def draw(self, prompt: list[int], seed: int) -> int:
        """The answer's length for this prompt and seed: the same for every copy of the request."""
        ids = array("q", prompt).tobytes()
        digest = hashlib.blake2b(ids + seed.to_bytes(8, "little", signed=True), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "little"))
        if self.kind == "lognormal":
            x = self.a * math.exp(self.b * rng.gauss(0.0, 1.0))
        elif self.kind == "grouped":  # the prompt's median from the prompt alone, the sample's spread from its seed
            of_prompt = random.Random(int.from_bytes(hashlib.blake2b(ids, digest_size=8).digest(), "little"))
            x = self.a * math.exp(self.b * of_prompt.gauss(0.0, 1.0)) * math.exp(self.c * rng.gauss(0.0, 1.0))
        else:
            x = self.a * (1.0 - rng.random()) ** (-1.0 / self.b)
        return max(1, min(1 << 30, round(x)))


@dataclass(eq=False)
class Origin:
    """One answer as first asked for: what its ids derive from and, with --lengths, its whole drawn length."""

    key: tuple[bytes, int]  # (prompt digest, seed): how calls_per_answer counts its copies
    last_id: int
    seed: int
    prompt_len: int
    total: int | None  # None: no drawn length (the answer is as long as its budget allows)
    eos_id: int
    vocab: int

    def token_at(self, pos: int) -> int:
        if self.eos_id >= 0 and self.total is not None and pos == self.total - 1:
            return self.eos_id
        return token([self.last_id], self.seed, pos, self.vocab)


@dataclass(eq=False)
class Item:
    """One member of a /generate request on its way through the fake scheduler."""

    rid: str
    input_ids: list[int]
    max_new: int
    seed: int
    stream_interval: int
    length: int  # tokens this request generates when nothing aborts it
    done: asyncio.Future
    origin: Origin | None = None  # what its ids derive from (set for every member the server accepts)
    pos0: int = 0  # the position in its origin's answer of this request's first token (a continuation's > 0)
    stop: bool = False  # ends with EOS before max_new_tokens (finish `stop`), else `length`
    on_chunk: Callable[[int], None] | None = None  # streamed: called with the token count at each chunk point
    start_t: float | None = None  # when it got a running slot (scheduler clock)
    finish_t: float | None = None
    start_step: int = 0  # the step model's step count when it got a slot
    aborted: bool = False
    _ids: list[int] | None = None
    _triples: list[list] | None = None

    def token_at(self, pos: int) -> int:
        return self.origin.token_at(self.pos0 + pos)

    def output(self, start: int, end: int) -> tuple[list[int], list[list]]:
        """Its ids and `[logprob, id, null]` triples from `start` to `end`, made once for the whole answer (a long
        answer's chunks each slice them instead of making them again)."""
        if self._ids is None:
            self._ids = [self.token_at(i) for i in range(self.length)]
            self._triples = [[logprob_of(t), t, None] for t in self._ids]
        return self._ids[start:end], self._triples[start:end]


@dataclass
class Stats:
    http_requests: int = 0
    batch_requests: int = 0
    items: int = 0
    finished: int = 0
    aborted: int = 0
    abort_requests: int = 0
    disconnects: int = 0
    max_running_seen: int = 0
    output_tokens: int = 0  # every token the scheduler generated, aborted members' included
    longest_tokens: int = 0  # the longest finished answer...
    longest_own_s: float = 0.0  # ...and its own generation time, first step to last, among the others it ran with
    chunks: int = 0  # intermediate stream chunks sent (finish_reason null)
    continuations: int = 0  # members recognised as continuing an earlier answer (--lengths only)
    member_seconds: float = 0.0  # the step model's running members integrated over its clock (its mean batch x time)
    rids: list[str] = field(default_factory=list)
    members_per_call: Counter = field(default_factory=Counter)
    calls_per_key: Counter = field(default_factory=Counter)  # (prompt digest, seed) -> members that carried it
    first_item_t: float | None = None  # time.time() of the first member received, and of the last one answered
    last_answer_t: float | None = None

    def ended(self, item: Item, tokens: int | None) -> None:
        """An item left the scheduler, finished or aborted, having generated `tokens` (None: never ran)."""
        if item.aborted:
            self.aborted += 1
        else:
            self.finished += 1
            own = (item.finish_t or 0.0) - (item.start_t or 0.0)
            if item.start_t is not None and (tokens or 0, own) > (self.longest_tokens, self.longest_own_s):
                self.longest_tokens, self.longest_own_s = tokens or 0, own  # the longest answer's own generation time
        self.output_tokens += tokens or 0

    def report(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("members_per_call", "calls_per_key")}
        out["generate_calls"] = self.http_requests
        out["members_per_call"] = {str(k): v for k, v in sorted(self.members_per_call.items())}
        out["calls_per_answer"] = {str(k): v for k, v in sorted(Counter(self.calls_per_key.values()).items())}
        return out


def next_chunk_point(n: int, interval: int) -> int:
    """The token count of a member's next chunk after the one at `n` (points 1, 1 + I, 1 + 2I, ...: SGLang's
    `len(output_ids) % I == 1`, every token when I is 1)."""
    return n + max(1, interval)


class Scheduler:
    """`max_running` slots; a member holds one for `length * step_s` from when it gets it (the clock is the
    scheduler's own: a slot freed at t is refilled at t, however late the event loop looks)."""

    def __init__(self, max_running: int, step_s: float, stats: Stats):
        self.max_running = max_running
        self.step_s = step_s
        self.stats = stats
        self.waiting: list[tuple[float, int, Item]] = []  # (ready time, order, item): FIFO
        self.running: list[tuple[float, int, Item]] = []  # heap on finish time
        self.chunks: list[tuple[float, int, Item, int]] = []  # (time, order, item, tokens): streamed chunk points
        self.order = itertools.count()
        self.wake = asyncio.Event()

    def submit(self, item: Item, now: float) -> None:
        heapq.heappush(self.waiting, (now, next(self.order), item))
        self._admit(now)
        self.wake.set()

    def _admit(self, t: float) -> None:
        while self.waiting and len(self.running) < self.max_running:
            ready, _, item = heapq.heappop(self.waiting)
            if item.aborted:
                continue
            item.start_t = max(t, ready)
            item.finish_t = item.start_t + item.length * self.step_s
            heapq.heappush(self.running, (item.finish_t, next(self.order), item))
            if item.on_chunk is not None and item.length > 1:
                heapq.heappush(self.chunks, (item.start_t + self.step_s, next(self.order), item, 1))
        self.stats.max_running_seen = max(self.stats.max_running_seen, len(self.running))

    def abort(self, item: Item, now: float) -> None:
        item.aborted = True
        done_tokens = 0 if item.start_t is None else max(0, min(item.length, int((now - item.start_t) / self.step_s)))
        if item.start_t is not None:  # free its slot now
            self.running = [e for e in self.running if e[2] is not item]
            heapq.heapify(self.running)
            self._admit(now)
        if not item.done.done():
            tokens = done_tokens if item.start_t is not None else None
            self.stats.ended(item, tokens)
            item.done.set_result(tokens)
        self.wake.set()

    def load(self) -> tuple[int, int]:
        return len(self.running), sum(1 for _, _, it in self.waiting if not it.aborted)

    def _chunks_until(self, now: float) -> None:
        while self.chunks and self.chunks[0][0] <= now:
            _, _, item, n = heapq.heappop(self.chunks)
            if item.aborted or item.done.done() or item.on_chunk is None:
                continue
            item.on_chunk(n)
            nxt = next_chunk_point(n, item.stream_interval)
            if nxt < item.length:
                heapq.heappush(self.chunks, (item.start_t + nxt * self.step_s, next(self.order), item, nxt))

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            while self.running and self.running[0][0] <= now:
                finish_t, _, item = heapq.heappop(self.running)
                self._chunks_until(finish_t)
                if not item.done.done():
                    self.stats.ended(item, item.length)
                    item.done.set_result(item.length)
                self._admit(finish_t)
            self._chunks_until(now)
            self.wake.clear()
            tops = [heap[0][0] for heap in (self.running, self.chunks) if heap]
            timeout = max(0.0, min(tops) - time.monotonic()) if tops else None
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass


class StepScheduler:
    """GPU-like: a batched decode loop on the scheduler's own clock. Each step takes `step_s + per_running_s x
    running` and gives every running member one token, so a member's finish is a step count known when it gets a
    slot; between two events (a finish, a chunk point, an arrival, an abort) the batch is constant, so the loop
    sleeps from event to event instead of ticking every step, and catches up on its own clock when the event
    loop is late."""

    def __init__(self, max_running: int, step_s: float, per_running_s: float, stats: Stats):
        self.max_running = max_running
        self.a, self.b = step_s, per_running_s
        self.stats = stats
        self.waiting: deque[Item] = deque()
        self.running: set[Item] = set()
        self.finishes: list[tuple[int, int, Item]] = []  # (step, order, item)
        self.chunks: list[tuple[int, int, Item, int]] = []  # (step, order, item, tokens)
        self.step = 0  # steps completed
        self.t = time.monotonic()  # when step `step` completed (or the idle engine's last look)
        self.order = itertools.count()
        self.wake = asyncio.Event()

    def step_s(self) -> float:
        return self.a + self.b * len(self.running)

    def submit(self, item: Item, now: float) -> None:
        self._sync(now)
        if not self.running:  # an idle engine starts its next step when work arrives
            self.t = now
        self.waiting.append(item)
        self._admit()
        self.wake.set()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            item = self.waiting.popleft()
            if item.aborted:
                continue
            item.start_step, item.start_t = self.step, self.t
            self.running.add(item)
            heapq.heappush(self.finishes, (self.step + item.length, next(self.order), item))
            if item.on_chunk is not None and item.length > 1:
                heapq.heappush(self.chunks, (self.step + 1, next(self.order), item, 1))
        self.stats.max_running_seen = max(self.stats.max_running_seen, len(self.running))

    def _next_event(self) -> int | None:
        while self.finishes and self.finishes[0][2] not in self.running:
            heapq.heappop(self.finishes)
        while self.chunks and self.chunks[0][2] not in self.running:
            heapq.heappop(self.chunks)
        steps = [heap[0][0] for heap in (self.finishes, self.chunks) if heap]
        return min(steps) if steps else None

    def _sync(self, now: float) -> None:
        """Run the loop's clock forward to `now`: every event due by then, at its own step's time."""
        while self.running:
            nxt = self._next_event()
            if nxt is None:
                return
            d = self.step_s()
            t_next = self.t + (nxt - self.step) * d
            if t_next > now:
                whole = int((now - self.t) / d) if d > 0 else 0
                if 0 < whole < nxt - self.step:
                    self._advance(self.step + whole, self.t + whole * d)
                return
            self._advance(nxt, t_next)
            while self.chunks and self.chunks[0][0] == nxt:
                _, _, item, n = heapq.heappop(self.chunks)
                if item in self.running and item.on_chunk is not None:
                    item.on_chunk(n)
                    following = next_chunk_point(n, item.stream_interval)
                    if following < item.length:
                        heapq.heappush(self.chunks, (item.start_step + following, next(self.order), item, following))
            while self.finishes and self.finishes[0][0] == nxt:
                _, _, item = heapq.heappop(self.finishes)
                if item in self.running:
                    self.running.discard(item)
                    item.finish_t = t_next
                    if not item.done.done():
                        self.stats.ended(item, item.length)
                        item.done.set_result(item.length)
            self._admit()

    def _advance(self, step: int, t: float) -> None:
        self.stats.member_seconds += len(self.running) * (t - self.t)
        self.step, self.t = step, t

    def abort(self, item: Item, now: float) -> None:
        self._sync(now)
        item.aborted = True
        tokens = None
        if item in self.running:
            tokens = max(0, min(item.length, self.step - item.start_step))
            self.running.discard(item)
            self._admit()
        if not item.done.done():
            self.stats.ended(item, tokens)
            item.done.set_result(tokens)
        self.wake.set()

    def load(self) -> tuple[int, int]:
        self._sync(time.monotonic())
        return len(self.running), sum(1 for it in self.waiting if not it.aborted)

    async def run(self) -> None:
        while True:
            self._sync(time.monotonic())
            self.wake.clear()
            timeout = None
            nxt = self._next_event() if self.running else None
            if nxt is not None:
                timeout = max(0.0, self.t + (nxt - self.step) * self.step_s() - time.monotonic())
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass


class FakeSGLang:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.stats = Stats()
        if args.step_ms_per_running > 0:
            self.scheduler: Scheduler | StepScheduler = StepScheduler(
                args.max_running, args.step_ms / 1000.0, args.step_ms_per_running / 1000.0, self.stats)
        else:
            self.scheduler = Scheduler(args.max_running, args.step_ms / 1000.0, self.stats)
        self.lengths = LengthModel.parse(args.lengths) if args.lengths else None
        self.origins: dict[tuple[int, ...], list[Origin]] = {}  # by the prompt's first PREFIX_IDS ids
        self.inflight: dict[str, Item] = {}

    # ---- answers: lengths, continuations, ids ----
    def _continued(self, prompt: list[int]) -> tuple[Origin, int] | None:
        """The earlier answer this prompt continues (its prompt, then its first k ids), and k."""
        for origin in self.origins.get(tuple(prompt[:PREFIX_IDS]), ()):
            k = len(prompt) - origin.prompt_len
            if (0 < k <= (origin.total or 0) and prompt[origin.prompt_len - 1] == origin.last_id
                    and all(prompt[origin.prompt_len + p] == origin.token_at(p) for p in range(k))):
                return origin, k
        return None

    def _shape(self, prompt: list[int], max_new: int, seed: int, loop: asyncio.AbstractEventLoop, rid: str,
               interval: int) -> Item:
        digest = hashlib.blake2b(array("q", prompt).tobytes(), digest_size=8).digest()
        if self.lengths is None:
            cap = self.args.answer_tokens or max_new
            item = Item(rid, prompt, max_new, seed, interval, max(0, min(max_new, cap)), loop.create_future())
            item.origin = Origin((digest, seed), prompt[-1], seed, len(prompt), None, -1, self.args.vocab)
            self.stats.calls_per_key[item.origin.key] += 1
            return item
        found = self._continued(prompt)
        if found is not None:
            origin, k = found
            self.stats.continuations += 1
        else:
            origin, k = Origin((digest, seed), prompt[-1], seed, len(prompt), self.lengths.draw(prompt, seed),
                               self.args.eos_id, self.args.vocab), 0
            known = self.origins.setdefault(tuple(prompt[:PREFIX_IDS]), [])
            if all(o.key != origin.key for o in known):
                known.append(origin)
        left = origin.total - k
        self.stats.calls_per_key[origin.key] += 1
        return Item(rid, prompt, max_new, seed, interval, max(0, min(max_new, left)), loop.create_future(),
                    origin=origin, pos0=k, stop=left < max_new)

    def _items(self, body: dict) -> tuple[list[Item], bool]:
        ids = body.get("input_ids")
        if not ids:
            raise web.HTTPBadRequest(text=orjson.dumps({"error": {"message": "input_ids cannot be empty."}}).decode(),
                                     content_type="application/json")
        single = not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        params = body.get("sampling_params") or {}
        params = [params] * len(prompts) if isinstance(params, dict) else params
        rids = body.get("rid")
        if rids is None:
            rids = [os.urandom(16).hex() for _ in prompts]
        elif isinstance(rids, str):
            rids = [rids] if single else [f"{rids}_{i}" for i in range(len(prompts))]
        if len(params) != len(prompts) or len(rids) != len(prompts):
            raise web.HTTPBadRequest(text='{"error": {"message": "batch lengths differ"}}',
                                     content_type="application/json")
        if len(set(rids)) != len(rids):
            raise web.HTTPBadRequest(text=orjson.dumps({"error": {"message": f"Duplicate request IDs detected "
                                                                              f"within the request: {rids}"}}).decode(),
                                     content_type="application/json")
        for rid in rids:
            if rid in self.inflight:
                raise web.HTTPBadRequest(text=orjson.dumps({"error": {"message": f"Duplicate request ID detected: "
                                                                                  f"{rid}"}}).decode(),
                                         content_type="application/json")
        loop = asyncio.get_running_loop()
        return [self._shape([int(t) for t in prompt], int(sp.get("max_new_tokens", 128)),
                            int(sp.get("sampling_seed", 42)), loop, rid, int(sp.get("stream_interval") or 1))
                for prompt, sp, rid in zip(prompts, params, rids)], single

    def _answer(self, item: Item, tokens: int | None, logprob: bool, start: int = 0,
                final: bool = True) -> dict[str, Any]:
        """The member's answer (final) or an intermediate chunk after `tokens` tokens, with the ids from `start`
        on (0: the answer so far)."""
        if not final:
            finish = None
        elif item.aborted:
            finish = ({"type": "abort", "message": "Abort in waiting queue"} if tokens is None else
                      {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
        elif item.stop and tokens == item.length:
            finish = {"type": "stop", "matched": item.token_at(item.length - 1)}
        else:
            finish = {"type": "length", "length": item.max_new}
        out, triples = item.output(start, tokens or 0)
        meta: dict[str, Any] = {"id": item.rid, "finish_reason": finish, "prompt_tokens": len(item.input_ids),
                                "weight_version": "default", "num_retractions": 0}
        if logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = triples
        meta["completion_tokens"] = tokens or 0
        meta["cached_tokens"] = 0
        meta["e2e_latency"] = 0.0
        return {"output_ids": out, "meta_info": meta}

    def _front_end(self, members: int) -> None:
        # SGLang's tokenizer manager: one process, so its per-request work blocks every other request's
        time.sleep((self.args.front_ms + self.args.item_ms * members) / 1000.0)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.stats.http_requests += 1
        if self.args.crash_on_request and self.stats.http_requests == self.args.crash_on_request:
            asyncio.get_running_loop().call_later(self.args.crash_delay_s, os._exit, CRASH_EXIT_CODE)
        body = orjson.loads(await request.read())
        items, single = self._items(body)
        self._front_end(len(items))
        if not single:
            self.stats.batch_requests += 1
        self.stats.items += len(items)
        self.stats.members_per_call[len(items)] += 1
        if self.stats.first_item_t is None:
            self.stats.first_item_t = time.time()
        events: asyncio.Queue[tuple[int, int | None]] | None = None
        if body.get("stream"):  # chunk points and finishes, in the order the scheduler reaches them
            events = asyncio.Queue()
            for i, item in enumerate(items):
                item.on_chunk = (lambda n, i=i: events.put_nowait((i, n)))
                item.done.add_done_callback(lambda _, i=i: events.put_nowait((i, None)))
        now = time.monotonic()
        for item in items:
            self.stats.rids.append(item.rid)
            self.inflight[item.rid] = item
            self.scheduler.submit(item, now)
        logprob = bool(body.get("return_logprob"))
        try:
            if events is not None:
                return await self._stream(request, items, single, logprob, events)
            tokens = await asyncio.gather(*(it.done for it in items))
            answers = [self._answer(it, t, logprob) for it, t in zip(items, tokens)]
            self.stats.last_answer_t = time.time()
            return web.Response(body=orjson.dumps(answers[0] if single else answers), content_type="application/json")
        except (asyncio.CancelledError, ConnectionResetError):  # the client went away: SGLang aborts its members
            self.stats.disconnects += 1
            for item in items:
                if not item.done.done():
                    self.scheduler.abort(item, time.monotonic())
            raise
        finally:
            for item in items:
                if self.inflight.get(item.rid) is item:
                    del self.inflight[item.rid]

    async def _stream(self, request: web.Request, items: list[Item], single: bool, logprob: bool,
                      events: asyncio.Queue) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        incremental = self.args.incremental_streaming_output
        sent = [0] * len(items)  # tokens each member's chunks have carried
        left = len(items)
        while left:
            batch = [await events.get()]
            while not events.empty():
                batch.append(events.get_nowait())
            parts = []
            for i, n in batch:
                item = items[i]
                final = n is None
                if final:
                    n = item.done.result()
                    left -= 1
                    self.inflight.pop(item.rid, None)
                    self.stats.last_answer_t = time.time()
                else:
                    self.stats.chunks += 1
                chunk = self._answer(item, n, logprob, start=sent[i] if incremental else 0, final=final)
                sent[i] = n or 0
                if not single:
                    chunk["index"] = i
                parts.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await resp.write(b"".join(parts))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- the other routes ----
    async def abort_request(self, request: web.Request) -> web.Response:
        self.stats.abort_requests += 1
        body = orjson.loads(await request.read() or b"{}")
        rid = str(body.get("rid") or "")
        now = time.monotonic()
        for key, item in list(self.inflight.items()):
            if (body.get("abort_all") or (rid and key.startswith(rid))) and not item.done.done():
                self.scheduler.abort(item, now)
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        a = self.args
        return web.json_response({"model_path": "fake", "skip_tokenizer_init": True, "version": "0.5.12",
                                  "max_running_requests": a.max_running, "context_length": a.context_length,
                                  "max_total_num_tokens": a.max_running * a.context_length,
                                  "max_req_input_len": a.context_length - 6, "tp_size": 1, "dp_size": 1})

    async def load(self, request: web.Request) -> web.Response:
        running, waiting = self.scheduler.load()
        return web.json_response([{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                                   "num_tokens": 0}])

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "tokenizer_path": "fake", "is_generation": True})

    async def fake_stats(self, request: web.Request) -> web.Response:
        running, waiting = self.scheduler.load()
        return web.Response(body=orjson.dumps({**self.stats.report(), "in_flight": len(self.inflight),
                                               "running": running, "waiting": waiting}),
                            content_type="application/json")


def build_app(fake: FakeSGLang) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/generate", fake.generate)
    app.router.add_put("/generate", fake.generate)
    app.router.add_post("/abort_request", fake.abort_request)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, fake.server_info)
    app.router.add_get("/get_load", fake.load)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, fake.ok)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, fake.model_info)
    app.router.add_get("/fake_stats", fake.fake_stats)

    async def start_scheduler(app: web.Application) -> None:
        app["scheduler"] = asyncio.create_task(fake.scheduler.run())

    async def stop_scheduler(app: web.Application) -> None:
        app["scheduler"].cancel()

    app.on_startup.append(start_scheduler)
    app.on_cleanup.append(stop_scheduler)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipegen.bench.doubles.fake_sglang", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", help="write the bound port here (with --port 0)")
    p.add_argument("--front-ms", type=float, default=1.25, help="front-end cost per HTTP request (ms)")
    p.add_argument("--item-ms", type=float, default=0.02, help="front-end cost per member of a request (ms)")
    p.add_argument("--step-ms", type=float, default=10.0,
                   help="scheduler time per output token (ms); with --step-ms-per-running, per step at no batch")
    p.add_argument("--step-ms-per-running", type=float, default=0.0,
                   help="GPU-like batched steps: each step's extra ms per running member (0: closed form)")
    p.add_argument("--max-running", type=int, default=160, help="members running at once")
    p.add_argument("--answer-tokens", type=int, default=0, help="answer length cap (0: max_new_tokens)")
    p.add_argument("--lengths", default="",
                   help="long-tailed answer lengths: lognormal:MEDIAN:SIGMA, pareto:XM:ALPHA or grouped:MEDIAN:SIGMA:"
                        "SAMPLE_SIGMA (a prompt's samples correlate; cut at max_new_tokens)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="each stream chunk holds only the ids and log-probs since the member's previous one")
    p.add_argument("--eos-id", type=int, default=-1, help="the last id of an answer that stops (-1: an ordinary id)")
    p.add_argument("--context-length", type=int, default=4096, help="reported by /get_server_info")
    p.add_argument("--vocab", type=int, default=49152, help="answer ids lie in [100, vocab - 100)")
    p.add_argument("--crash-on-request", type=int, default=0, help="exit hard during this /generate request (1-based)")
    p.add_argument("--crash-delay-s", type=float, default=0.2, help="...this long after it arrived")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(build_app(FakeSGLang(args)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the bound port when --port 0
    if args.port_file:
        tmp = f"{args.port_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    log.info("fake SGLang on http://%s:%d (front %.2f ms/request + %.3f ms/member, %d running x %.1f ms/step "
             "+ %.3f ms x running, lengths %s)", args.host, port, args.front_ms, args.item_ms, args.max_running,
             args.step_ms, args.step_ms_per_running, args.lengths or "fixed")
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(serve(parse_args(argv)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
