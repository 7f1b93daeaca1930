"""SGLang's native protocol as an `Engine`: `POST /generate` with `input_ids`, `sampling_params` and a
`rid`; the answer's `output_ids` with `meta_info.output_token_logprobs` triples. The same protocol is
served by pipegen's CPU reference server (with the real model or the bench's fake backend).

- abort: `POST /abort_request {rid}` (the server answers the request itself with an `abort` finish);
- readiness: `GET /health_generate` (generates one token);
- running limit: `/get_server_info` `max_running_requests`;
- load: `/get_load` (per data-parallel rank `num_reqs`, running and waiting together, and `num_waiting_reqs`);
- images: `image_data` (PNG data URLs) beside `input_ids`, which already hold the processor's placeholder spans.

The body and the answer are built and read here (`build_request`, `parse_response`), as verl's SGLang
server does.
Owns: SGLang's endpoints and their answers. Must never: retry, or re-tokenize anything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import operator
from typing import Any

import aiohttp
import orjson

from pipegen.engines.base import EngineRequest, LoadUnavailable
from pipegen.engines.request import TokenBudget, checked_prompt_ids, max_new_tokens_for, new_rid


_FIRST = operator.itemgetter(0)

log = logging.getLogger("pipegen.client")

_JSON = {"Content-Type": "application/json"}


async def get_json(session: "aiohttp.ClientSession", url: str, timeout_s: float) -> Any:
    """GET url as JSON; ValueError("HTTP <status>") for any other status than 200."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}")
        return orjson.loads(raw)


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


class SGLang:
    name = "sglang"
    generate_path = "/generate"
    health_path = "/health_generate"

    def build(self, prompt_ids: list[int], sampling_params: dict[str, Any], limits: TokenBudget,
              sampling_seed: int | None, image_data: list[str] | None = None) -> EngineRequest:
        body = build_request(prompt_ids, sampling_params, limits, sampling_seed)
        if image_data:  # SGLang's /generate: the pictures beside input_ids, whose placeholder spans they fill
            body["image_data"] = list(image_data)
        return EngineRequest(body, body["rid"], int(body["sampling_params"]["max_new_tokens"]),
                             body["return_logprob"])

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
        info = await get_json(session, f"{url}/get_server_info", 30.0)
        mrr = info.get("max_running_requests") if isinstance(info, dict) else None
        return int(mrr) if mrr else None

    async def load(self, session: aiohttp.ClientSession, url: str) -> tuple[int, int]:
        try:
            return parse_load(await get_json(session, f"{url}/get_load", 5.0))
        except ValueError as e:
            if "HTTP 404" in str(e):
                raise LoadUnavailable(f"{url} has no /get_load") from e
            raise


def build_request(
    prompt_ids: list[int], sampling_params: dict[str, Any], limits: TokenBudget, sampling_seed: int | None
) -> dict[str, Any]:
    """The JSON body for SGLang's POST /generate (single form)."""
    ids = checked_prompt_ids(prompt_ids, limits)
    params = dict(sampling_params)
    max_new = max_new_tokens_for(params, len(ids), limits)
    return_logprob = bool(params.pop("logprobs", False))
    params.pop("prompt_logprobs", None)
    params["max_new_tokens"] = max_new
    if sampling_seed is not None:
        params["sampling_seed"] = int(sampling_seed)
    return {
        "rid": new_rid(),  # fresh per attempt: re-sending an in-flight rid is a 400 in SGLang
        "input_ids": ids,
        "sampling_params": params,
        "return_logprob": return_logprob,
    }


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
