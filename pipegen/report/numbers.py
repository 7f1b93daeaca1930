"""What a run's report says, as data: `report_numbers(run)` is the dictionary `report.json` holds and the page
shows, and `RowFacts` the per-row facts the plots draw.

Read from what the run already keeps, through its existing readers:
- the committed rows: each batch file the checkpoint lists, read by `observe/committed.py` (the row's prompt, sample, data source, reward from `rm_scores`, response length from the attention mask), so a
  run in progress reports what is committed so far, and a finished one exactly the rows of trajectories.pkl;
- progress, state and the failed units with their reasons: `pipegen.status`'s own `gather` (observe/run_status.py),
  so the report and `status` cannot disagree;
- throughput and units in flight over time: the actors' stats stream (`observe/stats.py`'s `stats_history`);
- the engine and its settings: the run's saved config and `conf/launch.json`.

Per data source: rows, prompts, the mean reward with its 95% interval (a bootstrap over prompts, each prompt's
samples kept together, seed fixed: pipegen/report/estimators.py), pass@k for k = 1..n, the share of responses
at the length limit, length percentiles, statistics of each extra key a dict reward returned (its columns,
`reward_extra_keys`), the best and the worst answer (decoded with the model's tokenizer), and which reward
scored the rows (run/provenance.py: `pipegen rescore`'s `reward_by`, else the reward at generation). A run whose
agent loop returned several trajectories (pieces) for a sample also gets `pieces`: the same reward and length
figures per piece kind, `snapshot` (every piece but a sample's last) and `final` (its last), with how many rows
each reward rule (`reward_rule`) scored. Floats are rounded to DIGITS places once, here, so the page and
report.json show the same numbers.

Owns: the report's numbers. Must never: write anything, import a role, or parse a run file itself (each file
has one reader, and this module calls it).
"""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from typing import Any

import numpy as np

from pipegen.report.estimators import (BOOTSTRAP_DRAWS, BOOTSTRAP_SEED, CONFIDENCE, clustered_bootstrap,
                                       pass_at_ks, percentiles, share_at_limit)
from pipegen.observe.committed import RowFacts, committed_rows
from pipegen.run.layout import RunDir
from pipegen.run.provenance import LOOP, generation_reward, loop_reward

DIGITS = 4
EXTRA_VALUES_SHOWN = 5  # most common values of a non-numeric reward extra key
ANSWER_CHARS = 1500  # of each best or worst answer shown
TIMELINE_POINTS = 60  # throughput is drawn over at most this many equal time bins
ALL_SOURCES = "(all)"


def rounded(value: Any) -> Any:
    """Floats rounded to DIGITS places, recursively (ints, strings and None unchanged)."""
    if isinstance(value, (float, np.floating)):
        return round(float(value), DIGITS)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    return value


def extra_statistics(rows: list[RowFacts]) -> dict[str, dict[str, Any]]:
    """Each extra key of a dict reward over the rows that have it: numbers (and booleans, as shares) by mean, min
    and max; any other value by its most common values."""
    values: dict[str, list[Any]] = defaultdict(list)
    for r in rows:
        for key, value in r.extras.items():
            if value is not None:
                values[key].append(value.item() if isinstance(value, np.generic) else value)
    out: dict[str, dict[str, Any]] = {}
    for key, vals in values.items():
        if all(isinstance(v, (int, float)) for v in vals):  # bool is an int: a share of True
            arr = np.asarray(vals, dtype=float)
            out[key] = {"rows": len(vals), "mean": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max())}
        else:
            counts: dict[str, int] = defaultdict(int)
            for v in vals:
                counts[str(v)[:80]] += 1
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:EXTRA_VALUES_SHOWN]
            out[key] = {"rows": len(vals), "distinct": len(counts), "most_common": dict(top)}
    return out


def best_and_worst(rows: list[RowFacts]) -> list[tuple[str, RowFacts]]:
    """The scored row with the highest reward and the one with the lowest (the first by index on a tie)."""
    scored = sorted((r for r in rows if r.reward is not None), key=lambda r: (r.index, r.sample, r.position))
    if not scored:
        return []
    best = max(scored, key=lambda r: r.reward)  # type: ignore[arg-type, return-value]
    worst = min(scored, key=lambda r: r.reward)  # type: ignore[arg-type, return-value]
    return [("best", best)] + ([("worst", worst)] if worst is not best else [])


