"""The CPU reference server's HTTP side: an aiohttp app that speaks SGLang 0.5.12's native protocol.

Owns: ``POST|PUT /generate`` (single, batch, ``n > 1``, one generation streamed; the in-flight duplicate-rid check), ``GET /health``
and ``GET /health_generate`` (503 with an empty body until the model backend is loaded), ``GET /get_model_info`` and
``/model_info`` (answer during startup too), ``GET /get_server_info``, ``GET /v1/models``,
``GET|POST /flush_cache``, ``POST /abort_request`` (rid prefix semantics), ``GET /get_load`` (SGLang's
per-DP running/waiting counts) and pipegen's ``GET /pipegen_stats`` (JSON counters for tests and
benchmarks); lifecycle.py runs it as a process. A client disconnect aborts its request; the fault knobs (``--fail-rate``, ``--hang-rate``, ``--crash-after``) inject SGLang-shaped failures.
It always behaves as ``--skip-tokenizer-init``: token ids in, token ids + logprobs out, no ``text``.
Must never: bind anything but the given host (loopback by default), do model work on the event loop, answer a
request it did not validate, re-tokenize, or know a backend's constructor (backends build themselves from the
parsed command line). Acceptable differences from SGLang: a stream (``stream: true``, one generation) sends the
answer so far (or, with ``--incremental-streaming-output``, its new tokens) every STREAM_EVERY_S seconds while tokens
come, not every ``stream_interval`` tokens; no stop
strings, ``cached_tokens`` always 0, instant ``/health``, no ``/metrics``, ids >= vocab size rejected.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time
import uuid
from typing import Any, Optional

import orjson
from aiohttp import web

from pipegen.cpu_server.model_backend import (HEALTH_CHECK_PREFIX, BackendRequest, GenerationResult, ModelBackend,
                                              ModelFacts)
from pipegen.cpu_server.errors import ProtocolError, bad_request, service_unavailable, validation_error
from pipegen.cpu_server.parse import SCHEDULER_INPUT_MARGIN, EntrySpec, parse_generate_request
from pipegen.cpu_server.responses import WEIGHT_VERSION, build_output, finish_abort_waiting
from pipegen.cpu_server.sampling_params import SamplingSpec

log = logging.getLogger("pipegen.cpu_server")

CRASH_EXIT_CODE = 86  # --crash-after: distinctive, so a supervisor's log says what happened
HEALTH_PROBE_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT's default
# A streamed answer's chunk at most this often: what a client that keeps tokens as they come loses in a crash
# (at most this much of each answer's generation), while an answer that takes less time goes in one chunk
STREAM_EVERY_S = 0.05
SGLANG_VERSION = "0.5.12"


class ReferenceServer:
    """State shared by the handlers: the model backend, readiness, in-flight requests, counters, fault RNG."""

    def __init__(self, args: argparse.Namespace, backend: ModelBackend, facts: ModelFacts) -> None:
        self.args = args
        self.backend = backend
        self.facts = facts
        self.ready = asyncio.Event()
        self.inflight: dict[str, BackendRequest] = {}
        self.port: Optional[int] = None
        # A str seed is hashed with SHA-512 by random.Random: the fault sequence is reproducible per --seed.
        self.fault_rng = random.Random(f"pipegen-faults-{args.seed}")
        self.started_at = time.time()
        self.generate_requests = 0
        self.by_status: dict[str, int] = {}
        self.finish_reasons: dict[str, int] = {}
        self.generations = 0
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.injected_503 = 0
        self.hung = 0
        self.hung_aborted = 0  # hung requests released by /abort_request
        self.hung_disconnected = 0  # hung requests whose client closed the connection first
        self.hung_rids: dict[str, asyncio.Event] = {}
        self.client_disconnects = 0
        self.aborted_via_endpoint = 0
        self.abort_requests = 0  # POST /abort_request calls, whether or not the rid was in flight
        self.handlers_in_flight = 0
        self.max_handlers_in_flight = 0
        self.last_log_tokens = 0

    # -- helpers ---------------------------------------------------------------------------------------

    def count_status(self, status: int) -> None:
        key = str(status)
        self.by_status[key] = self.by_status.get(key, 0) + 1

    def error_response(self, err: ProtocolError) -> web.Response:
        self.count_status(err.status)
        return web.Response(status=err.status, body=err.body, content_type=err.content_type)

    def json_response(self, obj: Any, status: int = 200) -> web.Response:
        return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")

    # -- /generate -------------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.generate_requests += 1
        if self.args.crash_after is not None and self.generate_requests > self.args.crash_after:
            # Hard crash, like a dead scheduler: no answer, connections reset, exit code says why.
            log.error("crash-after %d: request #%d arrived, exiting hard (code %d)", self.args.crash_after,
                      self.generate_requests, CRASH_EXIT_CODE)
            logging.shutdown()
            os._exit(CRASH_EXIT_CODE)
        t0 = time.monotonic()
        self.handlers_in_flight += 1
        self.max_handlers_in_flight = max(self.max_handlers_in_flight, self.handlers_in_flight)
        try:
            return await self._generate(request, t0)
        finally:
            self.handlers_in_flight -= 1

    async def _generate(self, request: web.Request, t0: float) -> web.StreamResponse:
        raw = await request.read()
        u = self.fault_rng.random() if (self.args.fail_rate > 0 or self.args.hang_rate > 0) else 1.0
        if u < self.args.fail_rate:
            self.injected_503 += 1
            return self.error_response(service_unavailable())
        if u < self.args.fail_rate + self.args.hang_rate:
            return await self._hang(raw)
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError as exc:
            return self.error_response(validation_error(f"JSON decode error: {exc}"))
        await self.ready.wait()  # before the model is loaded, requests wait (SGLang would refuse connections)
        try:
            parsed = parse_generate_request(
                body,
                context_length=self.backend.context_length,
                vocab_size=self.backend.vocab_size,
                unknown_key_status=self.args.unknown_key_status,
            )
            if parsed.user_rids:
                for e in parsed.entries:
                    if e.rid in self.inflight:
                        raise bad_request(f"Duplicate request ID detected: {e.rid}")
        except ProtocolError as err:
            return self.error_response(err)

        loop = asyncio.get_running_loop()
        reqs = [BackendRequest(e, loop) for e in parsed.entries]
        for r in reqs:
            self.inflight[r.spec.rid] = r
        stream: Optional[web.StreamResponse] = None
        sent = 0  # a stream's tokens in the chunks before its last
        try:
            for r in reqs:
                self.backend.submit(r)
            if parsed.stream:
                stream, sent = await self._stream_progress(request, reqs[0], t0)
            results = await asyncio.gather(*(r.future for r in reqs))
        except (asyncio.CancelledError, ConnectionResetError):
            # Client disconnect (aiohttp cancels the handler, or a streamed chunk finds the connection gone):
            # abort server-side, as SGLang does.
            self.client_disconnects += 1
            for r in reqs:
                if not r.done:
                    self.backend.abort(r)
            log.info("client disconnected: aborted %d generation(s) (first rid %s)", len(reqs), reqs[0].spec.rid)
            raise
        finally:
            for r in reqs:
                if self.inflight.get(r.spec.rid) is r:
                    del self.inflight[r.spec.rid]

        for res in results:
            fr = res.finish_reason or {}
            if fr.get("type") == "abort" and fr.get("status_code") in (500, 503):
                # A backend-side failure: SGLang raises HTTPException with that status (in a stream: an error
                # chunk under HTTP 200, as SGLang sends one)
                status = int(fr["status_code"])
                if stream is not None:
                    return await self._end_stream(stream, {"error": {"message": fr.get("message"), "code": status}})
                return self.error_response(bad_request(fr.get("message"), status))
        e2e = time.monotonic() - t0
        outs = []
        for spec, res in zip(parsed.entries, results):
            self.generations += 1
            self.tokens_generated += len(res.output_ids)
            self.prompt_tokens += len(spec.input_ids)
            kind = str((res.finish_reason or {}).get("type"))
            self.finish_reasons[kind] = self.finish_reasons.get(kind, 0) + 1
            outs.append(build_output(spec, res, e2e_latency=e2e))
        self.count_status(200)
        if stream is not None:
            return await self._end_stream(stream, self._tail(outs[0], sent))
        return self.json_response(outs[0] if parsed.is_single else outs)

    async def _stream_progress(self, request: web.Request, req: BackendRequest,
                               t0: float) -> tuple[web.StreamResponse, int]:
        """A streamed answer until its generation ends: SGLang's server-sent events, each chunk the answer so far
        (cumulative `output_ids` and log-prob triples; with --incremental-streaming-output only the new ones;
        `finish_reason` null, `completion_tokens` the length so far), sent every STREAM_EVERY_S while new tokens
        came, not every `stream_interval` tokens (accepted, not used: see the module docstring). Returns the
        response and how many tokens its chunks carried."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        incremental = self.args.incremental_streaming_output
        sent = 0
        while not req.future.done():
            await asyncio.wait((req.future,), timeout=STREAM_EVERY_S)
            live = req.live
            n = len(live.output_ids) if live is not None and not req.future.done() else 0
            if n > sent:
                # the backend may be appending in another thread: the first n of each list are settled
                first = sent if incremental else 0
                snapshot = GenerationResult(live.output_ids[first:n], None, live.output_logprobs[first:n],
                                            live.output_logprob_ids[first:n])
                chunk = build_output(req.spec, snapshot, e2e_latency=time.monotonic() - t0)
                chunk["meta_info"]["completion_tokens"] = n  # the answer's length so far, as SGLang's chunks say
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                sent = n
        return resp, sent

    def _tail(self, answer: dict, sent: int) -> dict:
        """A stream's last chunk: the whole answer, or with --incremental-streaming-output only what the earlier
        chunks (`sent` tokens) did not carry (its meta_info's completion_tokens still the whole answer's)."""
        if not self.args.incremental_streaming_output or not sent:
            return answer
        meta = dict(answer["meta_info"])
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = meta["output_token_logprobs"][sent:]
        return {**answer, "output_ids": answer["output_ids"][sent:], "meta_info": meta}

    async def _end_stream(self, resp: web.StreamResponse, last: dict) -> web.StreamResponse:
        await resp.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _hang(self, raw: bytes) -> web.Response:
        """A request the scheduler accepted and never works on (SGLang has shipped such hangs while /health
        says 200): no answer until the client goes away, or until /abort_request names its rid, which
        answers it as SGLang does an abort in the waiting queue (HTTP 200, finish type abort)."""
        self.hung += 1
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            body = {}
        rid = body.get("rid") if isinstance(body, dict) else None
        rid = rid if isinstance(rid, str) else uuid.uuid4().hex
        released = asyncio.Event()
        self.hung_rids[rid] = released
        try:
            await released.wait()
        except asyncio.CancelledError:
            self.hung_disconnected += 1  # the client went away first
            raise
        finally:
            self.hung_rids.pop(rid, None)
        self.count_status(200)
        meta = {"id": rid, "finish_reason": finish_abort_waiting(), "weight_version": WEIGHT_VERSION,
                "e2e_latency": 0.0, "completion_tokens": 0}
        return self.json_response({"text": "", "output_ids": [], "meta_info": meta})

    # -- health and info -------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready.is_set() else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.ready.is_set():
            return web.Response(status=503)
        ok = await self.probe()
        return web.Response(status=200 if ok else 503)

    async def probe(self) -> bool:
        """A one-token greedy generation through the backend (SGLang's health check), 20 s budget."""
        if self.backend.trivial_probe:
            return True  # e.g. a synthetic backend: nothing can get stuck, and it must not queue behind its slots
        v = self.backend.vocab_size
        spec = EntrySpec(rid=f"{HEALTH_CHECK_PREFIX}{uuid.uuid4().hex}", input_ids=(10 % v, 11 % v, 12 % v),
                         sampling=SamplingSpec(max_new_tokens=1, top_k=1), max_new_tokens=1)
        req = BackendRequest(spec, asyncio.get_running_loop())
        self.backend.submit(req)
        try:
            await asyncio.wait_for(asyncio.shield(req.future), HEALTH_PROBE_TIMEOUT_S)
            return True
        except asyncio.TimeoutError:
            self.backend.abort(req)
            log.warning("health probe produced nothing within %.0f s", HEALTH_PROBE_TIMEOUT_S)
            return False
        except asyncio.CancelledError:
            self.backend.abort(req)
            raise

    def model_info(self) -> dict:
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": WEIGHT_VERSION,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.facts.model_type,
            "architectures": self.facts.architectures,
        }

    async def get_model_info(self, request: web.Request) -> web.Response:
        return self.json_response(self.model_info())

    async def get_server_info(self, request: web.Request) -> web.Response:
        a = self.args
        c = self.backend.context_length
        info = {
            "model_path": a.model_path,
            "tokenizer_path": a.model_path,
            "served_model_name": a.served_model_name or a.model_path,
            "host": a.host,
            "port": self.port,
            "context_length": c,
            "skip_tokenizer_init": True,
            "dtype": getattr(self.backend, "dtype_name", a.dtype),
            "device": "cpu",
            "tp_size": 1,
            "dp_size": 1,
            "random_seed": a.seed,
            "max_running_requests": self.backend.max_running_requests,
            "max_queued_requests": None,
            "skip_server_warmup": True,
            "max_total_num_tokens": c * self.backend.max_running_requests,
            "max_req_input_len": c - SCHEDULER_INPUT_MARGIN,
            "internal_states": [{"last_gen_throughput": 0.0, "memory_usage": {}}],
            "version": SGLANG_VERSION,
            "incremental_streaming_output": bool(a.incremental_streaming_output),
            "pipegen_reference_server": True,
            "engine": self.backend.name,
            "vocab_size": self.backend.vocab_size,
            "eos_token_ids": sorted(self.backend.eos_token_ids),
            # SGLang's name for its batch-invariant mode; the hf backend's --reproducible (canonical.py)
            "enable_deterministic_inference": bool(self.backend.stats().get("reproducible")),
        }
        if getattr(self.backend, "not_reproducible", ""):
            info["pipegen_not_reproducible"] = self.backend.not_reproducible
        return self.json_response(info)

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's per-DP load list: ``num_reqs`` counts running + waiting, ``num_waiting_reqs`` the queue."""
        s = self.backend.stats()
        running, waiting = int(s.get("running", 0)), int(s.get("waiting", 0))
        return self.json_response([{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                                    "num_tokens": 0}])

    async def v1_models(self, request: web.Request) -> web.Response:
        name = self.args.served_model_name or self.args.model_path
        data = [{"id": name, "object": "model", "created": int(self.started_at), "owned_by": "sglang",
                 "root": self.args.model_path, "parent": None, "max_model_len": self.backend.context_length}]
        return self.json_response({"object": "list", "data": data})

    async def flush_cache(self, request: web.Request) -> web.Response:
        timeout = request.query.get("timeout")
        deadline = time.monotonic() + (float(timeout) if timeout else 0.0)
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            return web.Response(status=400, text="Flush cache failed.")
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. "
                                             "(When there are running or waiting requests, the operation will not "
                                             "be performed.)\n")

    async def abort_request(self, request: web.Request) -> web.Response:
        self.abort_requests += 1
        try:
            body = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        rid = body.get("rid")
        if body.get("abort_all"):
            targets = list(self.inflight.values())
        elif isinstance(rid, str) and rid in self.inflight:
            # SGLang: only a rid that is exactly in flight triggers; then every rid starting with it goes.
            targets = [r for k, r in self.inflight.items() if k.startswith(rid)]
        else:
            targets = []
        for r in targets:
            if not r.done:
                self.backend.abort(r)
        hung = list(self.hung_rids) if body.get("abort_all") else [
            k for k in self.hung_rids if isinstance(rid, str) and rid in self.hung_rids and k.startswith(rid)]
        for k in hung:
            self.hung_rids[k].set()
        self.hung_aborted += len(hung)
        targets = targets + hung
        self.aborted_via_endpoint += len(targets)
        if targets:
            log.info("abort_request: aborted %d generation(s) for rid=%r abort_all=%s", len(targets), rid,
                     bool(body.get("abort_all")))
        return web.Response(status=200)

    def stats(self) -> dict:
        out = {
            "engine": self.backend.name,
            "ready": self.ready.is_set(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "requests_total": self.generate_requests,
            "responses_by_status": dict(self.by_status),
            "generations_total": self.generations,
            "finish_reasons": dict(self.finish_reasons),
            "tokens_generated": self.tokens_generated,
            "prompt_tokens": self.prompt_tokens,
            "inflight_generations": len(self.inflight),
            "http_requests_in_flight": self.handlers_in_flight,
            "max_http_requests_in_flight": self.max_handlers_in_flight,
            "injected_503": self.injected_503,
            "hung": self.hung,
            "hung_aborted": self.hung_aborted,
            "hung_disconnected": self.hung_disconnected,
            "hung_pending": len(self.hung_rids),
            "abort_requests": self.abort_requests,
            "client_disconnects": self.client_disconnects,
            "aborted_via_endpoint": self.aborted_via_endpoint,
        }
        out.update(self.backend.stats())
        return out

    async def pipegen_stats(self, request: web.Request) -> web.Response:
        return self.json_response(self.stats())

    async def log_stats_periodically(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            s = self.stats()
            if s["tokens_generated"] != self.last_log_tokens or s.get("running"):
                rate = (s["tokens_generated"] - self.last_log_tokens) / interval
                self.last_log_tokens = s["tokens_generated"]
                log.info("stats: running=%s waiting=%s gen_throughput=%.1f tok/s requests=%d by_status=%s",
                         s.get("running"), s.get("waiting"), rate, s["requests_total"], s["responses_by_status"])


def build_app(server: ReferenceServer) -> web.Application:
    """The aiohttp application with every route of the contract."""
    app = web.Application(client_max_size=512 * 1024 * 1024)
    app.router.add_routes([
        web.post("/generate", server.generate), web.put("/generate", server.generate),
        web.get("/health", server.health), web.get("/health_generate", server.health_generate),
        # SGLang serves both spellings of its info routes, depending on the version
        web.get("/get_model_info", server.get_model_info), web.get("/model_info", server.get_model_info),
        web.get("/get_server_info", server.get_server_info), web.get("/server_info", server.get_server_info),
        web.get("/v1/models", server.v1_models), web.get("/get_load", server.get_load),
        web.get("/flush_cache", server.flush_cache), web.post("/flush_cache", server.flush_cache),
        web.post("/abort_request", server.abort_request), web.get("/pipegen_stats", server.pipegen_stats),
    ])
    return app
