"""cluster=ray with a store: the head's writer. Each node runner's writer commits its own node's batches to the store
(writer/commit.py with `writer=ID`); this one follows the store until every unit of the run is committed there or
listed failed in this launch by a node's writer, then makes the outputs from the store alone.

A `Mode` of the writer process (commit.py's `main` picks it; it runs no commit loop of its own). It reads every
writer's segments and failed.json (transport/object_store.py's `SegmentFollower`, each segment once) and keeps
its stats line true (committed as the store says), so `pipegen status` and the launcher's console on the head count
from the store. Once the run is settled: failed_units.json goes to the store (or an earlier one is deleted), and
the merge from the store (publish.py's `merge_from_store`) lays the run out in this node's scratch folder, merges
it and uploads the output; the launcher's report then reads that folder.

Owns: the head's writer stats line, failed_units.json in the store, the head's copy of the run (its scratch).
Must never: read another node's disk, commit or publish a batch, or decide which units run again (the launcher's
lease book does: a lost node's uncommitted units are leased again, so this one only waits).
"""

from __future__ import annotations

import asyncio
import logging
import time

from omegaconf import DictConfig

from pipegen.observe.stats import StatsAppender
from pipegen.run.checkpoint import failed_listing, load_checkpoint, save_checkpoint
from pipegen.run.handshake import EXIT_FAILED_UNITS
from pipegen.run.layout import RunDir
from pipegen.run.stats_line import WriterStats
from pipegen.run.store import output_key
from pipegen.run.stream import UnitKeys, parse_unit_label
from pipegen.transport.object_store import SegmentFollower, Store
from pipegen.writer.commit import Mode
from pipegen.writer.publish import merge_from_store

log = logging.getLogger("pipegen.writer")

POLL_S = 1.0  # how often the store's segments are listed (each new one read once)


def failed_uncommitted(follower: SegmentFollower, keys: UnitKeys) -> dict[str, str]:
    """The failed units of this launch that no segment commits (label -> reason)."""
    return {label: reason for label, reason in follower.failed.items()
            if keys.key(*parse_unit_label(label)) not in follower.committed}


class StoreHead(Mode):
    """The head's writer: settled once the store holds every unit committed or failed; at the end, the outputs made
    from the store alone. A signal means nothing of its own (Ctrl-C: main's one line)."""

    def work(self, cfg: DictConfig, run: RunDir) -> int:
        """Follow the store until it settles the run, then merge it from the store. Returns the exit code."""
        self.cfg, self.run_dir = cfg, run
        self.url = str(cfg.storage.url)
        self.keys = UnitKeys(int(cfg.actor_rollout_ref.rollout.n))
        self.total = run.total_units(self.keys.n)
        self.stats = StatsAppender(run.stats, WriterStats.ROLE)

        def waiting(seconds: float, error: str) -> None:
            log.warning("store %s does not answer for %.0f s (%s): retrying with backoff", self.url, seconds, error)

        self.store = Store(self.url, patience_s=None, on_wait=waiting)
        self.follower = SegmentFollower(self.store, run.read_launch().launch)
        self.failed: dict[str, str] = {}
        self.last_said = 0
        self.follower.refresh()
        # what the store held at this writer's first look: before the nodes' first commits of this launch (their
        # runners start servers and actors and fill a batch first); the closing line's "this launch" counts from it
        self.committed_before = len(self.follower.committed)
        log.info("following %s: %d unit(s) to be committed by the nodes' writers", self.url, self.total)
        while not self.settled(0, time.monotonic()):
            time.sleep(POLL_S)
        return asyncio.run(self.end())

    def settled(self, got: int, now: float) -> bool:
        self.follower.refresh()
        self.failed = failed_uncommitted(self.follower, self.keys)
        committed = len(self.follower.committed)
        self.stats.append(WriterStats(committed=committed, units_total=self.total, committed_before=self.committed_before,
                                      batches=len(self.follower.segments), failed=len(self.failed)))
        if committed != self.last_said:
            log.info("%s: %d/%d unit(s) committed by %d segment(s), %d failed", self.url, committed, self.total,
                     len(self.follower.segments), len(self.failed))
            self.last_said = committed
        return committed + len(self.failed) >= self.total

    async def end(self) -> int:
        """failed_units.json into the store (or an earlier one deleted), then the merge from the store."""
        run, store, failed, segments = self.run_dir, self.store, self.failed, self.follower.segments
        committed = len(self.follower.committed)
        failed_object = output_key(run.failed_units.relative_to(run.root))
        if failed:
            store.put(failed_object, failed_listing(committed, self.total, failed, []))
        elif store.get(failed_object) is not None:
            store.delete(failed_object)  # an earlier launch's list: every unit is committed now
        code = merge_from_store(self.url, run.root) if segments else 0
        if code:
            return code
        ckpt = load_checkpoint(run.checkpoint)
        ckpt.merged = bool(segments)
        save_checkpoint(run.checkpoint, ckpt)
        self.stats.append(WriterStats(final=True, committed=committed, units_total=self.total,
                                      committed_before=self.committed_before, batches=len(segments),
                                      failed=len(failed)))
        return EXIT_FAILED_UNITS if failed else 0
