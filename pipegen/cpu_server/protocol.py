"""SGLang 0.5.12's native ``/generate`` protocol as pure functions, plus the engine contract.

Owns:
  * ``parse_generate_request`` - validate a ``/generate`` body exactly where pipegen's client can tell the
    difference (SGLang's error texts and status codes, docs: sglang-protocol.md §1, §3) and expand it into one
    ``EntrySpec`` per generation (batch entries and ``n > 1`` samples, prompt-major, with SGLang's rid rules);
  * ``effective_max_new_tokens`` - default 128 when absent, ``null`` = up to the context, clamp ``C - 2 - N``;
  * ``build_output`` - the response object: ``output_ids`` + ``meta_info`` with SGLang's key order,
    ``[lp, id, null]`` logprob triples, finish-reason shapes, the ``max_new_tokens = 0`` phantom logprob;
  * the data types shared by the server and the engines (``EntrySpec``, ``GenerationResult``,
    ``EngineRequest``, ``Engine``) and ``read_model_facts`` (a small reader of ``config.json``).
Must never: do network I/O, import torch/transformers/aiohttp, or re-tokenize anything (token ids in, token
ids out). Everything here is deterministic given its arguments (rid generation is injected).
"""

from __future__ import annotations

import abc
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import orjson

# ----------------------------------------------------------------------------------------------------------
# Constants mirrored from SGLang 0.5.12
# ----------------------------------------------------------------------------------------------------------

DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams default on /generate when the key is absent
UNLIMITED = 1 << 30  # what the scheduler uses for max_new_tokens=null before clamping
SAMPLING_EPS = 1e-6  # temperature below this means greedy (top_k = 1)
SCHEDULER_INPUT_MARGIN = 6  # max_req_input_len = context_len - 1 - 5
WEIGHT_VERSION = "default"  # SGLang's --weight-version default
HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"  # rids of the server's own /health_generate probes (as SGLang names them)

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

SKIP_TOKENIZER_TEXT_ERROR = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide "
    "input_ids or re-initialize the engine with skip_tokenizer_init=False."
)

# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------


class ProtocolError(Exception):
    """An HTTP answer other than 200: status, raw body bytes and content type, ready to send."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        super().__init__(body.decode("utf-8", "replace"))
        self.status = status
        self.body = body
        self.content_type = content_type

    @property
    def message(self) -> str:
        """The human-readable message, whatever the body shape."""
        try:
            obj = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return self.body.decode("utf-8", "replace")
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict):
            return str(err.get("message"))
        if isinstance(err, str):
            return err
        if isinstance(obj, dict) and "message" in obj:
            return str(obj["message"])
        return self.body.decode("utf-8", "replace")


def bad_request(message: str) -> ProtocolError:
    """SGLang's usual 400 for a ValueError raised while handling /generate: ``{"error": {"message": ...}}``."""
    return ProtocolError(400, orjson.dumps({"error": {"message": message}}))


def validation_error(message: str) -> ProtocolError:
    """The 400 SGLang's FastAPI layer gives when the body fails pydantic type validation."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return ProtocolError(400, orjson.dumps(body))


def unknown_field_error(key: str, status: int = 400) -> ProtocolError:
    """An unknown/ill-typed key inside sampling_params.

    0.5.23 answers 400 ``{"error": "unknown field `k`, expected one of ..."}`` (a plain string, not an object);
    0.5.12 raises an uncaught TypeError, i.e. a bare 500 ``Internal Server Error`` in text/plain.
    """
    if status == 500:
        return ProtocolError(500, b"Internal Server Error", "text/plain")
    expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
    return ProtocolError(400, orjson.dumps({"error": f"unknown field `{key}`, expected one of {expected}"}))


def invalid_type_error(key: str, value: Any, expected: str, status: int = 400) -> ProtocolError:
    """An ill-typed value inside sampling_params (same status rules as an unknown field)."""
    if status == 500:
        return ProtocolError(500, b"Internal Server Error", "text/plain")
    shown = orjson.dumps(value).decode()[:80]
    return ProtocolError(400, orjson.dumps({"error": f"invalid type: {shown} for field `{key}`, expected {expected}"}))


def service_unavailable(message: str = "The request queue is full.") -> ProtocolError:
    """SGLang's 503 (queue full, waiting/running timeout)."""
    body = {"object": "error", "message": message, "type": "503", "param": None, "code": 503}
    return ProtocolError(503, orjson.dumps(body))


