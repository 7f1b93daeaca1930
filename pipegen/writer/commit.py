"""Writer process: tails every actor shard into checkpointed DataProto batches, then merges them.

`python -m pipegen.writer output_dir=DIR` starts or restarts it, alone or under the launcher.

The commit protocol, in order, each step crash-safe on its own (ARCHITECTURE.md tells why each holds):
 1. read new complete lines from every shard from the checkpoint's byte offsets (streams=redis: from the run's
    Redis streams as a consumer group, each entry acknowledged once the checkpoint covering it is durable:
    run/medium.py);
 2. drop units already committed or buffered (counted as duplicates);
 3. at save_batch_size rows build a padded batch; write it to a temporary file, fsync, rename to
    batch_NNNNN.arrow (pipegen/run/batchfile.py). A partial batch is written only when every unit is
    settled, when nothing of the run generates any more (a writer alone, step 6), or after
    partial_batch_quiet_s seconds (minutes by default) without new lines: each sample
    is already durable in its shard line, so small batches would buy nothing but files;
 4. then replace checkpoint.json (committed ranges, batches, offsets, failures): temporary file,
    fsync, fsync the directory (which makes the batch renames of step 3 durable too), rename;
 5. on start: take the lock, load the checkpoint (rebuilt from the batch files when it is missing; a
    damaged one, or a listed batch file missing, is refused with one line), adopt the batch files it
    does not list (orphans of a crash between 3 and 4: whole, since fsynced before their rename);
 6. when every unit is committed or failed in this launch: merge, zip, upload; mark complete when none failed,
    else list the failed units beside the partial output (generation.all_or_nothing=true: no output then).
    A writer left alone (no launcher and no actor alive: alone.py) has nothing more to wait for: once it has
    read every shard it commits what they hold at once (no quiet period), merges that partial output, lists
    the units still pending beside it (failed_units.json) and exits 0; a relaunch generates the rest.

Steps 3-4's disk half (writing the encoded batch files, then the checkpoint) runs on one background
thread, `Committer` (committer.py), while the main loop parses the next lines; this module decides
what each commit holds and hands it over in order.

With storage.url, a publisher (publish.py) commits each batch again to the object store, exactly once, on its own
thread; the run ends once every committed batch is published and the outputs are uploaded.
Under cluster=ray with a store, `writer=ID` makes this a node runner's writer: it commits what its node's shards hold,
publishes as ID, never settles nor merges the run (other nodes own the other units), commits at once on the
runner's FLUSH_SIGNAL and exits once published on FINISH_SIGNAL (run/handshake.py). The head's writer follows the
store instead (store_head.py).

Owns: checkpoint.json, batch_*.arrow, trajectories.pkl/.zip, failed_units.json and the writer lock.
Must never: write a batch that the checkpoint does not list yet as if it were committed, hold the
whole run in memory before the merge (at most `MAX_QUEUED_BATCHES` encoded batches wait for the
disk), or run twice on one directory.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from typing import Callable

import orjson
from omegaconf import DictConfig

from pipegen.observe.logs import setup_logging, watch_parent
from pipegen.observe.stats import StatsAppender
from pipegen.run.atomic import atomic_write_bytes, remove_stale_temporaries
from pipegen.run.batchfile import CONVERT_FLAG, legacy_format_message
from pipegen.run.checkpoint import (check_listed_batches, failure_reason, failure_summary, load_checkpoint,
                                   save_checkpoint)
from pipegen.run.config import load_run_config
from pipegen.run.diskfull import exit_disk_full, is_disk_full
from pipegen.run.fingerprint import check_fingerprint
from pipegen.run.handshake import (EXIT_DAMAGED, EXIT_FAILED_UNITS, EXIT_LOCKED, FINISH_SIGNAL, FLUSH_SIGNAL,
                                   WRITER_IMPORTS, import_then_wait_for_manifest)
from pipegen.run.integrity import DamagedFile
from pipegen.run.layout import RunDir, output_dir_from_args
from pipegen.run.medium import FAILURES, ROLLOUTS, open_medium
from pipegen.run.ownership import DirectoryLock, LockHeld
from pipegen.run.stats_line import WriterStats
from pipegen.run.stream import (FailureRecord, LineParser, RolloutRecord, UnitKeys, parse_unit_label, read_head,
                                unit_label)
from pipegen.writer.alone import who_generates
from pipegen.writer.committer import Committer

log = logging.getLogger("pipegen.writer")

MAX_QUEUED_BATCHES = 4  # encoded batches waiting for the disk before the main loop waits too
WAITING_LINE_S = 60.0  # how often a writer without new lines says what it waits for
ALONE_CHECK_S = 1.0  # how often a writer that has caught up with the shards asks whether anything still generates
PENDING_LISTED = 10000  # pending units named one by one in failed_units.json (the count is always there)


def failed_listing(committed: int, total: int, failed: dict[str, str], pending: list[str]) -> bytes:
    """failed_units.json: each failed unit (index:sample) with its reason, and the units still pending when a writer
    alone delivers a partial output."""
    listing = {"committed": committed, "total": total, "failed": len(failed),
               "retry": "rerun the same command: it retries only these units, each with a fresh seed",
               "units": failed}
    if pending:
        listing["pending"] = len(pending)
        listing["pending_why"] = ("not generated: no launcher or actor was alive when the writer ran alone; "
                                  "rerun the same command to generate only them")
        listing["pending_units"] = pending[:PENDING_LISTED]  # the first ones; the count says how many
    return orjson.dumps(listing, option=orjson.OPT_INDENT_2)


class RunnerAsks:
    """What a node writer's runner asked by signal: "flush", "finish" (a flush, then the end) or nothing yet."""

    def __init__(self) -> None:
        self.what = ""

    def listen(self) -> None:
        """Installed first thing in main(): a signal's default action would kill the writer."""
        def asked(signum, _frame):
            self.what = "finish" if signum == FINISH_SIGNAL or self.what == "finish" else "flush"

        signal.signal(FLUSH_SIGNAL, asked)
        signal.signal(FINISH_SIGNAL, asked)

    def take(self) -> str:
        what, self.what = self.what, ""
        return what


