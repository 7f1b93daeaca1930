"""The report's plots: matplotlib figures (the Agg canvas, no display, no pyplot) as base64 PNG, for the page.

- rewards: a histogram of the rows' rewards per data source;
- lengths: the response lengths per data source, with the response limit marked;
- pass@k: pass@k against k per data source;
- throughput: units/s (and output tokens/s on the right axis) over the run, and units in flight.

Owns: drawing. Must never: compute a statistic the report's numbers do not hold (it draws rows and numbers it
is given), or touch a display or the network.
"""

from __future__ import annotations

import base64
import io
from collections import defaultdict
from typing import Any

from pipegen.observe.committed import RowFacts
from pipegen.report.numbers import ALL_SOURCES

SIZE = (5.6, 3.0)
DPI = 90


def _figure() -> tuple[Any, Any]:
    """A figure on the Agg canvas and its axes, without pyplot (no global state, no display; a third of the
    import time)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.12, right=0.86, bottom=0.17, top=0.9)
    return fig, fig.add_subplot()


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return base64.b64encode(buf.getvalue()).decode()


def draw(numbers: dict[str, Any], rows: list[RowFacts], line: list[dict[str, float]]) -> dict[str, str]:
    """name -> base64 PNG, for the plots there is data for."""
    by_source: dict[str, list[RowFacts]] = defaultdict(list)
    for r in rows:
        by_source[r.source].append(r)
    out: dict[str, str] = {}
    rewards = {s: [r.reward for r in rs if r.reward is not None] for s, rs in sorted(by_source.items())}
    if any(rewards.values()):
        fig, ax = _figure()
        ax.hist([v for v in rewards.values()], bins=20, label=list(rewards), stacked=True)
        ax.set_xlabel("reward")
        ax.set_ylabel("rows")
        ax.set_title("reward per row")
        ax.legend(fontsize=7)
        out["rewards"] = _png(fig)
    if rows:
        fig, ax = _figure()
        ax.hist([[r.response_length for r in rs] for rs in by_source.values()], bins=30, label=list(by_source),
                stacked=True)
        limit = numbers["response_limit"]
        ax.axvline(limit, color="red", linestyle="--", label=f"limit {limit}")
        ax.set_xlabel("response tokens")
        ax.set_ylabel("rows")
        ax.set_title("response length")
        ax.legend(fontsize=7)
        out["lengths"] = _png(fig)
    curves = {s: v["pass_at_k"] for s, v in numbers["sources"].items() if v["pass_at_k"] and s != ALL_SOURCES}
    if curves:
        fig, ax = _figure()
        for source, ks in curves.items():
            ax.plot([int(k) for k in ks], [p["value"] for p in ks.values()], marker="o", label=source)
        ax.set_xticks(sorted({int(k) for ks in curves.values() for k in ks}))
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.set_ylim(0, 1.02)
        ax.set_title("pass@k (unbiased estimator)")
        ax.legend(fontsize=7)
        out["pass_at_k"] = _png(fig)
    if line:
        fig, ax = _figure()
        t = [p["t_s"] for p in line]
        ax.plot(t, [p["units_per_s"] for p in line], color="tab:blue", label="units/s")
        ax.plot(t, [p["in_flight"] for p in line], color="tab:orange", label="units in flight")
        ax.set_xlabel("seconds since the first actor started")
        ax.set_title("throughput and units in flight")
        right = ax.twinx()
        right.plot(t, [p["output_tokens_per_s"] for p in line], color="tab:green", alpha=0.6,
                   label="output tokens/s")
        right.set_ylabel("output tokens/s")
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles=handles, fontsize=7, loc="upper right")
        out["throughput"] = _png(fig)
    return out
