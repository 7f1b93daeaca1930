"""pipegen's benchmarks: `python -m pipegen.bench [--quick] [--only SCENARIO ...] [--out BENCHMARKS.md]`.

One module per scenario, each with `KEY`, `TITLE` and `run(quick) -> ScenarioResult`; `__main__` runs
them in this order and writes the markdown table. Every figure is a ratio of two things measured side
by side, because the machines these run on are shared and noisy. `common` holds what they share.

Owns: the scenario names and the order the table lists them in.
"""

SCENARIOS = {
    "streams": "pipegen.bench.stream_io",
    "writer": "pipegen.bench.writer_ingest",
    "e2e": "pipegen.bench.end_to_end",
    "occupancy": "pipegen.bench.occupancy",
    "checkpoint": "pipegen.bench.checkpoint_scan",
    "cpu_server": "pipegen.bench.cpu_server",
    "outputs": "pipegen.bench.outputs",
    "gpu": "pipegen.bench.gpu",
    "vllm": "pipegen.bench.engine_vllm",
    "cluster": "pipegen.bench.cluster",
    "reward": "pipegen.bench.reward_verifier",
    "gateway": "pipegen.bench.gateway",
    "grouping": "pipegen.bench.grouping",
    "resume": "pipegen.bench.partial_progress",
    "longtail": "pipegen.bench.longtail",
    "grouping_default": "pipegen.bench.grouping_default",
    "demo": "pipegen.bench.demo_run",
    "store": "pipegen.bench.store_writers",
    "reproducible": "pipegen.bench.reproducible",
}