class Writer:
    def __init__(self, cfg: DictConfig, run: RunDir, node_writer: str | None = None,
                 asks: RunnerAsks | None = None):
        self.cfg = cfg
        self.run = run
        self.node_writer = node_writer  # cluster=ray with a store: this node runner's writer id
        self.asks = asks or RunnerAsks()
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
        if not self.run.checkpoint.exists() and self.run.batch_files_on_disk():
            # batch files without a checkpoint: it was lost (a copy without it) or never written (a crash
            # before the first one). Either way the batch files are the truth: rebuild, never delete.
            from pipegen.writer.rebuild import rebuild

            log.warning("no %s beside %d batch file(s): rebuilding it from them", self.run.checkpoint.name,
                        len(self.run.batch_files_on_disk()))
            log.warning("%s", rebuild(self.run, self.keys.n).summary(self.run))
            self.ckpt = load_checkpoint(self.run.checkpoint)
        check_listed_batches(self.run.root, self.ckpt)
        listed = {self.run.batch_file(i) for i in self.ckpt.batches.numbers()}
        orphans = [p for p in self.run.batch_files_on_disk() if p not in listed]
        if orphans:
            from pipegen.writer.rebuild import adopt_orphans

            for entry in adopt_orphans(self.run, self.ckpt, orphans, self.keys.n):
                log.warning("set aside %s", entry)
            save_checkpoint(self.run.checkpoint, self.ckpt)
        remove_stale_temporaries(self.run.root)
        self.ckpt.run_key = self.run.run_key()
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

    def pending_units(self) -> list[str]:
        """index:sample of every unit of the manifest neither committed nor failed, in the manifest's order."""
        failed = set(self.ckpt.failed)
        return [unit_label(index, sample) for index in self.run.read_manifest() for sample in range(self.keys.n)
                if self.keys.key(index, sample) not in self.ckpt.committed
                and unit_label(index, sample) not in failed]

    async def finish_alone(self) -> int:
        """No launcher and no actor of this run is alive: nothing more will reach the shards. Read what they
        hold (a line written just before its actor died included), commit it now, deliver the partial output
        and name what is still pending. Exit 0, or EXIT_FAILED_UNITS when units failed in this launch."""
        while await self.pull():
            pass
        await self.flush()
        pending = [] if self.settled() else self.pending_units()
        self.finalize(pending)
        self.write_stats(final=True)
        self.export()
        if pending:
            log.warning("no launcher or actor of this run is alive: committed %d of %d unit(s) (%s); %d still "
                        "pending, listed in %s; rerun the same command to generate only them",
                        self.ckpt.num_committed, self.total_units,
                        self.run.merged_output() or self.run.root, len(pending), self.run.failed_units)
        return self.deliver_to_store(0 if self.ckpt.complete or not self.ckpt.failed else EXIT_FAILED_UNITS)

    def say_waiting(self) -> None:
        """What a quiet writer waits for (alone, it would otherwise say nothing): the units not yet in a shard."""
        failed = len(self.ckpt.failed)
        pending = self.total_units - self.ckpt.num_committed - len(self.buffer) - failed
        log.info("waiting for %d of %d unit(s) to appear in %s (the actors write them; alive: %s; with no launcher "
                 "or actor alive the writer commits what is there and exits)", pending, self.total_units,
                 self.medium.where(ROLLOUTS), ", ".join(who_generates(self.run)) or "none")

    def export(self, only_if_missing: bool = False) -> None:
        """generation.export_format: after the merge, `python -m pipegen.export` as a step of its own (it
        reads the run directory, nothing of the writer's). A failed export never fails the run: the
        merged output is complete, and the log names the command that retries it."""
        fmt = self.gen.get("export_format")
        if not fmt or not self.ckpt.merged or (only_if_missing and self.run.export_file(str(fmt)).exists()):
            return
        command = [sys.executable, "-m", "pipegen.export", str(self.run.root), "--format", str(fmt)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            log.error("export to %s failed (%s); retry with: python -m pipegen.export %s --format %s",
                      self.run.export_file(str(fmt)), (done.stderr.strip().splitlines() or ["no output"])[-1],
                      self.run.root, fmt)
        else:
            log.info("%s", done.stdout.strip())

    def start_publisher(self) -> None:
        """storage.url: publish each committed batch to the object store on a background thread."""
        if self.cfg.storage.url:
            from pipegen.writer.publish import Publisher

            self.publisher = Publisher(self.cfg, self.run, self.keys, self.node_writer)
            self.committer.on_commit = self.publisher.wake  # each batch goes up as soon as it is on disk
            self.publisher.start()

    async def answer_runner(self) -> int | None:
        """A node writer asked to flush: every line its node's shards hold committed now and handed to the
        publisher, with the failures seen. Returns the exit code once asked to finish and all of it is published."""
        asked = self.asks.take()
        while await self.pull():
            pass
        await self.flush()
        self.publisher.failed_now(self.launch, self.failed_reasons())
        if asked != "finish":
            return None
        self.write_stats(final=True)
        problem = self.publisher.finish([], [])
        if problem:
            log.error("%s", problem)
            return 1
        if not self.gen.keep_streams:  # what its stream holds is committed and in the store now
            from pipegen.writer.tidy import drop_node_streams_once_committed

            drop_node_streams_once_committed(self.run, self.keys)
        return 0

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
        self.stats.append(
            WriterStats(
                final=final,
                committed=self.ckpt.num_committed,
                units_total=self.total_units,
                batches=len(self.ckpt.batches),
                buffered=len(self.buffer),
                failed=len(self.ckpt.failed),
                duplicates=self.duplicates,
                unknown_units=self.unknown_units,
                torn_lines=self.rollouts.stats.torn_lines + self.failures.stats.torn_lines,
                lines=self.rollouts.stats.lines,
            )
        )

    async def main(self) -> int:
        from pipegen.writer.batches import BatchBuilder
        from pipegen.inputs.dataset import load_processor, load_tokenizer

        # Import verl and load the tokenizer (and a vision model's processor) up front (seconds), not on the first commit.
        self.builder = BatchBuilder(self.cfg, load_tokenizer(self.cfg), load_processor(self.cfg))
        self.recover()
        self.start_publisher()
        if self.node_writer is None and self.ckpt.complete and self.ckpt.num_committed == self.total_units:
            log.info("run already complete: %s", self.run.trajectories)
            self.export(only_if_missing=True)  # a crash may have cut the last launch short after its merge
            return self.deliver_to_store(0)
        idle_since = time.monotonic()
        sleep = 0.005
        last_stats = 0.0
        said_waiting = time.monotonic() - WAITING_LINE_S + 5.0  # the first line after 5 s without new lines
        asked_alone = 0.0
        while True:
            got = await self.pull()
            self.committer.poll()
            if self.publisher is not None and self.publisher.error:
                log.error("%s", self.publisher.error)
                return 1
            now = time.monotonic()
            if got:
                idle_since = now
                sleep = 0.005  # busy: poll every few ms so tail latency stays low
            else:
                sleep = min(0.2, sleep * 2)  # idle: back off
            if self.buffer and (now - idle_since >= self.quiet_period_s or self.settled()):
                await self.commit()
            if now - last_stats >= 2.0:
                self.write_stats()
                last_stats = now
                if self.node_writer is not None:
                    self.publisher.failed_now(self.launch, self.failed_reasons())
            if self.node_writer is not None:  # its runner says when to flush and when to end: other nodes settle the run
                if self.asks.what:
                    code = await self.answer_runner()
                    if code is not None:
                        return code
                await asyncio.sleep(sleep)
                continue
            if not got and not self.settled() and now - asked_alone >= ALONE_CHECK_S:
                asked_alone = now  # caught up with the shards: does anything still generate?
                if not who_generates(self.run):
                    return await self.finish_alone()
            if now - idle_since >= 5.0 and now - said_waiting >= WAITING_LINE_S:
                self.say_waiting()
                said_waiting = now
            if self.settled() and not self.buffer:
                await self.committer.wait()
                self.finalize()
                self.write_stats(final=True)
                self.export()
                return self.deliver_to_store(0 if self.ckpt.complete else EXIT_FAILED_UNITS)
            await asyncio.sleep(sleep)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    store_url = next((a.split("=", 1)[1] for a in argv if a.startswith("output_dir=") and "://" in a), None)
    if store_url:  # a store run's merge, from the store alone
        setup_logging("writer")
        from pipegen.writer.publish import merge_from_store

        return merge_from_store(store_url)
    run = RunDir(output_dir_from_args(argv))
    node_writer = next((a.split("=", 1)[1] for a in argv if a.startswith("writer=")), None)
    asks = RunnerAsks()
    if node_writer is not None:
        asks.listen()
    # Ctrl-C on a writer run by hand raises KeyboardInterrupt (answered below) even where SIGINT arrived ignored,
    # as it does in a shell's background job, nohup or a test runner's worker: Python then installs no handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    setup_logging("writer")
    watch_parent()
    try:
        cfg = load_run_config(run)
    except DamagedFile as e:
        return refuse(run, e)
    lock = DirectoryLock(run.writer_lock)
    try:
        lock.acquire()
    except LockHeld as e:
        print(f"pipegen.writer: {e}", file=sys.stderr)
        return EXIT_LOCKED
    if CONVERT_FLAG in argv:
        from pipegen.writer.convert import convert_pickle_batches

        try:
            count = convert_pickle_batches(run)
        finally:
            lock.release()
        print(f"pipegen.writer: converted {count} pickle batch file(s) of {run.root} to Arrow batch files; "
              f"continue the run as before (python -m pipegen.launch output_dir={run.root})")
        return 0
    legacy = run.legacy_batch_files()
    problem = legacy_format_message(run.root, legacy) if legacy else check_fingerprint(cfg, run)
    if problem:
        lock.release()
        print(f"pipegen.writer: {problem}", file=sys.stderr)
        return 2
    writer = None
    try:
        if "--rebuild" in argv:
            from pipegen.writer.rebuild import rebuild

            print(rebuild(run, int(cfg.actor_rollout_ref.rollout.n)).summary(run))
            return 0
        import uvloop

        import_then_wait_for_manifest(run, WRITER_IMPORTS)  # verl first; the launcher may still read the dataset
        if cfg.storage.url and str(cfg.cluster.kind) == "ray" and node_writer is None:
            from pipegen.writer.store_head import follow_store  # the head: its nodes' writers commit the run

            return follow_store(cfg, run)
        writer = Writer(cfg, run, node_writer, asks)
        return uvloop.run(writer.main())
    except KeyboardInterrupt:  # Ctrl-C on a writer run by hand: one line, no traceback; nothing committed is lost
        committed = writer.ckpt.num_committed if writer is not None else 0
        print(f"pipegen.writer: stopped (Ctrl-C); {committed} unit(s) committed are safe; rerun python -m "
              f"pipegen.writer output_dir={run.root} (or the launch command) to continue", file=sys.stderr)
        return 130
    except DamagedFile as e:
        return refuse(run, e)
    except OSError as e:
        if is_disk_full(e):
            return exit_disk_full(run.root, "writer", "pipegen.writer")
        raise
    finally:
        if writer is not None:
            writer.committer.close()
        lock.release()


def refuse(run: RunDir, damage: DamagedFile) -> int:
    """One line for a damaged run-directory file, also in the writer's final stats line (the launcher
    closes with it); nothing on disk is touched."""
    print(f"pipegen.writer: error: {damage}", file=sys.stderr)
    try:
        StatsAppender(run.stats, WriterStats.ROLE).append(WriterStats(final=True, refused=str(damage)))
    except OSError:
        pass
    return EXIT_DAMAGED

