"""The report's statistics, as pure functions of plain rows: a prompt-clustered bootstrap interval of a mean,
the unbiased pass@k, the share of responses at the length limit, and length percentiles.

Every estimate here names its unit of resampling or averaging. A prompt's n samples are not independent draws
of the run's mean (they share the prompt's difficulty), so the bootstrap resamples whole prompts with
replacement and keeps each prompt's samples together: repeats are never pooled as if they were prompts. The
generator is seeded (BOOTSTRAP_SEED), so the same rows give the same interval on every machine and every run of
the report.

pass@k is the unbiased estimator of Chen et al. (2021), per prompt with n samples of which c are correct,
1 - C(n-c, k) / C(n, k), averaged over the prompts that have at least k samples; "correct" is a reward above 0,
as the end-of-run summary counts pass@n.

Owns: these estimators. Must never: read or write files, or know what a run directory is.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

BOOTSTRAP_SEED = 0
BOOTSTRAP_DRAWS = 2000
CONFIDENCE = 0.95
PERCENTILES = (10, 50, 90, 99)


@dataclass(frozen=True)
class Interval:
    """A mean and its bootstrap interval; `clusters` is how many resampling units (prompts) it rests on."""

    mean: float
    low: float
    high: float
    clusters: int
    unit: str = "prompt"


def clustered_bootstrap(values: list[float], clusters: list[object], draws: int = BOOTSTRAP_DRAWS,
                        seed: int = BOOTSTRAP_SEED, confidence: float = CONFIDENCE) -> Interval | None:
    """The mean of `values` and its percentile bootstrap interval, resampling whole clusters (the prompt of
    each value) with replacement: each draw takes as many clusters as there are, with all their values, and
    computes the mean over the values drawn. None when there is no value."""
    if not values:
        return None
    keys: dict[object, int] = {}
    ids = np.array([keys.setdefault(c, len(keys)) for c in clusters], dtype=np.int64)
    x = np.asarray(values, dtype=np.float64)
    sums = np.bincount(ids, weights=x, minlength=len(keys))
    counts = np.bincount(ids, minlength=len(keys)).astype(np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(keys), size=(draws, len(keys)))
    means = sums[picks].sum(axis=1) / counts[picks].sum(axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(x.mean()), float(low), float(high), len(keys))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with n samples of which c are correct (k <= n)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, the prompt has {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_at_ks(correct_by_prompt: dict[object, list[bool]], max_k: int) -> dict[int, tuple[float, int]]:
    """k -> (pass@k averaged over the prompts with at least k samples, how many prompts that is), k = 1..max_k
    (a k that no prompt reaches is left out)."""
    out: dict[int, tuple[float, int]] = {}
    for k in range(1, max_k + 1):
        scores = [pass_at_k(len(v), sum(v), k) for v in correct_by_prompt.values() if len(v) >= k]
        if scores:
            out[k] = (float(np.mean(scores)), len(scores))
    return out


def share_at_limit(lengths: list[int], limit: int) -> float | None:
    """The share of responses whose length reached `limit` tokens (None when there is none)."""
    if not lengths:
        return None
    return sum(1 for x in lengths if x >= limit) / len(lengths)


def percentiles(values: list[int], qs: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """`p<q>` -> the q-th percentile (numpy's linear interpolation), plus `max`; empty for no values."""
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    out = {f"p{q}": float(np.percentile(arr, q)) for q in qs}
    out["max"] = float(arr.max())
    return out
