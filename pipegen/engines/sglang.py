"""SGLang's native protocol as an `Engine`: `POST /generate` with `input_ids`, `sampling_params` and a
`rid`; the answer's `output_ids` with `meta_info.output_token_logprobs` triples. The same protocol is
served by pipegen's CPU reference server (with the real model or the bench's fake backend).

- abort: `POST /abort_request {rid}` (the server answers the request itself with an `abort` finish);
- readiness: `GET /health_generate` (generates one token);
- running limit: `/get_server_info` `max_running_requests`: the command line's value when one was given, else
  (0.5.12 leaves the top-level key null) each scheduler's resolved value in `internal_states`, summed over
  data-parallel ranks (a small model's is 2,048-4,096: `_resolve_max_num_reqs`);
- load: `/get_load` (per data-parallel rank `num_reqs`, running and waiting together, and `num_waiting_reqs`);
- images: `image_data` (PNG data URLs) beside `input_ids`, which already hold the processor's placeholder spans;
- groups: generations that are ready together go as one batched `/generate`: lists of `input_ids`,
  `sampling_params` (each keeps its `sampling_seed`) and `rid`s (each member is still aborted by its own rid),
  with `stream: true`. SGLang 0.5.12 sends such a batch (token ids only, no pictures, no DP attention) to its
  scheduler as one `BatchTokenizedGenerateReqInput` (`TokenizerManager._handle_batch_request` ->
  `_send_batch_request`), the path its offline benchmark takes, and pays its per-request front-end cost once;
  streamed, each member's chunks carry its `index` (`_stream_batch_responses`), so each member is read as its
  chunks come and answered when it finishes, not when the slowest one does. A member whose tokens are kept as they
  come (a long answer, actor/continuation.py) streams a chunk every `stream_interval` tokens, chosen by time
  (STREAM_MIN_TOKENS below); the others send their first token's chunk (the engine has started them: supervision's
  evidence) and their final one. `n > 1` is never used: that path first runs a prefill-only copy and then sends
  the copies one by one. A group of images goes one by one (SGLang tokenizes those one at a time anyway).
  pipegen's CPU reference server (`pipegen_reference_server` in its `/get_server_info`) streams no batch: it gets
  one request per generation.
- streamed answers: a generation alone (the CPU server, a picture, a server that refused groups) whose tokens are
  kept goes with `stream: true` and the same `stream_interval`; `StreamedAnswer` reads its chunks, whether each
  holds the answer so far or (--incremental-streaming-output, which pipegen passes to the servers it starts) only
  its new ids and log-probs.

The body and the answer are built and read here (`build_request`, `parse_response`), as verl's SGLang
server does.
Owns: SGLang's endpoints and their answers. Must never: retry, or re-tokenize anything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import operator
from typing import Any, AsyncIterator, Hashable

import aiohttp
import orjson

from pipegen.engines.base import Engine, EngineRequest, GroupRefused, Load, LoadUnavailable, StreamError
from pipegen.engines.request import Generation, new_rid


_FIRST = operator.itemgetter(0)

log = logging.getLogger("pipegen.client")

_JSON = {"Content-Type": "application/json"}
GROUP_MAX = 256  # members of one grouped request at most (SGLang's batch path has no limit of its own)


async def get_json(session: "aiohttp.ClientSession", url: str, timeout_s: float) -> Any:
    """GET url as JSON; ValueError("HTTP <status>") for any other status than 200."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}")
        return orjson.loads(raw)


def running_limit(info: Any) -> int | None:
    """SGLang's limit on running requests from its /get_server_info (see the header); None if it names none."""
    if not isinstance(info, dict):
        return None
    if info.get("max_running_requests"):
        return int(info["max_running_requests"])
    states = info.get("internal_states")
    values = [int(st["max_running_requests"]) for st in (states if isinstance(states, list) else [])
              if isinstance(st, dict) and st.get("max_running_requests")]
    return sum(values) if values else None


def parse_load(body: Any) -> tuple[int, int]:
    """(running, waiting) from SGLang's /get_load: a list of per-DP dicts (or one dict), where `num_reqs`
    counts running and waiting requests together."""
    entries = body if isinstance(body, list) else [body]
    reqs = waiting = 0
    for e in entries:
        if isinstance(e, dict):
            reqs += int(e.get("num_reqs") or 0)
            waiting += int(e.get("num_waiting_reqs") or 0)
    return max(0, reqs - waiting), waiting