def answer_texts(run: RunDir, cfg: Any, rows: list[RowFacts]) -> dict[tuple[int, int], str]:
    """(batch, position) -> the row's response as text (its valid tokens, special tokens left out), decoded with
    the model's tokenizer; empty when the tokenizer cannot be loaded (the report then shows the tokens' count)."""
    from pipegen.run.batchfile import BatchColumns, read_batch

    decode = _decoder(cfg)
    out: dict[tuple[int, int], str] = {}
    for number in sorted({r.batch for r in rows}):
        t = read_batch(run.batch_file(number)).tensors
        responses = t[BatchColumns.RESPONSES]
        for r in rows:
            if r.batch == number:
                ids = responses[r.position, : r.response_length].tolist()
                out[(r.batch, r.position)] = decode(ids) if decode else ""
    return out


def _decoder(cfg: Any):
    """The model's tokenizer's decode (skip_special_tokens, as verl decodes for scoring): the `tokenizers`
    file when the model folder has one (milliseconds to load), else transformers'; None when neither loads."""
    model = cfg.actor_rollout_ref.model
    path = str(model.get("tokenizer_path") or model.path)
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    except Exception:  # no tokenizer.json (a slow tokenizer, a hub id): transformers finds it
        pass
    try:
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(path, trust_remote_code=bool(model.get("trust_remote_code")))
        return lambda ids: slow.decode(ids, skip_special_tokens=True)
    except Exception:
        return None


def examples(run: RunDir, cfg: Any, by_source: dict[str, list[RowFacts]]) -> dict[str, list[dict[str, Any]]]:
    """Per data source, its best and its worst answer: which row, its reward, its length and its text."""
    picks = {name: best_and_worst(rows) for name, rows in by_source.items()}
    texts = answer_texts(run, cfg, [r for chosen in picks.values() for _, r in chosen])
    return {name: [{"which": which, "unit": f"{r.index}:{r.sample}", "reward": r.reward,
                    "response_length": r.response_length, "text": texts.get((r.batch, r.position), "")[:ANSWER_CHARS]}
                   for which, r in chosen] for name, chosen in picks.items()}


def scored_by(rows: list[RowFacts], at_generation: str, by_loop: str) -> dict[str, int]:
    """How many rows each reward scored: `reward_by` of a rescored row, else `by_loop` for a row its agent loop
    scored itself (an external harness's reward), else the run's reward at generation."""
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        if r.reward is not None:
            counts[r.reward_by or (by_loop if r.reward_rule == LOOP else at_generation)] += 1
    return dict(counts)


def source_numbers(rows: list[RowFacts], n: int, limit: int) -> dict[str, Any]:
    """One data source's (or the whole run's) statistics."""
    prompts = {r.index for r in rows}
    scored = [r for r in rows if r.reward is not None]
    interval = clustered_bootstrap([r.reward for r in scored], [r.index for r in scored])  # type: ignore[misc]
    # a unit is correct when any of its trajectories scores above 0 (the summary's pass@n counts the same)
    unit_best: dict[tuple[int, int], float] = {}
    for r in scored:
        key = (r.index, r.sample)
        unit_best[key] = max(unit_best.get(key, float("-inf")), r.reward)  # type: ignore[arg-type]
    correct: dict[int, list[bool]] = defaultdict(list)
    for (index, _), best in sorted(unit_best.items()):
        correct[index].append(best > 0)
    lengths = [r.response_length for r in rows]
    share = share_at_limit(lengths, limit)
    return {
        "rows": len(rows),
        "prompts": len(prompts),
        "scored_rows": len(scored),
        "mean_reward": interval.mean if interval else None,
        "reward_ci95": [interval.low, interval.high] if interval else None,
        "reward_ci_prompts": interval.clusters if interval else 0,
        "pass_at_k": {str(k): {"value": v, "prompts": p} for k, (v, p) in pass_at_ks(correct, n).items()},
        "prompts_with_a_pass": sum(1 for v in correct.values() if any(v)),
        "at_length_limit": sum(1 for x in lengths if x >= limit),
        "at_length_limit_share": share,
        "response_length_mean": float(np.mean(lengths)) if lengths else None,
        "response_length": percentiles(lengths),
        "reward_extras": extra_statistics(rows),
    }


