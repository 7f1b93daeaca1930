"""SGLang 0.5.12's ``SamplingParams`` for one generation: its keys, defaults, greedy conversion and verify().

Owns: ``SAMPLING_KEYS`` (the known keys, in SGLang's declaration order), ``SamplingSpec`` (the normalised,
immutable view a backend reads), ``parse_sampling_params`` (one ``sampling_params`` dict -> SamplingSpec, raising
SGLang's error for the first problem in SGLang's order), and the constants SGLang's scheduler uses for them.
Must never: do I/O, import torch/transformers/aiohttp, or accept a key or value SGLang would refuse (except
``None`` = default, which newer SGLang accepts too).

Hand-written on purpose, not pydantic: SGLang itself validates these with plain code (SamplingParams.__init__
raises TypeError, verify() raises ValueError in a fixed order after the temperature-0 -> top_k=1 conversion),
so a pydantic model would still need this verify() plus a translation of every ValidationError back into
SGLang's texts and first-error order - more code for the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from pipegen.cpu_server.errors import (
    bad_request,
    invalid_type_error,
    type_name,
    unknown_field_error,
    validation_error,
)

DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams default on /generate when the key is absent
UNLIMITED = 1 << 30  # what the scheduler uses for max_new_tokens=null before clamping
SAMPLING_EPS = 1e-6  # temperature below this means greedy (top_k = 1)

# SamplingParams.__init__ arguments in 0.5.12, in declaration order. Anything else inside sampling_params is
# an unknown field (0.5.12: TypeError -> bare 500; 0.5.23: 400 with a serde-style message).
SAMPLING_KEYS: tuple[str, ...] = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
)
_SAMPLING_KEY_SET = frozenset(SAMPLING_KEYS)


def is_int(v: Any) -> bool:
    """A JSON integer (``true``/``false`` are not integers)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A JSON number (``true``/``false`` are not numbers)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


@dataclass(frozen=True)
class SamplingSpec:
    """Normalised sampling parameters of one generation (SGLang's post-__init__ view)."""

    max_new_tokens: Optional[int] = DEFAULT_MAX_NEW_TOKENS  # as requested; None = up to the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    sampling_seed: Optional[int] = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        """SGLang turns temperature < 1e-6 into top_k = 1."""
        return self.top_k == 1


