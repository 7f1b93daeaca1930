"""generation.keep_streams=false: a finished run drops its rollout shards, once its output is proven whole.

A finished run holds its samples several times over: the rollout shards, the batch files, the merged
output and trajectories.zip. The shards are the raw material the writer read; once the checkpoint says
complete and `python -m pipegen.status DIR --verify` (observe/verify.py) passes on the run, every sample
is in the batch files (and the merged output), so the shards can go. verify reads shards only to add notes,
so the run still verifies afterwards.

A node's writer on a cluster with a store (writer=ID) never completes the run: other nodes own the other units.
It drops its node's rollout stream when its runner ends it, once every batch it committed is in the store and its
checkpoint commits every unit those lines hold (`drop_node_streams_once_committed`).

Owns: deleting the rollout stream of a complete, verified run (`streams/rollouts/`'s shard files, or with
streams=redis the run's rollout stream: run/medium.py's `drop`), and a node writer's own.
Must never: delete anything when verify finds a problem, delete batch files, the merged output, the
failures stream (the reasons of failed units) or the stats, or run before the checkpoint says complete.
"""

from __future__ import annotations

import logging

from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.layout import RunDir
from pipegen.run.medium import ROLLOUTS, open_medium
from pipegen.run.stream import UnitKeys

log = logging.getLogger("pipegen.writer")


def drop_streams_once_verified(run: RunDir) -> bool:
    """Delete the rollout shards when the run is complete and verifies; True when they were deleted."""
    from pipegen.observe.verify import verify_run

    if not load_checkpoint(run.checkpoint).complete:
        return False
    verdict = verify_run(run)
    if not verdict.ok:
        log.warning("generation.keep_streams=false: keeping the rollout shards: --verify found %d problem(s): %s",
                    len(verdict.problems), "; ".join(verdict.problems[:3]))
        return False
    log.info("generation.keep_streams=false: the run verified; %s", open_medium(run).drop(ROLLOUTS))
    return True


def drop_node_streams_once_committed(run: RunDir, keys: UnitKeys) -> bool:
    """A node writer at its end, every committed batch already in the store: delete its node's rollout stream when
    its checkpoint commits every unit a line there holds; True when it was deleted."""
    ckpt = load_checkpoint(run.checkpoint)
    medium = open_medium(run)
    left = [unit for unit in medium.units(ROLLOUTS) if keys.key(*unit) not in ckpt.committed]
    if left:
        log.warning("generation.keep_streams=false: keeping this node's rollout stream: %d unit(s) in it are not "
                    "committed here (first: %s)", len(left), ":".join(map(str, left[0])))
        return False
    log.info("generation.keep_streams=false: every unit of this node's stream is committed and in the store; %s",
             medium.drop(ROLLOUTS))
    return True
