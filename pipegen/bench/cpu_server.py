"""Scenario `cpu_server`: pipegen's CPU reference server (`--engine hf`, as the launcher starts it: one
torch thread, max batch 16) - output tokens/s with 8 requests in flight vs 1.

Same prompts (random ordinary ids of fixed length), `ignore_eos` so every request generates exactly
`max_new_tokens`, `return_logprob` on as pipegen asks. One warm-up request, then concurrency 1 and 8
alternate (1, 8, 8, 1, ...) against the same server process. Tiny test model always; SmolLM2-135M in
full mode (quick mode: tiny only).
"""

from __future__ import annotations

import asyncio
import time

import orjson

from pipegen.bench.common import (
    Row,
    ScenarioResult,
    check_target,
    fmt_rate,
    interleave,
    median,
    paired_ratio,
    reference_server,
    scratch,
)

KEY = "cpu_server"
TITLE = "6. CPU reference server, concurrency 8 vs 1"
TARGET = "≥ 3"


def generate_all(url: str, prompts: list[list[int]], max_new: int, concurrency: int) -> tuple[float, int]:
    import aiohttp

    tokens = 0

    async def main() -> None:
        nonlocal tokens
        queue = list(enumerate(prompts))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def worker() -> None:
                nonlocal tokens
                while queue:
                    i, ids = queue.pop()
                    body = {"input_ids": ids, "return_logprob": True,
                            "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True,
                                                "sampling_seed": i}}
                    async with session.post(f"{url}/generate", data=orjson.dumps(body),
                                            headers={"Content-Type": "application/json"}) as resp:
                        raw = await resp.read()
                        if resp.status != 200:
                            raise RuntimeError(f"HTTP {resp.status}: {raw[:200]!r}")
                    tokens += len(orjson.loads(raw)["output_ids"])

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    t0 = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - t0, tokens


def measure(res: ScenarioResult, tmp, name: str, model: str, prompt_len: int, max_new: int, per_c1: int,
            per_c8: int, reps: int) -> None:
    import random

    rng = random.Random(0)
    with reference_server(tmp / name, ["--engine", "hf", "--model-path", model, "--threads", "1",
                                       "--max-batch", "16"], ready_timeout_s=600) as server:
        vocab = int(server.get_json("/get_server_info")["vocab_size"])
        lo, hi = min(100, vocab // 4), min(vocab * 3 // 4, 20000)
        prompts = [[rng.randrange(lo, hi) for _ in range(prompt_len)] for _ in range(max(per_c1, per_c8))]
        generate_all(server.url, prompts[:2], max_new, 2)  # warm-up: first forwards allocate
        counts: dict[str, list[int]] = {"c1": [], "c8": []}

        def run_c(c: int, count: int):
            def go() -> float:
                dt, toks = generate_all(server.url, prompts[:count], max_new, c)
                counts[f"c{c}"].append(toks)
                return dt / toks  # seconds per output token

            return go

        times = interleave({"c1": run_c(1, per_c1), "c8": run_c(8, per_c8)}, reps)
    ratio = paired_ratio(times["c8"], times["c1"])
    res.add(Row(
        what=f"{name}: output tokens/s at concurrency 8 vs 1", ratio=ratio, label="tok/s at 8 ÷ tok/s at 1",
        target=TARGET, met=check_target(ratio, TARGET),
        raw=(f"c8 {fmt_rate(1 / median(times['c8']), ' tok/s')}, c1 {fmt_rate(1 / median(times['c1']), ' tok/s')}; "
             f"prompts {prompt_len} tokens, {max_new} new tokens each, {per_c8} vs {per_c1} requests per run, "
             f"1 torch thread; {reps} reps interleaved"),
    ))


def run(quick: bool) -> ScenarioResult:
    from pipegen.testing.tiny_models import tiny_model_path

    res = ScenarioResult(KEY, TITLE)
    with scratch("cpu") as tmp:
        # demo-shaped requests: the demo's chat prompts are ~64 tokens, its answers up to 96
        if quick:
            measure(res, tmp, "tiny model", tiny_model_path(), 64, 48, per_c1=3, per_c8=16, reps=2)
        else:
            from pipegen.models import resolve_model_path

            measure(res, tmp, "tiny model", tiny_model_path(), 64, 96, per_c1=4, per_c8=32, reps=4)
            measure(res, tmp, "SmolLM2-135M", resolve_model_path("smollm2-135m"), 64, 96, per_c1=2, per_c8=8,
                    reps=3)
    return res
