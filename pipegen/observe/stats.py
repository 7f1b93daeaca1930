"""The stats stream: periodic metric lines per role under DIR/streams/stats/<role>.jsonl.

Every line is one orjson object written with one `write()`: `time`, `role`, `pid`, `host`, `seq` and
the role's own counters (actors: units completed/failed/in flight, requests, output tokens, latency
percentiles, finish reasons, turns, response lengths, rewards, errors by kind; the writer: committed,
batches, duplicates dropped, torn lines skipped; the launcher: the aggregated view it tracks).
Counters are cumulative *per process* (a restarted process starts again from zero under a new pid),
so rates are computed between two lines of the same pid.

Owns: appending stats lines, reading them back (latest line, recent history), aggregating the
latest lines of all roles into one metrics dict, rates, and telling whether a line's process lives.
Must never: block a hot path (one small append every few seconds), be needed for correctness, or
write anything when reading.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson

from pipegen.run.layout import stats_file, stats_files
from pipegen.run.ownership import HOST, pid_alive

# Cumulative counters that get a `<name>_per_s` companion (the rate since this process's previous line).
RATE_COUNTERS = ("completed", "output_tokens", "requests", "committed", "lines")
RATE_WINDOW_S = 60.0  # "recent" rates are measured over about this much of the newest history
CPU_BOUND = 0.85  # an actor busier than this on its one core (cpu_busy) is what limits the run


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


class StatsAppender:
    """Appends one role's stats lines. Adds the identity (time, role, pid, host, seq, uptime_s) and,
    from the second line on, `<name>_per_s` since the previous line for the cumulative counters in
    RATE_COUNTERS; on the `final` line, `<name>_per_s` over the process's whole life instead
    (counter - baseline) / uptime_s."""

    def __init__(self, stats_dir: Path, role: str, baseline: dict[str, float] | None = None):
        Path(stats_dir).mkdir(parents=True, exist_ok=True)
        self.role = role
        self.path = stats_file(stats_dir, role)
        self.started = time.time()
        self.seq = 0
        self._previous: tuple[float, dict[str, float]] = (self.started, {})
        # the counters' values when this process started (0, or what a resumed writer found committed)
        self.baseline = {k: float(v) for k, v in (baseline or {}).items()}
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, metrics: dict[str, Any]) -> None:
        if self._fd is None:
            return
        now = time.time()
        head = {"time": now, "role": self.role, "pid": os.getpid(), "host": HOST, "seq": self.seq,
                "uptime_s": round(now - self.started, 3)}
        then, before = self._previous
        counters = {k: float(metrics[k]) for k in RATE_COUNTERS
                    if isinstance(metrics.get(k), (int, float)) and not isinstance(metrics.get(k), bool)}
        rates = {}
        if metrics.get("final") and now > self.started:
            # the closing line: rates over the whole life of the process (wall clock), not since the
            # previous line (units finish in bursts, so a last short interval says nothing)
            rates = {f"{k}_per_s": round((v - self.baseline.get(k, 0.0)) / (now - self.started), 3)
                     for k, v in counters.items()}
        elif before and now > then:  # not on the first line: a resumed writer starts from its checkpoint
            rates = {f"{k}_per_s": round((v - before.get(k, 0.0)) / (now - then), 3) for k, v in counters.items()}
        self._previous = (now, counters)
        line = orjson.dumps({**head, **metrics, **rates}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        os.write(self._fd, line)
        self.seq += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _complete_lines(data: bytes) -> list[dict[str, Any]]:
    out = []
    for raw in data.split(b"\n")[:-1]:  # only newline-terminated lines
        if not raw:
            continue
        try:
            rec = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _tail(path: Path, max_bytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        start = max(0, size - max_bytes)
        f.seek(start)
        data = f.read()
    if start:  # drop the partial first line
        data = data[data.find(b"\n") + 1 :]
    return data


def read_stats(path: Path, max_bytes: int = 32 << 20) -> list[dict[str, Any]]:
    """Every complete line of one role's stats file (the newest max_bytes of it), oldest first."""
    try:
        return _complete_lines(_tail(Path(path), max_bytes))
    except OSError:
        return []


def latest_stats(stats_dir: Path) -> dict[str, dict[str, Any]]:
    """The last complete line of every role's stats file (cheap: reads the last 16 KiB per role,
    more only when no complete line fits in that)."""
    out: dict[str, dict[str, Any]] = {}
    stats_dir = Path(stats_dir)
    if not stats_dir.is_dir():
        return out
    for path in stats_files(stats_dir):
        lines = read_stats(path, 16384) or read_stats(path, 1 << 20)
        if lines:
            out[path.stem] = lines[-1]
    return out


