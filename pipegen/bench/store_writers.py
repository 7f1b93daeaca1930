"""Scenario `store`: writers committing to one object store (SeaweedFS on loopback, `doubles/seaweed.py`).

    python -m pipegen.bench --only store [--quick]

Rows, each a ratio measured side by side in one sitting against one SeaweedFS:
- **writers scale**: committed records/s of 1, 2 and 4 writers at once, each the real `pipegen.writer.commit.Writer`
  with its publisher (storage.url) in a process of its own, with its own run folder and writer id, fed a
  pre-written actor shard of 1k-token records (disjoint units; the shared prefix is one run with k writers). A
  pass starts with the Writer's construction (recover, the publisher's conf PUTs and its look at its own segments)
  and ends when every batch is committed locally *and* its segment exists in the store (`Publisher.finish`);
  records/s = k x records ÷ (last writer's end - first writer's start). Generation is not timed. The 1, 2 and 4
  writer passes alternate, and each pass writes under a fresh prefix, then the store is read back: every unit in
  exactly one segment, or the scenario fails. Beside it, the CPU the writers and SeaweedFS used (their rusage and
  /proc figures), the cores that kept busy, and the CPU a record of 2 writers ÷ 1 (above 1 would be contention
  that a second writer adds): what decides scaling on a small shared machine;
- **store requests per committed record**: the S3 gateway's own count (its Prometheus endpoint,
  `SeaweedFS_s3_request_total` by type, not a client-side count) over the 1-writer passes, and the records each
  batch object holds at the default `generation.save_batch_size` (target ≥ 64, the issue's);
- **makespan, store ÷ local disk**: the real launcher (`python -m pipegen.launch`, the CPU server with the fake
  backend, 1k-token answers) with `output_dir=s3://...` and a scratch folder against the same job with a local
  `output_dir`, alternated; makespan = the launcher's wall time, start to exit (the store run's includes uploading
  the merged output). The store run is read back: every unit in exactly one segment.

Owns: the scenario's sizes and rows. Must never: assert a timing or raise on a missed target, set the AWS variables
in the bench's own process (only its writer processes and launchers get them), or leave SeaweedFS, a writer
process or a launcher running when it returns.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipegen.bench import common as c

KEY = "store"
TITLE = "18. Writers against one object store (SeaweedFS on loopback): records/s of 1, 2, 4 writers, requests, makespan"
TARGET_SCALE = "≥ 1.8"
TARGET_PER_OBJECT = "≥ 64"
TARGET_MAKESPAN = "≤ 1.05"
N = 128  # samples per prompt: the demo's 96 prompts give 12,288 units, enough for 4 writers' disjoint shares
TOKENS = 1024
WRITERS = (1, 2, 4)
SIZES = {"quick": {"records": 512, "reps": 2, "prompts": 16, "n": 8, "pairs": 2},
         "full": {"records": 2048, "reps": 4, "prompts": 32, "n": 16, "pairs": 3}}
LATENCY_S = 0.001  # the fake's seconds per token in the makespan runs: 1k-token answers take ~1 s each
READY_S = 600  # a writer process imports torch and verl and loads the tokenizer: slow on a loaded 2-core box
LAUNCH_TIMEOUT_S = 1200


@dataclass
class Pass:
    """One writer process's pass: its clock (time.monotonic, system-wide on Linux) and the CPU it used."""

    start: float
    end: float
    cpu_s: float
    records: int


def prepare_writer(root: Path, i: int, count: int, url: str, factory: c.RecordFactory | None = None,
                   tokens: int = TOKENS):
    """Writer i's run folder at the default settings (final merge off: no output to upload), its actor shard
    pre-written with `count` records of `tokens`-token answers, units [i x count, (i + 1) x count): (cfg, run,
    the record factory, for the next writer)."""
    cfg, run_dir = c.prepare_run(root, f"n={N}", "max_samples=-1", "max_prompt_length=256",
                                 f"max_response_length={tokens}", "generation.final_merge=false",
                                 "actors.scoring=false", f"storage.url={url}", f"storage.writer_id=w{i}")
    factory = factory or c.RecordFactory(cfg)
    c.write_records(run_dir.rollouts, factory.records(count, tokens, seed=i, first=i * count), max_bytes=1 << 40)
    return cfg, run_dir, factory


