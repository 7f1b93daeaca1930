"""What the CPU server answers for a generation: SGLang 0.5.12's finish reasons and response objects.

Owns: the finish-reason shapes (``stop`` with the matched id, ``length`` with the clamped budget, the two
``abort`` shapes), ``check_finish`` (SGLang's per-step order: length first, then EOS / stop_token_ids), and
``build_output`` - ``output_ids`` + ``meta_info`` with SGLang's key order, ``[logprob, id, null]`` triples, the
``max_new_tokens = 0`` phantom logprob and the aborted-in-queue shape.
Must never: do I/O, import torch/transformers/aiohttp, add a ``text`` field to a finished generation (the
server runs as ``--skip-tokenizer-init``), or reorder, rename or drop a key: clients read these objects as
SGLang writes them.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from pipegen.cpu_server.model_backend import GenerationResult, TopList
from pipegen.cpu_server.parse import EntrySpec

WEIGHT_VERSION = "default"  # SGLang's --weight-version default


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


def check_finish(token_id: int, n_generated: int, spec: EntrySpec, eos_ids: frozenset[int]) -> Optional[dict]:
    """SGLang's per-step order: length first, then EOS / stop_token_ids (both off with ignore_eos).

    ``n_generated`` counts ``token_id`` itself. Stop strings never match here (no tokenizer).
    """
    if n_generated >= spec.max_new_tokens:
        return finish_length(spec.max_new_tokens)
    if not spec.sampling.ignore_eos and (token_id in eos_ids or token_id in spec.sampling.stop_token_ids):
        return finish_stop(token_id)
    return None


def _triples(pairs: Optional[TopList]) -> Optional[list[list[Any]]]:
    if pairs is None:
        return None
    return [[lp, tid, None] for lp, tid in pairs]


def build_output(entry: EntrySpec, result: GenerationResult, *, e2e_latency: float,
                 now: Optional[float] = None, weight_version: str = WEIGHT_VERSION) -> dict:
    """One response object, keys in the order SGLang 0.5.12 builds them; no ``text`` (skip-tokenizer)."""
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
