"""Scenario `occupancy`: do pipegen's actors keep a fixed-slot server busy?

    python -m pipegen.bench.occupancy [--slots 32] [--token-latency 0.01] [--n 16] [--prompts 96]
                                      [--max-response-length 64] [--concurrency 2*slots] [--actors 1]

Starts the CPU server with the fake model backend (`--slots S`: at most S requests run at once, the rest wait
FIFO; `--token-latency L`: each generated token takes L seconds), then runs the real launcher against it
(`llm=external`: actors with verl agent loops, the writer, the merge) on the demo prompts. While it runs
it polls the server's `GET /pipegen_stats` and reports:
- slot occupancy over the run = busy slot-time / total slot-time = `busy_slot_seconds / (S * makespan)`,
  where makespan runs from the first request reaching the server to the last one finishing;
- makespan / ideal, with ideal = `busy_slot_seconds / S` (every slot busy all the time, same work);
- a per-second occupancy timeline (running requests / S, sampled).
Both figures are ratios within one run. The tail (the last requests draining while slots fall idle) is
the only loss a saturating client should show; it shrinks relative to the run as the run gets longer.
The table's target is occupancy ≥ 0.97; the command line exits 1 below 0.95.

`run_occupancy_bench(...)` returns the numbers as a dict (for the table, tests, or `--json`).

Owns: the benchmark's server process, its run directory (a temporary one unless --out), the report, and
the scenario's rows in the table.
Must never: bind anything but loopback, or leave its server or launcher running when it returns.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from pathlib import Path
from typing import Any

from pipegen.bench import common as c

KEY = "occupancy"
TITLE = "4. Slot occupancy and saturation, fake servers with fixed slots (per-token latency; GPU-like batched steps)"
TARGET_OCC = "≥ 0.97"
TARGET_MAKESPAN = "≤ 1.03"  # 1 / 0.97: the same loss seen from the clock
CLI_FLOOR = 0.95  # the command line's exit status

SETTINGS = {
    # slots, token latency, prompts, n, max_response_length
    "quick": dict(slots=32, token_latency=0.01, prompts=96, n=8, max_response_length=64),
    "full": dict(slots=32, token_latency=0.01, prompts=96, n=16, max_response_length=64),
}


class _Poller(threading.Thread):
    """Samples /pipegen_stats every `interval` seconds: (monotonic time, stats)."""

    def __init__(self, url: str, interval: float):
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            try:
                stats = c.server_stats(self.url, timeout=5)
                self.samples.append((time.monotonic(), stats))
            except (urllib.error.URLError, OSError, ValueError):
                pass
            self.stop_event.wait(max(0.0, self.interval - (time.monotonic() - t0)))


def _edges(samples: list[tuple[float, dict]], expected: int) -> tuple[float, float]:
    """First request arrival and last completion (the last time the running batch emptied), each as the
    midpoint of the two polls around it (or the poll itself at the edge of the samples)."""
    start = end = None
    prev_t = None
    for t, s in samples:
        if s["requests_total"] > 0:
            start = t if prev_t is None else (prev_t + t) / 2
            break
        prev_t = t
    busy = [i for i, (_, s) in enumerate(samples) if s["running"] > 0]
    if busy:
        i = busy[-1]
        end = samples[i][0] if i + 1 == len(samples) else (samples[i][0] + samples[i + 1][0]) / 2
    if start is None or end is None or end <= start or samples[-1][1]["generations_total"] < expected:
        raise RuntimeError("could not find the start and end of generation in the server's stats")
    return start, end


def _timeline(samples: list[tuple[float, dict]], t_start: float, t_end: float, slots: int) -> list[float]:
    """Mean running requests ÷ slots in each second of the run."""
    timeline = []
    second = 0
    while t_start + second < t_end:
        window = [s["running"] for t, s in samples if t_start + second <= t < min(t_end, t_start + second + 1)]
        if window:
            timeline.append(round(sum(window) / len(window) / slots, 3))
        second += 1
    return timeline


def run_occupancy_bench(*, slots: int = 32, token_latency: float = 0.01, n: int = 16, prompts: int = 96,
                        max_response_length: int = 64, concurrency: int | None = None, actors: int = 1,
                        eos_prob: float = 0.02, model: str | None = None, out: str | None = None,
                        poll_s: float = 0.05, seed: int = 0, extra_overrides: list[str] | None = None,
                        step_time: float = 0.0, step_time_per_request: float = 0.0, hang_rate: float = 0.0,
                        echo=print) -> dict[str, Any]:
    """Run the benchmark once; returns occupancy, makespan, ideal and the timeline.

    `concurrency` None leaves `actors.concurrency` at its default (auto)."""
    model = model or c.tiny_model()
    workdir = Path(out) if out else Path(tempfile.mkdtemp(prefix="pipegen-occupancy-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = workdir / "run"
    expected = prompts * n
    server_args = c.fake_backend_args(slots=slots, token_latency=token_latency, eos_prob=eos_prob, seed=seed,
                                     model=model, step_time=step_time, step_time_per_request=step_time_per_request,
                                     hang_rate=hang_rate)
    cmd_overrides = ["train_files=demo", f"max_samples={prompts}", f"n={n}",
                     f"max_response_length={max_response_length}", f"seed={seed}", f"actors.num_actors={actors}",
                     "generation.show_progress=false", *(extra_overrides or [])]
    if concurrency is not None:
        cmd_overrides.append(f"actors.concurrency={max(1, concurrency // actors)}")
    with c.reference_server(workdir, server_args, ready_timeout_s=60) as server:
        poller = _Poller(server.url, poll_s)
        poller.start()
        started = time.monotonic()
        try:
            result = subprocess.run(c.launcher_command(run_dir, server.url, *cmd_overrides, model=model),
                                    capture_output=True, text=True, stdin=subprocess.DEVNULL)
            wall = time.monotonic() - started
            time.sleep(2 * poll_s)
        finally:
            poller.stop_event.set()
            poller.join(5)
    if result.returncode != 0:
        raise RuntimeError(f"launcher failed (rc {result.returncode}); run folder kept: {workdir}\n"
                           f"{result.stderr[-3000:]}")
    samples = poller.samples
    final = samples[-1][1]
    if final["generations_total"] < expected:
        raise RuntimeError(f"expected {expected} generations, the server saw {final['generations_total']}")
    t_start, t_end = _edges(samples, expected)
    makespan = t_end - t_start
    busy = float(final["busy_slot_seconds"])
    occupancy = busy / (slots * makespan)
    ideal = busy / slots
    timeline = _timeline(samples, t_start, t_end, slots)
    report = {
        "slots": slots, "token_latency_s": token_latency, "units": expected, "actors": actors,
        "concurrency": concurrency or "auto", "max_response_length": max_response_length,
        "throughput_tok_s": round(int(final["tokens_generated"]) / makespan, 1), "hung": int(final.get("hung", 0)),
        "hung_aborted": int(final.get("hung_aborted", 0)),
        "tokens_generated": int(final["tokens_generated"]), "requests": int(final["requests_total"]),
        "max_running": int(final["max_batch_size"]),
        "busy_slot_seconds": round(busy, 3), "makespan_s": round(makespan, 3), "ideal_makespan_s": round(ideal, 3),
        "occupancy": round(occupancy, 4), "makespan_over_ideal": round(makespan / ideal, 4),
        "launcher_wall_s": round(wall, 1), "occupancy_per_second": timeline,
        "run_dir": str(run_dir) if out else None,
    }
    timing = (f"{token_latency * 1000:g} ms/token" if not (step_time or step_time_per_request) else
              f"GPU-like steps of {step_time * 1000:g} ms + {step_time_per_request * 1000:g} ms x running")
    echo(f"pipegen occupancy benchmark: fake server with {slots} slots x {timing}, "
         f"{expected} units ({prompts} prompts x n={n}), {actors} actor(s) x concurrency "
         f"{concurrency // actors if concurrency else 'auto'}")
    echo(f"  tokens generated     {report['tokens_generated']} in {report['requests']} requests "
         f"(max running {report['max_running']}/{slots})")
    echo(f"  busy slot-time       {busy:.2f} s")
    echo(f"  makespan             {makespan:.2f} s  (first request -> last completion, at the server)")
    echo(f"  ideal makespan       {ideal:.2f} s  (busy slot-time / slots)")
    echo(f"  slot occupancy       {occupancy:.4f}  (floor {CLI_FLOOR})")
    echo(f"  makespan / ideal     {makespan / ideal:.4f}")
    echo(f"  occupancy per second {' '.join(f'{x:.2f}' for x in timeline)}")
    echo(f"  launcher wall time   {wall:.1f} s (includes startup of actors and writer, and the merge)")
    if not out:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


# GPU-like engine: a batched step of 10 ms + 0.2 ms per running request, 64 slots (reported as SGLang's
# max_running_requests): throughput rises with the batch and flattens at the slots.
GPU_LIKE = dict(slots=64, step_time=0.01, step_time_per_request=0.0002, token_latency=0.0, max_response_length=64)
GPU_SETTINGS = {"quick": dict(prompts=96, n=16, sweep=(64, 128)), "full": dict(prompts=96, n=32, sweep=(32, 64, 128, 256))}
TARGET_AUTO = "≥ 0.95"
TARGET_HANG = "≤ 1.15"


def saturation_rows(res: c.ScenarioResult, quick: bool) -> None:
    """Default (auto) concurrency vs the best fixed one of a sweep, and the same with 2% hung requests."""
    g = GPU_SETTINGS["quick" if quick else "full"]
    quiet = dict(echo=lambda *a, **k: None, prompts=g["prompts"], n=g["n"], **GPU_LIKE)
    sweep = {conc: run_occupancy_bench(concurrency=conc, **quiet) for conc in g["sweep"]}
    auto = run_occupancy_bench(**quiet)
    hang = run_occupancy_bench(hang_rate=0.02, **quiet)
    best_conc, best = max(sweep.items(), key=lambda kv: kv[1]["throughput_tok_s"])
    setup = (f"{GPU_LIKE['slots']} slots, step {GPU_LIKE['step_time'] * 1000:g} ms + "
             f"{GPU_LIKE['step_time_per_request'] * 1000:g} ms × running, {auto['units']} units")
    res.add(c.Row(what="GPU-like fake engine, default (auto) concurrency vs best hand-tuned",
                  ratio=auto["throughput_tok_s"] / best["throughput_tok_s"], label="auto ÷ best of sweep (tok/s)",
                  target=TARGET_AUTO,
                  raw=(f"auto {auto['throughput_tok_s']:,.0f} tok/s; sweep " + ", ".join(
                      f"{k}: {v['throughput_tok_s']:,.0f}" for k, v in sweep.items())
                       + f" (best {best_conc}); {setup}")))
    res.add(c.Row(what="GPU-like fake engine, default concurrency: slot occupancy", ratio=auto["occupancy"], unit="",
                  label="busy slot-time ÷ total slot-time", target=TARGET_AUTO,
                  raw=f"makespan {auto['makespan_s']:.2f} s, ideal {auto['ideal_makespan_s']:.2f} s, "
                      f"max running {auto['max_running']}"))
    res.add(c.Row(what="same, 2% of requests never answered (default timeouts)",
                  ratio=hang["makespan_s"] / auto["makespan_s"], label="makespan ÷ no-hang makespan",
                  target=TARGET_HANG,
                  raw=(f"{hang['makespan_s']:.2f} s vs {auto['makespan_s']:.2f} s; {hang['hung']} requests hung, "
                       f"{hang['hung_aborted']} aborted on the server via /abort_request")))


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    report = run_occupancy_bench(**SETTINGS["quick" if quick else "full"], concurrency=64,
                                 echo=lambda *a, **k: None)
    setup = (f"{report['slots']} slots × {report['token_latency_s'] * 1000:g} ms/token, {report['units']} units, "
             f"{report['actors']} actor × concurrency {report['concurrency']} (fixed), "
             f"{report['tokens_generated']:,} tokens, max running {report['max_running']}")
    res.add(c.Row(what="busy slot-time ÷ total slot-time", ratio=float(report["occupancy"]), unit="",
                  label="occupancy over the run", target=TARGET_OCC,
                  raw=f"busy {report['busy_slot_seconds']:.1f} slot-s over {report['makespan_s']:.2f} s; {setup}"))
    res.add(c.Row(what="makespan ÷ ideal", ratio=float(report["makespan_over_ideal"]),
                  label="first request → last completion ÷ (busy ÷ slots)", target=TARGET_MAKESPAN,
                  raw=(f"makespan {report['makespan_s']:.2f} s, ideal {report['ideal_makespan_s']:.2f} s; launcher "
                       f"wall {report['launcher_wall_s']:.0f} s incl. start-up and merge")))
    timeline = report.get("occupancy_per_second") or []
    if timeline:
        res.notes.append("occupancy, per second of the run: " + " ".join(f"{x:.2f}" for x in timeline)
                         + " (the loss is the drain at the end, when fewer units than slots remain).")
    saturation_rows(res, quick)
    res.notes.append("occupancy (GPU-like rows): the hang row's makespan includes hung requests re-sent in the "
                     "tail (hedging) and stalled ones aborted by the watchdog; occupancy counts only the drain at "
                     "the end as loss.")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipegen.bench.occupancy", description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=32, help="fake server's running slots")
    p.add_argument("--token-latency", type=float, default=0.01, help="seconds per generated token")
    p.add_argument("--n", type=int, default=16, help="samples per prompt")
    p.add_argument("--prompts", type=int, default=96, help="demo prompts to use (at most 96)")
    p.add_argument("--max-response-length", type=int, default=64)
    p.add_argument("--eos-prob", type=float, default=0.02, help="the fake backend's EOS chance per token")
    p.add_argument("--concurrency", type=int, default=None, help="units in flight over all actors (default: auto)")
    p.add_argument("--step-time", type=float, default=0.0, help="GPU-like: seconds per batched step at batch 1")
    p.add_argument("--step-time-per-request", type=float, default=0.0, help="GPU-like: extra s per step per request")
    p.add_argument("--hang-rate", type=float, default=0.0, help="fraction of requests never answered")
    p.add_argument("--actors", type=int, default=1)
    p.add_argument("--model", default=None, help="model folder for tokenizer/chat template (default: tiny test model)")
    p.add_argument("--out", default=None, help="keep the run here (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    p.add_argument("overrides", nargs="*", help="extra launcher overrides (key=value)")
    a = p.parse_args(argv)
    report = run_occupancy_bench(slots=a.slots, token_latency=a.token_latency, n=a.n, prompts=a.prompts,
                                 max_response_length=a.max_response_length, concurrency=a.concurrency,
                                 actors=a.actors, eos_prob=a.eos_prob, model=a.model, out=a.out,
                                 extra_overrides=a.overrides, step_time=a.step_time,
                                 step_time_per_request=a.step_time_per_request, hang_rate=a.hang_rate)
    if a.json:
        print(json.dumps(report))
    return 0 if report["occupancy"] >= CLI_FLOOR else 1


if __name__ == "__main__":
    sys.exit(main())
