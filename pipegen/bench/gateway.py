"""Scenario `gateway`: the same prompts through the gateway (the official `openai` SDK, `stream: false`, one
session per prompt) against direct engine requests from pipegen (the actor's ServerPool, token ids in).

One fake-engine server (per-token latency, fixed slots, as the occupancy scenario's), one process: the pool,
the gateway and the SDK client share one event loop, as a callable harness shares the actor's. The direct side
sends the very ids the gateway renders for each prompt, so both sides ask the engine for the same work. Runs
alternate (direct, gateway, gateway, direct, ...); the ratio is samples/s through the gateway ÷ direct.

Owns: this scenario's request shapes and its row in the table.
"""

from __future__ import annotations

import asyncio
import time

from pipegen.bench import common as c

KEY = "gateway"
TITLE = "12. Gateway for outside agents (openai SDK through the gateway vs direct engine requests)"
TARGET = "≥ 0.9"


async def _measure(url: str, model: str, prompts: int, concurrency: int, reps: int) -> dict[str, list[float]]:
    import aiohttp
    try:
        from openai import AsyncOpenAI
    except ModuleNotFoundError:
        from pipegen.distribution import pip_install

        raise SystemExit(f"bench gateway: needs the openai SDK, which is not installed: {pip_install('examples')}") \
            from None
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.tool_parser import ToolParser
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from pipegen.actor.attempts import ClientLimits, ServerPool
    from pipegen.gateway.http_server import Gateway
    from pipegen.gateway.session import Renderer, Session

    tokenizer = AutoTokenizer.from_pretrained(model)
    renderer = Renderer(create_continuous_token_builder(tokenizer, hf_model_type="qwen2"),
                        ToolParser.get_tool_parser("hermes", tokenizer), tokenizer)
    questions = [[{"role": "user", "content": f"What is {i} + {i % 7}? Answer briefly."}] for i in range(prompts)]
    ids = [renderer.initial(q, None) for q in questions]
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    limits = ClientLimits(prompt_length=512, response_length=256, max_model_len=4096,
                          vocab_size=tokenizer.vocab_size + len(tokenizer.get_added_vocab()))
    gateway = Gateway()
    await gateway.start()
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        pool = ServerPool([url], limits, http, "sglang")

        async def direct(i: int) -> None:
            await pool.generate(f"d{i}", prompt_ids=ids[i], sampling_params=dict(sampling), sticky_key=i,
                                sampling_seed=i)

        client = AsyncOpenAI(base_url="http://unused/v1", api_key="unused", max_retries=0)

        async def through_gateway(i: int) -> None:
            async def generate(prompt_ids, params, seed):
                return await pool.generate(f"g{i}", prompt_ids=prompt_ids, sampling_params=params, sticky_key=i,
                                           sampling_seed=seed)

            session = gateway.open(lambda sid, key: Session(sid, key, renderer, generate, dict(sampling), i,
                                                            limits.prompt_length, limits.response_length))
            try:
                await client.with_options(base_url=gateway.base_url(session), api_key=session.key) \
                    .chat.completions.create(model="m", messages=questions[i])
            finally:
                gateway.finish(session)

        async def run_all(fn) -> float:
            queue = list(range(prompts))
            started = time.perf_counter()

            async def worker() -> None:
                while queue:
                    await fn(queue.pop())

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return (time.perf_counter() - started) / prompts  # seconds per sample

        await run_all(direct)  # warm-up (both sides: the SDK builds its types on first use)
        await run_all(through_gateway)
        for r in range(reps):
            for side in (("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")):
                times[side].append(await run_all(direct if side == "direct" else through_gateway))
        await client.close()
        pool.close()
    await gateway.close()
    return times


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    prompts, concurrency, reps = (96, 32, 2) if quick else (256, 32, 4)
    latency, slots = 0.005, 32
    with c.scratch("gateway") as tmp:
        args = c.fake_backend_args(slots=slots, eos_prob=0.01, token_latency=latency)
        with c.reference_server(tmp, args) as server:
            times = asyncio.run(_measure(server.url, c.tiny_model(), prompts, concurrency, reps))
    res.add(c.Row(
        what="chat completions, stream=false, one session per prompt",
        ratio=c.paired_ratio(times["gateway"], times["direct"]), label="gateway ÷ direct (samples/s)",
        target=TARGET,
        raw=(f"gateway {c.fmt_rate(1 / c.median(times['gateway']), ' samples/s')}, direct "
             f"{c.fmt_rate(1 / c.median(times['direct']), ' samples/s')}; {prompts} prompts, concurrency "
             f"{concurrency}, fake engine {slots} slots × {latency * 1000:g} ms/token (EOS chance 1%/token: ~100-token agent turns, 256 at most), "
             f"tiny Qwen-style model's template; {reps} reps alternated"),
    ))
    return res
