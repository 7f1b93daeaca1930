"""The writer's commit loop: tails the run's stream medium into checkpointed DataProto batches, then merges them.

`python -m pipegen.writer output_dir=DIR` starts or restarts it, alone or under the launcher.

The commit protocol, in order, each step crash-safe on its own (ARCHITECTURE.md tells why each holds):
 1. read new complete lines from every shard from the checkpoint's byte offsets (streams=redis: from the run's
    Redis streams as a consumer group, each entry acknowledged once the checkpoint covering it is durable:
    run/medium.py);
 2. drop units already committed or buffered (counted as duplicates);
 3. at save_batch_size rows build a padded batch; write it to a temporary file, fsync, rename to
    batch_NNNNN.arrow (pipegen/run/batchfile.py). A partial batch is written only when every unit is
    settled, when the mode says nothing more will arrive (a writer alone), or after partial_batch_quiet_s
    seconds (minutes by default) without new lines: each sample is already durable in its shard line, so
    small batches would buy nothing but files;
 4. then replace checkpoint.json (committed ranges, batches, offsets, failures): temporary file,
    fsync, fsync the directory (which makes the batch renames of step 3 durable too), rename;
 5. on start: take the lock, load the checkpoint (rebuilt from the batch files when it is missing; a
    damaged one, or a listed batch file missing, is refused with one line), adopt the batch files it
    does not list (orphans of a crash between 3 and 4: whole, since fsynced before their rename);
 6. when the mode says its part is settled: its end (`finalize` merges, zips and uploads; marks complete when
    none failed, else lists the failed units beside the partial output; generation.all_or_nothing=true: no
    output then).

Steps 3-4's disk half (writing the encoded batch files, then the checkpoint) runs on one background
thread, `Committer` (committer.py), while the main loop parses the next lines; this module decides
what each commit holds and hands it over in order. With storage.url, a publisher (publish.py) commits each
batch again to the object store, exactly once, on its own thread.

One writer process, one job (`Mode`: when it is settled, what it does at the end, what a signal means), picked by
process.py's `main`: the launcher's writer (which ends as the writer alone when nothing of the run generates any
more) and a node runner's writer (modes.py), the head of a store cluster (store_head.py). Those modules import
this one, never the reverse.

Owns: checkpoint.json, batch_*.arrow, trajectories.pkl/.zip, failed_units.json and the writer lock.
Must never: write a batch that the checkpoint does not list yet as if it were committed, hold the
whole run in memory before the merge (at most `MAX_QUEUED_BATCHES` encoded batches wait for the
disk), run twice on one directory, or import a mode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import Callable

from omegaconf import DictConfig

from pipegen.observe.stats import StatsAppender
from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.checkpoint import failed_listing, failure_reason, failure_summary, load_checkpoint, save_checkpoint
from pipegen.run.integrity import DamagedFile
from pipegen.run.layout import RunDir
from pipegen.run.medium import FAILURES, ROLLOUTS, open_medium
from pipegen.run.stats_line import WriterStats
from pipegen.run.stream import (FailureRecord, LineParser, RolloutRecord, UnitKeys, parse_unit_label, read_head,
                                unit_label)
from pipegen.writer.committer import Committer

log = logging.getLogger("pipegen.writer")

MAX_QUEUED_BATCHES = 4  # encoded batches waiting for the disk before the main loop waits too
STATS_EVERY_S = 2.0  # how often the writer's stats line is appended while it runs


class Mode(ABC):
    """One job of the writer process: when it is settled, what it does at the end, what a signal means."""

    publishes_as: str | None = None  # cluster=ray with a store: the writer id a node's writer publishes as
    settles_run = True  # False: other writers settle the run (a node's writer), so "already complete" is not its own
    writer: Writer | None = None  # the commit loop this mode drives, once it runs one

    def listen(self) -> None:
        """What a signal means, installed first thing in main(); by default nothing (Ctrl-C: KeyboardInterrupt)."""

    def work(self, cfg: DictConfig, run: RunDir) -> int:
        """The process's work: the commit loop, driven by this mode. Returns the writer's exit code."""
        import uvloop

        writer = Writer(cfg, run, self)
        try:
            return uvloop.run(writer.main())
        finally:
            writer.committer.close()

    def committed(self) -> int:
        """Units committed so far (the line a Ctrl-C ends with)."""
        return self.writer.ckpt.num_committed if self.writer is not None else 0

    @abstractmethod
    def settled(self, got: int, now: float) -> bool:
        """Between two pulls of `writer` (`got` lines read, monotonic `now`): whether its end comes now."""

    @abstractmethod
    async def end(self) -> int | None:
        """What it does once settled; the exit code, or None to go on reading (a node's flush)."""


class Writer:
    """The commit loop of one run directory; `mode` (a Mode) decides when it ends and how (None: a caller that drives
    pull, commit and flush itself, as the benches do)."""

    def __init__(self, cfg: DictConfig, run: RunDir, mode: Mode | None = None):
        self.cfg = cfg
        self.run = run
        self.mode = mode
        if mode is not None:
            mode.writer = self
        self.gen = cfg.generation
        # read once: an omegaconf lookup per line cost more than parsing a 1k-token line
        self.save_batch_size = int(self.gen.save_batch_size)
        self.quiet_period_s = float(self.gen.partial_batch_quiet_s)
        self.batch_int32 = bool(self.gen.batch_int32)
        self.keys = UnitKeys(int(cfg.actor_rollout_ref.rollout.n))
        self.total_units = run.total_units(self.keys.n)
        self.valid_index = set(run.read_manifest())
        self.launch = run.read_launch().launch
        self.ckpt = load_checkpoint(run.checkpoint)
        self.medium = open_medium(run, cfg)  # streams.kind: the shards (files) or the run's Redis streams
        self.buffer: dict[int, RolloutRecord] = {}
        self.buffered_rows = 0
        self.idle_since = time.monotonic()  # when the last line was read
        self.duplicates = 0
        self.unknown_units = 0
        self.builder = None  # BatchBuilder, made in main() (it imports verl)
        self.parser = LineParser()
        self.committer = Committer(run)
        self.publisher = None  # storage.url: publish.Publisher, started once the checkpoint is recovered
        self.stats = StatsAppender(run.stats, WriterStats.ROLE, baseline=WriterStats(committed=self.ckpt.num_committed))
        # The writer's tensor ops are small: torch's intra-op threads only fight the commit thread and
        # the actors for cores (verl's _postprocess ran 30x slower with 2 threads on a busy 2-core box).
        import torch  # here, not at the top: the refusals in main() (a held lock, a damaged file) answer without it

        torch.set_num_threads(1)

    # ---- start-up (step 5) ----
    def recover(self) -> None:
        from pipegen.writer.rebuild import recover

        self.ckpt = recover(self.run, self.ckpt, self.keys.n)
        self.ckpt.run_key = self.run.run_key()
        if self.ckpt.n not in (0, self.keys.n):  # the launcher renumbers it when n changes (launch/resume.py)
            raise DamagedFile(self.run.checkpoint, f"its units are numbered by n={self.ckpt.n}, this run's config says "
                              f"n={self.keys.n}", "the batch files and shards",
                              f"relaunch with n={self.keys.n} (the launcher renumbers it)")
        self.ckpt.n = self.keys.n
        if self.ckpt.launch != self.launch:
            # A new launch retries the units that failed before; forget their old failures.
            self.ckpt.failed = {}
            self.ckpt.launch = self.launch
            self.ckpt.complete = False
        self.rollouts = self.medium.reader(ROLLOUTS, self.ckpt)
        self.failures = self.medium.reader(FAILURES, self.ckpt)
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
            try:
                failure = FailureRecord.from_line(line)
            except (ValueError, TypeError, AttributeError):  # a damaged line: its unit is retried anyway
                log.error("unparseable line in a failure shard (skipped): %r", line[:120])
                continue
            key = self.keys.key(failure.index, failure.sample)
            if failure.launch == self.launch and key not in self.ckpt.committed:
                self.ckpt.mark_failed(unit_label(failure.index, failure.sample), failure.reason)
        for _, _, line in self.rollouts.lines():
            got += 1
            head = read_head(line)  # a duplicate is dropped before its line is parsed
            if head is not None and self._skip(*head):
                continue
            try:
                rec = self.parser.record(line)
            except (ValueError, TypeError, AttributeError):  # orjson's, or a line of another shape
                log.error("unparseable line in a rollout shard (skipped): %r", line[:120])
                continue
            if head is None and self._skip(rec.index, rec.sample):
                continue
            self.buffer[self.keys.key(rec.index, rec.sample)] = rec
            self.buffered_rows += rec.num_rows
            if self.buffered_rows >= self.save_batch_size:
                await self.commit()
        return got

    def _skip(self, index: int, sample: int) -> bool:
        """Count and skip a unit outside the manifest, or one already committed or buffered."""
        if index not in self.valid_index or not self.keys.valid_sample(sample):
            self.unknown_units += 1
            return True
        key = self.keys.key(index, sample)
        if key in self.ckpt.committed or key in self.buffer:
            self.duplicates += 1
            return True
        return False

    # ---- steps 3-4 ----
    async def commit(self) -> None:
        """Build the buffer into the next batch and hand it, with the checkpoint listing it, to the
        committer; the in-memory checkpoint counts it from here (a crash before the disk has it loses
        only this process's memory: the lines are read again)."""
        if not self.buffer:
            return
        from pipegen.writer.batches import encode_batch

        await self.committer.wait(MAX_QUEUED_BATCHES - 1)  # bounded memory: the disk keeps up or we wait
        keys = sorted(self.buffer)
        batch, derived = await self.builder.build_for_storage([self.buffer[k] for k in keys], self.batch_int32)
        chunks = encode_batch(batch, self.batch_int32, derived)
        path = self.run.batch_file(len(self.ckpt.batches))
        ckpt = self.ckpt
        ckpt.batches.add(len(batch), len(keys))
        ckpt.committed.add_sorted(keys)
        ckpt.merged = False  # a merged output (a partial one a writer alone left) no longer holds every committed row
        if ckpt.failed:  # a unit that failed earlier in this launch and then succeeded after all
            for k in keys:
                ckpt.failed.pop(unit_label(*self.keys.unit(k)), None)
        self.committer.submit(path, chunks, ckpt.to_json(), after=self._record_offsets())
        self.buffer.clear()
        self.buffered_rows = 0
        log.info("committed %s: %d units, %d/%d done", path.name, len(keys), ckpt.num_committed, self.total_units)

    async def flush(self) -> None:
        """Commit what is buffered and wait until every commit is on disk."""
        await self.commit()
        await self.committer.wait()

    def _record_offsets(self) -> Callable[[], None] | None:
        """Both readers' positions into the checkpoint about to be written; what to run once it is durable."""
        then = [after for after in (self.rollouts.save(self.ckpt), self.failures.save(self.ckpt)) if after]
        return (lambda: [after() for after in then]) if then else None

    # ---- step 6 ----
    def settled(self) -> bool:
        failed_keys = {self.keys.key(*parse_unit_label(label)) for label in self.ckpt.failed}
        pending = self.total_units - self.ckpt.num_committed - len(self.buffer) - len(failed_keys)
        return pending <= 0

    def finalize(self, pending: list[str] | None = None) -> None:
        """Every unit is settled, or (`pending`: a writer alone) nothing more will arrive: deliver what is
        committed. A complete run is merged, zipped and uploaded; so is a partial one (units whose tries were
        spent, or units no process generates now), whose left-out units are listed in failed_units.json,
        unless generation.all_or_nothing=true keeps its output back until a launch completes it."""
        ckpt = self.ckpt
        # failure offsets may have moved since the last batch: persist them with the final state
        after = self._record_offsets()
        complete = ckpt.num_committed == self.total_units
        deliver = complete or not self.gen.get("all_or_nothing", False)
        self._list_failed(complete, pending or [])
        if deliver and self.gen.final_merge and ckpt.batches:
            from pipegen.writer.merge import merge_run

            try:
                merge_run(self.cfg, self.run, ckpt)
            except Exception:
                self._raise_damaged_batch()
                raise
            ckpt.merged = True
        elif deliver and ckpt.batches:  # final_merge=false: the batch files are the output
            from pipegen.writer.merge import write_artifact

            write_artifact(self.cfg, self.run, ckpt)
        ckpt.complete = complete
        save_checkpoint(self.run.checkpoint, ckpt)
        if after:
            after()
        for reader in (self.rollouts, self.failures):
            reader.settle()
        if complete and not self.gen.keep_streams:
            from pipegen.writer.tidy import drop_streams_once_verified

            drop_streams_once_verified(self.run)
        if ckpt.failed:
            log.error("%d unit(s) failed in this launch, listed in %s (relaunch the same command to retry only "
                      "them):", len(ckpt.failed), self.run.failed_units)
            for line in failure_summary(ckpt.failed):
                log.error("  %s", line)

    def _list_failed(self, complete: bool, pending: list[str]) -> None:
        """failed_units.json: each failed unit (index:sample) with its reason, and the units still pending when a
        writer alone delivers a partial output; removed once the run is complete."""
        if complete or not (self.ckpt.failed or pending):
            self.run.failed_units.unlink(missing_ok=True)
            return
        atomic_write_bytes(self.run.failed_units, failed_listing(self.ckpt.num_committed, self.total_units,
                                                                 self.failed_reasons(), pending))

    def failed_reasons(self) -> dict[str, str]:
        return {unit: failure_reason(info) for unit, info in self.ckpt.failed.items()}

    def export(self, only_if_missing: bool = False) -> None:
        """generation.export_format, after the merge (merge.py's `export`)."""
        from pipegen.writer.merge import export

        export(self.run, self.gen.get("export_format"), self.ckpt.merged, only_if_missing)

    def start_publisher(self) -> None:
        """storage.url: publish each committed batch to the object store on a background thread."""
        if self.cfg.storage.url:
            from pipegen.writer.publish import Publisher

            publishes_as = self.mode.publishes_as if self.mode is not None else None
            self.publisher = Publisher(self.cfg, self.run, self.keys, publishes_as)
            self.committer.on_commit = self.publisher.wake  # each batch goes up as soon as it is on disk
            self.publisher.start()

    def deliver_to_store(self, code: int) -> int:
        """storage.url: wait until every committed batch is published (as long as the store takes to answer),
        then upload the outputs. Returns `code`, or 1 when publishing stopped (the log line says why)."""
        if self.publisher is None:
            return code
        from pipegen.writer.publish import run_outputs

        log.info("publishing to %s: waiting until every committed batch is in the store", self.cfg.storage.url)
        problem = self.publisher.finish(*run_outputs(self.run, self.gen.get("export_format")))
        if problem:
            log.error("%s", problem)
            return 1
        return code

    def _raise_damaged_batch(self) -> None:
        """After a failed merge: a DamagedFile for the first listed batch file that cannot be read."""
        from pipegen.run.rows import batch_rows

        for number in self.ckpt.batches.numbers():
            batch_rows(self.run.batch_file(number), whole=True)

    def write_stats(self, final: bool = False) -> None:
        ckpt, rollouts, failures = self.ckpt, self.rollouts.stats, self.failures.stats
        self.stats.append(WriterStats(
            final=final, committed=ckpt.num_committed, units_total=self.total_units, batches=len(ckpt.batches),
            buffered=len(self.buffer), failed=len(ckpt.failed), duplicates=self.duplicates,
            unknown_units=self.unknown_units, torn_lines=rollouts.torn_lines + failures.torn_lines, lines=rollouts.lines))

    async def main(self) -> int:
        """The commit loop under its mode, from start-up to the mode's end; the exit code."""
        from pipegen.writer.batches import BatchBuilder
        from pipegen.inputs.dataset import load_processor, load_tokenizer

        # Import verl and load the tokenizer (and a vision model's processor) up front (seconds), not on the first commit.
        self.builder = BatchBuilder(self.cfg, load_tokenizer(self.cfg), load_processor(self.cfg))
        self.recover()
        self.start_publisher()
        if self.mode.settles_run and self.ckpt.complete and self.ckpt.num_committed == self.total_units:
            log.info("run already complete: %s", self.run.trajectories)
            self.export(only_if_missing=True)  # a crash may have cut the last launch short after its merge
            return self.deliver_to_store(0)
        self.idle_since, sleep, last_stats = time.monotonic(), 0.005, 0.0
        while True:
            got = await self.pull()
            self.committer.poll()
            if self.publisher is not None and self.publisher.error:
                log.error("%s", self.publisher.error)
                return 1
            now = time.monotonic()
            if got:
                self.idle_since = now
                sleep = 0.005  # busy: poll every few ms so tail latency stays low
            else:
                sleep = min(0.2, sleep * 2)  # idle: back off
            if self.buffer and (now - self.idle_since >= self.quiet_period_s or self.settled()):
                await self.commit()
            if now - last_stats >= STATS_EVERY_S:
                self.write_stats()
                last_stats = now
            if self.mode.settled(got, now):
                code = await self.mode.end()
                if code is not None:
                    return code
            await asyncio.sleep(sleep)