def piece_numbers(rows: list[RowFacts], limit: int) -> dict[str, Any] | None:
    """Per piece kind (`snapshot`, `final`: a sample's last piece), for a run with a sample of several pieces:
    rows, samples, the mean reward with its prompt-clustered interval, lengths, and rows per reward rule."""
    last: dict[tuple[int, int], int] = {}
    for r in rows:
        last[(r.index, r.sample)] = max(last.get((r.index, r.sample), 0), r.trajectory)
    if not any(last.values()):
        return None
    out = {}
    for kind in ("snapshot", "final"):
        chosen = [r for r in rows if (r.trajectory == last[(r.index, r.sample)]) == (kind == "final")]
        scored = [r for r in chosen if r.reward is not None]
        interval = clustered_bootstrap([r.reward for r in scored], [r.index for r in scored])  # type: ignore[misc]
        lengths = [r.response_length for r in chosen]
        rules: dict[str, int] = defaultdict(int)
        for r in chosen:
            rules[r.reward_rule or "unscored"] += 1
        out[kind] = {"rows": len(chosen), "samples": len({(r.index, r.sample) for r in chosen}),
                     "scored_rows": len(scored), "mean_reward": interval.mean if interval else None,
                     "reward_ci95": [interval.low, interval.high] if interval else None,
                     "reward_rules": dict(sorted(rules.items())), "at_length_limit": sum(x >= limit for x in lengths),
                     "response_length_mean": float(np.mean(lengths)) if lengths else None,
                     "response_length": percentiles(lengths)}
    return out


def timeline(run: RunDir) -> list[dict[str, float]]:
    """Units/s, output tokens/s and units in flight over the run, from every actor process's stats lines:
    cumulative counters summed over processes (an ended process keeps its last count), in flight summed over the
    processes that have not written their final line; rates over up to TIMELINE_POINTS equal time bins."""
    from pipegen.observe.stats import stats_history
    from pipegen.run.stats_line import ActorStats

    lines = [ln for role_lines in stats_history(run.stats).values() for ln in role_lines
             if isinstance(ln, ActorStats) and ln.time is not None]
    # each process starts from zero at its start (its first line's time less its uptime)
    starts: dict[tuple[Any, Any, Any], ActorStats] = {}
    for ln in lines:
        key = (ln.role, ln.host, ln.pid)
        if key not in starts or float(ln.time or 0) < float(starts[key].time or 0):
            starts[key] = ln
    zero = [ActorStats(time=float(ln.time or 0) - float(ln.uptime_s or 0), role=ln.role, host=ln.host, pid=ln.pid)
            for ln in starts.values()]
    lines = sorted(zero + lines, key=lambda ln: float(ln.time or 0))
    if len(lines) < 2:
        return []
    latest: dict[tuple[Any, Any, Any], ActorStats] = {}
    points = []  # (t, completed, tokens, in_flight)
    for ln in lines:
        latest[(ln.role, ln.host, ln.pid)] = ln
        points.append((float(ln.time or 0), sum(x.completed for x in latest.values()),
                       sum(x.output_tokens for x in latest.values()),
                       sum(x.in_flight for x in latest.values() if not x.final)))
    t0, t1 = points[0][0], points[-1][0]
    if t1 <= t0:
        return []
    times = np.array([p[0] for p in points])
    bins = min(TIMELINE_POINTS, len(points))
    edges = np.linspace(t0, t1, bins + 1)
    at = np.searchsorted(times, edges, side="right") - 1  # the last point at or before each edge
    out = []
    for b in range(bins):
        lo, hi = points[at[b]], points[at[b + 1]]
        dt = edges[b + 1] - edges[b]
        out.append({"t_s": float(edges[b + 1] - t0), "units_per_s": (hi[1] - lo[1]) / dt,
                    "output_tokens_per_s": (hi[2] - lo[2]) / dt, "in_flight": float(hi[3])})
    return out


def throughput(line: list[dict[str, float]]) -> dict[str, Any]:
    """The timeline's totals: units and output tokens per second over the span the actors' stats cover
    (a resumed run's pause between launches included), and the most units in flight at once."""
    if not line:
        return {"units_per_s": None, "output_tokens_per_s": None, "span_s": None, "peak_in_flight": None}
    span = line[-1]["t_s"]
    width = span / len(line)
    return {"units_per_s": sum(p["units_per_s"] for p in line) * width / span,
            "output_tokens_per_s": sum(p["output_tokens_per_s"] for p in line) * width / span,
            "span_s": span, "peak_in_flight": max(p["in_flight"] for p in line)}


_NUMBERS = re.compile(r"\d+")


def failure_groups(failed_units: dict[str, Any]) -> list[dict[str, Any]]:
    """The failed units grouped by reason (numbers in a reason, ports and counts, do not split a group):
    how many, one reason as written, and the first units."""
    from pipegen.run.checkpoint import failure_reason

    groups: dict[str, dict[str, Any]] = {}
    for unit, info in failed_units.items():
        reason = failure_reason(info)
        group = groups.setdefault(_NUMBERS.sub("N", reason), {"reason": reason, "units": 0, "examples": []})
        group["units"] += 1
        if len(group["examples"]) < 5:
            group["examples"].append(unit)
    return sorted(groups.values(), key=lambda g: -g["units"])


