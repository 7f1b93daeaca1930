"""The stats stream: periodic metric lines per role under DIR/streams/stats/<role>.jsonl.

Every line is one orjson object written with one `write()`: `time`, `role`, `pid`, `host`, `seq` and
the role's own counters, one typed record per role (pipegen/run/stats_line.py: the actors' ActorStats,
the writer's WriterStats, the cluster's ClusterStats, the launcher's LaunchStats); reading parses
each line back into its role's record.
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from pipegen.run.layout import stats_file, stats_files
from pipegen.run.ownership import HOST, pid_alive
from pipegen.run.stats_line import RATE_SUFFIX, ActorStats, StatsHead, StatsLine, WriterStats, parse_stats_line

RATE_WINDOW_S = 60.0  # "recent" rates are measured over about this much of the newest history
CPU_BOUND = 0.85  # an actor busier than this on its one core (cpu_busy) is what limits the run


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


class StatsAppender:
    """Appends one role's stats lines. Adds the identity (time, role, pid, host, seq, uptime_s) and,
    from the second line on, `<name>_per_s` since the previous line for the line's rated counters
    (StatsLine.rated_counters); on the `final` line, `<name>_per_s` over the process's whole life
    instead (counter - baseline) / uptime_s."""

    def __init__(self, stats_dir: Path, role: str, baseline: StatsLine | None = None):
        Path(stats_dir).mkdir(parents=True, exist_ok=True)
        self.role = role
        self.path = stats_file(stats_dir, role)
        self.started = time.time()
        self.seq = 0
        self._previous: tuple[float, dict[str, float]] = (self.started, {})
        # the counters' values when this process started (0, or what a resumed writer found committed)
        self.baseline = baseline.rated_counters() if baseline is not None else {}
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, line: StatsLine) -> None:
        if self._fd is None:
            return
        metrics = line.body()
        now = time.time()
        head = StatsHead(time=now, role=self.role, pid=os.getpid(), host=HOST, seq=self.seq,
                         uptime_s=round(now - self.started, 3)).as_dict()
        then, before = self._previous
        counters = line.rated_counters()
        rates = {}
        if line.final and now > self.started:
            # the closing line: rates over the whole life of the process (wall clock), not since the
            # previous line (units finish in bursts, so a last short interval says nothing)
            rates = {k + RATE_SUFFIX: round((v - self.baseline.get(k, 0.0)) / (now - self.started), 3)
                     for k, v in counters.items()}
        elif before and now > then:  # not on the first line: a resumed writer starts from its checkpoint
            rates = {k + RATE_SUFFIX: round((v - before.get(k, 0.0)) / (now - then), 3) for k, v in counters.items()}
        self._previous = (now, counters)
        os.write(self._fd, orjson.dumps({**head, **metrics, **rates}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
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
    """Every complete line of one role's stats file (the newest max_bytes of it), oldest first, as
    written (what `tail -f` shows; `read_role_stats` gives the role's typed records)."""
    try:
        return _complete_lines(_tail(Path(path), max_bytes))
    except OSError:
        return []


def read_role_stats(path: Path, max_bytes: int = 32 << 20) -> list[StatsLine]:
    """read_stats, each line parsed into its role's record (the role is the file's name)."""
    role = Path(path).stem
    return [parse_stats_line(role, raw) for raw in read_stats(path, max_bytes)]


def latest_stats(stats_dir: Path) -> dict[str, StatsLine]:
    """The last complete line of every role's stats file (cheap: reads the last 16 KiB per role,
    more only when no complete line fits in that)."""
    out: dict[str, StatsLine] = {}
    stats_dir = Path(stats_dir)
    if not stats_dir.is_dir():
        return out
    for path in stats_files(stats_dir):
        lines = read_stats(path, 16384) or read_stats(path, 1 << 20)
        if lines:
            out[path.stem] = parse_stats_line(path.stem, lines[-1])
    return out


def stats_history(stats_dir: Path, max_bytes: int = 32 << 20) -> dict[str, list[StatsLine]]:
    stats_dir = Path(stats_dir)
    if not stats_dir.is_dir():
        return {}
    return {p.stem: read_role_stats(p, max_bytes) for p in stats_files(stats_dir)}


def line_alive(line: StatsLine) -> bool | None:
    return pid_alive(line.pid, line.host)


def actor_lines(roles: dict[str, StatsLine]) -> dict[str, ActorStats]:
    return {role: line for role, line in roles.items() if isinstance(line, ActorStats)}


def _num(value: Any) -> float:
    try:
        return float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return 0.0


def _weighted_mean(pairs: list[tuple[float | None, float]]) -> float | None:
    """The mean of the values that are set, each weighted (a zero total weight: the last value)."""
    vals = [(v, w) for v, w in pairs if v is not None]
    if not vals:
        return None
    weight = sum(w for _, w in vals)
    return sum(v * w for v, w in vals) / weight if weight else vals[-1][0]


def _summed(dicts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in (d or {}).items():
            total[k] = total.get(k, 0) + int(_num(v))
    return total


def aggregate(roles: dict[str, StatsLine], live_only_in_flight: bool = True) -> dict[str, Any]:
    """One metrics dict from the latest line of every role (no rates: see `Rates`).

    Latency: p50 is the request-weighted mean of the actors' p50s, p95 the worst actor's p95 (each
    actor measures its own newest requests). Means (turns, response length, reward) are weighted by
    the units each actor completed. Counts are summed over the actors' current processes.
    """
    out: dict[str, Any] = {}
    actors = list(actor_lines(roles).values())
    out["actors/completed"] = sum(a.completed for a in actors)
    out["actors/failed"] = sum(a.failed for a in actors)
    out["actors/requests"] = sum(a.requests for a in actors)
    out["actors/output_tokens"] = sum(a.output_tokens for a in actors)
    launch = roles.get("launch")  # the launcher's tracking: GPU utilisation while generating, where it sampled one
    gpu = getattr(launch, "metrics", {}).get("gpu/busy_percent_while_generating")
    if gpu is not None:
        out["gpu/busy_percent_while_generating"] = gpu
    in_flight = requests_in_flight = alive = 0
    for a in actors:
        live = line_alive(a)
        if live is not False:
            alive += 1
        if a.final or (live_only_in_flight and live is False):
            continue
        in_flight += a.in_flight
        requests_in_flight += a.requests_in_flight
    out["actors/alive"] = alive
    out["actors/total"] = len(actors)
    out["actors/in_flight"] = in_flight
    out["actors/requests_in_flight"] = requests_in_flight
    timed = [a for a in actors if a.latency_p50_s is not None]
    if timed:
        out["latency/p50_s"] = _weighted_mean([(a.latency_p50_s, float(a.requests or 1)) for a in timed])
        out["latency/p95_s"] = max(_num(a.latency_p95_s) for a in timed)
    for name, mean in (("turns/mean", lambda a: a.mean_turns), ("response_length/mean", lambda a: a.mean_response_length),
                       ("reward/mean", lambda a: a.mean_reward)):
        value = _weighted_mean([(mean(a), float(a.completed or 1)) for a in actors])
        if value is not None:
            out[name] = value
    for k, v in _summed([a.finish_reasons for a in actors]).items():
        out[f"finish_reason/{k}"] = v
    errors = _summed([a.errors for a in actors])
    for k, v in errors.items():
        out[f"errors/{k}"] = v
    out["errors/total"] = sum(errors.values())
    out["servers/out_of_rotation"] = len({u for a in actors for u in a.servers_out_of_rotation or []})
    # the stall watchdog and the tail's hedging (summed over the actors' current processes)
    out["requests/stalled"] = sum(a.stalled for a in actors)
    out["requests/aborts_sent"] = sum(a.aborts_sent for a in actors)
    out["requests/hedges"] = sum(a.hedges for a in actors)
    out["requests/hedge_wins"] = sum(a.hedge_wins for a in actors)
    out["requests/hedge_tokens"] = sum(a.hedge_tokens for a in actors)
    out["requests/http"] = sum(a.http_requests for a in actors)
    # the concurrency each server is driven at: units in flight the actors allow towards it (their
    # latest line: a finished run shows what it ran at)
    for url, limit in _summed([a.concurrency_by_server for a in actors]).items():
        out[f"concurrency/{url}"] = limit
    out.update(tail_metrics(actors))
    writer = roles.get(WriterStats.ROLE)
    if isinstance(writer, WriterStats):
        for name, value in (("duplicates", writer.duplicates), ("torn_lines", writer.torn_lines),
                            ("unknown_units", writer.unknown_units), ("buffered", writer.buffered),
                            ("lines", writer.lines)):
            if value is not None:
                out[f"writer/{name}"] = int(value)
    return out


def tail_metrics(actors: list[ActorStats]) -> dict[str, float]:
    """The tail (actor/concurrency.py's TailMeter) over a run's actors: `tail/idle_gpu_s` the GPU-seconds left idle
    while fewer answers than a full batch remained, summed over servers (the actors of a node watch the same
    servers: per server the actor that watched longest counts); `tail/seconds` the longest tail of a server;
    `tail/span_s` the actors' first request to their last line; `tail/makespan_over_ideal` that span over the ideal:
    the span less the idle time per server (what a full batch to the end would have taken), or the longest request
    (sent to answered: its queue wait included, so the ratio errs low), whichever is longer. {} where no server
    reported its running limit, or no tail was seen."""
    by_url: dict[str, dict[str, float]] = {}
    for a in actors:
        for url, t in (a.tail or {}).items():
            if float(t.get("idle_s") or 0.0) >= by_url.get(url, {}).get("idle_s", -1.0):
                by_url[url] = {k: float(v or 0.0) for k, v in t.items()}
    if not by_url:
        return {}
    idle = sum(t["idle_s"] for t in by_url.values())
    out = {"tail/idle_gpu_s": round(idle, 2), "tail/seconds": round(max(t["seconds"] for t in by_url.values()), 2)}
    starts = [a.startup.first_request for a in actors if a.startup.first_request]
    ends = [float(a.time) for a in actors if a.time]
    servers = len(set(by_url) | {u for a in actors for u in (a.concurrency_by_server or {})})
    if starts and ends and max(ends) > min(starts):
        span = max(ends) - min(starts)
        out["tail/span_s"] = round(span, 2)
        ideal = max(span - idle / max(1, servers), max(a.longest_request_s or 0.0 for a in actors))
        out["tail/makespan_over_ideal"] = round(span / max(1e-9, ideal), 3)
    return out


def tail_text(m: dict[str, Any]) -> str | None:
    """The tail in words, from `aggregate`'s metrics (None where it was not measured)."""
    if "tail/idle_gpu_s" not in m:
        return None
    text = (f"{m['tail/idle_gpu_s']:.1f} GPU-seconds idle while fewer than a full batch of answers remained "
            f"(over {m['tail/seconds']:.1f} s; a server counted as one GPU)")
    if "tail/makespan_over_ideal" in m:
        text += f"; makespan ÷ ideal {m['tail/makespan_over_ideal']:.2f}"
    return text


def across_processes(history: dict[str, list[StatsLine]]) -> dict[str, StatsLine]:
    """One line per role that counts every process of it (a resumed run's earlier launches, restarts):
    an actor's counters, finish reasons and errors are summed over the last line of each of its
    processes, its means weighted by the units each completed; liveness and in-flight counts stay
    those of the newest process. Other roles keep their newest line (the writer counts from its
    checkpoint, across launches already)."""
    out: dict[str, StatsLine] = {}
    for role, lines in history.items():
        if not lines:
            continue
        newest = lines[-1]
        if not isinstance(newest, ActorStats):
            out[role] = newest
            continue
        last_of: dict[tuple[Any, Any], ActorStats] = {}
        for line in lines:  # oldest first: each process's latest line wins
            last_of[(line.host, line.pid)] = line  # type: ignore[assignment]  (one role, one type)
        ends = list(last_of.values())
        out[role] = replace(
            newest,
            completed=sum(e.completed for e in ends), failed=sum(e.failed for e in ends),
            requests=sum(e.requests for e in ends), output_tokens=sum(e.output_tokens for e in ends),
            finish_reasons=_summed([e.finish_reasons for e in ends]), errors=_summed([e.errors for e in ends]),
            mean_turns=_weighted_mean([(e.mean_turns, float(e.completed)) for e in ends]),
            mean_response_length=_weighted_mean([(e.mean_response_length, float(e.completed)) for e in ends]),
            mean_reward=_weighted_mean([(e.mean_reward, float(e.completed)) for e in ends]),
        )
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


def history_rates(history: dict[str, list[StatsLine]], window_s: float = RATE_WINDOW_S) -> dict[str, Any]:
    """Units/s and output tokens/s from the actors' stats history, recent (the last window_s of
    each actor's current process) and overall (from each process's first line to its last)."""
    recent_units = recent_tokens = 0.0
    overall_units = overall_tokens = 0.0
    seen = False
    for lines in history.values():
        if not lines or not isinstance(lines[-1], ActorStats):
            continue
        last = lines[-1]
        same = [ln for ln in lines if ln.pid == last.pid and ln.host == last.host and isinstance(ln, ActorStats)]
        first = same[0]
        span = _num(last.time) - _num(first.time)
        if span <= 0:
            continue
        seen = True
        # the first line of a process counts from its start (uptime), so no early work is lost
        start_t = _num(first.time) - _num(first.uptime_s)
        whole = _num(last.time) - start_t
        overall_units += last.completed / whole if whole > 0 else 0.0
        overall_tokens += last.output_tokens / whole if whole > 0 else 0.0
        cutoff = _num(last.time) - window_s
        base = next((ln for ln in same if _num(ln.time) >= cutoff), first)
        if base is last:
            base = same[-2]
        dt = _num(last.time) - _num(base.time)
        recent_units += (last.completed - base.completed) / dt
        recent_tokens += (last.output_tokens - base.output_tokens) / dt
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
