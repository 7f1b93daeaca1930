"""Scenario `demo`: the default demo as a new user runs it (`./launch.sh output_dir=DIR`: the CPU server with the
embedded SmolLM2 on the packaged demo prompts, nothing overridden), and whether pipegen's supervision threw any of
its healthy work away: requests judged stalled, aborts sent, servers taken out of rotation. On a CPU server that
runs fewer requests than auto concurrency keeps waiting, a queued request is not a stalled one (issue 43).

    python -m pipegen.bench --only demo

`python -m pipegen.launch output_dir=DIR` with no other key (quick and full alike: the demo is one size). Figures,
from the actors' last stats lines (DIR/streams/stats/actor_*.jsonl, run/stats_line.py's `stalled`,
`aborts_sent`, `servers_out_of_rotation`) and their logs (DIR/logs/actor_*.log, "left rotation" lines):
- stalled ÷ units (target ≤ 0);
- aborts sent ÷ units (target ≤ 0);
- servers that left rotation (target none).

Owns: the scenario's rows. Must never: pass the launcher any key but output_dir (it measures the default), assert
a timing or raise on a missed target, or leave the launcher running when it returns.
"""

from __future__ import annotations

import subprocess
import sys
import time

from pipegen.bench import common as c

KEY = "demo"
TITLE = "The default demo (CPU server, SmolLM2, demo prompts, no overrides): stalled, aborted, left rotation"
TIMEOUT_S = 1800


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    with c.scratch("demo") as folder:
        out = folder / "run"
        t0 = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "pipegen.launch", f"output_dir={out}"], capture_output=True,
                                text=True, stdin=subprocess.DEVNULL, cwd=c.REPO, timeout=TIMEOUT_S)
        wall = time.perf_counter() - t0
        if result.returncode != 0:
            raise RuntimeError(f"the demo failed (rc {result.returncode}): {result.stderr[-2000:]}")
        units, kept, _ = c.kept_response_tokens(out)
        actors = c.actor_stats(out)
        left = c.actor_log_lines(out, "left rotation")
    stalled = sum(int(a.stalled or 0) for a in actors)
    aborts = sum(int(a.aborts_sent or 0) for a in actors)
    hedges = sum(int(a.hedges or 0) for a in actors)
    requests = sum(int(a.http_requests or 0) for a in actors)
    out_now = sorted({url for a in actors for url in a.servers_out_of_rotation})
    setup = (f"{units} units, {kept:,} response tokens, {len(actors)} actor(s), {requests} HTTP requests, "
             f"{hedges} hedges; launcher wall {wall:.0f} s")
    res.add(c.Row("requests judged stalled per unit", stalled / max(1, units), "stalled ÷ units", "≤ 0",
                  raw=f"{stalled} stalled; {setup}"))
    res.add(c.Row("aborts sent per unit", aborts / max(1, units), "aborts sent ÷ units", "≤ 0",
                  raw=f"{aborts} aborts sent"))
    res.add(c.Row("servers that left rotation", float(len(left)), "'left rotation' lines in the actor logs", "≤ 0",
                  unit="", raw=("none" if not left else f"{len(left)}: {left[0][-200:]}")
                  + (f"; out of rotation at the end: {', '.join(out_now)}" if out_now else "")))
    return res
