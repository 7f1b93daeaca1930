"""The CPU server's precision rule, in one place: `llm.dtype=auto` serves in bfloat16 where the CPU has native
bf16 (avx512_bf16 or amx_bf16 in /proc/cpuinfo), else in float32. The CPU server applies it; the plan line
states it, since bf16 log-probs differ from a float32 recomputation (by up to ~0.3 nats on a small model).

Owns: that rule. Must never: import torch or an engine (the launcher reads it before anything starts).
"""

from __future__ import annotations


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises avx512_bf16 or amx_bf16 (bf16 matmuls are slow without them)."""
    try:
        with open(cpuinfo_path) as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype_name(dtype: str) -> str:
    """``auto`` -> ``bfloat16`` where native, else ``float32``; explicit names pass through."""
    if dtype == "auto":
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"unsupported --dtype {dtype!r} (auto, bfloat16, float32)")
    return dtype
