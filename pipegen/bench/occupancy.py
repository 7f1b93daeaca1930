"""Scenario `occupancy`: does pipegen keep a fixed-slot server busy?

Calls `pipegen.bench_occupancy.run_occupancy_bench` (issue 4's benchmark): the real launcher
(`llm=external`: actor, writer, merge) against the reference server's fake engine with per-token latency
and a fixed number of running slots; the server's own counters give busy slot-time, and polling them gives
the makespan from the first request's arrival to the last completion. Both figures are ratios within one
run: busy slot-time ÷ (slots × makespan), and makespan ÷ ideal (busy slot-time ÷ slots).
"""

from __future__ import annotations

from pipegen.bench.common import Row, ScenarioResult, check_target

KEY = "occupancy"
TITLE = "4. Slot occupancy, fake server with per-token latency and fixed slots"
TARGET_OCC = "≥ 0.97"
TARGET_MAKESPAN = "≤ 1.03"  # 1 / 0.97: the same loss seen from the clock

SETTINGS = {
    # slots, token latency, prompts, n, max_response_length
    "quick": dict(slots=32, token_latency=0.01, prompts=96, n=8, max_response_length=64),
    "full": dict(slots=32, token_latency=0.01, prompts=96, n=16, max_response_length=64),
}


def run(quick: bool) -> ScenarioResult:
    from pipegen.bench_occupancy import run_occupancy_bench

    res = ScenarioResult(KEY, TITLE)
    settings = SETTINGS["quick" if quick else "full"]
    report = run_occupancy_bench(**settings, echo=lambda *a, **k: None)
    occ = float(report["occupancy"])
    ratio = float(report["makespan_over_ideal"])
    setup = (f"{report['slots']} slots × {report['token_latency_s'] * 1000:g} ms/token, {report['units']} units, "
             f"{report['actors']} actor × concurrency {report['concurrency']}, {report['tokens_generated']:,} tokens, "
             f"max running {report['max_running']}")
    res.add(Row(what="busy slot-time ÷ total slot-time", ratio=occ, unit="", label="occupancy over the run",
                target=TARGET_OCC, met=check_target(occ, TARGET_OCC),
                raw=f"busy {report['busy_slot_seconds']:.1f} slot-s over {report['makespan_s']:.2f} s; {setup}"))
    res.add(Row(what="makespan ÷ ideal", ratio=ratio, label="first request → last completion ÷ (busy ÷ slots)",
                target=TARGET_MAKESPAN, met=check_target(ratio, TARGET_MAKESPAN),
                raw=(f"makespan {report['makespan_s']:.2f} s, ideal {report['ideal_makespan_s']:.2f} s; launcher wall "
                     f"{report['launcher_wall_s']:.0f} s incl. start-up and merge")))
    timeline = report.get("occupancy_per_second") or []
    if timeline:
        res.notes.append("occupancy, per second of the run: " + " ".join(f"{x:.2f}" for x in timeline)
                         + " (the loss is the drain at the end, when fewer units than slots remain).")
    return res
