"""Scenario `reproducible`: what generation.reproducible costs, measured side by side on the default demo.

    python -m pipegen.bench --only reproducible

The README's first command (`python -m pipegen.launch output_dir=DIR`: the CPU server, SmolLM2, the demo prompts)
with generation.reproducible=true (the default: cpu_server/canonical.py) and =false (batched kernels), alternated
(quick: one pair; full: two pairs, the medians compared), each time read from the closing line's "this launch: ...
in T s" (generation, the launch's start-up left out). Rows:
- the reproducible run's generation time ÷ the batched run's (target ≤ 1.5);
- the reproducible runs' units identical to each other, ids and log-probs bit for bit (target: all).
- the same demo on vLLM on CPU (llm=vllm; its reproducible setting is float32 and one request at a time,
  launch/servers.py), one pair, where PIPEGEN_VLLM_PYTHON names vLLM's environment (`./launch.sh --setup-vllm`
  prints it); without it the row says so.
Owns: the scenario's rows. Must never: assert a timing or raise on a missed target.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys

from pipegen.bench import common as c

KEY = "reproducible"
TITLE = "generation.reproducible on the CPU server (the demo): generation time true ÷ false, and runs identical"
TIMEOUT_S = 1800
LAUNCH_TIME = re.compile(r"this launch: .*? in ([0-9.]+)s")


def _demo(out, reproducible: bool, *extra: str) -> float:
    result = subprocess.run([sys.executable, "-m", "pipegen.launch", f"output_dir={out}",
                             f"generation.reproducible={str(reproducible).lower()}", "generation.show_progress=false",
                             *extra],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=c.REPO, timeout=TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"the demo failed (rc {result.returncode}): {result.stderr[-2000:]}")
    found = LAUNCH_TIME.search(result.stderr + result.stdout)
    if found is None:
        raise RuntimeError("the demo's closing line has no 'this launch: ... in T s'")
    return float(found.group(1))


def run(quick: bool) -> c.ScenarioResult:
    from verl import DataProto

    from pipegen.replay import compare, units_of

    res = c.ScenarioResult(KEY, TITLE)
    pairs = 1 if quick else 2
    times: dict[bool, list[float]] = {True: [], False: []}
    with c.scratch("reproducible") as folder:
        for p in range(pairs):
            for mode in ((True, False) if p % 2 == 0 else (False, True)):
                times[mode].append(_demo(folder / f"{mode}-{p}", mode))
        same = None
        if pairs > 1:
            a = DataProto.load_from_disk(str(folder / "True-0" / "trajectories.pkl"))
            b = DataProto.load_from_disk(str(folder / "True-1" / "trajectories.pkl"))
            same = compare(a, b, sorted(units_of(a)))
        vllm = {mode: _demo(folder / f"vllm-{mode}", mode, "llm=vllm") for mode in (True, False)} \
            if os.environ.get("PIPEGEN_VLLM_PYTHON") else None
    on, off = statistics.median(times[True]), statistics.median(times[False])
    res.add(c.Row("demo generation time, reproducible ÷ batched", on / off, "true ÷ false (s, medians)", "≤ 1.5",
                  raw=f"true {', '.join(f'{t:.1f}' for t in times[True])} s; "
                      f"false {', '.join(f'{t:.1f}' for t in times[False])} s"))
    if vllm is not None:
        res.add(c.Row("the demo on vLLM on CPU, reproducible ÷ not", vllm[True] / vllm[False],
                      "true ÷ false (s)", "", raw=f"true {vllm[True]:.1f} s; false {vllm[False]:.1f} s"))
    else:
        res.add(c.Row("the demo on vLLM on CPU, reproducible ÷ not", None, "true ÷ false (s)", "",
                      raw="not run: PIPEGEN_VLLM_PYTHON is not set (./launch.sh --setup-vllm prints it)"))
    if same is not None:
        res.add(c.Row("reproducible runs' units identical", same.same / max(1, same.units), "identical ÷ units",
                      "≥ 1", raw=same.line()))
    return res