# ----------------------------------------------------------------------------------------------------------
# Finish reasons (sglang-protocol.md §2.2)
# ----------------------------------------------------------------------------------------------------------


def finish_stop(token_id: int) -> dict:
    """EOS or a stop_token_ids hit; the matched token is the last element of output_ids."""
    return {"type": "stop", "matched": token_id}


def finish_length(length: int) -> dict:
    """Reached the effective (clamped) max_new_tokens."""
    return {"type": "length", "length": length}


def finish_abort() -> dict:
    """Aborted while running: HTTP 200, partial tokens kept."""
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def finish_abort_waiting() -> dict:
    """Aborted before it ran."""
    return {"type": "abort", "message": "Abort in waiting queue"}


# ----------------------------------------------------------------------------------------------------------
# Parsed request
# ----------------------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class EntrySpec:
    """One generation: one prompt x one sample, after batch/n expansion. Immutable."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingSpec
    max_new_tokens: int  # effective: min(requested or 2^30, C - 2 - N), floored at 0
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1 = no prompt logprobs
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[tuple[int, ...]] = None
    prompt_index: int = 0
    sample_index: int = 0


@dataclass(frozen=True)
class ParsedRequest:
    """A validated /generate body. ``is_single``: answer one object, else a list in ``entries`` order."""

    entries: tuple[EntrySpec, ...]
    is_single: bool
    user_rids: bool  # True when the client's rids are used as-is (n == 1): in-flight duplicates are then 400


def effective_max_new_tokens(requested: Optional[int], prompt_len: int, context_length: int) -> int:
    """The scheduler's budget: ``min(requested or 2^30, C - 2 - N)``, floored at 0 (§2.3)."""
    want = UNLIMITED if requested is None else requested
    return max(0, min(want, context_length - 2 - prompt_len))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def parse_sampling_params(sp: Any, *, vocab_size: int, unknown_key_status: int = 400) -> SamplingSpec:
    """Normalise and verify one ``sampling_params`` dict the way SGLang 0.5.12's SamplingParams does.

    ``None`` values mean "default" (newer SGLang does the same; 0.5.12 would crash on most of them).
    Raises ProtocolError with SGLang's texts.
    """
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise validation_error(f"sampling_params: Input should be a valid dictionary, got {_type_name(sp)}")
    for key in sp:
        if key not in _SAMPLING_KEY_SET:
            raise unknown_field_error(str(key), unknown_key_status)

    def num(key: str, default: float) -> float:
        v = sp.get(key)
        if v is None:
            return default
        if not _is_number(v):
            raise invalid_type_error(key, v, "a number", unknown_key_status)
        return v

    def integer(key: str, default: Optional[int]) -> Optional[int]:
        v = sp.get(key)
        if v is None:
            return default
        if not _is_int(v):
            raise invalid_type_error(key, v, "an integer", unknown_key_status)
        return v

    def boolean(key: str, default: bool) -> bool:
        v = sp.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise invalid_type_error(key, v, "a boolean", unknown_key_status)
        return v

    # max_new_tokens: absent -> 128, explicit null -> unlimited (clamped to the context later).
    if "max_new_tokens" in sp:
        max_new_tokens = integer("max_new_tokens", None)
    else:
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    temperature = num("temperature", 1.0)
    top_p = num("top_p", 1.0)
    top_k = integer("top_k", -1)
    min_p = num("min_p", 0.0)
    frequency_penalty = num("frequency_penalty", 0.0)
    presence_penalty = num("presence_penalty", 0.0)
    repetition_penalty = num("repetition_penalty", 1.0)
    min_new_tokens = integer("min_new_tokens", 0)
    n = integer("n", 1)
    ignore_eos = boolean("ignore_eos", False)
    for key in ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        boolean(key, True)
    sampling_seed = integer("sampling_seed", None)

    stop_ids = sp.get("stop_token_ids")
    if stop_ids is None:
        stop_token_ids: frozenset[int] = frozenset()
    elif isinstance(stop_ids, list) and all(_is_int(t) or t is None for t in stop_ids):
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
    if top_k == -1:
        top_k_checked = UNLIMITED
    else:
        top_k_checked = top_k

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
            if not _is_number(bias):
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


