"""Scenario `cluster`: a loopback Ray cluster of two generation nodes, one node's server 4x slower than
the other's; `python -m pipegen.launch ... cluster=ray` leases the units to both. Ratio: the makespan ÷
(total work ÷ total capacity), i.e. how close the run comes to keeping both nodes busy to the end.

Both servers are the fake model backend at a fixed pace (`--token-latency`, EOS off, so every unit is exactly
`max_response_length` tokens); the slow node gets `--token-latency` x 4 through its environment
(node_runner.NODE_SERVER_ARGS_ENV, as a `ray start` with that variable would). Measured from the actors'
stats lines (every 0.5 s): the window starts when both nodes have sent their first request (units
finished before it are left out of the work), and ends with the line that shows the last finished unit;
each node's capacity is its own units ÷ its own busy time. A static half-and-half split would take (units ÷ 2) ÷ the slow node's rate: that
ratio is shown beside it, from the same measured rates.

Owns: this scenario's sizes and its row in the table.
"""

from __future__ import annotations

import os
import subprocess
import sys

from pipegen.bench import common as c
from pipegen.observe.stats import stats_history
from pipegen.run.layout import RunDir, is_actor_role
from pipegen.run.stats_line import ActorStats

KEY = "cluster"
TITLE = "9. Ray cluster, one node's server 4× slower"
TARGET = "≤ 1.15"
NODE_RESOURCE = "pipegen_bench_node"
SLOWDOWN = 4


def actor_history(run: RunDir) -> dict[str, list[ActorStats]]:
    return {role: lines for role, lines in stats_history(run.stats).items()  # type: ignore[misc]
            if is_actor_role(role)}


def measure(run: RunDir, total_units: int) -> tuple[float, float, float, dict[str, float]]:
    """(makespan s, ideal s, static-split s, units/s per actor) from the actors' stats lines."""
    lines = actor_history(run)
    starts = {actor: next(x.startup.first_request for x in ls if x.startup.first_request)
              for actor, ls in lines.items()}
    start = max(starts.values())
    rates, before, end = {}, 0, start
    for actor, ls in lines.items():
        done = ls[-1].completed
        busy_end = next(x.time for x in ls if x.completed == done)  # the line where its last unit showed
        rates[actor] = done / max(1e-9, busy_end - starts[actor])
        end = max(end, busy_end)
        before += max([x.completed for x in ls if x.time <= start] or [0])
    capacity = sum(rates.values())
    ideal = (total_units - before) / capacity
    static = (total_units / 2) / min(rates.values())  # the slow node's half sets the pace
    return end - start, ideal, static / (total_units / capacity), rates


def run(quick: bool) -> c.ScenarioResult:
    from pipegen.launch.node_runner import NODE_SERVER_ARGS_ENV
    from pipegen.bench.doubles.loopback_cluster import LOOPBACK_ENV, add_generation_node, loopback_cluster

    res = c.ScenarioResult(KEY, TITLE)
    prompts, n, tokens, latency, slots = (48, 4, 24, 0.04, 8) if quick else (96, 6, 24, 0.04, 8)
    total = prompts * n
    with c.scratch("cluster") as tmp, loopback_cluster() as cluster:
        add_generation_node(cluster, NODE_RESOURCE)
        add_generation_node(cluster, NODE_RESOURCE,
                            {NODE_SERVER_ARGS_ENV: f"--token-latency {latency * SLOWDOWN}"})
        cluster.wait_for_nodes()
        out = tmp / "run"
        cmd = [sys.executable, "-m", "pipegen.launch", f"output_dir={out}", f"model_path={c.tiny_model()}",
               "cluster=ray", f"cluster.node_resource={NODE_RESOURCE}", f"max_samples={prompts}", f"n={n}",
               f"max_response_length={tokens}", "llm.engine=pipegen.bench.doubles.fake_backend:FakeBackend",
               f"llm.engine_args=[--token-latency,{latency},--eos-prob,0]", f"llm.max_batch={slots}",
               f"actors.concurrency={slots}", "actors.stats_interval_s=0.5", "generation.show_progress=false"]
        env = {**os.environ, **LOOPBACK_ENV, "RAY_ADDRESS": cluster.address}
        with open(tmp / "launcher.log", "wb") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the launcher exited {proc.returncode}: "
                               f"{(tmp / 'launcher.log').read_text()[-1500:]}")
        makespan, ideal, static_ratio, rates = measure(RunDir(out), total)
    fast, slow = max(rates.values()), min(rates.values())
    res.add(c.Row(
        what=f"{total} units on 2 nodes, one server {SLOWDOWN}× slower: makespan vs total work ÷ total capacity",
        ratio=makespan / ideal, label="makespan ÷ (work ÷ capacity)", target=TARGET,
        raw=(f"makespan {makespan:.1f}s, ideal {ideal:.1f}s; nodes {c.fmt_rate(fast, ' units/s')} and "
             f"{c.fmt_rate(slow, ' units/s')} (measured, {fast / slow:.1f}× apart); a static half each would "
             f"be {static_ratio:.2f}× ideal; {tokens} tokens a unit, {slots} in flight per node"),
    ))
    return res
