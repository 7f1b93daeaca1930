"""A ``/generate`` body -> the generations it asks for, validated the way SGLang 0.5.12 validates it.

Owns: ``parse_generate_request`` (single vs batch, ``n > 1`` expansion prompt-major, SGLang's rid rules,
per-entry logprob options, the context-length and input-length checks with SGLang's texts and statuses),
``EntrySpec`` / ``ParsedRequest`` (what the server hands to its model backend), and ``effective_max_new_tokens`` (absent
= 128, ``null`` = up to the context, clamped to ``C - 2 - N``).
Must never: do I/O, import torch/transformers/aiohttp, re-tokenize anything (token ids in, token ids out), or
depend on server state (the in-flight duplicate-rid check lives in the server). Deterministic given its
arguments: rid generation is injected. Hand-written rather than pydantic for the reason given in
``sampling_params``: SGLang's own checks here are plain code with a fixed first-error order.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pipegen.cpu_server.vision import check_image_data
from pipegen.cpu_server.errors import bad_request, invalid_type_error, type_name, validation_error
from pipegen.cpu_server.sampling_params import UNLIMITED, SamplingSpec, is_int, parse_sampling_params

SCHEDULER_INPUT_MARGIN = 6  # max_req_input_len = context_length - 1 - 5
SKIP_TOKENIZER_TEXT_ERROR = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide "
    "input_ids or re-initialize the engine with skip_tokenizer_init=False."
)


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
    image_data: tuple[str, ...] = ()  # the prompt's pictures (data URLs / base64), for a vision model's prefill


@dataclass(frozen=True)
class ParsedRequest:
    """A validated /generate body. ``is_single``: answer one object, else a list in ``entries`` order."""

    entries: tuple[EntrySpec, ...]
    is_single: bool
    user_rids: bool  # True when the client's rids are used as-is (n == 1): in-flight duplicates are then 400
    stream: bool = False  # answer as server-sent events (server.py: one generation only)


def effective_max_new_tokens(requested: Optional[int], prompt_len: int, context_length: int) -> int:
    """The scheduler's budget: ``min(requested or 2^30, C - 2 - N)``, floored at 0."""
    want = UNLIMITED if requested is None else requested
    return max(0, min(want, context_length - 2 - prompt_len))


def _per_entry(value: Any, batch_size: int, name: str, check: Callable[[Any], bool], default: Any) -> list[Any]:
    """SGLang's normalize_param: None -> default for all, a scalar broadcasts, a list is per prompt."""
    if value is None:
        return [default] * batch_size
    if isinstance(value, list):
        if len(value) != batch_size:
            raise bad_request(f"The length of {name} should be equal to the batch size.")
        for v in value:
            if not check(v):
                raise validation_error(f"{name}: Input should be valid, got {type_name(v)}")
        return list(value)
    if not check(value):
        raise validation_error(f"{name}: Input should be valid, got {type_name(value)}")
    return [value] * batch_size


def _prompts(body: Any) -> tuple[list[list[int]], bool]:
    """The prompts and whether the body is a single request; single vs batch is decided by input_ids[0]."""
    if not isinstance(body, dict):
        raise validation_error(f"Input should be a valid dictionary or object to extract fields from, got "
                               f"{type_name(body)}")
    input_ids = body.get("input_ids")
    if body.get("text") is None and input_ids is None and body.get("input_embeds") is None:
        raise bad_request("Either text, input_ids or input_embeds should be provided.")
    if input_ids is None:
        # Text (or embeddings) only: this server always runs as --skip-tokenizer-init.
        raise bad_request(SKIP_TOKENIZER_TEXT_ERROR)
    if not isinstance(input_ids, list):
        raise validation_error(f"input_ids: Input should be a valid list, got {type_name(input_ids)}")
    if len(input_ids) == 0:
        raise bad_request("input_ids cannot be empty.")
    if isinstance(input_ids[0], list):
        for p in input_ids:
            if not isinstance(p, list) or not all(is_int(t) for t in p):
                raise validation_error("input_ids: Input should be a list of lists of integers")
            if len(p) == 0:
                raise bad_request("input_ids cannot be empty.")
        return input_ids, False
    if not all(is_int(t) for t in input_ids):
        raise validation_error("input_ids: Input should be a valid list of integers")
    return [input_ids], True