def _per_entry(value: Any, batch_size: int, name: str, check: Callable[[Any], bool], default: Any) -> list[Any]:
    """SGLang's normalize_param: None -> default for all, a scalar broadcasts, a list is per prompt."""
    if value is None:
        return [default] * batch_size
    if isinstance(value, list):
        if len(value) != batch_size:
            raise bad_request(f"The length of {name} should be equal to the batch size.")
        for v in value:
            if not check(v):
                raise validation_error(f"{name}: Input should be valid, got {_type_name(v)}")
        return list(value)
    if not check(value):
        raise validation_error(f"{name}: Input should be valid, got {_type_name(value)}")
    return [value] * batch_size


def parse_generate_request(
    body: Any,
    *,
    context_length: int,
    vocab_size: int,
    unknown_key_status: int = 400,
    new_rid: Callable[[], str] = lambda: uuid.uuid4().hex,
) -> ParsedRequest:
    """Validate a /generate body (already JSON-decoded) and expand it into generations.

    Mirrors GenerateReqInput.normalize_batch_and_arguments, TokenizerManager._validate_one_request,
    SamplingParams.verify and the scheduler's input-length checks of SGLang 0.5.12 (sglang-protocol.md §1, §3).
    Raises ProtocolError; the in-flight duplicate-rid check needs server state and lives in the server.
    """
    if not isinstance(body, dict):
        raise validation_error(f"Input should be a valid dictionary or object to extract fields from, got "
                               f"{_type_name(body)}")
    input_ids = body.get("input_ids")
    text = body.get("text")
    if text is None and input_ids is None and body.get("input_embeds") is None:
        raise bad_request("Either text, input_ids or input_embeds should be provided.")
    if input_ids is None:
        # Text (or embeddings) only: this server always runs as --skip-tokenizer-init.
        raise bad_request(SKIP_TOKENIZER_TEXT_ERROR)
    if not isinstance(input_ids, list):
        raise validation_error(f"input_ids: Input should be a valid list, got {_type_name(input_ids)}")
    if len(input_ids) == 0:
        raise bad_request("input_ids cannot be empty.")

    # Single vs batch is decided by the type of input_ids[0].
    if isinstance(input_ids[0], list):
        is_single = False
        prompts = input_ids
        for p in prompts:
            if not isinstance(p, list) or not all(_is_int(t) for t in p):
                raise validation_error("input_ids: Input should be a list of lists of integers")
            if len(p) == 0:
                raise bad_request("input_ids cannot be empty.")
    else:
        is_single = True
        if not all(_is_int(t) for t in input_ids):
            raise validation_error("input_ids: Input should be a valid list of integers")
        prompts = [input_ids]
    batch_size = len(prompts)

    if body.get("stream"):
        raise bad_request("pipegen reference server: stream=true is not supported; use the non-streaming /generate.")

    # Parallel sampling: every per-entry dict must carry the same n.
    sp_raw = body.get("sampling_params")
    if sp_raw is None:
        sp_list: list[Any] = [{}] * batch_size
    elif isinstance(sp_raw, dict):
        sp_list = [sp_raw] * batch_size
    elif isinstance(sp_raw, list):
        if is_single:
            raise validation_error("sampling_params: Input should be a valid dictionary for a single request")
        if len(sp_raw) != batch_size:
            raise bad_request("The length of sampling_params should be equal to the batch size.")
        sp_list = sp_raw
    else:
        raise validation_error(f"sampling_params: Input should be a valid dictionary, got {_type_name(sp_raw)}")
    n_values = [(s.get("n", 1) if isinstance(s, dict) else 1) for s in sp_list]
    n = n_values[0] if n_values[0] is not None else 1
    if any((v if v is not None else 1) != n for v in n_values):
        raise bad_request("The parallel_sample_num should be the same for all samples in sample params.")
    if not _is_int(n):
        raise invalid_type_error("n", n, "an integer", unknown_key_status)
    if n > 1:
        is_single = False

    # rid rules: single -> as given (or uuid); batch -> "rid_i" for a string, a list must match the batch;
    # n > 1 -> everything replaced by fresh uuids (after the list checks).
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, (str, list)):
        raise bad_request("The rid should be a string or a list of strings.")
    if isinstance(rid, list):
        if not all(isinstance(r, str) for r in rid):
            raise bad_request("The rid should be a string or a list of strings.")
        if is_single and n == 1:
            raise validation_error("rid: Input should be a valid string for a single request")
        if len(rid) != batch_size:
            raise bad_request("The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rid)) != len(rid):
            seen: dict[str, int] = {}
            for r in rid:
                seen[r] = seen.get(r, 0) + 1
            dups = [r for r, c in seen.items() if c > 1]
            raise bad_request(f"Duplicate request IDs detected within the request: {dups}")
    if n > 1:
        rids = [new_rid() for _ in range(batch_size * n)]
        user_rids = False
    elif is_single:
        rids = [rid if isinstance(rid, str) else new_rid()]
        user_rids = isinstance(rid, str)
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(batch_size)]
        user_rids = True
    elif isinstance(rid, list):
        rids = list(rid)
        user_rids = True
    else:
        rids = [new_rid() for _ in range(batch_size)]
        user_rids = False

    return_logprob = _per_entry(body.get("return_logprob"), batch_size, "return_logprob",
                               lambda v: isinstance(v, bool), False)
    logprob_start_len = _per_entry(body.get("logprob_start_len"), batch_size, "logprob_start_len", _is_int, -1)
    top_logprobs_num = _per_entry(body.get("top_logprobs_num"), batch_size, "top_logprobs_num", _is_int, 0)
    tid_raw = body.get("token_ids_logprob")
    if tid_raw is None or tid_raw == []:
        token_ids_logprob: list[Optional[tuple[int, ...]]] = [None] * batch_size
    elif isinstance(tid_raw, list) and all(_is_int(t) for t in tid_raw):
        token_ids_logprob = [tuple(tid_raw)] * batch_size
    elif isinstance(tid_raw, list) and len(tid_raw) == batch_size and all(
            isinstance(x, list) and all(_is_int(t) for t in x) for x in tid_raw):
        token_ids_logprob = [tuple(x) if x else None for x in tid_raw]
    else:
        raise validation_error("token_ids_logprob: Input should be a list of integers or a list of lists")

    entries: list[EntrySpec] = []
    for i, prompt in enumerate(prompts):
        sampling = parse_sampling_params(sp_list[i], vocab_size=vocab_size, unknown_key_status=unknown_key_status)
        n_tok = len(prompt)
        # TokenizerManager._validate_one_request (note: >=, as in SGLang's source).
        if n_tok >= context_length:
            raise bad_request(f"The input ({n_tok} tokens) is longer than the model's context length "
                              f"({context_length} tokens).")
        if sampling.max_new_tokens is not None and sampling.max_new_tokens + n_tok >= context_length:
            total = sampling.max_new_tokens + n_tok
            raise bad_request(
                f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
                f"You requested a total of {total} tokens: {n_tok} tokens from the input messages and "
                f"{sampling.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
                f"input messages or the completion to fit within the limit.")
        # SGLang does not check this on /generate (garbage or a device assert); we refuse instead (§10).
        if any(t < 0 or t >= vocab_size for t in prompt):
            raise bad_request(f"The input_ids {prompt} contains values greater than the vocab size ({vocab_size}).")
        # Scheduler-side limit: max_req_input_len = C - 1 - 5.
        max_req_input_len = context_length - SCHEDULER_INPUT_MARGIN
        if n_tok >= max_req_input_len:
            raise bad_request(f"Input length ({n_tok} tokens) exceeds the maximum allowed length "
                              f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
        lsl = logprob_start_len[i]
        if return_logprob[i] and lsl > n_tok:
            raise bad_request(f"req.logprob_start_len={lsl} is higher than the number of input tokens "
                              f"len(req.origin_input_ids)={n_tok}. Please use a smaller logprob_start_len.")
        if lsl < -1:
            lsl = -1
        if top_logprobs_num[i] < 0:
            raise bad_request(f"top_logprobs_num must be at least 0, got {top_logprobs_num[i]}.")
        tids = token_ids_logprob[i]
        if tids is not None and any(t < 0 or t >= vocab_size for t in tids):
            raise bad_request(f"token_ids_logprob must be in [0, {vocab_size - 1}].")
        eff = effective_max_new_tokens(sampling.max_new_tokens, n_tok, context_length)
        for j in range(n):
            entries.append(EntrySpec(
                rid=rids[i * n + j] if n > 1 else rids[i],
                input_ids=tuple(prompt),
                sampling=sampling,
                max_new_tokens=eff,
                return_logprob=return_logprob[i],
                logprob_start_len=lsl if return_logprob[i] else -1,
                top_logprobs_num=top_logprobs_num[i] if return_logprob[i] else 0,
                token_ids_logprob=tids if return_logprob[i] else None,
                prompt_index=i,
                sample_index=j,
            ))
    return ParsedRequest(entries=tuple(entries), is_single=is_single and n == 1, user_rids=user_rids)


# ----------------------------------------------------------------------------------------------------------
# Results and response building
# ----------------------------------------------------------------------------------------------------------

TopList = list[tuple[float, int]]


@dataclass
class GenerationResult:
    """What an engine hands back for one EntrySpec.

    ``output_logprobs`` / ``output_logprob_ids`` are per sampled token; with ``max_new_tokens = 0`` they hold
    the one phantom token that SGLang still samples while ``output_ids`` is empty. Input-side lists start at
    ``logprob_start_len``; their first element's logprob is None.
    """

    output_ids: list[int]
    finish_reason: dict
    output_logprobs: list[float] = field(default_factory=list)
    output_logprob_ids: list[int] = field(default_factory=list)
    input_logprobs: Optional[list[Optional[float]]] = None
    output_top_logprobs: Optional[list[TopList]] = None
    input_top_logprobs: Optional[list[Optional[TopList]]] = None
    output_token_ids_logprobs: Optional[list[TopList]] = None
    input_token_ids_logprobs: Optional[list[Optional[TopList]]] = None
    aborted_in_queue: bool = False
    num_retractions: int = 0
    cached_tokens: int = 0


def _triples(pairs: Optional[TopList]) -> Optional[list[list[Any]]]:
    if pairs is None:
        return None
    return [[lp, tid, None] for lp, tid in pairs]


def build_output(entry: EntrySpec, result: GenerationResult, *, e2e_latency: float,
                 now: Optional[float] = None, weight_version: str = WEIGHT_VERSION) -> dict:
    """One response object, keys in the order SGLang 0.5.12 builds them (§2.1); no ``text`` (skip-tokenizer)."""
    if result.aborted_in_queue:
        # TokenizerManager._handle_abort_req: no prompt_tokens, and "text": "" even without a tokenizer.
        meta: dict[str, Any] = {
            "id": entry.rid,
            "finish_reason": result.finish_reason,
            "weight_version": weight_version,
            "e2e_latency": e2e_latency,
        }
        if entry.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = []
            meta["output_token_logprobs_length"] = 0
        meta["completion_tokens"] = 0
        return {"text": "", "output_ids": [], "meta_info": meta}

    meta = {
        "id": entry.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(entry.input_ids),
        "weight_version": weight_version,
        "num_retractions": result.num_retractions,
    }
    if entry.return_logprob:
        if entry.logprob_start_len >= 0 and result.input_logprobs is not None:
            ids = entry.input_ids[entry.logprob_start_len:]
            meta["input_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(result.input_logprobs, ids)]
        else:
            meta["input_token_logprobs"] = []
        out = [[lp, tid, None] for lp, tid in zip(result.output_logprobs, result.output_logprob_ids)]
        meta["output_token_logprobs"] = out
        meta["output_token_logprobs_length"] = len(out)
        if entry.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [_triples(x) for x in (result.input_top_logprobs or [])]
            meta["output_top_logprobs"] = [_triples(x) for x in (result.output_top_logprobs or [])]
        if entry.token_ids_logprob is not None:
            meta["input_token_ids_logprobs"] = [_triples(x) for x in (result.input_token_ids_logprobs or [])]
            meta["output_token_ids_logprobs"] = [_triples(x) for x in (result.output_token_ids_logprobs or [])]
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = len(result.output_ids)
    meta["cached_tokens"] = result.cached_tokens
    meta["cached_tokens_details"] = None
    meta["dp_rank"] = None
    meta["e2e_latency"] = e2e_latency
    meta["response_sent_to_client_ts"] = time.time() if now is None else now
    return {"output_ids": list(result.output_ids), "meta_info": meta}


def check_finish(token_id: int, n_generated: int, spec: EntrySpec, eos_ids: frozenset[int]) -> Optional[dict]:
    """SGLang's per-step order: length first, then EOS / stop_token_ids (both off with ignore_eos).

    ``n_generated`` counts ``token_id`` itself. Stop strings never match here (no tokenizer).
    """
    if n_generated >= spec.max_new_tokens:
        return finish_length(spec.max_new_tokens)
    if not spec.sampling.ignore_eos and (token_id in eos_ids or token_id in spec.sampling.stop_token_ids):
        return finish_stop(token_id)
    return None


# ----------------------------------------------------------------------------------------------------------
# Engine contract
# ----------------------------------------------------------------------------------------------------------


class EngineRequest:
    """One generation travelling through an engine: the spec plus its mutable life (abort flag, future).

    Engines resolve it exactly once through ``finish`` (thread-safe); the server awaits ``future``.
    ``abort_requested`` is a plain attribute so a worker thread can poll it between decode steps.
    """

    __slots__ = ("spec", "future", "loop", "abort_requested", "state", "created", "started", "done")

    def __init__(self, spec: EntrySpec, loop: asyncio.AbstractEventLoop) -> None:
        self.spec = spec
        self.loop = loop
        self.future: asyncio.Future[GenerationResult] = loop.create_future()
        self.abort_requested = False
        self.state = "waiting"  # waiting -> running -> done
        self.created = time.monotonic()
        self.started: Optional[float] = None
        self.done = False

    def finish(self, result: GenerationResult) -> None:
        """Resolve from any thread; later calls are ignored."""
        if self.done:
            return
        self.done = True
        self.state = "done"

        def _set() -> None:
            if not self.future.done():
                self.future.set_result(result)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            _set()
        else:
            try:
                self.loop.call_soon_threadsafe(_set)
            except RuntimeError:
                pass  # the loop is closed (shutdown): nobody is waiting any more


class Engine(abc.ABC):
    """What the reference server needs from an engine. Implementations: HFEngine, FakeEngine.

    Lifecycle: construct (cheap, no model) -> ``load()`` in a worker thread after the port is bound ->
    ``await start()`` on the event loop -> ``submit``/``abort`` from the loop -> ``await close()``.
    """

    name: str = "engine"
    trivial_probe: bool = False  # True: /health_generate need not run a generation through this engine
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]
    max_running_requests: int

    @abc.abstractmethod
    def load(self) -> None:
        """Blocking model load; runs in a worker thread while the server already answers /get_model_info."""

    async def start(self) -> None:
        """Start background work on the running loop (after load)."""

    @abc.abstractmethod
    def submit(self, req: EngineRequest) -> None:
        """Queue a generation; must not block. The engine later calls ``req.finish(result)``."""

    @abc.abstractmethod
    def abort(self, req: EngineRequest) -> None:
        """Abort a queued or running generation: queued -> 'Abort in waiting queue', running -> 'Aborted'."""

    def stats(self) -> dict:
        """Engine counters merged into /pipegen_stats."""
        return {}

    async def close(self) -> None:
        """Stop background work."""


# ----------------------------------------------------------------------------------------------------------
# Model facts from a Hugging Face folder (no torch)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What the server needs to know about a model before (or without) loading it."""

    model_path: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    primary_eos: int  # config.json's eos (first of a list): what a fake engine emits to stop
    context_length: int
    model_type: Optional[str]
    architectures: Optional[list[str]]
    has_tokenizer: bool


def _as_id_set(v: Any) -> set[int]:
    if v is None:
        return set()
    if isinstance(v, list):
        return {int(x) for x in v if x is not None}
    return {int(v)}


def read_model_facts(model_path: Optional[str], *, default_vocab: int = 32000, default_eos: int = 2,
                     default_context: int = 4096) -> ModelFacts:
    """Read vocab size, EOS ids (config.json plus generation_config.json) and context length.

    Context length follows SGLang's get_context_length for the keys that matter here
    (max_position_embeddings and friends); a missing folder gives the defaults (fake engine without a model).
    """
    cfg: dict = {}
    gen: dict = {}
    has_tok = False
    if model_path:
        p = Path(model_path)
        if (p / "config.json").is_file():
            cfg = json.loads((p / "config.json").read_text())
        if (p / "generation_config.json").is_file():
            gen = json.loads((p / "generation_config.json").read_text())
        has_tok = (p / "tokenizer.json").is_file()
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    vocab = int(text_cfg.get("vocab_size") or cfg.get("vocab_size") or default_vocab)
    eos = _as_id_set(cfg.get("eos_token_id")) | _as_id_set(text_cfg.get("eos_token_id")) | _as_id_set(
        gen.get("eos_token_id"))
    if not eos:
        eos = {default_eos}
    cfg_eos = cfg.get("eos_token_id", text_cfg.get("eos_token_id"))
    if isinstance(cfg_eos, list):
        cfg_eos = cfg_eos[0] if cfg_eos else None
    primary = int(cfg_eos) if cfg_eos is not None else min(eos)
    ctx = None
    for key in ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings"):
        if text_cfg.get(key):
            ctx = int(text_cfg[key])
            break
    return ModelFacts(
        model_path=str(model_path or ""),
        vocab_size=vocab,
        eos_token_ids=frozenset(eos),
        primary_eos=primary,
        context_length=ctx or default_context,
        model_type=cfg.get("model_type"),
        architectures=cfg.get("architectures"),
        has_tokenizer=has_tok,
    )
