"""The tail, measured in every run: the GPU-seconds a server left idle while fewer answers than a full batch
remained (from the engine's own running counts), shown by the closing summary, `pipegen status` and the report.

Against the fake SGLang (pipegen/bench/doubles/fake_sglang.py) whose capacity is known: 16 running slots and a
fixed time per token, every answer the same length. Four answers on sixteen slots leave twelve idle for the whole
run: the tail's idle GPU-seconds are 12/16 of its seconds, and its makespan is one answer's time, the ideal.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from conftest import FAST
from fake_servers import FakeSGLang, launch_external

SLOTS, STEP_MS, TOKENS = 16, 10, 300  # each answer 3 s on the fake's clock


def test_the_idle_tail_is_the_share_of_empty_slots_over_the_tail_and_every_view_shows_it(tmp_path: Path):
    fake = FakeSGLang("tail", tmp_path, "--max-running", str(SLOTS), "--step-ms", str(STEP_MS),
                      "--answer-tokens", str(TOKENS), "--front-ms", "0").wait_ready()
    out = tmp_path / "run"
    keep = [o for o in FAST if not o.startswith(("llm.", "actors.concurrency", "max_samples", "n=",
                                                   "max_response_length", "generation.report"))]
    try:
        proc = launch_external(out, [fake.url], *keep, "max_samples=4", "n=1", f"max_response_length={TOKENS}",
                               "llm.protocol=sglang")
    finally:
        fake.stop()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    closing = [line for line in proc.stdout.splitlines() if line.strip().startswith("tail:")]
    assert closing and "GPU-seconds idle while fewer than a full batch of answers remained" in closing[0]

    report = orjson.loads((out / "report.json").read_bytes())["tail"]
    # four of sixteen slots ran for the whole tail: twelve sixteenths of it idle
    assert report["seconds"] >= 1.5
    assert abs(report["idle_gpu_s"] / report["seconds"] - (SLOTS - 4) / SLOTS) < 0.05
    # nothing a scheduler could do: the longest answer bounds the run
    assert 0.9 <= report["makespan_over_ideal"] < 1.5
    assert "makespan ÷ ideal" in (out / "report.html").read_text()

    from pipegen.observe.run_status import gather, render
    from pipegen.run.layout import RunDir

    shown = render(gather(RunDir(out)))
    assert "tail" in shown and "GPU-seconds idle" in shown


def test_divided_answers_are_the_undivided_ones_bit_for_bit_on_the_cpu_server(tmp_path: Path, tiny_model: str):
    """generation.reproducible (the CPU server's default): answers asked 5 tokens a request, each continued from the
    prompt plus its tokens so far, are the answers asked whole, ids and log-probs alike (the tiny model: its
    answers run to the budget or stop early, both)."""
    from conftest import assert_same_trajectories, launch, load_trajectories
    from pipegen.observe.stats import actor_lines, latest_stats
    from pipegen.run.layout import RunDir

    whole, divided = tmp_path / "whole", tmp_path / "divided"
    for out, chunk in ((whole, 0), (divided, 5)):
        proc = launch(out, *FAST, f"model_path={tiny_model}", f"actors.chunk_tokens={chunk}")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    requests = {out: sum(a.requests for a in actor_lines(latest_stats(RunDir(out).stats)).values())
                for out in (whole, divided)}
    assert requests[divided] > requests[whole] == 12  # the answers were divided: more requests, one per chunk
    assert_same_trajectories(load_trajectories(whole / "trajectories.pkl"),
                             load_trajectories(divided / "trajectories.pkl"))


def test_admission_probes_every_prompt_once_then_starts_the_longest_expected_and_starves_none():
    import asyncio

    from pipegen.actor.units import FixedUnits

    units = FixedUnits([(p, s) for p in range(4) for s in range(3)], longest_first=True)

    async def take(k: int) -> list:
        return [await units.next(1) for _ in range(k)]

    async def story() -> None:
        assert await take(4) == [(0, 0), (1, 0), (2, 0), (3, 0)]  # one sample of each prompt first: its probe
        units.observe(0, 10, True)  # prompt 0's first sample ended short
        units.observe(1, 500, False)  # prompt 1's is still running, 500 tokens in
        units.observe(2, 300, True)
        rest = await take(8)
        assert rest[:2] == [(1, 1), (1, 2)]  # the prompt whose sample runs longest goes first
        assert rest[-2:] == [(0, 1), (0, 2)]  # the short prompt last, and not starved
        assert await units.next(1) is None

    asyncio.run(story())