def parse_sampling_params(sp: Any, *, vocab_size: int, unknown_key_status: int = 400) -> SamplingSpec:
    """Normalise and verify one ``sampling_params`` dict the way SGLang 0.5.12's SamplingParams does.

    ``None`` values mean "default" (newer SGLang does the same; 0.5.12 would crash on most of them).
    Raises ProtocolError with SGLang's texts.
    """
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise validation_error(f"sampling_params: Input should be a valid dictionary, got {type_name(sp)}")
    for key in sp:
        if key not in _SAMPLING_KEY_SET:
            raise unknown_field_error(str(key), SAMPLING_KEYS, unknown_key_status)

    def typed(key: str, default: Any, ok: Callable[[Any], bool], expected: str) -> Any:
        v = sp.get(key)
        if v is None:
            return default
        if not ok(v):
            raise invalid_type_error(key, v, expected, unknown_key_status)
        return v

    # max_new_tokens: absent -> 128, explicit null -> unlimited (clamped to the context later).
    if "max_new_tokens" in sp:
        max_new_tokens = typed("max_new_tokens", None, is_int, "an integer")
    else:
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    temperature = typed("temperature", 1.0, is_number, "a number")
    top_p = typed("top_p", 1.0, is_number, "a number")
    top_k = typed("top_k", -1, is_int, "an integer")
    min_p = typed("min_p", 0.0, is_number, "a number")
    frequency_penalty = typed("frequency_penalty", 0.0, is_number, "a number")
    presence_penalty = typed("presence_penalty", 0.0, is_number, "a number")
    repetition_penalty = typed("repetition_penalty", 1.0, is_number, "a number")
    min_new_tokens = typed("min_new_tokens", 0, is_int, "an integer")
    n = typed("n", 1, is_int, "an integer")
    ignore_eos = typed("ignore_eos", False, _is_bool, "a boolean")
    for key in ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        typed(key, True, _is_bool, "a boolean")
    sampling_seed = typed("sampling_seed", None, is_int, "an integer")

    stop_ids = sp.get("stop_token_ids")
    if stop_ids is None:
        stop_token_ids: frozenset[int] = frozenset()
    elif isinstance(stop_ids, list) and all(is_int(t) or t is None for t in stop_ids):
        stop_token_ids = frozenset(int(t) for t in stop_ids if t is not None)
    else:
        raise invalid_type_error("stop_token_ids", stop_ids, "a list of integers", unknown_key_status)

    # Stop strings need a tokenizer: under --skip-tokenizer-init they are accepted and can never match.
    for key in ("stop", "stop_regex"):
        v = sp.get(key)
        if v is not None and not isinstance(v, str) and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise invalid_type_error(key, v, "a string or a list of strings", unknown_key_status)

    logit_bias_raw = sp.get("logit_bias")
    if logit_bias_raw is not None and not isinstance(logit_bias_raw, dict):
        raise invalid_type_error("logit_bias", logit_bias_raw, "a map of token id to bias", unknown_key_status)

    # SamplingParams.__init__: greedy conversion happens before verify().
    if 0 <= temperature < SAMPLING_EPS:
        temperature = 1.0
        top_k = 1
    top_k_checked = UNLIMITED if top_k == -1 else top_k

    # verify(), in SGLang's order and with its texts.
    if temperature < 0.0:
        raise bad_request(f"temperature must be non-negative, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {min_p}.")
    if top_k_checked < 1:
        raise bad_request(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if not -2.0 <= frequency_penalty <= 2.0:
        raise bad_request(f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.")
    if not -2.0 <= presence_penalty <= 2.0:
        raise bad_request(f"presence_penalty must be in [-2, 2], got {presence_penalty}.")
    if not 0.0 < repetition_penalty <= 2.0:
        raise bad_request(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition_penalty}.")
    if not 0 <= min_new_tokens:
        raise bad_request(f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}.")
    if max_new_tokens is not None:
        if max_new_tokens < 0:
            raise bad_request(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if not min_new_tokens <= max_new_tokens:
            raise bad_request(f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new_tokens}.")
    logit_bias: list[tuple[int, float]] = []
    if logit_bias_raw:
        for tok, bias in logit_bias_raw.items():
            try:
                tid = int(tok)
            except (TypeError, ValueError):
                raise invalid_type_error("logit_bias", logit_bias_raw, "integer keys", unknown_key_status) from None
            if not 0 <= tid < vocab_size:
                raise bad_request(f"logit_bias must has keys in [0, {vocab_size - 1}], got {tok}.")
            if not is_number(bias):
                raise invalid_type_error("logit_bias", logit_bias_raw, "numeric biases", unknown_key_status)
            logit_bias.append((tid, float(bias)))
    grammars = [sp.get("json_schema"), sp.get("regex"), sp.get("ebnf")]
    if sum(g is not None for g in grammars) > 1:
        raise bad_request("Only one of regex, json_schema, or ebnf can be set.")
    if any(g is not None for g in grammars) or sp.get("structural_tag") is not None:
        # Explicit, not silent: constrained decoding would change the output distribution.
        raise bad_request("pipegen reference server: constrained decoding (json_schema/regex/ebnf/structural_tag) "
                          "is not supported.")
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}.")

    return SamplingSpec(
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        min_p=float(min_p),
        frequency_penalty=float(frequency_penalty),
        presence_penalty=float(presence_penalty),
        repetition_penalty=float(repetition_penalty),
        min_new_tokens=min_new_tokens,
        n=n,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
        sampling_seed=sampling_seed,
        logit_bias=tuple(logit_bias),
    )
