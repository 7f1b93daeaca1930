"""Scenario `grouping`: what sending ready units as one grouped request buys, against a server whose front end
pays a fixed cost per HTTP request, without a GPU.

    python -m pipegen.bench --only grouping

The server is the fake SGLang (pipegen/bench/doubles/fake_sglang.py): SGLang's batched, streamed `/generate`,
a front end that spends FRONT_MS per HTTP request plus ITEM_MS per member, one request after another, and a
scheduler of MAX_RUNNING slots at STEP_MS per output token. FRONT_MS is the H100's: SGLang 0.5.12 with
SmolLM2-135M answered ~800 single requests/s with every request in flight and ~1,250/s in one offline call
(BENCHMARKS row 8), so its one front-end process costs ~1.25 ms per request. The scheduler's ceiling,
MAX_RUNNING / (ANSWER_TOKENS x STEP_MS) = 1,000 answers/s, sits between the two: one request per unit can
reach at most 1 / (FRONT_MS + ITEM_MS) = 787/s of it, a grouped client all of it.

Three arms, each on a fresh fake, the same prompts (the demo set's, `n` samples each, answers of ANSWER_TOKENS
with log-probs):
- the fake's own batch ceiling: every unit sent at once in batched requests of 256 (as SGLang's offline
  benchmark hands the engine its whole list), no pipegen;
- pipegen (the real launcher, `llm=external`, default settings: `actors.group_requests=true`, auto concurrency);
- pipegen with `actors.group_requests=false` (one request per unit, as before grouping).
Each rate is the fake's own count: answers ÷ (last answer - first request received), so start-up and the
merge are outside the window. The row is pipegen grouped ÷ the ceiling (target ≥ 0.9), with ungrouped beside it.

Owns: the three arms and the scenario's rows. Must never: leave a server or a launcher running when it returns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipegen.bench import common as c
from pipegen.launch.servers import ServerProcess

KEY = "grouping"
TITLE = "13. Grouped requests, fake SGLang with the H100's front-end cost per request (CPU)"
TARGET = "≥ 0.9"
FRONT_MS, ITEM_MS, STEP_MS, MAX_RUNNING, ANSWER_TOKENS = 1.25, 0.02, 10.0, 160, 16
PROMPT_TOKENS = 64
SETTINGS = {"quick": dict(prompts=96, n=16), "full": dict(prompts=96, n=48)}


def fake_sglang(folder: Path, name: str, vocab: int) -> ServerProcess:
    port_file = folder / f"{name}.port"
    argv = [sys.executable, "-m", "pipegen.bench.doubles.fake_sglang", "--port", "0", "--port-file", str(port_file),
            "--front-ms", str(FRONT_MS), "--item-ms", str(ITEM_MS), "--step-ms", str(STEP_MS),
            "--max-running", str(MAX_RUNNING), "--answer-tokens", str(ANSWER_TOKENS), "--vocab", str(vocab)]
    return ServerProcess(argv, folder / f"{name}.log", port_file=port_file, cwd=c.REPO).start().wait_ready(60)


def _rate(stats: dict[str, Any], expected: int) -> float:
    if stats["finished"] < expected:
        raise RuntimeError(f"the fake answered {stats['finished']} of {expected} units")
    return stats["finished"] / (stats["last_answer_t"] - stats["first_item_t"])


def ceiling(folder: Path, units: int, vocab: int) -> tuple[float, dict[str, Any]]:
    """The fake's own best: every unit at once, in batched requests of 256, nothing but HTTP in the way."""
    import random

    rng = random.Random(0)
    members = [{"ids": [rng.randrange(c.TOKEN_LO, c.TOKEN_HI) for _ in range(PROMPT_TOKENS)], "seed": i}
               for i in range(units)]
    bodies = []
    for start in range(0, units, 256):
        part = members[start:start + 256]
        bodies.append({"input_ids": [m["ids"] for m in part], "return_logprob": True,
                       "rid": [os.urandom(16).hex() for _ in part],
                       "sampling_params": [{"max_new_tokens": ANSWER_TOKENS, "temperature": 1.0,
                                            "sampling_seed": m["seed"]} for m in part]})
    server = fake_sglang(folder, "ceiling", vocab)
    try:
        c.post_all(server.url, bodies, concurrency=len(bodies))
        stats = c.get_json(f"{server.url}/fake_stats")
    finally:
        server.stop()
    return _rate(stats, units), stats


def pipegen_arm(folder: Path, name: str, prompts: int, n: int, vocab: int, *overrides: str) -> tuple[float, dict]:
    server = fake_sglang(folder, name, vocab)
    try:
        cmd = c.launcher_command(folder / name, server.url, "train_files=demo", f"max_samples={prompts}", f"n={n}",
                                 f"max_response_length={ANSWER_TOKENS}", "llm.protocol=sglang",
                                 "generation.show_progress=false", *overrides)
        result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=c.REPO)
        if result.returncode != 0:
            raise RuntimeError(f"launcher failed (rc {result.returncode}): {result.stderr[-2000:]}")
        stats = c.get_json(f"{server.url}/fake_stats")
    finally:
        server.stop()
    return _rate(stats, prompts * n), stats


def run(quick: bool) -> c.ScenarioResult:
    from pipegen.bench.doubles.tiny_models import MODEL_VOCAB_SIZE

    s = SETTINGS["quick" if quick else "full"]
    prompts, n = s["prompts"], s["n"]
    units = prompts * n
    res = c.ScenarioResult(KEY, TITLE)
    with c.scratch("grouping") as folder:
        top, top_stats = ceiling(folder, units, MODEL_VOCAB_SIZE)
        grouped, g = pipegen_arm(folder, "grouped", prompts, n, MODEL_VOCAB_SIZE)
        single, u = pipegen_arm(folder, "ungrouped", prompts, n, MODEL_VOCAB_SIZE, "actors.group_requests=false")
    model_top = min(1000.0 * MAX_RUNNING / (ANSWER_TOKENS * STEP_MS), 1000.0 / ITEM_MS)
    res.add(c.Row(
        what="pipegen grouped vs the fake's own batch ceiling", ratio=grouped / top,
        label="pipegen ÷ ceiling (answers/s)", target=TARGET,
        raw=(f"pipegen grouped {c.fmt_rate(grouped)} in {g['http_requests']} HTTP requests "
             f"({units / max(1, g['http_requests']):.1f} units each), ceiling {c.fmt_rate(top)} (the model's "
             f"{model_top:.0f}/s), ungrouped {c.fmt_rate(single)} in {u['http_requests']} requests; {units} units "
             f"({prompts} demo prompts × {n}) of {ANSWER_TOKENS} tokens; fake: {FRONT_MS} ms per request + "
             f"{ITEM_MS} ms per member (front end), {MAX_RUNNING} running × {STEP_MS:.0f} ms per token")))
    res.add(c.Row(what="pipegen ungrouped (actors.group_requests=false) vs the same ceiling",
                  ratio=single / top, label="pipegen ÷ ceiling (answers/s)",
                  raw=(f"bound by the front end's {FRONT_MS + ITEM_MS:.2f} ms per request: at most "
                       f"{1000.0 / (FRONT_MS + ITEM_MS):.0f}/s; max running seen {u['max_running_seen']} of "
                       f"{MAX_RUNNING} (grouped {g['max_running_seen']})")))
    return res


if __name__ == "__main__":
    result = run("--quick" in sys.argv)
    for row in result.rows:
        print(f"{row.what}: {row.ratio:.2f} | {row.raw}")
