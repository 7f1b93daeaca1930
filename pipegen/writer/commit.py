"""Writer process: tails every actor shard into checkpointed DataProto batches, then merges them.

`python -m pipegen.writer output_dir=DIR` starts or restarts it, alone or under the launcher.

The commit protocol, in order, each step crash-safe on its own (ARCHITECTURE.md tells why each holds):
 1. read new complete lines from every shard from the checkpoint's byte offsets;
 2. drop units already committed or buffered (counted as duplicates);
 3. at save_batch_size rows, or after pull_timeout seconds without new lines, build a padded batch,
    write it to a temporary file, fsync, rename to batch_NNNNN.pkl;
 4. then replace checkpoint.json the same way (committed ranges, batches, offsets, failures);
 5. on start: take the lock, load the checkpoint, delete batch files it does not list;
 6. when every unit is committed or failed in this launch: merge, zip, upload, mark complete.

Owns: checkpoint.json, batch_*.pkl, trajectories.pkl/.zip and the writer lock.
Must never: write a batch that the checkpoint does not list yet as if it were committed, hold the
whole run in memory before the merge, or run twice on one directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import sys
import time

import orjson
from omegaconf import DictConfig

from pipegen.observe.logs import setup_logging, watch_parent
from pipegen.observe.stats import StatsAppender
from pipegen.run.atomic import DirectoryLock, LockHeld, atomic_write, remove_stale_temporaries
from pipegen.run.checkpoint import failure_reason, load_checkpoint, save_checkpoint
from pipegen.run.config import load_run_config
from pipegen.run.fingerprint import check_fingerprint
from pipegen.run.layout import RunDir, output_dir_from_args
from pipegen.run.records import FailureRecord, RolloutRecord, UnitKeys, parse_unit_label, unit_label
from pipegen.run.streams import ShardTailer

log = logging.getLogger("pipegen.writer")

FAULT_ENV = "PIPEGEN_WRITER_FAULT"  # test hook: "<point>:<k>" SIGKILLs the writer the k-th time it reaches point
EXIT_LOCKED = 3
EXIT_FAILED_UNITS = 4  # settled, but some units failed in this launch: a restart would not change that


class FaultInjector:
    """Deterministic crash points for the kill tests: batch_write, after_batch_rename, checkpoint_write."""

    def __init__(self, spec: str | None):
        self.point, self.remaining = None, 0
        if spec:
            point, _, count = spec.partition(":")
            self.point, self.remaining = point, int(count or 1)

    def reached(self, point: str) -> None:
        if point == self.point:
            self.remaining -= 1
            if self.remaining <= 0:
                os.kill(os.getpid(), signal.SIGKILL)


class Writer:
    def __init__(self, cfg: DictConfig, run: RunDir):
        self.cfg = cfg
        self.run = run
        self.gen = cfg.generation
        self.keys = UnitKeys(int(cfg.actor_rollout_ref.rollout.n))
        self.fault = FaultInjector(os.environ.get(FAULT_ENV))
        self.total_units = run.total_units(self.keys.n)
        self.valid_index = set(run.read_manifest())
        self.launch = run.read_launch().launch
        self.ckpt = load_checkpoint(run.checkpoint)
        self.buffer: dict[int, RolloutRecord] = {}
        self.buffered_rows = 0
        self.duplicates = 0
        self.unknown_units = 0
        self.builder = None  # BatchBuilder, made in main() (it imports verl)
        self.stats = StatsAppender(run.stats, "writer")

    # ---- start-up (step 5) ----
    def recover(self) -> None:
        listed = {self.run.batch_file(i) for i in self.ckpt.batches.numbers()}
        orphans = [p for p in self.run.batch_files_on_disk() if p not in listed]
        for p in orphans:
            log.warning("deleting %s: written before a crash, never committed by the checkpoint", p.name)
            p.unlink()
        remove_stale_temporaries(self.run.root)
        self.ckpt.fingerprint = self.run.run_key()
        if self.ckpt.launch != self.launch:
            # A new launch retries the units that failed before; forget their old failures.
            self.ckpt.failed = {}
            self.ckpt.launch = self.launch
            self.ckpt.complete = False
        self.rollouts = ShardTailer(self.run.rollouts, dict(self.ckpt.rollout_offsets), dict(self.ckpt.rollout_sealed))
        self.failures = ShardTailer(self.run.failures, dict(self.ckpt.failure_offsets), dict(self.ckpt.failure_sealed))
        log.info(
            "writer: %d/%d units committed in %d batches; resuming from %d shard offsets",
            self.ckpt.num_committed, self.total_units, len(self.ckpt.batches), len(self.ckpt.rollout_offsets),
        )

    # ---- steps 1-2 ----
    async def pull(self) -> int:
        """Consume new lines; commit whenever the buffer is full. Returns lines consumed."""
        got = 0
        for _, _, line in self.failures.lines():
            got += 1
            failure = FailureRecord.from_line(line)
            key = self.keys.key(failure.index, failure.sample)
            if failure.launch == self.launch and key not in self.ckpt.committed:
                self.ckpt.mark_failed(unit_label(failure.index, failure.sample), failure.reason)
        for _, _, line in self.rollouts.lines():
            got += 1
            try:
                rec = RolloutRecord.from_line(line)
            except (orjson.JSONDecodeError, TypeError):
                log.error("unparseable line in a rollout shard (skipped): %r", line[:120])
                continue
            if rec.index not in self.valid_index or not self.keys.valid_sample(rec.sample):
                self.unknown_units += 1
                continue
            key = self.keys.key(rec.index, rec.sample)
            if key in self.ckpt.committed or key in self.buffer:
                self.duplicates += 1
                continue
            self.buffer[key] = rec
            self.buffered_rows += rec.num_rows
            if self.buffered_rows >= int(self.gen.save_batch_size):
                await self.commit()
        return got

    # ---- steps 3-4 ----
    async def commit(self) -> None:
        if not self.buffer:
            return
        from pipegen.writer.batches import to_storage

        keys = sorted(self.buffer)
        batch = to_storage(await self.builder.build([self.buffer[k] for k in keys]), bool(self.gen.batch_int32))
        path = self.run.batch_file(len(self.ckpt.batches))
        data = pickle.dumps(batch)  # what DataProto.save_to_disk writes

        def write_batch(f) -> None:
            f.write(data[: len(data) // 2])
            self.fault.reached("batch_write")
            f.write(data[len(data) // 2 :])

        atomic_write(path, write_batch)
        self.fault.reached("after_batch_rename")
        ckpt = self.ckpt
        ckpt.batches.add(len(batch), len(keys))
        for k in keys:
            ckpt.committed.add(k)
            ckpt.failed.pop(unit_label(*self.keys.unit(k)), None)
        self._record_offsets()
        self._save_checkpoint()
        self.buffer.clear()
        self.buffered_rows = 0
        log.info("committed %s: %d units, %d/%d done", path.name, len(keys), ckpt.num_committed, self.total_units)

    def _record_offsets(self) -> None:
        ckpt = self.ckpt
        ckpt.rollout_offsets, ckpt.rollout_sealed = dict(self.rollouts.offsets), dict(self.rollouts.sealed)
        ckpt.failure_offsets, ckpt.failure_sealed = dict(self.failures.offsets), dict(self.failures.sealed)

    def _save_checkpoint(self) -> None:
        data = self.ckpt.to_json()

        def write(f) -> None:
            f.write(data[: len(data) // 2])
            self.fault.reached("checkpoint_write")
            f.write(data[len(data) // 2 :])

        atomic_write(self.run.checkpoint, write)

    # ---- step 6 ----
    def settled(self) -> bool:
        failed_keys = {self.keys.key(*parse_unit_label(label)) for label in self.ckpt.failed}
        pending = self.total_units - self.ckpt.num_committed - len(self.buffer) - len(failed_keys)
        return pending <= 0

    def finalize(self) -> None:
        ckpt = self.ckpt
        # failure offsets may have moved since the last batch: persist them with the final state
        self._record_offsets()
        complete = ckpt.num_committed == self.total_units
        if complete and self.gen.final_merge and ckpt.batches:
            from pipegen.writer.merge import merge_run

            merge_run(self.cfg, self.run, ckpt)
            ckpt.merged = True
        ckpt.complete = complete
        save_checkpoint(self.run.checkpoint, ckpt)
        if ckpt.failed:
            log.error("%d unit(s) failed in this launch (relaunch the same command to retry them):", len(ckpt.failed))
            for unit, info in list(ckpt.failed.items())[:20]:
                log.error("  unit %s: %s", unit, failure_reason(info))

    def write_stats(self, final: bool = False) -> None:
        self.stats.append(
            {
                "final": final,
                "committed": self.ckpt.num_committed,
                "units_total": self.total_units,
                "batches": len(self.ckpt.batches),
                "buffered": len(self.buffer),
                "failed": len(self.ckpt.failed),
                "duplicates": self.duplicates,
                "unknown_units": self.unknown_units,
                "torn_lines": self.rollouts.stats.torn_lines + self.failures.stats.torn_lines,
                "lines": self.rollouts.stats.lines,
            }
        )

    async def main(self) -> int:
        from pipegen.writer.batches import BatchBuilder
        from pipegen.actor.dataset import load_tokenizer

        # Import verl and load the tokenizer up front (seconds), not on the first commit.
        self.builder = BatchBuilder(self.cfg, load_tokenizer(self.cfg))
        self.recover()
        if self.ckpt.complete and self.ckpt.num_committed == self.total_units:
            log.info("run already complete: %s", self.run.trajectories)
            return 0
        idle_since = time.monotonic()
        sleep = 0.005
        last_stats = 0.0
        while True:
            got = await self.pull()
            now = time.monotonic()
            if got:
                idle_since = now
                sleep = 0.005  # busy: poll every few ms so tail latency stays low
            else:
                sleep = min(0.2, sleep * 2)  # idle: back off
            if self.buffer and (now - idle_since >= float(self.gen.pull_timeout) or self.settled()):
                await self.commit()
            if now - last_stats >= 2.0:
                self.write_stats()
                last_stats = now
            if self.settled() and not self.buffer:
                self.finalize()
                self.write_stats(final=True)
                return 0 if self.ckpt.complete else EXIT_FAILED_UNITS
            await asyncio.sleep(sleep)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run = RunDir(output_dir_from_args(argv))
    setup_logging("writer")
    watch_parent()
    cfg = load_run_config(run)
    lock = DirectoryLock(run.writer_lock)
    try:
        lock.acquire()
    except LockHeld as e:
        print(f"pipegen.writer: {e}", file=sys.stderr)
        return EXIT_LOCKED
    problem = check_fingerprint(cfg, run)
    if problem:
        print(f"pipegen.writer: {problem}", file=sys.stderr)
        return 2
    import uvloop

    from pipegen.actor.startup import ACTOR_IMPORTS, import_then_wait_for_manifest

    try:
        import_then_wait_for_manifest(run, ACTOR_IMPORTS)  # verl first; the launcher may still read the dataset
        return uvloop.run(Writer(cfg, run).main())
    finally:
        lock.release()

