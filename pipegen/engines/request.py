"""What every engine's request shares: `Generation`, the one value a model call travels as from verl's call to
the engine's body (prompt ids, sampling params, the token budget computed once, the seed, the pictures, where its
tokens go as they come); the token budget rule (`max_new_tokens`, verl's SGLang rule); the prompt ids checked
against the vocabulary before sending (SGLang does not check them); a fresh request id; and `RequestRejected` for
a request that retrying cannot help.

`limits` is anything with the token budget's four numbers (`prompt_length`, `response_length`,
`max_model_len`, `vocab_size`): the actor's ClientLimits, or a bench's.
Owns: those rules. Must never: do I/O, or re-tokenize anything (ids in, ids out).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

# where an answer's tokens so far go while it is generated: (the attempt's rid, its ids so far, their log-probs or
# None); actor/continuation.py keeps them on disk
Keep = Callable[[str, list[int], "list[float] | None"], None]
# the sampling keys that carry the token budget (verl's and OpenAI's spellings): read once, into Generation
BUDGET_KEYS = ("max_new_tokens", "max_tokens")


class TokenBudget(Protocol):
    prompt_length: int
    response_length: int
    max_model_len: int
    vocab_size: int | None
    draws_by_position: bool


class RequestRejected(Exception):
    """The request itself is wrong (HTTP 4xx, too long, bad ids): retrying cannot help."""


def max_new_tokens_for(sampling_params: dict[str, Any], prompt_len: int, limits: TokenBudget) -> int:
    """verl's SGLang rule (async_sglang_server.generate): caller's value, else the remaining budget, clamped.
    Reads `sampling_params`, never changes it."""
    max_possible = limits.max_model_len - prompt_len - 1
    if max_possible < 0:
        raise RequestRejected(
            f"prompt of {prompt_len} tokens exceeds the model's maximum context length ({limits.max_model_len})"
        )
    if "max_new_tokens" in sampling_params:
        wanted = sampling_params["max_new_tokens"]
    elif "max_tokens" in sampling_params:
        wanted = sampling_params["max_tokens"]
    else:
        wanted = min(limits.response_length, limits.prompt_length + limits.response_length - prompt_len)
    return max(0, min(int(wanted), max_possible))


@dataclass
class Generation:
    """One model call as it travels from verl's `generate` to an engine's body: built once (`Generation.of`), read
    by every layer (continuation, the client's attempts, the engine), never re-derived."""

    prompt_ids: list[int]  # checked against the vocabulary
    params: dict[str, Any]  # verl's sampling params without the budget keys (BUDGET_KEYS)
    max_new_tokens: int  # the token budget, verl's rule, computed once
    seed: int | None = None  # the engine's sampling seed (SGLang's sampling_seed, vLLM's seed)
    pictures: list[str] | None = None  # the prompt's pictures as PNG data URLs (run/pictures.py)
    on_tokens: Keep | None = field(default=None, compare=False)  # None: the answer is read whole
    draws_by_position: bool = False  # the engine keys its draws on (seed, position): the rest keeps the seed

    @property
    def return_logprob(self) -> bool:
        return bool(self.params.get("logprobs", False))

    @classmethod
    def of(cls, prompt_ids: list[int], sampling_params: dict[str, Any], limits: TokenBudget,
           seed: int | None = None, pictures: list[str] | None = None, on_tokens: Keep | None = None) -> "Generation":
        ids = checked_prompt_ids(prompt_ids, limits)
        budget = max_new_tokens_for(sampling_params, len(ids), limits)
        params = {k: v for k, v in sampling_params.items() if k not in BUDGET_KEYS}
        return cls(ids, params, budget, seed, list(pictures) if pictures else None, on_tokens,
                   bool(getattr(limits, "draws_by_position", False)))

    def continued(self, ids: list[int]) -> "Generation":
        """The rest of this answer after its first `ids` (a chunk, a resumed answer, a hedge copy): the prompt plus
        them, the budget less them, and the seed `continuation_seed` gives it."""
        return Generation(self.prompt_ids + list(ids), self.params, max(0, self.max_new_tokens - len(ids)),
                          continuation_seed(self.seed, len(ids), self.draws_by_position), self.pictures, None,
                          self.draws_by_position)


def continuation_seed(seed: int | None, offset: int, draws_by_position: bool = False) -> int | None:
    """The seed of an answer's rest from its token `offset` on: the call's own at 0, and always where the engine
    keys each draw on (seed, position) (the rest then draws what the uninterrupted answer drew); elsewhere a seed
    derived from it, so the rest does not replay the earlier random draws of an engine's per-request stream."""
    if seed is None or offset == 0 or draws_by_position:
        return seed
    digest = hashlib.blake2b(f"{seed}:{offset}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def turn_seed(seed: int | None, turn: int, draws_by_position: bool = False) -> int | None:
    """The seed of a unit's model call number `turn` (0: its first; a tool loop's later turns count on): the
    unit's own for the first, and for every turn where the engine keys each draw on (seed, position) (a later
    turn's positions lie past the earlier turns', so its draws are its own); elsewhere one derived from the
    unit's and the turn, so a turn does not replay the first turn's draws of a per-request stream."""
    if seed is None or turn == 0 or draws_by_position:
        return seed
    digest = hashlib.blake2b(f"{seed}:turn:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF


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
