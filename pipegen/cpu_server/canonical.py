"""The CPU server's reproducible mode (``--reproducible``): every row's logits computed the same way whatever else runs.

A transformers model on CPU gives a row different logits in a different batch: MKL/oneDNN pick a GEMM's kernel and
its blocking from the row count M (one class at M=1, another at 2-15, another at 16+ on an AVX-512 box; other CPUs
draw other lines), left padding changes attention's key length, and a prefill computes its tokens at M = the
prompt's length where a decode step has M = the batch. This module removes each cause, so a row's logits are a
function of its own tokens only: the same in any batch, at any concurrency, on any number of servers, and the same
for a token whether it was prefilled or decoded (so a continuation that prefills an answer's kept tokens lands on
the logits the uninterrupted answer had):
  * every ``nn.Linear`` runs on blocks of exactly ``ROW_BLOCK`` rows (the last one zero-padded): at a fixed M a
    row's result never depends on the other rows' contents or its place among them (checked at load, below);
  * attention is computed one (row, query) at a time over exactly that query's keys (its causal prefix, no
    padding columns), with the same ``scaled_dot_product_attention`` call in prefill and in decode;
  * what remains (embedding, RMSNorm, rotary, activations, residuals) works row by row on its own values.
Cost: the row-blocked linears cost little (a decode batch of 16 is one block, as before); attention becomes one
small call per query per layer, which a prefill pays per prompt token (the backend prefills a prompt's new tokens
only: prompts sharing a prefix reuse its keys and values, which are the same by construction).
``check_row_invariance`` probes the loaded model's linears on this CPU and refuses to serve reproducibly where the
property fails, rather than serving data that only looks reproducible.
Owns: the row-blocked linears, the canonical attention and the probe. Must never: import torch at module import
time (the server binds its port first), or change the model's weights or numerics beyond the order of operations.
"""

from __future__ import annotations

from typing import Any

# The GEMM row count every linear runs at. 16 rows are one decode batch at the CPU server's default max_batch, and
# the class every M >= 16 shares on the CPUs we measured; any fixed value is reproducible, this one is cheapest.
ROW_BLOCK = 16
ATTENTION_NAME = "pipegen_canonical"


class Keys:
    """Where each row's keys start in the batch's KV cache (its left-padding columns), set before every forward."""

    def __init__(self) -> None:
        self.lead: list[int] = []


def _blocked_linear(module: Any, torch: Any) -> Any:
    weight, bias = module.weight, module.bias

    def forward(x: Any) -> Any:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        rows = flat.shape[0]
        pad = (-rows) % ROW_BLOCK
        if pad:
            flat = torch.cat([flat, flat.new_zeros((pad, shape[-1]))])
        out = torch.cat([torch.nn.functional.linear(block, weight, bias) for block in flat.split(ROW_BLOCK)])
        return out[:rows].reshape(*shape[:-1], out.shape[-1])

    return forward


def _attention(keys: Keys, torch: Any) -> Any:
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                  dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
        b, _, q_len, _ = query.shape
        k_len = key.shape[2]
        out = query.new_empty((b, q_len) + (query.shape[1], query.shape[3]))
        for r in range(b):
            lead = keys.lead[r] if r < len(keys.lead) else 0
            for i in range(q_len):
                end = k_len - q_len + i + 1  # query i sees its causal prefix: every key up to its own position
                o = sdpa(query[r:r + 1, :, i:i + 1], key[r:r + 1, :, lead:end], value[r:r + 1, :, lead:end],
                         scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
                out[r, i] = o[0, :, 0]
        return out, None

    return attention


def make_canonical(model: Any, torch: Any) -> Keys:
    """Switch a loaded model to row-blocked linears and canonical attention; returns the holder of each row's lead."""
    from transformers import AttentionInterface

    keys = Keys()
    AttentionInterface.register(ATTENTION_NAME, _attention(keys, torch))
    model.set_attn_implementation(ATTENTION_NAME)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _blocked_linear(module, torch)
    return keys


def check_row_invariance(model: Any, torch: Any) -> str | None:
    """None when every distinct linear shape of ``model`` gives a row the same result at any place in a block with any
    neighbours on this CPU; else what failed (the server then refuses ``--reproducible``)."""
    seen: set[tuple[int, int, Any]] = set()
    gen = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        shape = (module.in_features, module.out_features, module.weight.dtype)
        if shape in seen:
            continue
        seen.add(shape)
        row = torch.randn((1, module.in_features), generator=gen).to(module.weight.dtype)
        ref = None
        for place in (0, ROW_BLOCK - 1):
            block = torch.randn((ROW_BLOCK, module.in_features), generator=gen).to(module.weight.dtype)
            block[place] = row[0]
            got = module(block)[place]
            if ref is None:
                ref = got
            elif not torch.equal(ref, got):
                return f"{name} ({module.in_features}x{module.out_features}, {module.weight.dtype})"
    return None
