"""generation.keep_streams=false: a finished run drops its rollout shards, once its output is proven whole.

A finished run holds its samples several times over: the rollout shards, the batch files, the merged
output and trajectories.zip. The shards are the raw material the writer read; once the checkpoint says
complete and `python -m pipegen.status DIR --verify` (observe/verify.py) passes on the run, every sample
is in the batch files (and the merged output), so the shards can go. verify reads shards only to add notes,
so the run still verifies afterwards.

Owns: deleting `streams/rollouts/`'s shard files of a complete, verified run.
Must never: delete anything when verify finds a problem, delete batch files, the merged output, the
failures stream (the reasons of failed units) or the stats, or run before the checkpoint says complete.
"""

from __future__ import annotations

import logging

from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.layout import RunDir, list_shards

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
    shards = [path for paths in list_shards(run.rollouts).values() for path in paths]
    freed = 0
    for path in shards:
        freed += path.stat().st_size
        path.unlink()
    log.info("generation.keep_streams=false: the run verified; deleted %d rollout shard(s) (%.1f MiB) under %s",
             len(shards), freed / 2**20, run.rollouts)
    return True
