"""Scenario `cpu_server`: pipegen's CPU reference server (`python -m pipegen.cpu_server --engine hf`, as
the launcher starts it: one torch thread, max batch 16) - output tokens/s with 8 requests in flight vs 1.

Same prompts (random ordinary ids of fixed length), `ignore_eos` so every request generates exactly
`max_new_tokens`, `return_logprob` on as pipegen asks. One warm-up request, then concurrency 1 and 8
alternate (1, 8, 8, 1, ...) against the same server process. Tiny test model always; SmolLM2-135M in
full mode (quick mode: tiny only).

Owns: this scenario's request shapes and its rows in the table.
"""

from __future__ import annotations

import random
import time

from pipegen.bench import common as c

KEY = "cpu_server"
TITLE = "6. CPU reference server, concurrency 8 vs 1"
TARGET = "≥ 3"


def generate_all(url: str, prompts: list[list[int]], max_new: int, concurrency: int) -> tuple[float, int]:
    """Every prompt through /generate at `concurrency`, exactly `max_new` tokens each (ignore_eos), with
    logprobs as pipegen asks; (seconds, output tokens)."""
    bodies = [{"input_ids": ids, "return_logprob": True,
               "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True,
                                   "sampling_seed": i}} for i, ids in enumerate(prompts)]
    t0 = time.perf_counter()
    answers = c.post_all(url, bodies, concurrency)
    return time.perf_counter() - t0, sum(len(answer["output_ids"]) for _, answer in answers)


def measure(res: c.ScenarioResult, tmp, name: str, model: str, prompt_len: int, max_new: int, per_c1: int,
            per_c8: int, reps: int) -> None:
    rng = random.Random(0)
    args = ["--engine", "hf", "--model-path", model, "--threads", "1", "--max-batch", "16"]
    with c.reference_server(tmp / name, args, ready_timeout_s=600) as server:
        vocab = int(c.get_json(f"{server.url}/get_server_info")["vocab_size"])
        lo, hi = min(100, vocab // 4), min(vocab * 3 // 4, 20000)
        prompts = [[rng.randrange(lo, hi) for _ in range(prompt_len)] for _ in range(max(per_c1, per_c8))]
        generate_all(server.url, prompts[:2], max_new, 2)  # warm-up: first forwards allocate

        def run_c(concurrency: int, count: int):
            def go() -> float:
                dt, toks = generate_all(server.url, prompts[:count], max_new, concurrency)
                return dt / toks  # seconds per output token

            return go

        times = c.interleave({"c1": run_c(1, per_c1), "c8": run_c(8, per_c8)}, reps)
    res.add(c.Row(
        what=f"{name}: output tokens/s at concurrency 8 vs 1", ratio=c.paired_ratio(times["c8"], times["c1"]),
        label="tok/s at 8 ÷ tok/s at 1", target=TARGET,
        raw=(f"c8 {c.fmt_rate(1 / c.median(times['c8']), ' tok/s')}, "
             f"c1 {c.fmt_rate(1 / c.median(times['c1']), ' tok/s')}; "
             f"prompts {prompt_len} tokens, {max_new} new tokens each, {per_c8} vs {per_c1} requests per run, "
             f"1 torch thread; {reps} reps interleaved"),
    ))


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    with c.scratch("cpu") as tmp:
        # demo-shaped requests: the demo's chat prompts are ~64 tokens, its answers up to 96
        if quick:
            measure(res, tmp, "tiny model", c.tiny_model(), 64, 48, per_c1=3, per_c8=16, reps=2)
        else:
            from pipegen.inputs.models import resolve_model_path

            measure(res, tmp, "tiny model", c.tiny_model(), 64, 96, per_c1=4, per_c8=32, reps=4)
            measure(res, tmp, "SmolLM2-135M", resolve_model_path("smollm2-135m"), 64, 96, per_c1=2, per_c8=8,
                    reps=3)
    return res
