"""Unit keys, range sets and the checkpoint's size guarantee."""

import random

from pipegen.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from pipegen.units import RangeSet, prompt_uid, unit_seed


def test_rangeset_matches_a_python_set_under_random_adds():
    rng = random.Random(0)
    ref, rs = set(), RangeSet()
    for _ in range(3000):
        start = rng.randrange(500)
        end = start + rng.randrange(1, 4)
        rs.add_range(start, end)
        ref.update(range(start, end))
        probe = rng.randrange(520)
        assert (probe in rs) == (probe in ref)
    assert sorted(rs) == sorted(ref) and len(rs) == len(ref)
    starts = [s for s, _ in rs.ranges()]
    ends = [e for _, e in rs.ranges()]
    assert all(e < s for e, s in zip(ends, starts[1:]))  # disjoint and non-adjacent


def test_checkpoint_size_does_not_grow_with_in_order_commits(tmp_path):
    small, big = Checkpoint(), Checkpoint()
    for k in range(1000):
        small.committed.add(k)
    big.committed.add_range(0, 1_000_000)
    assert len(big.to_json()) - len(small.to_json()) < 10
    save_checkpoint(tmp_path / "c.json", big)
    back = load_checkpoint(tmp_path / "c.json")
    assert back.num_committed == 1_000_000 and 999_999 in back.committed and 1_000_000 not in back.committed


def test_seeds_distinct_per_unit_and_stable():
    seeds = {unit_seed(0, i, s) for i in range(200) for s in range(8)}
    assert len(seeds) == 1600
    assert unit_seed(0, 5, 1) == unit_seed(0, 5, 1) != unit_seed(1, 5, 1)
    assert prompt_uid("k", 3) == prompt_uid("k", 3) != prompt_uid("k", 4)
