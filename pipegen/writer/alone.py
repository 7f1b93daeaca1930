"""Whether anything could still add lines to a run's shards: a live launcher, or a live actor.

A writer run by hand after the launcher stopped (Ctrl-C, a crash) has nothing left to wait for: no
process of the run generates, so the quiet period (`generation.partial_batch_quiet_s`) would only
delay what it can deliver now. The writer asks `who_generates` when it has caught up with the shards.

Liveness is judged as `pipegen.status` judges it: the launcher by its OS lock (`.launcher.lock`, held
while it lives), each actor by the pid of its latest stats line (`run/ownership.pid_alive`, which knows
a reused pid from a pipegen process). An actor on another host (cluster=ray) cannot be seen from here:
it counts as alive, so a writer in doubt waits as it always did.

Owns: that judgement. Must never: signal, lock or write anything.
"""

from __future__ import annotations

from pipegen.observe.stats import latest_stats, line_alive
from pipegen.run.layout import RunDir, is_actor_role
from pipegen.run.ownership import lock_status


def who_generates(run: RunDir) -> list[str]:
    """The processes of this run that could still write a rollout line (empty: none is alive), each named
    for the writer's log: the launcher, and every actor not known to be dead."""
    alive = []
    launcher = lock_status(run.launcher_lock)
    if launcher.held:
        alive.append(f"launcher (pid {launcher.pid})")
    for name, line in latest_stats(run.stats).items():
        if is_actor_role(name) and not line.final and line_alive(line) is not False:
            alive.append(f"{name} (pid {line.pid}{' on ' + line.host if line.host else ''})")
    return alive
