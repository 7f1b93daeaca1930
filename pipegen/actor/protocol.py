"""SGLang's native /generate, as verl's SGLang adapter speaks it: the request body and the answer.

Owns: `ClientLimits` (what a request may ask, and the client's timing knobs), the `max_new_tokens`
rule, the body (`logprobs` popped to top-level `return_logprob`, no unknown keys inside
`sampling_params`, a fresh `rid`, the unit's `sampling_seed`, token ids checked against the vocabulary
before sending: SGLang does not check them), and the answer parsed into verl's `TokenOutput` the way
verl's SGLang server builds it.
Must never: re-tokenize anything (ids in, ids out), or do I/O (client.py sends and retries).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import Any

from pipegen.actor.pacing import WatchdogLimits
from pipegen.run.schema import CpuServers, Generation

_FIRST = operator.itemgetter(0)


class RequestRejected(Exception):
    """The request itself is wrong (HTTP 4xx, too long, bad ids): retrying cannot help."""



@dataclass
class ClientLimits:
    prompt_length: int
    response_length: int
    max_model_len: int
    request_timeout_s: float = CpuServers.request_timeout_s  # the schema's defaults: one place for each
    max_attempts: int = Generation.max_attempts  # tries per request (over servers) before RetriesExhausted
    backoff_base_s: float = 0.2
    backoff_max_s: float = 5.0
    quarantine_after: int = 3  # consecutive failures that take a server out of rotation
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 30.0  # /health_generate generates one token: give it time under load
    vocab_size: int | None = None  # ids >= this are refused before sending (SGLang does not check)
    watchdog: WatchdogLimits = field(default_factory=WatchdogLimits)
    abort_timeout_s: float = 5.0  # POST /abort_request; a wedged server may not answer it either


def max_new_tokens_for(sampling_params: dict[str, Any], prompt_len: int, limits: ClientLimits) -> int:
    """verl's SGLang rule (async_sglang_server.generate): caller's value, else the remaining budget, clamped."""
    max_possible = limits.max_model_len - prompt_len - 1
    if max_possible < 0:
        raise RequestRejected(
            f"prompt of {prompt_len} tokens exceeds the model's maximum context length ({limits.max_model_len})"
        )
    if "max_new_tokens" in sampling_params:
        wanted = sampling_params.pop("max_new_tokens")
        sampling_params.pop("max_tokens", None)
    elif "max_tokens" in sampling_params:
        wanted = sampling_params.pop("max_tokens")
    else:
        wanted = min(limits.response_length, limits.prompt_length + limits.response_length - prompt_len)
    return max(0, min(int(wanted), max_possible))


def new_rid() -> str:
    """A fresh request id: 128 random bits as 32 hex digits, like `uuid4().hex` at a fifth of its cost."""
    return os.urandom(16).hex()


def build_request(
    prompt_ids: list[int], sampling_params: dict[str, Any], limits: ClientLimits, sampling_seed: int | None
) -> dict[str, Any]:
    """The JSON body for SGLang's POST /generate (single form)."""
    ids = list(map(int, prompt_ids))
    if not ids:
        raise RequestRejected("empty prompt")
    # min/max first: a per-token comparison in Python costs more than the rest of the body
    if limits.vocab_size is not None and (min(ids) < 0 or max(ids) >= limits.vocab_size):
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestRejected(f"{len(bad)} prompt token id(s) outside the vocabulary of "
                                  f"{limits.vocab_size} (first {bad[0]})")
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
