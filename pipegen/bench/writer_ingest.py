"""Scenario `writer`: the writer's ingest -> DataProto batches vs a bare orjson read of the same shards.

pipegen: the real `pipegen.writer.Writer` on a prepared run folder (config, unit manifest, launch record,
one actor shard of realistic records): `recover()`, then `pull()` until the shards are drained (it commits
every `save_batch_size` rows: verl's postprocessing into a padded DataProto, int32 storage, pickle, batch
file fsync + rename, checkpoint fsync + rename), then `commit()` of the rest. Bare: `orjson.loads` of every
line of the same shard files. Both from page cache, interleaved.
When the writer misses its target, one extra pass runs under cProfile and the notes name where the time goes.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
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

KEY = "writer"
TITLE = "2. Writer ingest → DataProto batches (Writer pull/commit vs bare orjson read)"
TARGET = "≥ 0.6"
SIZES = {"quick": {1024: 192, 4096: 64}, "full": {1024: 1024, 4096: 384}}
N = 16
BATCH = 64


def prepare_run(root, tokens: int, count: int):
    """A run folder as the launcher leaves it, with one actor shard holding `count` records."""
    from pipegen.config import RunDir, save_run_config
    from pipegen.dataset import write_manifest
    from pipegen.streams import ShardAppender, encode_record

    cfg = bench_config(root, f"n={N}", "max_samples=-1", "max_prompt_length=256",
                       f"max_response_length={tokens}", f"generation.save_batch_size={BATCH}",
                       "generation.final_merge=false", "actors.scoring=false")
    run = RunDir(root)
    save_run_config(run, cfg)
    factory = RecordFactory(cfg, n=N)
    write_manifest(run.units_file, factory.indices)
    run.launch_file.write_bytes(orjson.dumps({"launch": "bench", "run_key": "bench", "servers": []}))
    app = ShardAppender(run.rollouts, 0, max_bytes=1 << 40, fsync_interval_s=1.0)
    for index, sample, body in factory.bodies(count, tokens, seed=tokens):
        app.append(encode_record(index, sample, body))
    app.close()
    return cfg, run


def make_writer_pass(cfg, run, builder, count: int):
    from pipegen.writer import Writer

    def reset() -> None:
        run.checkpoint.unlink(missing_ok=True)
        for p in run.root.glob("batch_*.pkl"):
            p.unlink()

    def writer_pass() -> float:
        reset()
        writer = Writer(cfg, run)
        writer.builder = builder
        writer.recover()

        async def drain() -> None:
            while await writer.pull():
                pass
            await writer.commit()

        t0 = time.perf_counter()
        asyncio.run(drain())
        dt = time.perf_counter() - t0
        assert writer.ckpt.num_committed == count, (writer.ckpt.num_committed, count)
        return dt

    return writer_pass


def warm_up(builder, run) -> None:
    path = sorted(run.rollouts.glob("actor_*/*.jsonl"))[0]
    with open(path, "rb") as f:
        record = orjson.loads(f.readline())
    asyncio.run(builder.build([record]))


def make_bare_pass(run, count: int):
    shards = sorted(run.rollouts.glob("actor_*/*.jsonl"))

    def bare_pass() -> float:
        t0 = time.perf_counter()
        got = 0
        for path in shards:
            with open(path, "rb") as f:
                for line in f:
                    orjson.loads(line)
                    got += 1
        dt = time.perf_counter() - t0
        assert got == count
        return dt

    return bare_pass


def profile_hotspots(fn, top: int = 8) -> str:
    """Where one pass spends its time: the heaviest functions by cumulative time (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    wall = max(v[3] for v in stats.stats.values())
    picks = []
    interesting = ("_agent_loop_postprocess", "_postprocess", "build", "pad", "model_validate", "pickle",
                   "dumps", "loads", "atomic_write", "fsync", "to_storage", "lines", "_compute", "tensor",
                   "collate", "concat", "stack", "save_checkpoint", "_save_checkpoint", "to_json")
    for (filename, line, func), (cc, nc, tt, ct, callers) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3]):
        short = f"{filename.rsplit('/site-packages/', 1)[-1].rsplit('/pipegen/', 1)[-1]}:{func}"
        if any(word in func for word in interesting) and ct > 0.02 * wall:
            picks.append(f"{short} {100 * ct / wall:.0f}% ({nc} calls)")
        if len(picks) >= top:
            break
    return "; ".join(picks)


def run(quick: bool) -> ScenarioResult:
    from pipegen.batches import BatchBuilder
    from pipegen.dataset import load_tokenizer

    res = ScenarioResult(KEY, TITLE)
    reps = 2 if quick else 4
    sizes = SIZES["quick" if quick else "full"]
    for tokens, count in sizes.items():
        with scratch(f"writer{tokens}") as tmp:
            cfg, run_dir = prepare_run(tmp / "run", tokens, count)
            builder = BatchBuilder(cfg, load_tokenizer(cfg))
            writer_pass = make_writer_pass(cfg, run_dir, builder, count)
            bare_pass = make_bare_pass(run_dir, count)
            warm_up(builder, run_dir)  # first-call imports and allocations inside verl's postprocessing
            times = interleave({"writer": writer_pass, "bare": bare_pass}, reps)
            ratio = paired_ratio(times["writer"], times["bare"])
            met = check_target(ratio, TARGET)
            shard_mb = sum(p.stat().st_size for p in run_dir.rollouts.glob("actor_*/*.jsonl")) / 2**20
            res.add(Row(
                what=f"{tokens // 1024}k-token records",
                ratio=ratio, label="writer ÷ bare orjson read (records/s)", target=TARGET, met=met,
                raw=(f"writer {fmt_rate(count / median(times['writer']), ' rec/s')}, bare orjson "
                     f"{fmt_rate(count / median(times['bare']), ' rec/s')}; {count} records ({shard_mb:.0f} MiB), "
                     f"batches of {BATCH} rows; {reps} reps interleaved"),
            ))
            if met is False and not quick:
                res.notes.append(f"writer, {tokens // 1024}k-token records, cProfile of one pass (cumulative "
                                 f"share of the pass): {profile_hotspots(writer_pass)}")
    if quick and any(r.met is False for r in res.rows):
        res.notes.append("writer: run `python -m pipegen.bench --only writer` (full mode) for a cProfile of where "
                         "the writer's time goes.")
    return res
