"""What every engine's request shares: the token budget (`max_new_tokens`, verl's SGLang rule), the prompt
ids checked against the vocabulary before sending (SGLang does not check them), a fresh request id, and
`RequestRejected` for a request that retrying cannot help.

`limits` is anything with the token budget's four numbers (`prompt_length`, `response_length`,
`max_model_len`, `vocab_size`): the actor's ClientLimits, or a bench's.
Owns: those rules. Must never: do I/O, or re-tokenize anything (ids in, ids out).
"""

from __future__ import annotations

import os
from typing import Any, Protocol


class TokenBudget(Protocol):
    prompt_length: int
    response_length: int
    max_model_len: int
    vocab_size: int | None


class RequestRejected(Exception):
    """The request itself is wrong (HTTP 4xx, too long, bad ids): retrying cannot help."""


def max_new_tokens_for(sampling_params: dict[str, Any], prompt_len: int, limits: TokenBudget) -> int:
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


def checked_prompt_ids(prompt_ids: list[int], limits: TokenBudget) -> list[int]:
    """The prompt as a list of ints, refused (RequestRejected) when empty or outside the vocabulary."""
    ids = list(map(int, prompt_ids))
    if not ids:
        raise RequestRejected("empty prompt")
    # min/max first: a per-token comparison in Python costs more than the rest of the body
    if limits.vocab_size is not None and (min(ids) < 0 or max(ids) >= limits.vocab_size):
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise RequestRejected(f"{len(bad)} prompt token id(s) outside the vocabulary of "
                                  f"{limits.vocab_size} (first {bad[0]})")
    return ids
