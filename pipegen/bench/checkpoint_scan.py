"""Scenario `checkpoint`: checkpoint write time at 1k vs 1M committed units, and the actor's restart scan
(`pipegen.run.stream.scan_units`) vs run size.

Checkpoint: two `Checkpoint`s built the way the writer builds them: units arrive slightly out of order
(each unit's completion is displaced by up to 4 × 64 positions, as with 4 actors × 64 in flight), the
writer commits them `save_batch_size`=64 at a time (`RangeSet.add` per unit, one batch recorded per
commit) and tracks 64 MiB shards of ~20 KiB records from 4 actors (per actor, the sealed-shard
watermark plus the live shard's offset). The 1k and 1M checkpoints are written with `save_checkpoint`
(serialise + temp file + fsync + rename + directory fsync) alternately; also timed: `to_json` alone,
and a diagnostic copy with no batches recorded.

Restart scan: shards of realistic RolloutRecord lines (256-token trajectories), 10k vs 100k lines
(quick: 2k vs 20k). `scan_units` from offset 0 (no checkpoint: the whole run is read) and from the offsets
a checkpoint would hold when all but the last 1,000 lines are committed (the normal restart), each run
alternately at the two sizes; the page cache is warm for both.

Owns: this scenario's synthetic checkpoints and shards, and its rows in the table.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import PurePosixPath

from pipegen.bench import common as c

KEY = "checkpoint"
TITLE = "5. Checkpoint write (1k vs 1M units) and actor restart scan (vs run size)"
TARGET = "≤ 1.5"
BATCH = 64
WINDOW = 4 * 64
ACTORS = 4
RECORD_BYTES = 20 * 1024
SHARD_BYTES = 64 << 20
SCAN_N = 16  # samples per prompt of the scanned shards


def actor_folder(actor: int) -> str:
    from pipegen.run.layout import actor_shard_dir

    return actor_shard_dir(PurePosixPath(), actor).as_posix()


def shard_name(actor: int, seq: int) -> str:
    """How a checkpoint names a shard: its path relative to the topic folder."""
    from pipegen.run.layout import shard_path

    return shard_path(PurePosixPath(actor_folder(actor)), seq).as_posix()


def build_checkpoint(units: int, seed: int = 0):
    """A Checkpoint after `units` commits, with the out-of-order frontier a live run has: per actor, the
    sealed-shard watermark and the offsets of the shards above it."""
    from pipegen.run.checkpoint import Checkpoint

    rng = random.Random(seed)
    total = units + WINDOW
    order = sorted(range(total), key=lambda k: k + rng.uniform(0, WINDOW))[:units]
    ckpt = Checkpoint(run_key="f" * 16, launch="0" * 32)
    for b in range(0, units, BATCH):
        keys = sorted(order[b:b + BATCH])
        for k in keys:
            ckpt.committed.add(k)
        ckpt.batches.add(len(keys), len(keys))
    shards_per_actor = max(1, units * RECORD_BYTES // ACTORS // SHARD_BYTES + 1)
    live = shards_per_actor - 1  # every shard below it is sealed, fully consumed, not listed
    for a in range(ACTORS):
        ckpt.rollout_offsets[shard_name(a, live)] = 12345678
        ckpt.rollout_sealed[actor_folder(a)] = live
        ckpt.failure_offsets[shard_name(a, 0)] = 0
    return ckpt


def checkpoint_rows(res: c.ScenarioResult, quick: bool) -> None:
    from pipegen.run.checkpoint import save_checkpoint

    small, big = build_checkpoint(1000, 1), build_checkpoint(1_000_000, 2)
    lean_small = dataclasses.replace(small, batches=type(small.batches)())
    lean_big = dataclasses.replace(big, batches=type(big.batches)())
    reps = 15 if quick else 41
    with c.scratch("ckpt") as tmp:
        def saver(ckpt, name):
            path = tmp / name

            def save() -> float:
                t0 = time.perf_counter()
                save_checkpoint(path, ckpt)
                return time.perf_counter() - t0

            return save

        def serialiser(ckpt):
            def ser() -> float:
                t0 = time.perf_counter()
                ckpt.to_json()
                return time.perf_counter() - t0

            return ser

        saves = c.interleave({"1k": saver(small, "small.json"), "1M": saver(big, "big.json")}, reps)
        sers = c.interleave({"1k": serialiser(small), "1M": serialiser(big)}, reps)
        lean = c.interleave({"1k": saver(lean_small, "lean_small.json"), "1M": saver(lean_big, "lean_big.json")},
                            reps)
    sizes = {k: len(ckpt.to_json()) for k, ckpt in (("1k", small), ("1M", big), ("lean1M", lean_big))}
    res.add(c.Row(
        what="checkpoint write (save_checkpoint), 1M vs 1k committed units",
        ratio=c.paired_ratio(saves["1k"], saves["1M"]),  # time(1M) / time(1k)
        label="time at 1M ÷ time at 1k", target=TARGET,
        raw=(f"1k: {c.fmt_s(c.median(saves['1k']))}, {sizes['1k'] / 1024:.1f} KiB, "
             f"{small.committed.num_ranges} ranges, {len(small.batches)} batches; "
             f"1M: {c.fmt_s(c.median(saves['1M']))}, {sizes['1M'] / 1024:.0f} KiB, "
             f"{big.committed.num_ranges} ranges, {len(big.batches):,} batches, "
             f"{len(big.rollout_offsets)} shard offsets listed; {reps} reps interleaved"),
    ))
    res.add(c.Row(
        what="  of which serialising (Checkpoint.to_json)", ratio=c.paired_ratio(sers["1k"], sers["1M"]),
        label="time at 1M ÷ time at 1k",
        raw=f"1k: {c.fmt_s(c.median(sers['1k']))}, 1M: {c.fmt_s(c.median(sers['1M']))}",
    ))
    res.add(c.Row(
        what="  diagnostic: same checkpoints with no batches recorded", ratio=c.paired_ratio(lean["1k"], lean["1M"]),
        label="time at 1M ÷ time at 1k", target=TARGET,
        raw=(f"1k: {c.fmt_s(c.median(lean['1k']))}, 1M: {c.fmt_s(c.median(lean['1M']))}, "
             f"{sizes['lean1M'] / 1024:.1f} KiB at 1M"),
    ))


def scan_template():
    """A realistic RolloutRecord (a 128-token prompt, a 256-token answer, float32 logprobs) whose copies,
    one per unit, make the scanned shards."""
    import numpy as np

    from pipegen.run.stream import RolloutRecord, TrajectoryKeys, prompt_uid, unit_seed

    rng = np.random.default_rng(0)
    trajectory = {TrajectoryKeys.PROMPT_IDS: rng.integers(c.TOKEN_LO, c.TOKEN_HI, 128).tolist(),
                  TrajectoryKeys.RESPONSE_IDS: rng.integers(c.TOKEN_LO, c.TOKEN_HI, 256).tolist(),
                  TrajectoryKeys.RESPONSE_MASK: [1] * 256,
                  TrajectoryKeys.RESPONSE_LOGPROBS: (-rng.exponential(1.0, 256)).astype(np.float32)}
    return RolloutRecord(index=0, sample=0, uid=prompt_uid(c.LAUNCH, 0), priority=0, seed=unit_seed(0, 0, 0),
                         agent_name="single_turn_agent", launch="x" * 32,
                         row={"data_source": "openai/gsm8k", "raw_prompt": [{"role": "user", "content": "q" * 160}]},
                         trajectories=[trajectory])


def write_lines(topic, count: int) -> int:
    """`count` records of units 0..count-1 (SCAN_N samples a prompt) in one actor's shards; their bytes."""
    from pipegen.run.stream import UnitKeys

    keys, template = UnitKeys(SCAN_N), scan_template()
    records = []
    for key in range(count):
        index, sample = keys.unit(key)
        records.append(dataclasses.replace(template, index=index, sample=sample))
    c.write_records(topic, records, max_bytes=SHARD_BYTES, fsync_interval_s=60.0)
    return c.shard_bytes(topic)


