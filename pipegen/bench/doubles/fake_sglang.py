"""A fake SGLang server that speaks SGLang 0.5.12's batched, streamed `/generate` and charges its front end per
HTTP request: what grouped requests are tested and measured against without a GPU.

    python -m pipegen.bench.doubles.fake_sglang --port 0 --port-file F [--front-ms 1.25] [--item-ms 0.02]
        [--step-ms 10] [--max-running 160] [--answer-tokens N] [--crash-on-request K] [--crash-delay-s S]

The protocol, as SGLang's `http_server.py` and `TokenizerManager` serve it: `input_ids` one list (single) or a
list of lists (batch); `sampling_params` one dict or one per member; `rid` a string or one per member
(duplicates in flight: 400); `return_logprob`; `stream`. A single answer is one object, a batch a list in input
order; streamed, every chunk is `data: <json>\\n\\n` carrying the member's `index` (batch only), intermediate
chunks have `finish_reason: null` (one at the first token when the member's `stream_interval` > 1, as SGLang's
`len(output_ids) % interval == 1` rule sends it), and the stream ends with `data: [DONE]`. `meta_info` holds
`id`, `finish_reason` (`length` at `max_new_tokens`; `abort` shapes on abort), `prompt_tokens`,
`completion_tokens`, `output_token_logprobs` as `[logprob, id, null]` triples. `POST /abort_request {rid}`
aborts every member in flight whose rid starts with it; a client that disconnects aborts its members.
`/get_server_info` reports `max_running_requests` and `max_total_num_tokens`; `/get_load` SGLang's per-DP list;
`/health`, `/health_generate`, `/get_model_info`; `/fake_stats` its counters (for tests and the bench).

The costs, modelled on SGLang's processes: the front end (SGLang's one tokenizer-manager process) spends
`--front-ms` per HTTP request plus `--item-ms` per member, blocking, one request after another (a sleep on
the event loop: it uses no CPU, so the model holds on a busy machine); the scheduler (SGLang's GPU process)
runs `--max-running` members at once, each taking `--step-ms` per output token, on its own clock (the front
end never slows it; its answers wait for the front end to be free, as SGLang's do). Answers are
`min(max_new_tokens, --answer-tokens)` tokens long; ids (in `[100, --vocab - 100)`) and log-probs are a pure
function of the prompt, the member's `sampling_seed` and the position.

Owns: that protocol and that cost model. Must never: import torch, verl or pipegen's product code (it starts
in well under a second and is a stand-in for someone else's server).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

log = logging.getLogger("pipegen.fake_sglang")

TOKEN_LO = 100  # answer ids stay clear of the special ids at both ends of a vocabulary
CRASH_EXIT_CODE = 86


@dataclass(eq=False)
class Item:
    """One member of a /generate request on its way through the fake scheduler."""

    rid: str
    input_ids: list[int]
    max_new: int
    seed: int
    stream_interval: int
    length: int
    done: asyncio.Future
    start_t: float | None = None  # when it got a running slot (scheduler clock)
    finish_t: float | None = None
    aborted: bool = False


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
    output_tokens: int = 0
    rids: list[str] = field(default_factory=list)
    first_item_t: float | None = None  # time.time() of the first member received, and of the last one answered
    last_answer_t: float | None = None


class Scheduler:
    """`max_running` slots; a member holds one for `length * step_s` from when it gets it (the clock is the
    scheduler's own: a slot freed at t is refilled at t, however late the event loop looks)."""

    def __init__(self, max_running: int, step_s: float, stats: Stats):
        self.max_running = max_running
        self.step_s = step_s
        self.stats = stats
        self.waiting: list[tuple[float, int, Item]] = []  # (ready time, order, item): FIFO
        self.running: list[tuple[float, int, Item]] = []  # heap on finish time
        self.order = itertools.count()
        self.wake = asyncio.Event()

    def submit(self, item: Item, now: float) -> None:
        heapq.heappush(self.waiting, (now, next(self.order), item))
        self._admit(now)
        self.wake.set()

    def _live_running(self) -> int:
        return sum(1 for _, _, it in self.running if not it.aborted)

    def _admit(self, t: float) -> None:
        while self.waiting and len(self.running) < self.max_running:
            ready, _, item = heapq.heappop(self.waiting)
            if item.aborted:
                continue
            item.start_t = max(t, ready)
            item.finish_t = item.start_t + item.length * self.step_s
            heapq.heappush(self.running, (item.finish_t, next(self.order), item))
        self.stats.max_running_seen = max(self.stats.max_running_seen, len(self.running))

    def abort(self, item: Item, now: float) -> None:
        item.aborted = True
        done_tokens = 0 if item.start_t is None else max(0, min(item.length, int((now - item.start_t) / self.step_s)))
        if item.start_t is not None:  # free its slot now
            self.running = [e for e in self.running if e[2] is not item]
            heapq.heapify(self.running)
            self._admit(now)
        if not item.done.done():
            item.done.set_result(done_tokens if item.start_t is not None else None)
        self.wake.set()

    def load(self) -> tuple[int, int]:
        return len(self.running), sum(1 for _, _, it in self.waiting if not it.aborted)

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            while self.running and self.running[0][0] <= now:
                finish_t, _, item = heapq.heappop(self.running)
                if not item.done.done():
                    item.done.set_result(item.length)
                self._admit(finish_t)
            self.wake.clear()
            timeout = max(0.0, self.running[0][0] - time.monotonic()) if self.running else None
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass


def token(ids: list[int], seed: int, pos: int, vocab: int) -> int:
    return TOKEN_LO + (ids[-1] * 131 + seed * 31 + pos * 7 + 11) % (vocab - 2 * TOKEN_LO)


class FakeSGLang:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.stats = Stats()
        self.scheduler = Scheduler(args.max_running, args.step_ms / 1000.0, self.stats)
        self.inflight: dict[str, Item] = {}

    # ---- /generate ----
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
        items = []
        for prompt, sp, rid in zip(prompts, params, rids):
            max_new = int(sp.get("max_new_tokens", 128))
            cap = self.args.answer_tokens or max_new
            items.append(Item(rid, [int(t) for t in prompt], max_new, int(sp.get("sampling_seed", 42)),
                              int(sp.get("stream_interval") or 1), max(0, min(max_new, cap)), loop.create_future()))
        return items, single

    def _answer(self, item: Item, tokens: int | None, logprob: bool) -> dict[str, Any]:
        if item.aborted:
            finish = ({"type": "abort", "message": "Abort in waiting queue"} if tokens is None else
                      {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
        else:
            finish = {"type": "length", "length": item.max_new}
        out = [token(item.input_ids, item.seed, i, self.args.vocab) for i in range(tokens or 0)]
        meta: dict[str, Any] = {"id": item.rid, "finish_reason": finish, "prompt_tokens": len(item.input_ids),
                                "weight_version": "default", "num_retractions": 0}
        if logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[-0.5 - (t % 7) * 0.125, t, None] for t in out]
        meta["completion_tokens"] = len(out)
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
        if self.stats.first_item_t is None:
            self.stats.first_item_t = time.time()
        now = time.monotonic()
        for item in items:
            self.stats.rids.append(item.rid)
            self.inflight[item.rid] = item
            self.scheduler.submit(item, now)
        logprob = bool(body.get("return_logprob"))
        try:
            if body.get("stream"):
                return await self._stream(request, items, single, logprob)
            tokens = await asyncio.gather(*(it.done for it in items))
            answers = [self._answer(it, t, logprob) for it, t in zip(items, tokens)]
            self._count(items, answers)
            return web.Response(body=orjson.dumps(answers[0] if single else answers), content_type="application/json")
        except asyncio.CancelledError:  # the client went away: SGLang aborts what it was waiting for
            self.stats.disconnects += 1
            for item in items:
                if not item.done.done():
                    self.scheduler.abort(item, time.monotonic())
            raise
        finally:
            for item in items:
                if self.inflight.get(item.rid) is item:
                    del self.inflight[item.rid]

    async def _stream(self, request: web.Request, items: list[Item], single: bool,
                      logprob: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        index = {id(it.done): i for i, it in enumerate(items)}
        pending = {it.done for it in items}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            parts = []
            for fut in done:
                i = index[id(fut)]
                item = items[i]
                answer = self._answer(item, fut.result(), logprob)
                self._count([item], [answer])
                self.inflight.pop(item.rid, None)
                if not single:
                    answer["index"] = i
                if item.stream_interval > 1 and len(answer["output_ids"]) > 1 and not item.aborted:
                    first = {"output_ids": answer["output_ids"][:1],
                             "meta_info": {**answer["meta_info"], "finish_reason": None, "completion_tokens": 1}}
                    if logprob:
                        first["meta_info"]["output_token_logprobs"] = answer["meta_info"]["output_token_logprobs"][:1]
                    if not single:
                        first["index"] = i
                    parts.append(b"data: " + orjson.dumps(first) + b"\n\n")
                parts.append(b"data: " + orjson.dumps(answer) + b"\n\n")
            await resp.write(b"".join(parts))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _count(self, items: list[Item], answers: list[dict]) -> None:
        for item, answer in zip(items, answers):
            if item.aborted:
                self.stats.aborted += 1
            else:
                self.stats.finished += 1
            self.stats.output_tokens += len(answer["output_ids"])
        self.stats.last_answer_t = time.time()

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
                                  "max_running_requests": a.max_running, "context_length": 4096,
                                  "max_total_num_tokens": a.max_running * 4096, "max_req_input_len": 4090,
                                  "tp_size": 1, "dp_size": 1})

    async def load(self, request: web.Request) -> web.Response:
        running, waiting = self.scheduler.load()
        return web.json_response([{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                                   "num_tokens": 0}])

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "tokenizer_path": "fake", "is_generation": True})

    async def fake_stats(self, request: web.Request) -> web.Response:
        s = self.stats
        return web.Response(body=orjson.dumps({**s.__dict__, "in_flight": len(self.inflight)}),
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
    p.add_argument("--step-ms", type=float, default=10.0, help="scheduler time per output token (ms)")
    p.add_argument("--max-running", type=int, default=160, help="members running at once")
    p.add_argument("--answer-tokens", type=int, default=0, help="answer length cap (0: max_new_tokens)")
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
    log.info("fake SGLang on http://%s:%d (front %.2f ms/request + %.3f ms/member, %d running x %.1f ms/token)",
             args.host, port, args.front_ms, args.item_ms, args.max_running, args.step_ms)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(serve(parse_args(argv)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
