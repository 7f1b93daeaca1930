"""Scenario `writer`: the writer's ingest -> DataProto batches vs a bare orjson read of the same shards.

pipegen: the real `pipegen.writer.commit.Writer` on a prepared run folder (config, unit manifest,
launch record, one actor shard of realistic records): `recover()`, then `pull()` until the shards are
drained (it commits every `save_batch_size` rows: simdjson parse into numpy, whole-batch padding,
verl's `_postprocess`, the numpy batch file, and on the commit thread batch fsync + rename and
checkpoint fsync + directory fsync + rename), then `flush()`: the rest as the last batch, and the
clock stops only when every commit is on disk. Bare: `orjson.loads` of every line of the same shard
files. Both from page cache, interleaved. When the writer misses its target in full mode, one extra
pass runs under cProfile and the notes name where the time goes.

Owns: this scenario's sizes, its writer pass, and its rows in the table.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats

from pipegen.bench import common as c

KEY = "writer"
TITLE = "2. Writer ingest → DataProto batches (Writer pull/commit vs bare orjson read)"
TARGET = "≥ 0.6"
SIZES = {"quick": {1024: 192, 4096: 64}, "full": {1024: 1024, 4096: 384}}
N = 16
BATCH = 64


def prepare_run(root, tokens: int, count: int):
    """A run folder as the launcher leaves it, with one actor shard holding `count` records."""
    cfg, run = c.prepare_run(root, f"n={N}", "max_samples=-1", "max_prompt_length=256",
                             f"max_response_length={tokens}", f"generation.save_batch_size={BATCH}",
                             "generation.final_merge=false", "actors.scoring=false")
    c.write_records(run.rollouts, c.RecordFactory(cfg).records(count, tokens, seed=tokens), max_bytes=1 << 40)
    return cfg, run


def make_writer_pass(cfg, run, builder, count: int):
    """One ingest of the whole run by a fresh Writer (batch files and checkpoint removed first); returns
    the seconds of its pull/commit loop."""
    from pipegen.writer.commit import Writer

    def writer_pass() -> float:
        run.checkpoint.unlink(missing_ok=True)
        for p in run.batch_files_on_disk():
            p.unlink()
        writer = Writer(cfg, run)
        writer.builder = builder
        writer.recover()

        async def drain() -> int:
            while await writer.pull():
                writer.committer.poll()
            await writer.flush()  # the rest as the last batch, and every commit on disk
            return writer.ckpt.num_committed

        try:
            return c.timed(asyncio.run, drain(), expect=count)
        finally:
            writer.committer.close()

    return writer_pass


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
                   "dumps", "loads", "record", "_fast", "_trajectory", "encode_batch", "wait", "poll", "fsync",
                   "lines", "_compute", "tensor", "cat", "to_json", "commit")
    for (filename, line, func), (cc, nc, tt, ct, callers) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3]):
        short = f"{filename.rsplit('/site-packages/', 1)[-1].rsplit('/pipegen/', 1)[-1]}:{func}"
        if any(word in func for word in interesting) and ct > 0.02 * wall:
            picks.append(f"{short} {100 * ct / wall:.0f}% ({nc} calls)")
        if len(picks) >= top:
            break
    return "; ".join(picks)


def run(quick: bool) -> c.ScenarioResult:
    import torch

    threads = torch.get_num_threads()  # the Writer sets 1 for its process; give later scenarios theirs back
    try:
        return _run(quick)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool) -> c.ScenarioResult:
    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.run.stream import RolloutRecord
    from pipegen.writer.batches import BatchBuilder

    res = c.ScenarioResult(KEY, TITLE)
    reps = 2 if quick else 4
    sizes = SIZES["quick" if quick else "full"]
    for tokens, count in sizes.items():
        with c.scratch(f"writer{tokens}") as tmp:
            cfg, run_dir = prepare_run(tmp / "run", tokens, count)
            builder = BatchBuilder(cfg, load_tokenizer(cfg))
            # first-call imports and allocations inside verl's postprocessing stay out of the timing
            asyncio.run(builder.build([RolloutRecord.from_line(c.shard_lines(run_dir.rollouts)[0])]))
            writer_pass = make_writer_pass(cfg, run_dir, builder, count)
            shards = c.shard_files(run_dir.rollouts)
            times = c.interleave({"writer": writer_pass,
                                  "bare": lambda: c.timed(c.bare_read, shards, expect=count)}, reps)
            row = res.add(c.Row(
                what=f"{tokens // 1024}k-token records",
                ratio=c.paired_ratio(times["writer"], times["bare"]),
                label="writer ÷ bare orjson read (records/s)", target=TARGET,
                raw=(f"writer {c.fmt_rate(count / c.median(times['writer']), ' rec/s')}, bare orjson "
                     f"{c.fmt_rate(count / c.median(times['bare']), ' rec/s')}; {count} records "
                     f"({c.shard_bytes(run_dir.rollouts) / 2**20:.0f} MiB), batches of {BATCH} rows; "
                     f"{reps} reps interleaved"),
            ))
            if row.met is False and not quick:
                res.notes.append(f"writer, {tokens // 1024}k-token records, cProfile of one pass (cumulative "
                                 f"share of the pass): {profile_hotspots(writer_pass)}")
    if quick and any(r.met is False for r in res.rows):
        res.notes.append("writer: run `python -m pipegen.bench --only writer` (full mode) for a cProfile of where "
                         "the writer's time goes.")
    return res
