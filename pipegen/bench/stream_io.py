"""Scenario `streams`: JSONL stream write + read of realistic records through pipegen's stream layer
vs a bare orjson loop on the same data.

pipegen write: `RolloutRecord.to_line()` + `ShardAppender.append` (fsync on the actor's default 1 s
timer and at seal). Bare write: `orjson.dumps(record, OPT_SERIALIZE_NUMPY)` + newline + `write` +
`flush` per record, the records as plain dicts, into one binary file (per-record visibility for
`tail -f`, as pipegen), one fsync at close.
pipegen read: `ShardTailer.lines()` + `RolloutRecord.from_line` per line (what the writer does). Bare
read: `for line in open(path, 'rb'): orjson.loads(line)`. Both read from page cache.

Owns: this scenario's sizes and its rows in the table.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import orjson

from pipegen.bench import common as c

KEY = "streams"
TITLE = "1. Stream write + read (ShardAppender / ShardTailer vs bare orjson)"
TARGET = "≥ 0.9"
SIZES = {"quick": {1024: 400, 4096: 120}, "full": {1024: 2000, 4096: 600}}


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    reps = 3 if quick else 7
    sizes = SIZES["quick" if quick else "full"]
    with c.scratch("streams") as tmp:
        factory = c.RecordFactory(c.bench_config(tmp / "run", "n=32", "max_samples=-1"))
        for tokens, count in sizes.items():
            records = factory.records(count, tokens, seed=tokens)
            plain = [dataclasses.asdict(r) for r in records]  # the same data as plain dicts, for the bare loop
            line_bytes = len(records[0].to_line())
            pg_topic, bare_path = tmp / "pg", tmp / "bare.jsonl"

            def pipegen_write() -> float:
                shutil.rmtree(pg_topic, ignore_errors=True)
                t0 = time.perf_counter()
                c.write_records(pg_topic, records)
                return time.perf_counter() - t0

            def bare_write() -> float:
                t0 = time.perf_counter()
                with open(bare_path, "wb") as f:
                    for rec in plain:
                        f.write(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
                        f.flush()
                    os.fsync(f.fileno())
                return time.perf_counter() - t0

            writes = c.interleave({"pipegen": pipegen_write, "bare": bare_write}, reps)
            # read what the last writes left (the same records, so the same bytes)
            reads = c.interleave({"pipegen": lambda: c.timed(c.tail_records, pg_topic, expect=count),
                                  "bare": lambda: c.timed(c.bare_read, [bare_path], expect=count)}, reps * 2)
            for kind, times in (("write", writes), ("read", reads)):
                res.add(c.Row(
                    what=f"{tokens // 1024}k-token records: {kind}",
                    ratio=c.paired_ratio(times["pipegen"], times["bare"]),
                    label="pipegen ÷ bare orjson (records/s)", target=TARGET,
                    raw=(f"pipegen {c.fmt_rate(count / c.median(times['pipegen']), ' rec/s')}, bare "
                         f"{c.fmt_rate(count / c.median(times['bare']), ' rec/s')}; {count} records × "
                         f"{line_bytes / 1024:.1f} KiB; {len(times['pipegen'])} reps interleaved"),
                ))
            shutil.rmtree(pg_topic, ignore_errors=True)
            bare_path.unlink(missing_ok=True)
    res.notes.append("streams: ratios above 1 are real, not noise alone: the tailer reads 8 MiB chunks and slices "
                     "lines out of them, while the bare loop iterates a buffered file line by line (each 20-75 KiB "
                     "line spans several 8 KiB buffer refills); on the write side both do one orjson.dumps and one "
                     "write per record. The pipegen read also builds a RolloutRecord per line, as the writer does.")
    res.notes.append("streams: the ≥ 0.9 target is this benchmark's own yardstick (no requirement sets one): the "
                     "stream layer should cost next to nothing over plain orjson.")
    return res