# ---- the writer processes (spawned: each imports torch, verl and obstore itself) ----
def _writer_main(conn, root: str, env: dict[str, str]) -> None:
    """A writer process: load the run folder's config and a warm BatchBuilder, then answer ("pass", url, writer),
    ("check", url, units) and None (exit) from the parent."""
    os.environ.update(env)  # this process's own environment: the store's endpoint and key
    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir
    from pipegen.run.stream import RolloutRecord
    from pipegen.writer.batches import BatchBuilder

    run = RunDir(Path(root))
    cfg = load_run_config(run)
    builder = BatchBuilder(cfg, load_tokenizer(cfg))
    # first-call imports and allocations inside verl's postprocessing stay out of the timing
    asyncio.run(builder.build([RolloutRecord.from_line(c.shard_lines(run.rollouts)[0])]))
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        try:
            conn.send(writer_pass(cfg, run, builder, *msg[1:]) if msg[0] == "pass" else check(*msg[1:]))
        except Exception as e:  # the parent reports it as the scenario's error
            conn.send(f"{type(e).__name__}: {e}")


def writer_pass(cfg, run, builder, url: str, writer_id: str) -> Pass:
    """One fresh Writer over the whole shard, publishing to `url` as `writer_id`, until every batch is in the store."""
    from omegaconf import open_dict

    from pipegen.writer.commit import Writer

    with open_dict(cfg):
        cfg.storage.url, cfg.storage.writer_id = url, writer_id
    run.checkpoint.unlink(missing_ok=True)
    run.publish_state.unlink(missing_ok=True)
    for p in run.batch_files_on_disk():
        p.unlink()
    cpu0, t0 = _cpu_self(), time.monotonic()
    writer = Writer(cfg, run)
    writer.builder = builder
    writer.recover()
    writer.start_publisher()

    async def drain() -> None:
        while await writer.pull():
            writer.committer.poll()
        await writer.flush()  # the rest as the last batch, and every commit on disk

    try:
        asyncio.run(drain())
        problem = writer.publisher.finish([], [])
    finally:
        writer.committer.close()
    end = time.monotonic()
    if problem:
        raise RuntimeError(problem)
    return Pass(t0, end, _cpu_self() - cpu0, writer.ckpt.num_committed)


