"""`python -m pipegen.bench [--quick] [--only SCENARIO ...] [--out BENCHMARKS.md]`

Runs the scenarios in order and writes one markdown table (date, machine, versions, each scenario's
ratio and the raw figures behind it) to BENCHMARKS.md at the repository root, or to --out.
A scenario that fails is reported in the table with its error; the others still run.

Owns: the table's layout, the machine facts and package versions it states, and the load average read
around each scenario.
Must never: judge a timing (a missed target is reported, not raised).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import os
import platform
import sys
import time
import traceback
from pathlib import Path

from pipegen.bench import SCENARIOS
from pipegen.bench.common import REPO, ScenarioResult


def loadavg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f", {int(line.split()[1]) / 1024 ** 2:.0f} GiB RAM"
    except OSError:
        pass
    return f"{cpu_model()}, {cores} cores{mem}, {platform.system()} {platform.release()}"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "verl", "orjson", "aiohttp", "uvloop", "ray", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipegen.bench",
                                description="pipegen's speed as ratios against its baselines (see BENCHMARKS.md)")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--only", nargs="+", choices=list(SCENARIOS), metavar="SCENARIO",
                   help=f"run only these scenarios: {', '.join(SCENARIOS)}")
    p.add_argument("--out", default=str(REPO / "BENCHMARKS.md"), help="markdown file to write (default: %(default)s)")
    return p.parse_args(argv)


# what --quick does and costs, as measured (every scenario still runs: 12 min on 2 shared cores)
QUICK_HELP = ("smaller sizes and fewer repetitions of every scenario (about 12 min on 2 shared cores; --only "
              "SCENARIO runs one)")


def run_one(key: str, quick: bool) -> ScenarioResult:
    module = importlib.import_module(SCENARIOS[key])
    before = loadavg()
    t0 = time.monotonic()
    try:
        result = module.run(quick)
    except Exception as e:  # one broken scenario must not hide the others' figures
        result = ScenarioResult(key, getattr(module, "TITLE", key))
        result.error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    result.seconds = time.monotonic() - t0
    result.load_before, result.load_after = before, loadavg()
    return result


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(results: list[ScenarioResult], quick: bool, total_s: float, argv: list[str]) -> str:
    v = versions()
    now = dt.datetime.now().astimezone()
    lines = [
        "# pipegen benchmarks",
        "",
        f"Written by `{' '.join(['python -m pipegen.bench', *argv])}` on {now:%Y-%m-%d %H:%M %Z} "
        f"({'quick' if quick else 'full'} mode, {total_s:.0f} s).",
        "",
        f"- **Machine:** {machine_info()}",
        "- **Versions:** " + ", ".join(f"{k} {val}" for k, val in v.items()),
        "- Every figure is a **ratio of two things measured side by side** (interleaved in one process, or in "
        "the same minute); absolute rates on a shared machine move 2-3× between runs, so only the ratios are "
        "compared. Raw figures are medians over the repetitions. *load* = the 1-minute load average before → "
        "after the scenario (the machine is shared: read the ratios with it).",
        "",
        "| scenario | measurement | ratio | of | target | raw figures | load |",
        "|---|---|---:|---|---|---|---|",
    ]
    for r in results:
        load = f"{r.load_before[0]:.1f} → {r.load_after[0]:.1f}"
        title = f"{r.title} ({r.seconds:.0f} s)"
        if r.skipped:
            lines.append(f"| {_cell(title)} | skipped: {_cell(r.skipped)} | | | | | {load} |")
            continue
        if r.error and not r.rows:
            lines.append(f"| {_cell(title)} | **error:** {_cell(r.error)} | | | | | {load} |")
            continue
        for i, row in enumerate(r.rows):
            if row.ratio is None:
                ratio = "—"
            else:
                ratio = f"{row.ratio:.2f}{row.unit}" if row.unit else f"{row.ratio:.2f}"
            status = ""
            if row.met is True:
                status = " ✅"
            elif row.met is False:
                status = " ❌ missed"
            lines.append(
                f"| {_cell(title) if i == 0 else ''} | {_cell(row.what)} | **{ratio}** | {_cell(row.label)} | "
                f"{_cell(row.target)}{status} | {_cell(row.raw)} | {load if i == 0 else ''} |"
            )
        if r.error:
            lines.append(f"| | **error:** {_cell(r.error)} | | | | | |")
    notes = [(r.title, n) for r in results for n in r.notes]
    if notes:
        lines += ["", "## Notes", ""]
        for title, note in notes:
            lines.append(f"- **{title.split(' ', 1)[0].rstrip('.')}**: {note}")
    lines += [
        "",
        "Run one scenario alone with `python -m pipegen.bench --only SCENARIO` (scenarios: "
        + ", ".join(f"`{k}`" for k in SCENARIOS) + f"); `--quick`: {QUICK_HELP}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    keys = args.only or list(SCENARIOS)
    started = time.monotonic()
    results = []
    for key in keys:
        print(f"pipegen.bench: {key} ...", file=sys.stderr, flush=True)
        result = run_one(key, args.quick)
        results.append(result)
        state = "skipped" if result.skipped else "error" if result.error else "ok"
        print(f"pipegen.bench: {key} {state} in {result.seconds:.1f}s", file=sys.stderr, flush=True)
        for row in result.rows:
            r = "—" if row.ratio is None else f"{row.ratio:.2f}{row.unit}"
            print(f"  {row.what}: {r} ({row.label}) {row.target} | {row.raw}", file=sys.stderr, flush=True)
    text = render(results, args.quick, time.monotonic() - started, argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(text)
    print(f"pipegen.bench: wrote {out}", file=sys.stderr)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
