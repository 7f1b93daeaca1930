"""The response text a scorer reads: `tokenizer.decode(ids, skip_special_tokens=True)`, as verl's reward
loop computes it, answered from a per-token byte table where that gives the very same string.

Why by hand: for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) the library's decode costs about
0.4 us per token (a character-to-byte map lookup per character, then a lossy UTF-8 conversion): 100-150 us
for a 256-token response, the largest single cost of an actor's unit after the HTTP exchange itself. The
same string is a join of each token's bytes and one UTF-8 decode with replacement (~10 us), because that is
all the ByteLevel decoder does: a token whose characters all come from the byte alphabet contributes those
bytes, any other token (an added token, say) its own UTF-8 bytes, special tokens nothing, and the joined
bytes go through a lossy conversion that, like Python's `errors="replace"`, replaces each maximal invalid
subsequence with U+FFFD.

The table is only used when it is proven equal: it is built for tokenizers whose decoder is exactly
ByteLevel with no clean-up step, then checked against `tokenizer.decode` on every token id, in runs of
consecutive and of shuffled ids (which split multi-byte characters every way); any difference, or any
other tokenizer, and `decode` is the library's own.

Owns: the decoded response text handed to scorers.
Must never: return a string `tokenizer.decode(ids, skip_special_tokens=True)` would not.
"""

from __future__ import annotations

import json
import logging
import random
from operator import itemgetter
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger("pipegen.actor")

PROBE_RUN = 64  # ids per probe decode: long enough to join tokens in every order, short enough to stay fast


def byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (the ByteLevel pre-tokenizer's alphabet), inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def library_decode(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    # an array, as verl's reward loop passes (a tensor): transformers then converts it with one tolist()
    # instead of an isinstance check per token
    return lambda ids: tokenizer.decode(np.asarray(ids, dtype=np.int64), skip_special_tokens=True)


def _token_bytes(tokenizer: Any) -> list[bytes] | None:
    """Each id's bytes in a decoded text (b"" for special tokens and unused ids), or None where the
    tokenizer is not a plain ByteLevel one."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):  # transformers edits the text after decoding
        return None
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, TypeError):
        return None
    if decoder.get("type") != "ByteLevel":
        return None
    alphabet = byte_alphabet()
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    table = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i)
        if token is None or i in special:
            table.append(b"")
        elif all(c in alphabet for c in token):
            table.append(bytes(alphabet[c] for c in token))
        else:
            table.append(token.encode())
    return table


def _probes(size: int, seed: int = 0) -> list[list[int]]:
    ids = list(range(size))
    shuffled = ids[:]
    random.Random(seed).shuffle(shuffled)
    return [seq[i:i + PROBE_RUN] for seq in (ids, shuffled) for i in range(0, size, PROBE_RUN)]


class ByteTableDecoder:
    """`decode(ids)`: the joined bytes of each token, decoded once (ids outside the table: the library)."""

    def __init__(self, table: list[bytes], fallback: Callable[[Sequence[int]], str]):
        self._table = table
        self._fallback = fallback

    def __call__(self, ids: Sequence[int]) -> str:
        if len(ids) < 2:  # itemgetter of one id returns the item itself, not a tuple
            return self._fallback(ids)
        if min(ids) < 0:  # a negative id would index from the end
            return self._fallback(ids)
        try:
            parts = itemgetter(*ids)(self._table)  # the fastest gather in CPython: one C call
        except (IndexError, TypeError):  # an id past the vocabulary, or not an int
            return self._fallback(ids)
        return b"".join(parts).decode("utf-8", "replace")


def response_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """The fastest decode proven equal to `tokenizer.decode(ids, skip_special_tokens=True)` for this
    tokenizer (checked here, once per process: ~0.1 s for a 50k vocabulary)."""
    library = library_decode(tokenizer)
    try:
        table = _token_bytes(tokenizer)
    except Exception as e:  # noqa: BLE001  (an unusual tokenizer object: keep the library's decode)
        log.info("response text: the tokenizer's decode (no byte table: %s)", e)
        return library
    if table is None:
        return library
    fast = ByteTableDecoder(table, library)
    for probe in _probes(len(table)):
        if fast(probe) != library(probe):
            log.info("response text: the tokenizer's decode (the byte table differs on ids %s...)", probe[:4])
            return library
    return fast