def _sampling_list(body: dict, batch_size: int, is_single: bool, unknown_key_status: int) -> tuple[list[Any], int]:
    """One raw sampling_params per prompt, and the parallel-sample count n (the same for every prompt)."""
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
        raise validation_error(f"sampling_params: Input should be a valid dictionary, got {type_name(sp_raw)}")
    n_values = [(s.get("n", 1) if isinstance(s, dict) else 1) for s in sp_list]
    n = n_values[0] if n_values[0] is not None else 1
    if any((v if v is not None else 1) != n for v in n_values):
        raise bad_request("The parallel_sample_num should be the same for all samples in sample params.")
    if not is_int(n):
        raise invalid_type_error("n", n, "an integer", unknown_key_status)
    return sp_list, n


def _rids(rid: Any, batch_size: int, is_single: bool, n: int, new_rid: Callable[[], str]) -> tuple[list[str], bool]:
    """SGLang's rid rules: single -> as given (or a uuid); batch -> ``rid_i`` for a string, a list must match
    the batch; ``n > 1`` -> everything replaced by fresh uuids (after the list checks). Also: user rids?"""
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
        return [new_rid() for _ in range(batch_size * n)], False
    if is_single:
        return [rid if isinstance(rid, str) else new_rid()], isinstance(rid, str)
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(batch_size)], True
    if isinstance(rid, list):
        return list(rid), True
    return [new_rid() for _ in range(batch_size)], False


def _token_ids_logprob(raw: Any, batch_size: int) -> list[Optional[tuple[int, ...]]]:
    if raw is None or raw == []:
        return [None] * batch_size
    if isinstance(raw, list) and all(is_int(t) for t in raw):
        return [tuple(raw)] * batch_size
    if isinstance(raw, list) and len(raw) == batch_size and all(
            isinstance(x, list) and all(is_int(t) for t in x) for x in raw):
        return [tuple(x) if x else None for x in raw]
    raise validation_error("token_ids_logprob: Input should be a list of integers or a list of lists")


def _check_prompt(prompt: list[int], sampling: SamplingSpec, context_length: int, vocab_size: int) -> None:
    """TokenizerManager._validate_one_request and the scheduler's input-length limit, in SGLang's order."""
    n_tok = len(prompt)
    # Note: >=, as in SGLang's source.
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
    # SGLang does not check this on /generate (garbage or a device assert); this server refuses instead.
    if any(t < 0 or t >= vocab_size for t in prompt):
        raise bad_request(f"The input_ids {prompt} contains values greater than the vocab size ({vocab_size}).")
    # Scheduler-side limit: max_req_input_len = C - 1 - 5.
    max_req_input_len = context_length - SCHEDULER_INPUT_MARGIN
    if n_tok >= max_req_input_len:
        raise bad_request(f"Input length ({n_tok} tokens) exceeds the maximum allowed length "
                          f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")


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
    SamplingParams.verify and the scheduler's input-length checks of SGLang 0.5.12, in that order.
    Raises ProtocolError; the in-flight duplicate-rid check needs server state and lives in the server.
    """
    prompts, is_single = _prompts(body)
    batch_size = len(prompts)
    sp_list, n = _sampling_list(body, batch_size, is_single, unknown_key_status)
    stream = bool(body.get("stream"))
    if stream and not (is_single and n == 1):
        raise bad_request("pipegen reference server: stream=true takes one generation (one input_ids list, n=1); "
                          "send a batch without stream.")
    if n > 1:
        is_single = False
    rids, user_rids = _rids(body.get("rid"), batch_size, is_single, n, new_rid)

    return_logprob = _per_entry(body.get("return_logprob"), batch_size, "return_logprob",
                                lambda v: isinstance(v, bool), False)
    logprob_start_len = _per_entry(body.get("logprob_start_len"), batch_size, "logprob_start_len", is_int, -1)
    top_logprobs_num = _per_entry(body.get("top_logprobs_num"), batch_size, "top_logprobs_num", is_int, 0)
    token_ids_logprob = _token_ids_logprob(body.get("token_ids_logprob"), batch_size)
    for key in ("video_data", "audio_data"):
        if body.get(key):
            raise bad_request(f"pipegen reference server: {key} is not supported; it takes image_data only.")
    image_data = check_image_data(body.get("image_data"), batch_size)

    entries: list[EntrySpec] = []
    for i, prompt in enumerate(prompts):
        sampling = parse_sampling_params(sp_list[i], vocab_size=vocab_size, unknown_key_status=unknown_key_status)
        _check_prompt(prompt, sampling, context_length, vocab_size)
        n_tok = len(prompt)
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
                image_data=image_data[i],
            ))
    return ParsedRequest(entries=tuple(entries), is_single=is_single and n == 1, user_rids=user_rids, stream=stream)