def check(url: str, units: int) -> dict:
    """The store read back as every reader reads it: units committed, units committed twice, rows per segment."""
    from pipegen.run.store import resolve
    from pipegen.transport.object_store import Store

    segments = Store(url).segments()
    keys = sorted(k for seg in segments for k in seg.unit_keys())
    twice = sum(len(dropped) for _, dropped in resolve(segments))
    if twice or len(keys) != units or len(set(keys)) != units:
        raise RuntimeError(f"{url}: {len(set(keys))} distinct units committed ({twice} twice), expected {units}")
    return {"segments": len(segments), "rows": [seg.rows for seg in segments]}


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process: main, commit, publish
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pid: int) -> float:
    """Seconds of CPU a process has used (user + system), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _answer(conn):
    got = conn.recv()
    if isinstance(got, str):
        raise RuntimeError(f"a writer process failed: {got}")
    return got


# ---- the scenario ----
def run(quick: bool) -> c.ScenarioResult:
    from pipegen.bench.doubles.seaweed import Seaweed, weed_binary

    res = c.ScenarioResult(KEY, TITLE)
    try:
        weed_binary()
    except RuntimeError as e:
        res.skipped = str(e)
        return res
    size = SIZES["quick" if quick else "full"]
    with c.scratch("store") as folder:
        store = Seaweed(folder / "seaweed")
        store.start()
        try:
            _scaling(res, store, folder, size)
            _makespan(res, store, folder, size)
        finally:
            store.stop()
    return res


def _scaling(res: c.ScenarioResult, store, folder: Path, size: dict) -> None:
    from pipegen.bench.doubles.seaweed import BUCKET

    count, reps = size["records"], size["reps"]
    factory = None
    roots = []
    for i in range(max(WRITERS)):
        cfg, run_dir, factory = prepare_writer(folder / f"writer{i}", i, count, f"s3://{BUCKET}/scale", factory)
        roots.append(run_dir.root)
    shard_mib = c.shard_bytes(run_dir.rollouts) / 2**20  # each writer's shard is the same size
    batch = int(cfg.generation.save_batch_size)
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    try:
        for root in roots:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_writer_main, args=(child, str(root), store.env()), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        for conn in conns:
            if not conn.poll(READY_S):
                raise RuntimeError(f"a writer process was not ready within {READY_S} s")
            if (got := conn.recv()) != "ready":
                raise RuntimeError(f"a writer process failed to start: {got}")
        rates: dict[int, list[float]] = {k: [] for k in WRITERS}
        cores: dict[int, list[float]] = {k: [] for k in WRITERS}
        cpu_per_record: dict[int, list[float]] = {k: [] for k in WRITERS}
        requests: dict[str, int] = {}
        rows: list[int] = []
        for rep in range(reps):
            for k in (WRITERS if rep % 2 == 0 else WRITERS[::-1]):
                url = f"s3://{BUCKET}/scale-{k}w-{rep}"
                before, weed0 = store.requests(), _cpu_of(store.proc.pid)
                wall0 = time.monotonic()
                for i in range(k):
                    conns[i].send(("pass", url, f"w{i}"))
                passes = [_answer(conns[i]) for i in range(k)]
                wall = time.monotonic() - wall0
                weed_cpu, after = _cpu_of(store.proc.pid) - weed0, store.requests()
                if any(p.records != count for p in passes):
                    raise RuntimeError(f"a writer committed {[p.records for p in passes]}, expected {count} each")
                span = max(p.end for p in passes) - min(p.start for p in passes)
                rates[k].append(k * count / span)
                used = sum(p.cpu_s for p in passes) + weed_cpu
                cores[k].append(used / wall)
                cpu_per_record[k].append(used / (k * count))
                conns[0].send(("check", url, k * count))
                checked = _answer(conns[0])
                if k == 1:
                    for kind in set(before) | set(after):
                        requests[kind] = requests.get(kind, 0) + after.get(kind, 0) - before.get(kind, 0)
                    rows += checked["rows"]
        for conn in conns:
            conn.send(None)
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    med = {k: c.median(v) for k, v in rates.items()}
    ratios = {k: [a / b for a, b in zip(rates[k], rates[1])] for k in WRITERS}
    setup = (f"{count} records of {TOKENS // 1024}k tokens per writer ({shard_mib:.0f} MiB of shard each), batches of "
             f"{batch} rows; {reps} reps alternated")
    cpu = "; ".join(f"{k} writer(s): {c.median(cores[k]):.2f} cores busy, {1e3 * c.median(cpu_per_record[k]):.2f} "
                    "ms CPU a record (writers + SeaweedFS)" for k in WRITERS)  # of this scenario's processes only
    res.add(c.Row("2 writers vs 1, one store", c.median(ratios[2]), "records/s committed to the store, 2 ÷ 1 writer",
                  TARGET_SCALE, raw=f"1 writer {c.fmt_rate(med[1], ' rec/s')}, 2 writers "
                  f"{c.fmt_rate(med[2], ' rec/s')}; {setup}; {cpu}"))
    res.add(c.Row("4 writers vs 1, one store", c.median(ratios[4]), "records/s committed, 4 ÷ 1 writer",
                  raw=f"4 writers {c.fmt_rate(med[4], ' rec/s')}"))
    cpu_ratio = c.median([a / b for a, b in zip(cpu_per_record[2], cpu_per_record[1])])
    res.add(c.Row("CPU a committed record, 2 writers vs 1", cpu_ratio, "(writers' + SeaweedFS's CPU) ÷ records, "
                  "2 ÷ 1 writer", raw=f"{1e3 * c.median(cpu_per_record[1]):.2f} ms vs "
                  f"{1e3 * c.median(cpu_per_record[2]):.2f} ms; cores busy {c.median(cores[1]):.2f} vs "
                  f"{c.median(cores[2]):.2f} (of the machine's {os.cpu_count()}, shared)"))
    if res.rows[0].met is False and cpu_ratio <= 1.1:
        res.notes.append(f"store: 2 writers gave {res.rows[0].ratio:.2f}× the records/s of 1 while each record cost "
                         f"them {cpu_ratio:.2f}× the CPU: a second writer adds no work a record (no contention in "
                         "the store or the protocol); what it did not get is a second core's worth of CPU "
                         f"({c.median(cores[2]):.2f} cores busy with 2 writers, {c.median(cores[1]):.2f} with 1). "
                         "Read the row with the load column.")
    committed = reps * count
    total = sum(requests.values())
    by_kind = ", ".join(f"{kind} {n}" for kind, n in sorted(requests.items()) if n)
    res.add(c.Row("store requests per committed record (1 writer)", total / committed, "S3 requests ÷ records",
                  unit="", raw=f"{total} requests for {committed} records over {reps} passes ({by_kind}; SeaweedFS's "
                  "own count, its metrics endpoint)"))
    res.add(c.Row("records per batch object, default save_batch_size", c.median(rows), "rows a segment commits "
                  "(median)", TARGET_PER_OBJECT, unit="",
                  raw=f"{len(rows)} objects, {min(rows)}-{max(rows)} rows each"))


def _makespan(res: c.ScenarioResult, store, folder: Path, size: dict) -> None:
    from pipegen.bench.doubles.seaweed import BUCKET

    units = size["prompts"] * size["n"]
    job = [f"model_path={c.tiny_model()}", f"llm.engine={c.FAKE_BACKEND}", f"max_samples={size['prompts']}",
           f"n={size['n']}", f"max_response_length={TOKENS}",
           f"llm.engine_args=[--token-latency,{LATENCY_S},--eos-prob,0]"]
    times: dict[str, list[float]] = {"store": [], "local": []}
    for rep in range(size["pairs"]):
        for arm in (("local", "store") if rep % 2 == 0 else ("store", "local")):
            if arm == "store":
                url = f"s3://{BUCKET}/makespan-{rep}"
                where = [f"output_dir={url}", f"storage.scratch_dir={folder / f'scratch-{rep}'}"]
            else:
                where = [f"output_dir={folder / f'local-{rep}'}"]
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "pipegen.launch", *where, *job], capture_output=True,
                                  text=True, stdin=subprocess.DEVNULL, cwd=c.REPO, timeout=LAUNCH_TIMEOUT_S,
                                  env={**os.environ, **store.env()} if arm == "store" else None)
            times[arm].append(time.perf_counter() - t0)
            if done.returncode != 0:
                raise RuntimeError(f"the {arm} run failed (rc {done.returncode}): {done.stderr[-1500:]}")
            if arm == "store":
                _check_in_subprocess(url, units, store.env())
    ratio = c.median([s / loc for s, loc in zip(times["store"], times["local"])])
    res.add(c.Row("makespan, store run ÷ local-disk run", ratio, "launcher wall time, output_dir=s3://... ÷ local",
                  TARGET_MAKESPAN, raw=f"store {c.median(times['store']):.1f} s, local {c.median(times['local']):.1f} "
                  f"s; the real launcher, CPU server with the fake backend, {units} units × {TOKENS} tokens at "
                  f"{LATENCY_S * 1e3:g} ms a token; {size['pairs']} pair(s) alternated"))


def _check_in_subprocess(url: str, units: int, env: dict[str, str]) -> None:
    code = f"from pipegen.bench.store_writers import check; print(check({url!r}, {units}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=c.REPO, timeout=300,
                          env={**os.environ, **env})
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "the store check failed")