def stats_history(stats_dir: Path, max_bytes: int = 32 << 20) -> dict[str, list[dict[str, Any]]]:
    stats_dir = Path(stats_dir)
    if not stats_dir.is_dir():
        return {}
    return {p.stem: read_stats(p, max_bytes) for p in stats_files(stats_dir)}


def line_alive(line: dict[str, Any]) -> bool | None:
    return pid_alive(line.get("pid"), line.get("host"))


def _is_actor(role: str) -> bool:
    return role.startswith("actor_")


def _num(value: Any) -> float:
    try:
        return float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return 0.0


def aggregate(roles: dict[str, dict[str, Any]], live_only_in_flight: bool = True) -> dict[str, Any]:
    """One metrics dict from the latest line of every role (no rates: see `Rates`).

    Latency: p50 is the request-weighted mean of the actors' p50s, p95 the worst actor's p95 (each
    actor measures its own newest requests). Means (turns, response length, reward) are weighted by
    the units each actor completed. Counts are summed over the actors' current processes.
    """
    out: dict[str, Any] = {}
    actors = {r: line for r, line in roles.items() if _is_actor(r)}
    completed = sum(int(_num(a.get("completed"))) for a in actors.values())
    out["actors/completed"] = completed
    out["actors/failed"] = sum(int(_num(a.get("failed"))) for a in actors.values())
    out["actors/requests"] = sum(int(_num(a.get("requests"))) for a in actors.values())
    out["actors/output_tokens"] = sum(int(_num(a.get("output_tokens"))) for a in actors.values())
    in_flight = requests_in_flight = alive = 0
    for a in actors.values():
        live = line_alive(a)
        if live is not False:
            alive += 1
        if a.get("final") or (live_only_in_flight and live is False):
            continue
        in_flight += int(_num(a.get("in_flight")))
        requests_in_flight += int(_num(a.get("requests_in_flight")))
    out["actors/alive"] = alive
    out["actors/total"] = len(actors)
    out["actors/in_flight"] = in_flight
    out["actors/requests_in_flight"] = requests_in_flight
    weights = [(a, _num(a.get("requests"))) for a in actors.values() if a.get("latency_p50_s") is not None]
    if weights:
        total_w = sum(w for _, w in weights) or float(len(weights))
        out["latency/p50_s"] = sum(_num(a["latency_p50_s"]) * (w or 1.0) for a, w in weights) / total_w
        out["latency/p95_s"] = max(_num(a.get("latency_p95_s")) for a, _ in weights)
    for key, name in (("mean_turns", "turns/mean"), ("mean_response_length", "response_length/mean"),
                      ("mean_reward", "reward/mean")):
        vals = [(_num(a[key]), _num(a.get("completed")) or 1.0) for a in actors.values() if a.get(key) is not None]
        if vals:
            out[name] = sum(v * w for v, w in vals) / sum(w for _, w in vals)
    finish: dict[str, int] = {}
    errors: dict[str, int] = {}
    for a in actors.values():
        for k, v in (a.get("finish_reasons") or {}).items():
            finish[k] = finish.get(k, 0) + int(_num(v))
        for k, v in (a.get("errors") or {}).items():
            errors[k] = errors.get(k, 0) + int(_num(v))
    for k, v in finish.items():
        out[f"finish_reason/{k}"] = v
    for k, v in errors.items():
        out[f"errors/{k}"] = v
    out["errors/total"] = sum(errors.values())
    out["servers/out_of_rotation"] = len({u for a in actors.values() for u in a.get("servers_out_of_rotation") or []})
    # the stall watchdog and the tail's hedging (summed over the actors' current processes)
    for key in ("stalled", "aborts_sent", "hedges", "hedge_wins"):
        out[f"requests/{key}"] = sum(int(_num(a.get(key))) for a in actors.values())
    # the concurrency each server is driven at: units in flight the actors allow towards it (their
    # latest line: a finished run shows what it ran at)
    driven: dict[str, int] = {}
    for a in actors.values():
        for url, limit in (a.get("concurrency_by_server") or {}).items():
            driven[url] = driven.get(url, 0) + int(_num(limit))
    for url, limit in driven.items():
        out[f"concurrency/{url}"] = limit
    writer = roles.get("writer")
    if writer:
        for key in ("duplicates", "torn_lines", "unknown_units", "buffered", "lines"):
            if key in writer:
                out[f"writer/{key}"] = int(_num(writer.get(key)))
    return out


