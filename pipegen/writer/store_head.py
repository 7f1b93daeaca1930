"""cluster=ray with a store: the head's writer. Each node runner's writer commits its own node's batches to the store
(writer/commit.py with `writer=ID`); this one follows the store until every unit of the run is committed there or
listed failed in this launch by a node's writer, then makes the outputs from the store alone.

It reads every writer's segments and failed.json (run/store.py's `SegmentFollower`, each segment once) and keeps
its stats line true (committed as the store says), so `pipegen status` and the launcher's console on the head count
from the store. Once the run is settled: failed_units.json goes to the store (or an earlier one is deleted), and
the merge from the store (publish.py's `merge_from_store`) lays the run out in this node's scratch folder, merges
it and uploads the output; the launcher's report then reads that folder.

Owns: the head's writer stats line, failed_units.json in the store, the head's copy of the run (its scratch).
Must never: read another node's disk, commit or publish a batch, or decide which units run again (the launcher's
lease book does: a lost node's uncommitted units are leased again, so this one only waits).
"""

from __future__ import annotations

import logging
import time

from omegaconf import DictConfig

from pipegen.observe.stats import StatsAppender
from pipegen.run.checkpoint import load_checkpoint, save_checkpoint
from pipegen.run.handshake import EXIT_FAILED_UNITS
from pipegen.run.layout import RunDir
from pipegen.run.stats_line import WriterStats
from pipegen.run.store import SegmentFollower, Store, output_key
from pipegen.run.stream import UnitKeys, parse_unit_label
from pipegen.writer.commit import failed_listing
from pipegen.writer.publish import merge_from_store

log = logging.getLogger("pipegen.writer")

POLL_S = 1.0  # how often the store's segments are listed (each new one read once)


def failed_uncommitted(follower: SegmentFollower, keys: UnitKeys) -> dict[str, str]:
    """The failed units of this launch that no segment commits (label -> reason)."""
    return {label: reason for label, reason in follower.failed.items()
            if keys.key(*parse_unit_label(label)) not in follower.committed}


def follow_store(cfg: DictConfig, run: RunDir) -> int:
    """Wait until the store settles the run, then merge it from the store. Returns the writer's exit code."""
    url = str(cfg.storage.url)
    keys = UnitKeys(int(cfg.actor_rollout_ref.rollout.n))
    total = run.total_units(keys.n)
    stats = StatsAppender(run.stats, WriterStats.ROLE)

    def waiting(seconds: float, error: str) -> None:
        log.warning("store %s does not answer for %.0f s (%s): retrying with backoff", url, seconds, error)

    store = Store(url, patience_s=None, on_wait=waiting)
    follower = SegmentFollower(store, run.read_launch().launch)
    log.info("following %s: %d unit(s) to be committed by the nodes' writers", url, total)
    last_said = 0
    while True:
        follower.refresh()
        failed = failed_uncommitted(follower, keys)
        committed = len(follower.committed)
        stats.append(WriterStats(committed=committed, units_total=total, batches=len(follower.segments),
                                 failed=len(failed)))
        if committed != last_said:
            log.info("%s: %d/%d unit(s) committed by %d segment(s), %d failed", url, committed, total,
                     len(follower.segments), len(failed))
            last_said = committed
        if committed + len(failed) >= total:
            break
        time.sleep(POLL_S)
    failed_object = output_key(run.failed_units.relative_to(run.root))
    if failed:
        store.put(failed_object, failed_listing(committed, total, failed, []))
    elif store.get(failed_object) is not None:
        store.delete(failed_object)  # an earlier launch's list: every unit is committed now
    code = merge_from_store(url, run.root) if follower.segments else 0
    if code:
        return code
    ckpt = load_checkpoint(run.checkpoint)
    ckpt.merged = bool(follower.segments)
    save_checkpoint(run.checkpoint, ckpt)
    stats.append(WriterStats(final=True, committed=committed, units_total=total, batches=len(follower.segments),
                             failed=len(failed)))
    return EXIT_FAILED_UNITS if failed else 0