def engine_settings(cfg: Any, run: RunDir) -> dict[str, Any]:
    """The engine, the model and the sampling settings the run used."""
    from omegaconf import OmegaConf

    from pipegen.config.schema import reproducibility

    rollout = cfg.actor_rollout_ref.rollout
    launch = run.read_launch()
    llm = OmegaConf.to_container(cfg.llm, resolve=True) if "llm" in cfg else {}
    return {
        "llm": cfg.llm.kind if "llm" in cfg else "?",
        "engine_settings": {k: v for k, v in (llm or {}).items() if k != "kind"},  # type: ignore[union-attr]
        "servers": list(launch.servers),
        "model_path": str(cfg.actor_rollout_ref.model.path),
        "sampling": {"temperature": rollout.get("temperature"), "top_p": rollout.get("top_p"),
                     "top_k": rollout.get("top_k"), "n": int(rollout.n),
                     "response_length": int(rollout.response_length), "prompt_length": int(rollout.prompt_length),
                     "seed": cfg.get("seed")},
        "agent_loop": str(rollout.get("agent", {}).get("default_agent_loop", "")),
        # what the server itself said outranks the config's promise (a vision model on the CPU server is not canonical)
        "reproducible": (f"not reproducible: {run.engine_facts()['pipegen_not_reproducible']}"
                         if run.engine_facts().get("pipegen_not_reproducible")
                         else reproducibility(cfg) if "llm" in cfg else "not known"),
    }


def report_numbers(run: RunDir) -> tuple[dict[str, Any], list[RowFacts], list[dict[str, float]]]:
    """(report.json's content, the committed rows, the timeline): everything the page and its plots show."""
    from pipegen.observe.run_status import gather
    from pipegen.run.config import load_run_config

    started = time.monotonic()
    cfg = load_run_config(run)
    st = gather(run, ignore_pid=os.getpid())  # the launcher writes the report as its last step: it has ended
    n = int(cfg.actor_rollout_ref.rollout.n)
    limit = int(cfg.actor_rollout_ref.rollout.response_length)
    found = committed_rows(run)
    by_source: dict[str, list[RowFacts]] = defaultdict(list)
    for row in found.rows:
        by_source[row.source].append(row)
    sources = {name: source_numbers(rows, n, limit) for name, rows in sorted(by_source.items())}
    if len(sources) > 1:
        sources[ALL_SOURCES] = source_numbers(found.rows, n, limit)
    line = timeline(run)
    from pipegen.run.fingerprint import load_fingerprint

    try:
        stored = load_fingerprint(run)
    except ValueError:  # a damaged fingerprint (status says so): its reward is not named
        stored = None
    numbers = {
        "run": str(run.root),
        "state": st.state,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "progress": {"units": st.progress["total"], "committed": st.progress["committed"],
                     "failed": st.progress["failed"], "pending": st.progress["pending"],
                     "complete": bool(st.progress["complete"]), "rows_read": len(found.rows),
                     "batches_read": found.batches},
        "n": n,
        "response_limit": limit,
        "statistics": {"interval": f"{int(CONFIDENCE * 100)}% percentile bootstrap of the mean reward",
                       "resampling_unit": "prompt (all samples of a prompt drawn together; repeats never pooled)",
                       "draws": BOOTSTRAP_DRAWS, "seed": BOOTSTRAP_SEED,
                       "pass_at_k": "unbiased 1 - C(n-c,k)/C(n,k) per prompt, averaged over prompts with >= k "
                                    "samples; correct = a reward above 0"},
        "sources": sources,
        "pieces": piece_numbers(found.rows, limit),
        "examples": examples(run, cfg, dict(sorted(by_source.items()))),
        "scored_by": scored_by(found.rows, generation_reward(stored), loop_reward(cfg)),
        "throughput": throughput(line),
        # the servers' idle slots once fewer answers than a full batch were left (observe/stats.py's tail_metrics)
        "tail": {k.split("/", 1)[1]: v for k, v in st.metrics.items() if k.startswith("tail/")},
        "failures": failure_groups(st.failed_units),
        "engine": engine_settings(cfg, run),
    }
    numbers["report_seconds"] = time.monotonic() - started  # reading and computing; the page adds its plots
    return rounded(numbers), found.rows, rounded(line)
