"""Unit keys, range sets and the checkpoint's size guarantee."""

import random

import orjson
import pytest

from pipegen.run.checkpoint import Checkpoint, RangeSet, load_checkpoint, save_checkpoint
from pipegen.run.stream import prompt_uid, unit_seed


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


def test_checkpoint_size_does_not_grow_with_committed_units_or_batches(tmp_path):
    small, big = Checkpoint(), Checkpoint()
    for ckpt, units in ((small, 1000), (big, 1_000_000)):
        for start in range(0, units, 64):  # commits of 64, the writer's default batch
            ckpt.committed.add_range(start, start + 64)
            ckpt.batches.add(64, 64)
    assert len(big.batches) == 15625 and big.num_rows == 1_000_000
    assert big.batches.files()[-1] == "batch_15624.arrow"
    assert len(big.to_json()) - len(small.to_json()) < 40
    save_checkpoint(tmp_path / "c.json", big)
    back = load_checkpoint(tmp_path / "c.json")
    assert back.num_committed == 1_000_000 and 999_999 in back.committed and 1_000_000 not in back.committed


def test_seeds_distinct_per_unit_and_stable():
    seeds = {unit_seed(0, i, s) for i in range(200) for s in range(8)}
    assert len(seeds) == 1600
    assert unit_seed(0, 5, 1) == unit_seed(0, 5, 1) != unit_seed(1, 5, 1)
    assert prompt_uid("k", 3) == prompt_uid("k", 3) != prompt_uid("k", 4)


def test_fully_read_sealed_shards_fold_into_a_per_actor_watermark(tmp_path):
    from pipegen.run.stream import encode_record
    from pipegen.run.stream import ShardAppender, ShardTailer, scan_units

    app = ShardAppender(tmp_path, 0, max_bytes=200, fsync_interval_s=60)
    for i in range(50):
        app.append(encode_record(i, 0, {"pad": "x" * 40}))
    tailer = ShardTailer(tmp_path)
    assert len(list(tailer.lines())) == 50
    shards = sorted((tmp_path / "actor_0").glob("*.jsonl"))
    assert len(shards) > 10
    assert tailer.sealed == {"actor_0": len(shards) - 1}  # all but the live shard folded
    assert list(tailer.offsets) == [f"actor_0/{shards[-1].name}"]
    resumed = ShardTailer(tmp_path, dict(tailer.offsets), dict(tailer.sealed))
    assert list(resumed.lines()) == []
    app.append(encode_record(99, 0, {}))
    assert scan_units(tmp_path, tailer.offsets, tailer.sealed) == {(99, 0)}


def test_a_late_answer_of_a_superseded_attempt_is_a_duplicate_never_a_second_row(tmp_path, tiny_model):
    """Unit (i, 0) arrives first from its retry (attempt 1) and later again from the try it superseded
    (attempt 0, e.g. an actor that was presumed dead): the output keeps the first complete record, once,
    and the writer counts the late one as a duplicate."""
    import asyncio
    import dataclasses

    from pipegen.bench import common as c
    from pipegen.writer.batches import from_storage, load_batch
    from pipegen.writer.commit import Writer
    from pipegen.writer.modes import LauncherWriter

    cfg, run = c.prepare_run(tmp_path / "run", "n=2", "max_samples=4", "max_prompt_length=256",
                             "max_response_length=16", "generation.final_merge=false")
    records = c.RecordFactory(cfg).records(8, 16, seed=1)
    first = records[0]
    retry = dataclasses.replace(first, attempt=1, trajectories=[{**first.trajectories[0], "response_ids": [7] * 16}])
    c.write_records(run.rollouts, [retry, *records[1:], first])

    async def drain() -> Writer:
        writer = Writer(cfg, run, LauncherWriter())
        try:
            assert await asyncio.wait_for(writer.main(), 60) == 0
        finally:
            writer.committer.close()
        return writer

    writer = asyncio.run(drain())
    assert writer.duplicates == 1
    data = from_storage(load_batch(run.batch_files_on_disk()[0]))
    units = list(zip(data.non_tensor_batch["index"].tolist(), data.non_tensor_batch["sample"].tolist()))
    assert sorted(units) == sorted(set(units)) and len(units) == 8
    row = units.index((first.index, first.sample))
    assert data.batch["responses"][row].tolist() == [7] * 16  # the retry's answer, the first to arrive


def test_failures_are_summarised_by_reason_class_each_on_one_cut_line():
    """Six units whose reward raised on their own broken responses are one group, not five: the class is what
    raised what; the shown reason is the first unit's, its line breaks folded and cut."""
    from pipegen.run.checkpoint import REASON_SHOWN, failure_summary

    reward = "reward custom_reward_function /home/u/r.py:score raised ValueError: invalid literal for int(): "
    failed = {f"{i}:0": {"reason": reward + f"'The answer\n\nis {i}" + " and more" * 40 + "'"} for i in range(6)}
    failed["9:0"] = {"reason": "request failed after 8 attempts: HTTP 503"}
    lines = failure_summary(failed)
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert lines[0].startswith("6 unit(s) (0:0, 1:0, 2:0, 3:0 and 2 more): reward custom_reward_function "
                               "/home/u/r.py:score raised ValueError; the first: ")
    assert "'The answer is 0" in lines[0] and lines[0].endswith("…")
    assert len(lines[0].partition("; the first: ")[2]) == REASON_SHOWN
    assert lines[1] == "1 unit(s) (9:0): request failed after 8 attempts: HTTP 503"


def test_renumbering_the_checkpoint_for_a_larger_n_keeps_every_committed_unit():
    """Samples added to a run (n 1 -> 2): the same (index, sample) pairs, numbered by the new n, and the run not
    complete until the new samples are; back to n=1 only while no sample 1 is committed (an interrupted launch)."""
    from pipegen.run.stream import UnitKeys

    ckpt = Checkpoint(n=1, complete=True, merged=True)
    ckpt.committed.add_sorted([0, 1, 2, 5])
    ckpt.renumber(1, 2)
    assert sorted(UnitKeys(2).unit(k) for k in ckpt.committed) == [(0, 0), (1, 0), (2, 0), (5, 0)]
    assert (ckpt.n, ckpt.complete, ckpt.merged) == (2, False, False)
    assert Checkpoint.from_dict(orjson.loads(ckpt.to_json())).n == 2
    ckpt.renumber(2, 1)  # nothing of n=2 was committed yet
    assert sorted(ckpt.committed) == [0, 1, 2, 5]
    ckpt.renumber(1, 2)
    ckpt.committed.add(UnitKeys(2).key(0, 1))
    with pytest.raises(ValueError, match="sample 1 of prompt 0 is committed: a run numbered by n=1 cannot hold it"):
        ckpt.renumber(2, 1)
