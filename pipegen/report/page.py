"""The report as one self-contained HTML page: inline CSS, plots embedded as base64 PNG, no script and no
network fetch, so it opens from a cluster's disk, an e-mail or an artifact store.

Every number on the page is printed from the numbers report.json holds (pipegen/report/numbers.py, already
rounded), with `shown`, so the two cannot disagree.

Owns: the page's markup. Must never: compute a number, or reference anything outside the page.
"""

from __future__ import annotations

import html
from typing import Any

import orjson

CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; max-width: 1200px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; } td, th { border: 1px solid #ccc; padding: 3px 8px; }
th { background: #f0f0f0; text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.plots img { margin: 4px; border: 1px solid #ddd; } pre { background: #f7f7f7; padding: 8px; overflow-x: auto; }
.note { color: #555; font-size: 0.9em; }
"""


def shown(value: Any) -> str:
    """How the page prints a value of report.json: numbers exactly as JSON holds them, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return html.escape(str(value))


def _table(head: list[str], rows: list[list[Any]]) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = "".join(f'<td class="n">{shown(v)}</td>' if isinstance(v, (int, float)) and not isinstance(v, bool)
                        else f"<td>{shown(v)}</td>" for v in row)
        out.append(f"<tr>{cells}</tr>")
    return "".join(out) + "</table>"


def _interval(ci: list[float] | None) -> str:
    return "–" if ci is None else f"[{shown(ci[0])}, {shown(ci[1])}]"


def render(numbers: dict[str, Any], plots: dict[str, str]) -> str:
    """The page for report.json's numbers and the plots (name -> base64 PNG)."""
    p, n = numbers["progress"], numbers["n"]
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>pipegen report: "
             f"{html.escape(numbers['run'])}</title><style>{CSS}</style></head><body>",
             f"<h1>pipegen run report</h1><p>{html.escape(numbers['run'])}: <b>{shown(numbers['state'])}</b>, "
             f"written {shown(numbers['written_at'])}</p>",
             "<h2>Progress</h2>",
             _table(["units", "committed", "failed", "pending", "complete", "rows read", "batch files read"],
                    [[p["units"], p["committed"], p["failed"], p["pending"], p["complete"], p["rows_read"],
                      p["batches_read"]]])]
    parts.append("<h2>Per data source</h2>")
    ks = sorted({int(k) for s in numbers["sources"].values() for k in s["pass_at_k"]})
    head = ["data source", "rows", "prompts", "mean reward", "95% interval", "prompts resampled"] + \
           [f"pass@{k}" for k in ks] + ["at length limit", "share at limit", "mean length", "p10", "p50", "p90",
                                        "p99", "max"]
    rows = []
    for name, s in numbers["sources"].items():
        lengths = s["response_length"]
        rows.append([name, s["rows"], s["prompts"], s["mean_reward"], _interval(s["reward_ci95"]),
                     s["reward_ci_prompts"]]
                    + [s["pass_at_k"].get(str(k), {}).get("value") for k in ks]
                    + [s["at_length_limit"], s["at_length_limit_share"], s["response_length_mean"]]
                    + [lengths.get(q) for q in ("p10", "p50", "p90", "p99", "max")])
    parts.append(_table(head, rows))
    stats = numbers["statistics"]
    parts.append(f"<p class='note'>Interval: {shown(stats['interval'])}; resampling unit: "
                 f"{shown(stats['resampling_unit'])}; {shown(stats['draws'])} draws, seed {shown(stats['seed'])}. "
                 f"pass@k: {shown(stats['pass_at_k'])}. Lengths in response tokens; the limit is "
                 f"{shown(numbers['response_limit'])} tokens; n = {shown(n)}.</p>")
    extra_rows = [[name, key, x["rows"], x.get("mean"), x.get("min"), x.get("max"),
                   ", ".join(f"{v} ({c})" for v, c in x.get("most_common", {}).items()) or None]
                  for name, s in numbers["sources"].items() for key, x in s.get("reward_extras", {}).items()]
    if extra_rows:
        parts.append("<h2>The reward's extra keys</h2>")
        parts.append(_table(["data source", "key", "rows", "mean", "min", "max", "most common values"], extra_rows))
        parts.append("<p class='note'>What a dict reward returned beside its score; a boolean's mean is the share "
                     "of true.</p>")
    if numbers.get("examples"):
        parts.append("<h2>Best and worst answers</h2>")
        for name, picks in numbers["examples"].items():
            for pick in picks:
                parts.append(f"<p><b>{shown(name)}</b>, {shown(pick['which'])}: unit {shown(pick['unit'])}, reward "
                             f"{shown(pick['reward'])}, {shown(pick['response_length'])} tokens</p>"
                             f"<pre>{shown(pick['text']) if pick['text'] else '(the tokenizer could not be loaded)'}"
                             f"</pre>")
    if numbers.get("scored_by"):
        parts.append(_table(["scored by", "rows"], [[by, rows] for by, rows in numbers["scored_by"].items()]))
    pass_rows = [[name, int(k), v["value"], v["prompts"]] for name, s in numbers["sources"].items()
                 for k, v in s["pass_at_k"].items()]
    if pass_rows:
        parts.append(_table(["data source", "k", "pass@k", "prompts with >= k samples"], pass_rows))
    if numbers.get("pieces"):  # a loop returned several trajectories per sample: snapshots, then the final one
        parts.append("<h2>Per piece kind</h2>")
        parts.append(_table(["piece", "rows", "samples", "mean reward", "95% interval", "reward rules", "mean length"],
                            [[kind, s["rows"], s["samples"], s["mean_reward"], _interval(s["reward_ci95"]),
                              ", ".join(f"{r} {c}" for r, c in s["reward_rules"].items()), s["response_length_mean"]]
                             for kind, s in numbers["pieces"].items()]))
    if plots:
        parts.append("<h2>Plots</h2><div class='plots'>")
        for name, png in plots.items():
            parts.append(f"<img alt='{html.escape(name)}' src='data:image/png;base64,{png}'>")
        parts.append("</div>")
    t = numbers["throughput"]
    parts.append("<h2>Throughput</h2>")
    parts.append(_table(["units/s", "output tokens/s", "over (s)", "peak units in flight"],
                        [[t["units_per_s"], t["output_tokens_per_s"], t["span_s"], t["peak_in_flight"]]]))
    parts.append("<p class='note'>From the actors' stats stream (streams/stats/actor_*.jsonl): every actor "
                 "process, counted from its start.</p>")
    tail = numbers.get("tail") or {}
    if tail:
        parts.append(_table(["tail: idle GPU-seconds", "tail (s)", "makespan ÷ ideal"],
                            [[tail.get("idle_gpu_s"), tail.get("seconds"), tail.get("makespan_over_ideal")]]))
        parts.append("<p class='note'>The tail: once an actor had nothing left to admit, the seconds a server "
                     "reported fewer answers than its running limit, and the slots it left idle over them (from the "
                     "engine's own running counts; a server counted as one GPU). Makespan ÷ ideal: the actors' first "
                     "request to their last line, over that span less the idle time per server.</p>")
    parts.append("<h2>Failures</h2>")
    if numbers["failures"]:
        parts.append(_table(["units", "reason", "units (index:sample)"],
                            [[g["units"], g["reason"], ", ".join(g["examples"])] for g in numbers["failures"]]))
    else:
        parts.append("<p>No unit failed.</p>")
    parts.append("<h2>Engine and settings</h2>")
    parts.append(f"<p>{html.escape(str(numbers['engine'].get('reproducible', 'not known')))}</p>")
    parts.append(f"<pre>{html.escape(orjson.dumps(numbers['engine'], option=orjson.OPT_INDENT_2).decode())}</pre>")
    parts.append(f"<p class='note'>Numbers: report.json beside this page. Computed in "
                 f"{shown(numbers['report_seconds'])} s ({shown(numbers.get('report_cpu_seconds'))} s of CPU)."
                 f"</p></body></html>")
    return "\n".join(parts)

