"""Per-row sampling and logprobs for the transformers backend: one batch of logits in, one token per row out.

Owns:
  * ``sample`` - temperature, top_p, top_k, min_p, greedy for temperature < 1e-6, repetition / frequency /
    presence penalties over a row's output tokens, logit_bias and min_new_tokens (EOS and stop ids masked), each
    row with its own parameters and its own draws, so a row's draws never depend on its batch neighbours;
  * ``row_seed`` - the seed of a row with a ``sampling_seed`` (with the sample index), independent of the server
    seed so the same sampling_seed reproduces on any server;
  * ``keyed_uniform`` - the uniform a row's token is drawn with: a stateless function of (row seed, absolute
    position of the last input token), as SGLang's deterministic sampler keys its noise, so a continuation (the
    prompt plus the answer's first k tokens, the same seed) draws token k+1 with the uninterrupted answer's number;
  * ``prompt_logprobs`` - prompt-side logprob lists from a full-logits prefill.
Logprob convention, SGLang 0.5.12's (``srt/layers/sampler.py``, standard path): the reported logprob of an output
token, and the top-k / token-id lists, come from ``log_softmax((logits after penalties, logit_bias and the
min_new_tokens mask) / temperature)``, clamped to the float32 minimum instead of -inf. top-k / top-p / min-p
filtering shapes the draw only, never the reported logprobs. That is what verl's trainer recomputes (HF forward,
logits / temperature, log_softmax), so ``rollout_log_probs`` and ``old_log_probs`` agree at any temperature. Greedy
rows (temperature < 1e-6, or top_k = 1) report the unscaled log_softmax, as SGLang's all-greedy path does. With
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` in the server's environment every row reports the unscaled log_softmax, as
SGLang does. Prompt logprobs are never temperature-scaled (SGLang's ``temp_scaled_logprobs`` is off).
Must never: import torch at module import time (the server binds its port before torch loads), keep state
between calls, or draw from a shared or advancing RNG.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from pipegen.cpu_server.model_backend import TopList
from pipegen.cpu_server.parse import EntrySpec
from pipegen.cpu_server.sampling_params import SamplingSpec

MASK64 = (1 << 64) - 1
# Read once at import, like SGLang: report logprobs before temperature scaling.
RETURN_ORIGINAL_LOGPROB = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes", "on")


def row_seed(sampling_seed: int, sample_index: int) -> int:
    """A 64-bit RNG seed from (sampling_seed, sample index)."""
    x = (sampling_seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a 64-bit bijection that spreads every input bit over the output."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that draws the token after absolute ``position`` of a row seeded ``seed``."""
    return (_mix64((seed ^ _mix64(position + 0x9E3779B97F4A7C15)) & MASK64) >> 11) / float(1 << 53)


def _needs_adjust(sp: SamplingSpec, output_ids: list[int]) -> bool:
    return (sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
            or bool(sp.logit_bias) or len(output_ids) < sp.min_new_tokens)


