"""SGLang's native protocol as an `Engine`: `POST /generate` with `input_ids`, `sampling_params` and a
`rid`; the answer's `output_ids` with `meta_info.output_token_logprobs` triples. The same protocol is
served by pipegen's CPU reference server and the test fakes.

- abort: `POST /abort_request {rid}` (the server answers the request itself with an `abort` finish);
- readiness: `GET /health_generate` (generates one token);
- running limit: `/get_server_info` `max_running_requests`;
- load: `/get_load` (per data-parallel rank `num_reqs`, running and waiting together, and `num_waiting_reqs`).

The body and the answer are built and read by protocol.py, as verl's SGLang server does.
Owns: SGLang's endpoints and their answers. Must never: retry, or re-tokenize anything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import aiohttp
import orjson

from pipegen.actor.engines import EngineRequest, LoadUnavailable, get_json
from pipegen.actor.protocol import ClientLimits, build_request, new_rid, parse_response

log = logging.getLogger("pipegen.client")

_JSON = {"Content-Type": "application/json"}


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

    def build(self, prompt_ids: list[int], sampling_params: dict[str, Any], limits: ClientLimits,
              sampling_seed: int | None) -> EngineRequest:
        body = build_request(prompt_ids, sampling_params, limits, sampling_seed)
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
