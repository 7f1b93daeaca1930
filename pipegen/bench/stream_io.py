"""Scenario `streams`: JSONL stream write + read of realistic records through pipegen's stream layer
vs a bare orjson loop on the same data.

pipegen write: `encode_record(index, sample, body)` + `ShardAppender.append` (fsync on the actor's
default 1 s timer and at seal). Bare write: `orjson.dumps(record, OPT_SERIALIZE_NUMPY)` + newline +
`write` + `flush` per record into one binary file (per-record visibility for `tail -f`, as pipegen),
one fsync at close.
pipegen read: `ShardTailer.lines()` + `orjson.loads` per line (what the writer does). Bare read:
`for line in open(path, 'rb'): orjson.loads(line)`. Both read from page cache.
"""

from __future__ import annotations

import os
import shutil
import time

import orjson

from pipegen.bench.common import (
    RecordFactory,
    Row,
    ScenarioResult,
    bench_config,
    check_target,
    fmt_rate,
    interleave,
    median,
    paired_ratio,
    scratch,
)

KEY = "streams"
TITLE = "1. Stream write + read (ShardAppender / ShardTailer vs bare orjson)"
SIZES = {"quick": {1024: 400, 4096: 120}, "full": {1024: 2000, 4096: 600}}


def run(quick: bool) -> ScenarioResult:
    from pipegen.streams import ShardAppender, ShardTailer, encode_record

    res = ScenarioResult(KEY, TITLE)
    reps = 3 if quick else 7
    sizes = SIZES["quick" if quick else "full"]
    with scratch("streams") as tmp:
        cfg = bench_config(tmp / "run", "n=32", "max_samples=-1")
        factory = RecordFactory(cfg, n=32)
        for tokens, count in sizes.items():
            bodies = factory.bodies(count, tokens, seed=tokens)
            records = [{"index": i, "sample": s, **b} for i, s, b in bodies]  # the same dicts, for the bare loop
            line_bytes = len(encode_record(*bodies[0]))
            counter = iter(range(1 << 30))

            def pipegen_write() -> float:
                topic = tmp / f"pg_{next(counter)}"
                t0 = time.perf_counter()
                app = ShardAppender(topic, 0, max_bytes=64 << 20, fsync_interval_s=1.0)
                for index, sample, body in bodies:
                    app.append(encode_record(index, sample, body))
                app.close()
                return time.perf_counter() - t0

            def bare_write() -> float:
                path = tmp / f"bare_{next(counter)}.jsonl"
                t0 = time.perf_counter()
                with open(path, "wb") as f:
                    for rec in records:
                        f.write(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
                        f.flush()
                    os.fsync(f.fileno())
                return time.perf_counter() - t0

            writes = interleave({"pipegen": pipegen_write, "bare": bare_write}, reps)
            # read the newest files of each kind (same bytes: the bare loop wrote the same records)
            pg_topic = sorted(tmp.glob("pg_*"), key=lambda p: int(p.name[3:]))[-1]
            bare_path = sorted(tmp.glob("bare_*.jsonl"), key=lambda p: int(p.stem[5:]))[-1]

            def pipegen_read() -> float:
                t0 = time.perf_counter()
                tailer = ShardTailer(pg_topic)
                got = 0
                for _, _, line in tailer.lines():
                    orjson.loads(line)
                    got += 1
                dt = time.perf_counter() - t0
                assert got == count, (got, count)
                return dt

            def bare_read() -> float:
                t0 = time.perf_counter()
                got = 0
                with open(bare_path, "rb") as f:
                    for line in f:
                        orjson.loads(line)
                        got += 1
                dt = time.perf_counter() - t0
                assert got == count
                return dt

            reads = interleave({"pipegen": pipegen_read, "bare": bare_read}, reps * 2)
            for kind, times in (("write", writes), ("read", reads)):
                ratio = paired_ratio(times["pipegen"], times["bare"])
                target = "≥ 0.9"
                res.add(Row(
                    what=f"{tokens // 1024}k-token records: {kind}",
                    ratio=ratio, label="pipegen ÷ bare orjson (records/s)", target=target,
                    met=check_target(ratio, target),
                    raw=(f"pipegen {fmt_rate(count / median(times['pipegen']), ' rec/s')}, bare "
                         f"{fmt_rate(count / median(times['bare']), ' rec/s')}; {count} records × "
                         f"{line_bytes / 1024:.1f} KiB; {len(times['pipegen'])} reps interleaved"),
                ))
            for p in list(tmp.glob("pg_*")) + list(tmp.glob("bare_*")):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    res.notes.append("streams: ratios above 1 are real, not noise alone: the tailer reads 8 MiB chunks and slices "
                     "lines out of them, while the bare loop iterates a buffered file line by line (each 20-75 KiB "
                     "line spans several 8 KiB buffer refills); on the write side both do one orjson.dumps and one "
                     "write per record.")
    res.notes.append("streams: the ≥ 0.9 target here is this benchmark's own yardstick (issue 7 sets none for it): the "
                     "stream layer should cost next to nothing over plain orjson.")
    return res
