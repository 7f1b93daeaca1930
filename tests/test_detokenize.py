"""The text scorers read is exactly what verl's reward loop decodes: `tokenizer.decode(ids,
skip_special_tokens=True)`, whether the actor answers it from its byte table or from the library."""

from __future__ import annotations

import random

import pytest

from pipegen.actor import detokenize
from pipegen.actor.detokenize import ByteTableDecoder, response_decoder


def library(tokenizer, ids):
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except Exception as e:  # noqa: BLE001
        return type(e)


def ours(decode, ids):
    try:
        return decode(ids)
    except Exception as e:  # noqa: BLE001
        return type(e)


def random_responses(vocab: int, count: int = 300) -> list[list[int]]:
    rng = random.Random(7)
    # random ids split multi-byte characters across tokens and mix in special and added tokens
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 300))] for _ in range(count)]
    return seqs + [[], [5], [vocab - 1], [3, vocab + 10, 4], [7, -1, 9], list(range(vocab))]


@pytest.fixture(scope="module")
def tokenizers(tiny_model):
    from transformers import AutoTokenizer

    from pipegen.inputs.models import resolve_model_path

    return {"tiny-qwen": AutoTokenizer.from_pretrained(tiny_model),
            "smollm2-135m": AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))}


@pytest.mark.parametrize("name", ["tiny-qwen", "smollm2-135m"])
def test_the_byte_table_gives_the_tokenizers_own_text(tokenizers, name):
    tokenizer = tokenizers[name]
    decode = response_decoder(tokenizer)
    assert isinstance(decode, ByteTableDecoder), "a byte-level BPE tokenizer should get the fast path"
    for ids in random_responses(len(tokenizer)):
        assert ours(decode, ids) == library(tokenizer, ids), ids[:8]
    # the added tokens verl's tool parser relies on survive, the special ones do not
    if name == "tiny-qwen":
        ids = tokenizer.encode("<|im_start|>hi <tool_call>é</tool_call><|im_end|>", add_special_tokens=False)
        assert decode(ids) == "hi <tool_call>é</tool_call>" == library(tokenizer, ids)


def test_a_table_that_would_differ_is_never_used(tokenizers, monkeypatch):
    """The check against the library is what guards the fast path: a wrong byte map must be caught."""
    tokenizer = tokenizers["tiny-qwen"]
    right = detokenize.byte_alphabet()
    monkeypatch.setattr(detokenize, "byte_alphabet", lambda: {c: (b + 1) % 256 for c, b in right.items()})
    decode = response_decoder(tokenizer)
    assert not isinstance(decode, ByteTableDecoder)
    for ids in random_responses(len(tokenizer), count=20):
        assert ours(decode, ids) == library(tokenizer, ids)


def test_other_tokenizers_keep_the_library_decode():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "##lo": 2, "world": 3}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    decode = response_decoder(tokenizer)
    assert not isinstance(decode, ByteTableDecoder)
    assert decode([1, 2, 3]) == library(tokenizer, [1, 2, 3]) == "hellolo world"
