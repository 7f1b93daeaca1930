"""Scenario `outputs`: the merge's peak memory against the size of what it writes, and the Parquet export's rate.

A run folder of committed batch files (1k-token responses, 256-token prompts, 64 rows per batch, in commit
order) is built from one real batch (`BatchBuilder` on `RecordFactory` records, stored as the writer stores
it: `build_for_storage` + `encode_batch`, the batch-file format) copied with fresh (index, sample) keys, plus
its checkpoint ledger.
Each measurement runs in a fresh child process (`python -m pipegen.bench.outputs child WHAT DIR`) that reports
its peak RSS (`ru_maxrss`) above its resident set after imports (VmRSS):
  * merge, single: `merge_run` writing trajectories.pkl; ÷ the file's size (one copy of the output);
  * merge, verl's way (context): load every batch, `DataProto.concat`, sort, `DataProto.save_to_disk`;
  * merge, sharded: `merge_run` with `merge_output=sharded` (parts of 1/8 of the run);
  * export: `export_plan` to Parquet (row groups of 1024) vs a bare pyarrow write of the same batches' response
    ids and log-probs as list columns (load_batch, mask, `pq.ParquetWriter`), interleaved.
Owns: this scenario's sizes and its rows in the table.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from pipegen.bench import common as c

KEY = "outputs"
TITLE = "7. Outputs: merge peak memory ÷ output size; Parquet export rate"
ROWS = {"quick": 1024, "full": 20480}
BATCH = 64
TOKENS = 1024


def prepare(root: Path, rows: int):
    """A complete run folder holding `rows` committed rows in batch files, as the writer leaves it."""
    import asyncio

    import numpy as np

    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.run.atomic import atomic_write_bytes
    from pipegen.run.checkpoint import Checkpoint
    from pipegen.writer.batches import BatchBuilder, encode_batch

    cfg, run = c.prepare_run(root, "n=16", "max_samples=-1", "max_prompt_length=256",
                             f"max_response_length={TOKENS}", f"generation.save_batch_size={BATCH}",
                             "actors.scoring=false")
    records = c.RecordFactory(cfg).records(BATCH, TOKENS)
    builder = BatchBuilder(cfg, load_tokenizer(cfg))
    batch, derived = asyncio.run(builder.build_for_storage(records, True))  # the writer's own storage form
    ckpt = Checkpoint()
    index = batch.non_tensor_batch["index"].astype(np.int64)
    for number in range(rows // BATCH):
        # fresh keys per copy, in commit order: copy k holds indices k*1000 + the batch's own
        batch.non_tensor_batch["index"] = (index + 1000 * number).astype(object)
        atomic_write_bytes(run.batch_file(number), b"".join(encode_batch(batch, True, derived)))
        ckpt.batches.add(len(batch), len(batch))
    ckpt.complete = True
    return cfg, run, ckpt


def child(what: str, root: str) -> dict:
    """One measurement in this (fresh) process: seconds and peak RSS growth in bytes."""
    from omegaconf import open_dict

    from pipegen.run.checkpoint import load_checkpoint
    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir
    from pipegen.writer import merge

    run = RunDir(Path(root))
    cfg = load_run_config(run)
    ckpt = load_checkpoint(run.checkpoint)
    import importlib

    for module in ("pyarrow.parquet", "verl", "verl.experimental.agent_loop.agent_loop"):
        importlib.import_module(module)  # imports stay out of the peak
    from verl import DataProto

    base = current_rss()
    t0 = time.perf_counter()
    extra: dict = {}
    if what in ("single", "sharded"):
        with open_dict(cfg):
            cfg.generation.merge_output = what
            cfg.generation.merge_shard_rows = max(1, ckpt.batches.rows // 8)
            cfg.generation.upload_artifact = False
        merge.merge_run(cfg, run, ckpt)
    elif what == "verl":
        from pipegen.run.rows import ROW_ORDER
        from pipegen.writer.batches import from_storage, load_batch

        import numpy as np

        merged = DataProto.concat([from_storage(load_batch(run.batch_file(i))) for i in ckpt.batches.numbers()])
        nt = merged.non_tensor_batch
        merged = merged.select_idxs(np.lexsort([nt[k].astype(np.int64) for k in reversed(ROW_ORDER)]))
        merged.save_to_disk(str(run.root / "verl.pkl"))
    elif what == "export":
        from pipegen.export.writers import export_plan

        plan = merge.plan_run(cfg, run, ckpt)
        export_plan(cfg, plan, run.export_file("parquet"), "parquet")
        extra["batch_reads"] = plan.batch_reads
    elif what == "bare":
        extra["bytes"] = bare_parquet(run, ckpt)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"seconds": seconds, "peak": peak, **extra}


def current_rss() -> int:
    """This process's resident set now (ru_maxrss holds the import-time high-water mark, which would hide
    part of the measured peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bare_parquet(run, ckpt) -> int:
    """Response ids and log-probs of every batch as Parquet list columns, batch by batch: the floor."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from pipegen.run.batchfile import BatchColumns
    from pipegen.writer.batches import load_batch

    path = run.root / "bare.parquet"
    schema = pa.schema([("response_ids", pa.list_(pa.int32())), ("rollout_log_probs", pa.list_(pa.float32()))])
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for i in ckpt.batches.numbers():
            b = load_batch(run.batch_file(i)).batch
            p = b[BatchColumns.PROMPTS].shape[1]
            att = b[BatchColumns.ATTENTION_MASK][:, p:].bool()
            off = pa.array([0, *att.sum(1).cumsum(0).tolist()], pa.int32())
            ids = pa.ListArray.from_arrays(off, pa.array(b[BatchColumns.RESPONSES][att].to(torch.int32).numpy()))
            lps = pa.ListArray.from_arrays(off, pa.array(b[BatchColumns.ROLLOUT_LOG_PROBS][att].numpy()))
            writer.write_table(pa.Table.from_arrays([ids, lps], schema=schema))
    return path.stat().st_size


def measure(what: str, run) -> dict:
    out = subprocess.run([sys.executable, "-m", "pipegen.bench.outputs", "child", what, str(run.root)],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"child {what} failed: {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    rows = ROWS["quick" if quick else "full"]
    with c.scratch("outputs") as tmp:
        cfg, run_dir, ckpt = prepare(tmp / "run", rows)
        from pipegen.run.checkpoint import save_checkpoint

        save_checkpoint(run_dir.checkpoint, ckpt)
        batch_bytes = sum(p.stat().st_size for p in run_dir.batch_files_on_disk())
        single = measure("single", run_dir)
        size = run_dir.trajectories.stat().st_size
        verl = measure("verl", run_dir)
        sharded = measure("sharded", run_dir)
        part = max(p.stat().st_size for p in run_dir.output_shards.glob("part_*.pkl"))
        gib = 2 ** 30
        res.add(c.Row(what=f"merge into one trajectories.pkl, {rows} rows of 1k tokens",
                      ratio=single["peak"] / size, label="peak RSS growth ÷ output size", target="≤ 1.5",
                      raw=(f"peak +{single['peak'] / gib:.2f} GiB for a {size / gib:.2f} GiB output "
                           f"({batch_bytes / gib:.2f} GiB of int32 batch files) in {single['seconds']:.1f} s; "
                           f"verl's concat + sort + save_to_disk: +{verl['peak'] / gib:.2f} GiB "
                           f"({verl['peak'] / size:.2f}×) in {verl['seconds']:.1f} s"),
                      unit="×"))
        res.add(c.Row(what=f"merge into sharded parts (8 parts of {rows // 8} rows)",
                      ratio=sharded["peak"] / size, label="peak RSS growth ÷ whole output size", target="≤ 0.5",
                      raw=(f"peak +{sharded['peak'] / gib:.2f} GiB, largest part {part / gib:.2f} GiB, "
                           f"{sharded['seconds']:.1f} s"), unit="×"))
        times: dict[str, list[float]] = {"export": [], "bare": []}
        reads = 0
        for rep in range(1 if quick else 2):
            for what in (("export", "bare") if rep % 2 == 0 else ("bare", "export")):
                m = measure(what, run_dir)
                times[what].append(m["seconds"])
                reads = m.get("batch_reads", reads)
                if what == "export":
                    export_peak = m["peak"]
        pq_bytes = run_dir.export_file("parquet").stat().st_size
        res.add(c.Row(what=f"Parquet export, {rows} rows of 1k tokens", ratio=c.paired_ratio(times["export"],
                                                                                        times["bare"]),
                      label="export rows/s ÷ bare pyarrow write of the responses", target="",
                      raw=(f"export {c.fmt_rate(rows / c.median(times['export']), ' rows/s')} "
                           f"({c.fmt_rate(rows * TOKENS / c.median(times['export']), ' response tokens/s')}; "
                           f"{pq_bytes / 2**20:.0f} MiB file: the rows repeat one batch, so it compresses well), "
                           f"bare {c.fmt_rate(rows / c.median(times['bare']), ' rows/s')}; "
                           f"export peak +{export_peak / gib:.2f} GiB; {reads} batch reads for "
                           f"{rows // BATCH} batches")))
    return res


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        sys.exit("usage: python -m pipegen.bench.outputs child WHAT RUN_DIR (run it through python -m pipegen.bench)")
