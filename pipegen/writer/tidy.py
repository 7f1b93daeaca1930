"""generation.keep_streams=false: a finished run drops its rollout shards, once its output is proven whole.

A finished run holds its samples several times over: the rollout shards, the batch files, the merged
output and trajectories.zip. The shards are the raw material the writer read; once the checkpoint says
complete and `python -m pipegen.status DIR --verify` (observe/verify.py) passes on the run, every sample
is in the batch files (and the merged output), so the shards can go. verify reads shards only to add notes,
so the run still verifies afterwards.

Owns: deleting the rollout stream of a complete, verified run (`streams/rollouts/`'s shard files, or with
streams=redis the run's rollout stream: run/medium.py's `drop`).
Must never: delete anything when verify finds a problem, delete batch files, the merged output, the
failures stream (the reasons of failed units) or the stats, or run before the checkpoint says complete.
"""

from __future__ import annotations

import logging

from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.layout import RunDir
from pipegen.run.medium import ROLLOUTS, open_medium

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
