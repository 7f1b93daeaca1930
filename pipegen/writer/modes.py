"""The writer's jobs that commit: the launcher's writer, the writer alone, and a node runner's writer.

Each is a `Mode` of commit.py's loop (when it is settled, what it does at the end, what a signal means); commit.py's
`main` picks one by MODES. The head of a store cluster, which commits nothing, is store_head.py.

- `LauncherWriter` (a launch on one node, or a writer started by hand): settled once every unit of the manifest is
  committed or failed in this launch; at the end it merges, zips and uploads (commit.py's `finalize`), exports and
  delivers to the store. While it waits it says what for; once it has caught up with the medium and no launcher
  or actor of the run is alive (alone.py), it ends as the writer alone.
- `AloneWriter`: nothing more will reach the medium. It reads what is there (a line written just before its actor
  died included), commits it at once (no quiet period), delivers the partial output, lists the units still
  pending beside it (failed_units.json) and exits 0; a relaunch generates the rest.
- `NodeWriter` (cluster=ray with a store, `writer=ID`): commits what its node's shards hold and publishes as ID;
  it never settles nor merges the run (other nodes own the other units). Its runner's FLUSH_SIGNAL means: commit
  everything now and publish it with the failures seen; FINISH_SIGNAL: that, then exit once published
  (run/handshake.py).

Owns: each job's end and what its signals mean. Must never: commit, checkpoint or merge but through commit.py's
Writer, or be imported by commit.py.
"""

from __future__ import annotations

import logging
import signal

from pipegen.run.handshake import EXIT_FAILED_UNITS, FINISH_SIGNAL, FLUSH_SIGNAL
from pipegen.run.medium import ROLLOUTS
from pipegen.run.stream import unit_label
from pipegen.writer.alone import who_generates
from pipegen.writer.commit import STATS_EVERY_S, Mode, Writer

log = logging.getLogger("pipegen.writer")

WAITING_LINE_S = 60.0  # how often a writer without new lines says what it waits for
ALONE_CHECK_S = 1.0  # how often a writer that has caught up with the shards asks whether anything still generates


def deliver(writer: Writer, pending: list[str] | None = None) -> None:
    """A settling writer's end: finalize (the merge; `pending`: what a writer alone leaves ungenerated), the final
    stats line, the export."""
    writer.finalize(pending)
    writer.write_stats(final=True)
    writer.export()


class AloneWriter(Mode):
    """No launcher and no actor of the run is alive: the writer commits what the medium holds and exits."""

    def settled(self, got: int, now: float) -> bool:
        writer = self.writer
        return True  # nothing more will arrive

    async def end(self) -> int:
        writer = self.writer
        """Exit 0, or EXIT_FAILED_UNITS when units failed in this launch."""
        while await writer.pull():
            pass
        await writer.flush()
        pending = [] if writer.settled() else pending_units(writer)
        deliver(writer, pending)
        if pending:
            log.warning("no launcher or actor of this run is alive: committed %d of %d unit(s) (%s); %d still "
                        "pending, listed in %s; rerun the same command to generate only them",
                        writer.ckpt.num_committed, writer.total_units,
                        writer.run.merged_output() or writer.run.root, len(pending), writer.run.failed_units)
        return writer.deliver_to_store(0 if writer.ckpt.complete or not writer.ckpt.failed else EXIT_FAILED_UNITS)


def pending_units(writer: Writer) -> list[str]:
    """index:sample of every unit of the manifest neither committed nor failed, in the manifest's order."""
    failed, keys = set(writer.ckpt.failed), writer.keys
    return [unit_label(index, sample) for index in writer.run.read_manifest() for sample in range(keys.n)
            if keys.key(index, sample) not in writer.ckpt.committed and unit_label(index, sample) not in failed]


class LauncherWriter(Mode):
    """The run's writer on one node: settled when every unit is; the writer alone once nothing generates."""

    def __init__(self) -> None:
        self.ending: Mode | None = None  # AloneWriter, once nothing of the run generates
        self.asked_alone = 0.0
        self.said_waiting = float("-inf")

    def settled(self, got: int, now: float) -> bool:
        writer = self.writer
        if not got and not writer.settled() and now - self.asked_alone >= ALONE_CHECK_S:
            self.asked_alone = now  # caught up with the shards: does anything still generate?
            if not who_generates(writer.run):
                self.ending = AloneWriter()
                return True
        if now - writer.idle_since >= 5.0 and now - self.said_waiting >= WAITING_LINE_S:  # first after 5 s idle
            say_waiting(writer)
            self.said_waiting = now
        return writer.settled() and not writer.buffer

    async def end(self) -> int:
        writer = self.writer
        if self.ending is not None:
            self.ending.writer = writer
            return await self.ending.end()
        await writer.committer.wait()
        deliver(writer)
        return writer.deliver_to_store(0 if writer.ckpt.complete else EXIT_FAILED_UNITS)


def say_waiting(writer: Writer) -> None:
    """What a quiet writer waits for (alone, it would otherwise say nothing): the units not yet in a shard."""
    pending = writer.total_units - writer.ckpt.num_committed - len(writer.buffer) - len(writer.ckpt.failed)
    log.info("waiting for %d of %d unit(s) to appear in %s (the actors write them; alive: %s; with no launcher "
             "or actor alive the writer commits what is there and exits)", pending, writer.total_units,
             writer.medium.where(ROLLOUTS), ", ".join(who_generates(writer.run)) or "none")


class NodeWriter(Mode):
    """A node runner's writer: its runner's signals say when to flush and when to end."""

    settles_run = False

    def __init__(self, writer_id: str) -> None:
        self.publishes_as = writer_id
        self.asked = ""  # what the runner asked by signal: "flush", "finish" (a flush, then the end) or nothing yet
        self.told_failed = 0.0

    def listen(self) -> None:
        def asked(signum, _frame) -> None:
            self.asked = "finish" if signum == FINISH_SIGNAL or self.asked == "finish" else "flush"

        signal.signal(FLUSH_SIGNAL, asked)
        signal.signal(FINISH_SIGNAL, asked)

    def settled(self, got: int, now: float) -> bool:
        writer = self.writer
        if now - self.told_failed >= STATS_EVERY_S:  # the failures it saw, for the head
            writer.publisher.failed_now(writer.launch, writer.failed_reasons())
            self.told_failed = now
        return bool(self.asked)

    async def end(self) -> int | None:
        writer = self.writer
        """Every line its node's shards hold committed now and handed to the publisher, with the failures seen.
        The exit code once asked to finish and all of it is published; None after a flush."""
        asked, self.asked = self.asked, ""
        while await writer.pull():
            pass
        await writer.flush()
        writer.publisher.failed_now(writer.launch, writer.failed_reasons())
        if asked != "finish":
            return None
        writer.write_stats(final=True)
        problem = writer.publisher.finish([], [])
        if problem:
            log.error("%s", problem)
            return 1
        if not writer.gen.keep_streams:  # what its stream holds is committed and in the store now
            from pipegen.writer.tidy import drop_node_streams_once_committed

            drop_node_streams_once_committed(writer.run, writer.keys)
        return 0
