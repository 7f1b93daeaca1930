"""The fake backend's pure token function: deterministic tokens and log-probs without a model.

Each next token is a function of (server seed, sampling_seed, sample index, the full context token ids)
through a 64-bit hash: an FNV-style fold over the context, then a splitmix64 finalizer. It is drawn from a
small range of ordinary token ids, with an EOS chance per token so lengths vary; its logprob is a
deterministic negative float. Because the hash is a fold over the context, re-sending ``prompt + partial
output`` continues exactly the same trajectory (resume == uninterrupted), in any process, after any restart.

Owns: the hash, ``FakeModel`` (token draw, log-probs, top lists).
Must never: import torch or transformers, use Python's randomized ``hash()``, or keep state between calls.
"""

from __future__ import annotations

from typing import Optional

from pipegen.cpu_server.model_backend import ModelFacts, TopList
from pipegen.cpu_server.parse import EntrySpec

MASK64 = (1 << 64) - 1
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
DEFAULT_SAMPLING_SEED = 42


def mix64(x: int) -> int:
    """splitmix64's finalizer: a fast, well-mixed 64-bit bijection (stable across processes, unlike hash())."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def fold(h: int, token: int) -> int:
    """Extend a context hash by one token (FNV-1a over whole token ids; mixing happens at draw time)."""
    return ((h ^ (token + 1)) * FNV_PRIME) & MASK64


def fold_all(tokens: tuple[int, ...] | list[int], h: int = FNV_OFFSET) -> int:
    """The context hash of a whole sequence; ``fold_all(a + b) == fold_all(b, fold_all(a))``."""
    for t in tokens:
        h = ((h ^ (t + 1)) * FNV_PRIME) & MASK64
    return h


class FakeModel:
    """The pure token function (no I/O, no time): same arguments, same tokens, everywhere."""

    def __init__(self, facts: ModelFacts, *, seed: int = 0, eos_prob: float = 0.02,
                 token_range: Optional[tuple[int, int]] = None) -> None:
        self.vocab_size = facts.vocab_size
        self.eos_ids = facts.eos_token_ids
        self.eos = facts.primary_eos
        self.seed = seed
        if token_range is None:
            # Ordinary ids, away from the low special ids many tokenizers use and from the added tokens at the top.
            lo = min(100, self.vocab_size // 4)
            hi = min(lo + 1000, (self.vocab_size * 3) // 4)
            token_range = (lo, max(hi, lo + 1))
        self.lo, self.hi = token_range
        self.span = self.hi - self.lo
        self.eos_threshold = int(max(0.0, min(1.0, eos_prob)) * (1 << 32))

    def key(self, spec: EntrySpec) -> int:
        """Per-generation key. Greedy ignores sampling_seed and the sample index (argmax has no randomness)."""
        if spec.sampling.greedy:
            return mix64(mix64(self.seed) ^ 0x6A09E667F3BCC908)
        s = spec.sampling.sampling_seed
        s = DEFAULT_SAMPLING_SEED if s is None else s
        k = mix64(mix64(self.seed) ^ mix64(s & MASK64))
        if spec.sample_index:
            k = mix64(k ^ mix64(spec.sample_index + 0x3C6EF372FE94F82B))
        return k

    def logprob(self, r: int) -> float:
        """A deterministic logprob in (-3.05, -0.05] from hash bits."""
        return -(0.05 + ((r >> 16) & 0xFFFF) / 65536.0 * 3.0)

    def ordinary(self, r: int, avoid: frozenset[int]) -> int:
        tok = self.lo + ((r >> 32) % self.span)
        tries = 0
        while (tok in avoid or tok in self.eos_ids) and tries < self.span:
            tok = self.lo + ((tok - self.lo + 1) % self.span)
            tries += 1
        return tok

    def draw(self, h: int, key: int, allow_stop: bool, stop_ids: frozenset[int]) -> tuple[int, float]:
        """Next token and its logprob for context hash ``h``."""
        r = mix64(h ^ key)
        if allow_stop and (r & 0xFFFFFFFF) < self.eos_threshold:
            return self.eos, self.logprob(r)
        return self.ordinary(r, frozenset() if allow_stop else stop_ids), self.logprob(r)

    def token_logprob(self, h: int, key: int, token: int) -> float:
        """Deterministic logprob of an arbitrary token at context ``h`` (prompt logprobs, token_ids_logprob)."""
        r = mix64(h ^ key ^ mix64(token + 0x510E527FADE682D1))
        return -(0.5 + ((r >> 16) & 0xFFFF) / 65536.0 * 8.0)

    def top_list(self, h: int, key: int, chosen: int, lp: float, n: int) -> TopList:
        """A fake top-n list: the chosen token first, then distinct ordinary ids with lower logprobs."""
        out: TopList = [(lp, chosen)]
        r = mix64(h ^ key ^ 0x1F83D9ABFB41BD6B)
        j = 0
        while len(out) < n and j < self.span + n:
            tok = self.lo + ((r >> 32) + 7919 * (j + 1)) % self.span
            j += 1
            if tok != chosen and all(tok != t for _, t in out):
                out.append((lp - 0.25 * len(out), tok))
        return out
