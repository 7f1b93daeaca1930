"""The run report's statistics against hand computations on fixed rows: the prompt-clustered bootstrap
interval, the unbiased pass@k, the share of responses at the length limit, the length percentiles, a dict reward's
extra keys and the best and worst answers.
(The report of real runs is checked where those runs are made: the demo in test_python_entry.py, a run with
failures and its resume in test_failures.py, the dataset card in test_outputs.py, ATIF in test_gateway.py, a rescored
run's in test_rescore.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from pipegen.report.estimators import (BOOTSTRAP_DRAWS, BOOTSTRAP_SEED, clustered_bootstrap, pass_at_k, pass_at_ks,
                                       percentiles, share_at_limit)
from pipegen.report.numbers import RowFacts, rounded, source_numbers


def test_pass_at_k_is_the_unbiased_estimator():
    # n = 4 samples, c = 1 correct: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6, pass@3 = 1 - C(3,3)/C(4,3)
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5
    assert pass_at_k(4, 1, 3) == pytest.approx(0.75)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    # n = 5, c = 2: pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
    # averaged over prompts; a prompt with fewer than k samples is left out of pass@k
    got = pass_at_ks({"a": [True, False, False, False], "b": [False, False, False, False], "c": [True, True]}, 4)
    assert got[1] == (pytest.approx((0.25 + 0 + 1) / 3), 3)
    assert got[2] == (pytest.approx((0.5 + 0 + 1) / 3), 3)
    assert got[3] == (pytest.approx((0.75 + 0) / 2), 2)
    assert got[4] == (0.5, 2)


def test_bootstrap_resamples_prompts_whole_with_a_fixed_seed():
    # two prompts, one sample each, rewards 0 and 1: a draw's mean is 0, 1/2 or 1 with chance 1/4, 1/2, 1/4,
    # so the 2.5% and 97.5% percentiles are 0 and 1
    two = clustered_bootstrap([0.0, 1.0], ["a", "b"])
    assert (two.mean, two.low, two.high, two.clusters, two.unit) == (0.5, 0.0, 1.0, 2, "prompt")
    # repeats never pooled: prompt a scores [1, 1, 1], prompt b [0, 0, 0]. Resampling prompts gives the same
    # [0, 1] interval (6 rows are 2 independent facts); resampling the 6 rows as if independent would not.
    rows = clustered_bootstrap([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], ["a", "a", "a", "b", "b", "b"])
    assert (rows.mean, rows.low, rows.high, rows.clusters) == (0.5, 0.0, 1.0, 2)
    pooled = clustered_bootstrap([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], [1, 2, 3, 4, 5, 6])
    assert pooled.low > 0.0 and pooled.high < 1.0

    # the interval by hand: the same seeded draws, prompt by prompt, the percentile of the draws' means
    rewards = {"p0": [1.0, 0.0], "p1": [0.0, 0.0], "p2": [1.0, 1.0], "p3": [0.5, 0.0], "p4": [1.0, 0.0, 1.0]}
    values = [v for p in rewards.values() for v in p]
    clusters = [k for k, p in rewards.items() for _ in p]
    got = clustered_bootstrap(values, clusters)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    names = list(rewards)
    means = []
    for draw in rng.integers(0, len(names), size=(BOOTSTRAP_DRAWS, len(names))):
        picked = [v for i in draw for v in rewards[names[i]]]
        means.append(sum(picked) / len(picked))
    assert got.mean == pytest.approx(sum(values) / len(values))
    assert (got.low, got.high) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
    assert clustered_bootstrap(values, clusters) == got  # reproducible
    assert clustered_bootstrap([], []) is None


def test_share_at_limit_and_percentiles():
    assert share_at_limit([3, 24, 24, 10], 24) == 0.5
    assert share_at_limit([25, 1], 24) == 0.5 and share_at_limit([], 24) is None
    p = percentiles([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    # numpy's linear interpolation: position q/100 * (n - 1)
    assert (p["p10"], p["p50"], p["p90"], p["p99"], p["max"]) == pytest.approx((1.9, 5.5, 9.1, 9.91, 10.0))
    assert percentiles([]) == {}


def test_source_numbers_of_fixed_rows_by_hand():
    # 3 prompts x n=2, response limit 8; prompt 2's second sample failed (not committed); one row unscored
    rows = [RowFacts(0, 0, "s", 1.0, 8), RowFacts(0, 1, "s", 0.0, 3),
            RowFacts(1, 0, "s", 0.0, 8), RowFacts(1, 1, "s", 0.0, 5),
            RowFacts(2, 0, "s", 1.0, 2)]
    got = rounded(source_numbers(rows, n=2, limit=8))
    assert (got["rows"], got["prompts"], got["scored_rows"]) == (5, 3, 5)
    assert got["mean_reward"] == 0.4  # 2 of 5 rows
    # pass@1: (1/2 + 0 + 1) / 3 over all three prompts; pass@2 only over the two prompts with 2 samples: (1 + 0) / 2
    assert got["pass_at_k"] == {"1": {"value": 0.5, "prompts": 3}, "2": {"value": 0.5, "prompts": 2}}
    assert got["prompts_with_a_pass"] == 2
    assert (got["at_length_limit"], got["at_length_limit_share"]) == (2, 0.4)
    assert got["response_length_mean"] == 5.2
    assert got["response_length"] == {"p10": 2.4, "p50": 5.0, "p90": 8.0, "p99": 8.0, "max": 8.0}
    assert got["reward_ci_prompts"] == 3 and 0.0 <= got["reward_ci95"][0] <= 0.4 <= got["reward_ci95"][1] <= 1.0


def test_a_dict_rewards_extra_keys_and_the_best_and_worst_answers_by_hand():
    from pipegen.report.numbers import best_and_worst, extra_statistics

    rows = [RowFacts(0, 0, "s", 0.5, 4, extras={"length": 10, "exact": True, "verdict": "close"}),
            RowFacts(0, 1, "s", 1.0, 6, extras={"length": 20, "exact": False, "verdict": "right"}),
            RowFacts(1, 0, "s", 0.0, 2, extras={"length": 30, "exact": False, "verdict": "close"}),
            RowFacts(1, 1, "s", None, 3, extras={"length": None, "exact": None, "verdict": None}),  # unscored
            RowFacts(2, 0, "s", 0.0, 5, extras={"length": np.int64(40), "exact": True, "verdict": "close"})]
    got = rounded(extra_statistics(rows))
    assert got["length"] == {"rows": 4, "mean": 25.0, "min": 10.0, "max": 40.0}  # numpy numbers count as numbers
    assert got["exact"] == {"rows": 4, "mean": 0.5, "min": 0.0, "max": 1.0}  # a boolean's mean: the share of true
    assert got["verdict"] == {"rows": 4, "distinct": 2, "most_common": {"close": 3, "right": 1}}
    picks = best_and_worst(rows)
    assert [(which, r.index, r.sample) for which, r in picks] == [("best", 0, 1), ("worst", 1, 0)]  # a tie: first
    assert best_and_worst([RowFacts(0, 0, "s", None, 1)]) == []  # nothing scored: no example
    one = RowFacts(0, 0, "s", 0.5, 1)
    assert best_and_worst([one]) == [("best", one)]  # one row is not shown twice