def offsets_before_tail(topic, tail_lines: int) -> dict[str, int]:
    """The shard offsets a checkpoint holds when all but the last tail_lines lines are committed."""
    from pipegen.run.stream import ShardTailer

    ends = [(rel, off) for rel, off, _ in ShardTailer(topic).lines()]
    return dict(ends[: len(ends) - tail_lines])


def scan_rows(res: c.ScenarioResult, quick: bool) -> None:
    from pipegen.run.stream import scan_units

    small_n, big_n = (2_000, 20_000) if quick else (10_000, 100_000)
    tail = 1000
    reps = 3 if quick else 5
    with c.scratch("scan") as tmp:
        small, big = tmp / "small", tmp / "big"
        write_lines(small, small_n)
        big_bytes = write_lines(big, big_n)
        off_small, off_big = offsets_before_tail(small, tail), offsets_before_tail(big, tail)

        def scanner(topic, offsets, expect):
            return lambda: c.timed(lambda: len(scan_units(topic, offsets)), expect=expect)

        full = c.interleave({"small": scanner(small, {}, small_n), "big": scanner(big, {}, big_n)}, reps)
        resume = c.interleave({"small": scanner(small, off_small, tail), "big": scanner(big, off_big, tail)},
                              reps * 3)
    res.add(c.Row(
        what=f"restart scan from offset 0 (no checkpoint), {big_n // 1000}k vs {small_n // 1000}k lines",
        ratio=c.paired_ratio(full["small"], full["big"]), label="time ÷ time (linear would be 10×)",
        raw=(f"{small_n // 1000}k: {c.fmt_s(c.median(full['small']))}, {big_n // 1000}k: "
             f"{c.fmt_s(c.median(full['big']))} ({big_bytes / 2**20 / c.median(full['big']):.0f} MiB/s; lines of "
             f"{big_bytes / big_n / 1024:.1f} KiB, {big_bytes / 2**20:.0f} MiB)"),
    ))
    res.add(c.Row(
        what=f"restart scan from the checkpoint's offsets ({tail:,} uncommitted lines), {big_n // 1000}k vs "
             f"{small_n // 1000}k-line run",
        ratio=c.paired_ratio(resume["small"], resume["big"]), label="time ÷ time", target=TARGET,
        raw=(f"{small_n // 1000}k: {c.fmt_s(c.median(resume['small']))}, {big_n // 1000}k: "
             f"{c.fmt_s(c.median(resume['big']))}"),
    ))


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    checkpoint_rows(res, quick)
    scan_rows(res, quick)
    res.notes.append("checkpoint: the ≤ 1.5 target on the checkpoint write is the project's requirement. A restart "
                     "scan reads only what the checkpoint has not committed, so its cost follows the uncommitted "
                     "tail, not the run; the ≤ 1.5 applied to it is this benchmark's own yardstick.")
    return res