class SGLang(Engine):
    name = "sglang"
    generate_path = "/generate"
    health_path = "/health_generate"
    streams = True
    load_trails_s = 0.0  # /get_load: the schedulers count their own queues when asked

    def build(self, generation: Generation) -> EngineRequest:
        body = build_request(generation)
        return EngineRequest(body, body["rid"], generation)

    def renewed(self, request: EngineRequest) -> EngineRequest:
        rid = new_rid()  # re-sending an in-flight rid is a 400 in SGLang
        return dataclasses.replace(request, body={**request.body, "rid": rid}, rid=rid)

    def finish_type(self, answer: dict[str, Any]) -> str | None:
        finish = (answer.get("meta_info") or {}).get("finish_reason")
        return finish.get("type") if isinstance(finish, dict) else None

    def parse(self, answer: dict[str, Any], request: EngineRequest):
        return parse_response(answer, request.return_logprob)

    async def abort(self, session: aiohttp.ClientSession, url: str, request: EngineRequest,
                    timeout_s: float) -> None:
        try:
            async with session.post(f"{url}/abort_request", data=orjson.dumps({"rid": request.rid}), headers=_JSON,
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.info("abort of %s on %s not confirmed: %s", request.rid, url, e)

    async def max_running(self, session: aiohttp.ClientSession, url: str) -> int | None:
        return running_limit(await get_json(session, f"{url}/get_server_info", 30.0))

    async def load(self, session: aiohttp.ClientSession, url: str) -> Load:
        try:
            return Load(*parse_load(await get_json(session, f"{url}/get_load", 5.0)))
        except ValueError as e:
            if "HTTP 404" in str(e):
                raise LoadUnavailable(f"{url} has no /get_load") from e
            raise

    async def group_limit(self, session: aiohttp.ClientSession, url: str) -> int:
        info = await get_json(session, f"{url}/get_server_info", 30.0)
        if not isinstance(info, dict) or info.get("pipegen_reference_server"):
            return 1  # pipegen's CPU server answers a batch only when its last member is done: one by one there
        mrr = running_limit(info)
        return max(1, min(GROUP_MAX, mrr)) if mrr else GROUP_MAX

    def group_key(self, request: EngineRequest) -> Hashable | None:
        if request.body.get("image_data"):  # SGLang tokenizes pictures one request at a time anyway
            return None
        return ("logprob", bool(request.body["return_logprob"]))

    def group_body(self, requests: list[EngineRequest], intervals: list[int]) -> dict[str, Any]:
        return group_request([r.body for r in requests], intervals)

    def group_chunks(self, resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        return member_chunks(resp)

    def stream_body(self, request: EngineRequest, interval: int) -> dict[str, Any]:
        body = request.body
        return {**body, "stream": True,
                "sampling_params": {**body["sampling_params"], "stream_interval": int(interval)}}

    def stream_chunks(self, resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        return sse_chunks(resp)

    def streamed(self, request: EngineRequest) -> StreamedAnswer:
        return StreamedAnswer(request.return_logprob)


class StreamedAnswer:
    """A streamed /generate answer read chunk by chunk. A chunk holds the answer so far, or, from a server started
    with --incremental-streaming-output (pipegen starts its CPU server so), only its new ids and log-prob triples;
    its meta_info's `completion_tokens` (the answer's length so far) says which."""

    def __init__(self, return_logprob: bool):
        self.ids: list[int] = []
        self.logprobs: list[float] | None = [] if return_logprob else None
        self._triples: list[Any] = []
        self._pieces = False  # the chunks came as pieces: the last one is made whole

    def add(self, chunk: dict[str, Any]) -> None:
        ids = chunk.get("output_ids") or []
        meta = chunk.get("meta_info") or {}
        triples = (meta.get("output_token_logprobs") or []) if self.logprobs is not None else []
        total = meta.get("completion_tokens")
        if self.ids and isinstance(total, int) and len(ids) < total and len(self.ids) + len(ids) == total:
            self._pieces = True  # the new tokens only
            if len(triples) == total:  # ids sliced, log-probs still the whole answer so far: their new part
                triples = triples[len(self.ids):]
            if self.logprobs is not None and len(triples) != len(ids):
                raise ValueError(f"a streamed piece of {len(ids)} ids carries {len(triples)} log-probs")
            self.ids += ids
            self._triples += triples
            if self.logprobs is not None:
                self.logprobs += map(_FIRST, triples)
            return
        if self._pieces:
            raise ValueError(f"a streamed piece does not continue the answer ({len(self.ids)} ids so far, "
                             f"{len(ids)} more, completion_tokens {total})")
        self.ids = list(ids)
        self._triples = list(triples)
        if self.logprobs is not None:
            self.logprobs = list(map(_FIRST, triples))
        if len(self._triples) != len(self.ids) and self.logprobs is not None:  # a chunk cut mid-token: its ids only
            n = min(len(self.ids), len(self._triples))
            del self.ids[n:], self._triples[n:], self.logprobs[n:]

    def whole(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if not self._pieces and not self.ids:
            return chunk
        self.add(chunk)
        if not self._pieces:
            return chunk
        meta = dict(chunk.get("meta_info") or {})
        if self.logprobs is not None:
            meta["output_token_logprobs"] = self._triples
        return {**chunk, "output_ids": self.ids, "meta_info": meta}


# How often a streamed answer's tokens come back is chosen by time, not by a fraction of its budget (the client's
# sending.py asks for a chunk about every `keep_every_s` of actor/supervision.py, in the server's observed
# generation time, `stream_interval` tokens): a crash then loses about the same time of generation whatever the
# budget. Never a chunk per fewer than STREAM_MIN_TOKENS tokens: each chunk costs its parsing and a line in the
# unit's progress file. pipegen starts SGLang with --incremental-streaming-output, so a chunk holds only its new
# ids and log-probs (StreamedAnswer reads either shape); pipegen's CPU server streams on a timer and ignores the
# interval.
STREAM_MIN_TOKENS = 32


def build_request(generation: Generation) -> dict[str, Any]:
    """The JSON body for SGLang's POST /generate (single form)."""
    params = {k: v for k, v in generation.params.items() if k not in ("logprobs", "prompt_logprobs")}
    params["max_new_tokens"] = generation.max_new_tokens
    if generation.seed is not None:
        params["sampling_seed"] = int(generation.seed)
    body = {
        "rid": new_rid(),  # fresh per attempt: re-sending an in-flight rid is a 400 in SGLang
        "input_ids": generation.prompt_ids,
        "sampling_params": params,
        "return_logprob": generation.return_logprob,
    }
    if generation.pictures:  # SGLang's /generate: the pictures beside input_ids, whose placeholder spans they fill
        body["image_data"] = list(generation.pictures)
    return body


def group_request(bodies: list[dict[str, Any]], intervals: list[int]) -> dict[str, Any]:
    """One streamed batch /generate for several single bodies of one `return_logprob` (see the header), member i
    streaming every `intervals[i]` tokens."""
    return {
        "rid": [b["rid"] for b in bodies],
        "input_ids": [b["input_ids"] for b in bodies],
        "sampling_params": [{**b["sampling_params"], "stream_interval": int(n)} for b, n in zip(bodies, intervals)],
        "return_logprob": bool(bodies[0]["return_logprob"]),
        "stream": True,
    }


async def member_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Each chunk of a streamed batch answer as `(index, chunk)`, in the order they come (a server that ignores
    `stream` and answers the list at once: each of its items, in order). An `error` chunk (SGLang's in-stream 400,
    sent with HTTP 200) raises GroupRefused."""
    if resp.content_type == "application/json":  # a server that answers the batch at once, unstreamed
        answers = orjson.loads(await resp.read())
        for index, answer in enumerate(answers if isinstance(answers, list) else [answers]):
            yield index, answer
        return
    try:
        async for chunk in sse_chunks(resp):
            yield int(chunk.get("index", 0)), chunk
    except StreamError as e:
        raise GroupRefused(str(e)) from e


async def sse_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """A streamed /generate answer's chunks (`data: <json>` events) until `data: [DONE]`; an error chunk (SGLang's
    in-stream 400, sent with HTTP 200) raises StreamError. A server that answers at once (JSON): that answer.
    Lines are cut by hand: a chunk of a long answer (its cumulative ids and log-prob triples) can exceed
    aiohttp's line limit."""
    if resp.content_type == "application/json":
        yield orjson.loads(await resp.read())
        return
    buffer = b""
    async for data in resp.content.iter_any():
        buffer += data
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2:]
            if not event.startswith(b"data:"):
                continue
            payload = event[5:].strip()
            if payload == b"[DONE]":
                return
            chunk = orjson.loads(payload)
            if not isinstance(chunk, dict):
                raise ValueError(f"expected a JSON object in the stream, got {type(chunk).__name__}")
            if "error" in chunk:
                error = chunk["error"]
                message = error.get("message") if isinstance(error, dict) else error
                code = error.get("code") if isinstance(error, dict) else None
                raise StreamError(str(message), int(code) if isinstance(code, int) else 400)
            yield chunk


def parse_response(body: dict[str, Any], return_logprob: bool):
    """SGLang /generate answer -> verl TokenOutput, the way verl's SGLang server builds it."""
    from verl.workers.rollout.replica import TokenOutput

    meta = body.get("meta_info") or {}
    finish = meta.get("finish_reason")
    stop_reason = finish.get("type") if isinstance(finish, dict) else None
    # no per-token int()/float() here: TokenOutput (pydantic) validates and coerces the lists in Rust
    token_ids = body.get("output_ids") or []
    if return_logprob:
        triples = meta.get("output_token_logprobs") or []
        if triples and len(triples) == len(token_ids):
            log_probs = list(map(_FIRST, triples))  # (logprob, id, text) triples; map: half a list comprehension's cost
        else:  # the max_new_tokens=0 phantom entry, or an abort with no logprobs: verl keeps nothing
            token_ids, log_probs = [], []
    else:
        log_probs = None
    extra = {"global_steps": None, "min_global_steps": None, "max_global_steps": None}
    return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason, extra_fields=extra)