_SUMMED = ("completed", "failed", "requests", "output_tokens", "trajectories", "retries")
_MEANS = ("mean_turns", "mean_response_length", "mean_reward")


def across_processes(history: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One line per role that counts every process of it (a resumed run's earlier launches, restarts):
    an actor's counters, finish reasons and errors are summed over the last line of each of its
    processes, its means weighted by the units each completed; liveness and in-flight counts stay
    those of the newest process. Other roles keep their newest line (the writer counts from its
    checkpoint, across launches already)."""
    out: dict[str, dict[str, Any]] = {}
    for role, lines in history.items():
        if not lines:
            continue
        if not _is_actor(role):
            out[role] = lines[-1]
            continue
        last_of: dict[tuple[Any, Any], dict[str, Any]] = {}
        for line in lines:  # oldest first: each process's latest line wins
            last_of[(line.get("host"), line.get("pid"))] = line
        merged = dict(lines[-1])
        ends = list(last_of.values())
        for key in _SUMMED:
            if any(key in e for e in ends):
                merged[key] = sum(int(_num(e.get(key))) for e in ends)
        for key in ("finish_reasons", "errors"):
            total: dict[str, int] = {}
            for e in ends:
                for k, v in (e.get(key) or {}).items():
                    total[k] = total.get(k, 0) + int(_num(v))
            merged[key] = total
        for key in _MEANS:
            vals = [(_num(e[key]), _num(e.get("completed"))) for e in ends if e.get(key) is not None]
            weight = sum(w for _, w in vals)
            if vals:
                merged[key] = sum(v * w for v, w in vals) / weight if weight else vals[-1][0]
        out[role] = merged
    return out


class Rates:
    """Rates from successive observations of cumulative counters (restarts reset the baseline)."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._points: dict[str, list[tuple[float, float, Any]]] = {}

    def observe(self, name: str, t: float, value: float, identity: Any = None) -> float | None:
        """Record value at time t; return the rate over the last window_s (None until two points)."""
        points = self._points.setdefault(name, [])
        if points and points[-1][2] != identity:  # another process: its counters started again
            points.clear()
        if not points or t > points[-1][0]:
            points.append((t, value, identity))
        while len(points) > 2 and t - points[1][0] >= self.window_s:
            points.pop(0)
        if len(points) < 2:
            return None
        (t0, v0, _), (t1, v1, _) = points[0], points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else None


def history_rates(history: dict[str, list[dict[str, Any]]], window_s: float = RATE_WINDOW_S) -> dict[str, Any]:
    """Units/s and output tokens/s from the actors' stats history, recent (the last window_s of
    each actor's current process) and overall (from each process's first line to its last)."""
    recent_units = recent_tokens = 0.0
    overall_units = overall_tokens = 0.0
    seen = False
    for role, lines in history.items():
        if not _is_actor(role) or not lines:
            continue
        last = lines[-1]
        same = [ln for ln in lines if ln.get("pid") == last.get("pid") and ln.get("host") == last.get("host")]
        first = same[0]
        span = _num(last.get("time")) - _num(first.get("time"))
        if span <= 0:
            continue
        seen = True
        # the first line of a process counts from its start (uptime), so no early work is lost
        start_t = _num(first.get("time")) - _num(first.get("uptime_s"))
        whole = _num(last.get("time")) - start_t
        overall_units += _num(last.get("completed")) / whole if whole > 0 else 0.0
        overall_tokens += _num(last.get("output_tokens")) / whole if whole > 0 else 0.0
        cutoff = _num(last.get("time")) - window_s
        base = next((ln for ln in same if _num(ln.get("time")) >= cutoff), first)
        if base is last:
            base = same[-2]
        dt = _num(last.get("time")) - _num(base.get("time"))
        recent_units += (_num(last.get("completed")) - _num(base.get("completed"))) / dt
        recent_tokens += (_num(last.get("output_tokens")) - _num(base.get("output_tokens"))) / dt
    if not seen:
        return {}
    return {"recent_units_per_s": recent_units, "recent_output_tokens_per_s": recent_tokens,
            "overall_units_per_s": overall_units, "overall_output_tokens_per_s": overall_tokens}


def flatten_numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """Only the numeric entries (what metric backends accept)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def human_rate(value: float | None, unit: str) -> str:
    if value is None:
        return f"? {unit}/s"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.1f}{suffix} {unit}/s"
    return f"{value:.1f} {unit}/s" if value < 100 else f"{value:.0f} {unit}/s"
