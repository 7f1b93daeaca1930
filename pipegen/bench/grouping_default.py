"""Scenario `grouping_default`: does a user's job at the default budget get grouped requests and kept tokens
together? Both were built for it (issue 43): grouping cuts the engine front end's cost per HTTP request, kept
tokens bound what a crash loses, and an answer whose budget passes `actors.progress_chunk_tokens` used to go
alone.

    python -m pipegen.bench --only grouping_default [--quick]

The real launcher (`llm=external`, shipped defaults, `actors.progress_chunk_tokens` left at its default) runs a
user's job at the default 4,096-token budget (JOB_DEFAULTS' `max_response_length`) on the demo prompts against the
GPU-like fake SGLang of bench/longtail.py (long-tailed lengths, batched steps, SGLang's front-end cost per
request, incremental chunks). Figures, from the fake's own counters:
- /generate HTTP requests ÷ units (target ≤ 0.5: on average at least two units a request);
- the intermediate chunks the fake streamed ÷ units: tokens kept as they stream (met when above 0).

Owns: the scenario's settings and rows. Must never: assert a timing or raise on a missed target, or leave a
server or launcher running when it returns.
"""

from __future__ import annotations


from pipegen.bench import common as c
from pipegen.bench.longtail import FULL_ENGINE, QUICK_ENGINE, Case, run_case

KEY = "grouping_default"
TITLE = "A user's job at the default 4,096-token budget, fake SGLang: grouped requests and tokens kept as they stream"
TARGET_CALLS = "≤ 0.5"


def run(quick: bool) -> c.ScenarioResult:
    from pipegen.config.schema import JOB_DEFAULTS, Actors

    budget = int(JOB_DEFAULTS["max_response_length"])
    case = (Case("default job", 96, 2, budget, 1, QUICK_ENGINE) if quick else
            Case("default job", 96, 16, budget, 1, FULL_ENGINE))
    res = c.ScenarioResult(KEY, TITLE)
    with c.scratch("grouping-default") as folder:
        f = run_case(folder, case)
    setup = (f"{f.units} units ({case.prompts} demo prompts × {case.n}), budget {budget:,}, "
             f"actors.progress_chunk_tokens={Actors.progress_chunk_tokens} (default); fake: "
             f"{case.engine.describe()}")
    res.add(c.Row("/generate HTTP requests per unit", f.generate_calls / max(1, f.units),
                  "/generate requests ÷ units", TARGET_CALLS,
                  raw=f"{f.generate_calls:,} requests for {f.units} units; {setup}"))
    res.add(c.Row("tokens kept as they stream: intermediate chunks per unit", f.chunks / max(1, f.units),
                  "fake's intermediate chunks ÷ units", "> 0", met=f.chunks > 0,
                  raw=(f"{f.chunks:,} chunks; {f.kept:,} tokens kept, {f.generated:,} generated; "
                       f"makespan ÷ ideal {f.makespan_ratio:.2f}")))
    return res