def _adjust(logits: Any, sp: SamplingSpec, output_ids: list[int], eos_ids: frozenset[int]) -> Any:
    """Penalties, logit_bias and min_new_tokens on one row's logits ([V], a copy the caller owns)."""
    import torch

    vocab = logits.shape[-1]
    if output_ids and (sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].to(logits.dtype)
        seen = counts > 0
        if sp.repetition_penalty != 1.0:
            penalised = torch.where(logits > 0, logits / sp.repetition_penalty, logits * sp.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        if sp.frequency_penalty != 0.0:
            logits = logits - sp.frequency_penalty * counts
        if sp.presence_penalty != 0.0:
            logits = logits - sp.presence_penalty * seen.to(logits.dtype)
    for tid, bias in sp.logit_bias:
        logits[tid] += bias
    if len(output_ids) < sp.min_new_tokens:
        stops = [t for t in (set(eos_ids) | set(sp.stop_token_ids)) if 0 <= t < vocab]
        if stops:
            logits[stops] = float("-inf")
    return logits


def _draw(logits: Any, specs: list[SamplingSpec], u: Any) -> list[int]:
    """Inverse-CDF draws for sampled rows from temperature-scaled ``logits``; ``u``: one uniform in [0, 1) per row."""
    import torch

    vocab = logits.shape[-1]
    order = None
    if any((0 < s.top_k < vocab) or s.top_p < 1.0 or s.min_p > 0.0 for s in specs):
        logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([s.top_k if 0 < s.top_k < vocab else vocab for s in specs])
        logits = logits.masked_fill(torch.arange(vocab)[None, :] >= ks[:, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        ps = torch.tensor([s.top_p for s in specs], dtype=probs.dtype)
        cum = probs.cumsum(dim=-1)
        drop = (cum - probs) > ps[:, None]
        mps = torch.tensor([s.min_p for s in specs], dtype=probs.dtype)
        drop |= probs < (mps[:, None] * probs[:, :1])
        drop[:, 0] = False  # always keep the most likely token
        logits = logits.masked_fill(drop, float("-inf"))
    cdf = torch.softmax(logits, dim=-1).double().cumsum(dim=-1)
    # Scale u by the total so float rounding can never push the draw past the last token.
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    if order is not None:
        pick = order.gather(1, pick)
    return pick.squeeze(1).tolist()


def sample(logits: Any, samplings: Sequence[SamplingSpec], uniforms: Sequence[float],
           outputs: Sequence[list[int]], eos_ids: frozenset[int]) -> tuple[list[int], list[float], Any]:
    """One token per row of ``logits`` ([B, V] float32) with that row's parameters, uniform and output so far.

    Returns the tokens, their logprobs and the logprob matrix they come from (for top-k / token-id lists),
    both in SGLang's convention (module docstring).
    """
    import torch

    b = logits.shape[0]
    work = logits
    # Rare per-row adjustments (penalties, bias, min_new_tokens) on a copy.
    adjust = [i for i in range(b) if _needs_adjust(samplings[i], outputs[i])]
    if adjust:
        work = logits.clone()
        for i in adjust:
            work[i] = _adjust(work[i], samplings[i], outputs[i], eos_ids)
    temps = [1.0 if sp.greedy else sp.temperature for sp in samplings]
    scaled = work if all(t == 1.0 for t in temps) else work / torch.tensor(temps, dtype=work.dtype)[:, None]
    lp = torch.log_softmax(work if RETURN_ORIGINAL_LOGPROB else scaled, dim=-1)
    lp.clamp_(min=torch.finfo(lp.dtype).min)  # SGLang clamps -inf (masked tokens) to the dtype's minimum
    tokens = [0] * b
    greedy = [i for i in range(b) if samplings[i].greedy]
    sampled = [i for i in range(b) if not samplings[i].greedy]
    if greedy:
        for i, t in zip(greedy, work[greedy].argmax(dim=-1).tolist()):
            tokens[i] = t
    if sampled:
        u = torch.tensor([uniforms[i] for i in sampled], dtype=torch.float64)
        for i, t in zip(sampled, _draw(scaled[sampled], [samplings[i] for i in sampled], u)):
            tokens[i] = t
    lps = lp[torch.arange(b), torch.tensor(tokens, dtype=torch.long)].tolist()
    return tokens, lps, lp


def prompt_logprobs(logits: Any, spec: EntrySpec) -> tuple[list[Optional[float]], Optional[list[Optional[TopList]]],
                                                           Optional[list[Optional[TopList]]]]:
    """Prompt-side (logprobs, top lists, token_ids lists) from one row's full prefill logits ([N, V]).

    Lists start at ``logprob_start_len`` k; position k's entry is None (as SGLang).
    """
    import torch

    ids = spec.input_ids
    k = spec.logprob_start_len
    lp_all = torch.log_softmax(logits[:-1].float(), dim=-1)  # lp_all[i] predicts ids[i + 1]
    vals: list[Optional[float]] = [None]
    tops: list[Optional[TopList]] = [None]
    tids: list[Optional[TopList]] = [None]
    if len(ids) - 1 > k:
        positions = torch.arange(k, len(ids) - 1)
        targets = torch.tensor(ids[k + 1:], dtype=torch.long)
        vals += lp_all[positions, targets].tolist()
        if spec.top_logprobs_num > 0:
            tv, ti = lp_all[positions].topk(spec.top_logprobs_num, dim=-1)
            tops += [list(zip(a, b)) for a, b in zip(tv.tolist(), ti.tolist())]
        if spec.token_ids_logprob is not None:
            sel = torch.tensor(spec.token_ids_logprob, dtype=torch.long)
            tids += [list(zip(a, spec.token_ids_logprob)) for a in lp_all[positions][:, sel].tolist()]
    return (vals, tops if spec.top_logprobs_num > 0 else None,
            tids if spec.token_ids_logprob is not None else None)
