"""`write_report(run)`: report.json and report.html for a run directory; `main(argv)`, the command line
`python -m pipegen.report DIR` (and the `report` subcommand of the `pipegen` command).

`end_of_run` is the launcher's last step: the report of the run just ended, and the summary's last line naming it.

Owns: writing the two report files (atomically), the command's one-line errors, and the summary's report line.
Must never: write anything else under the run directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.layout import RunDir


def write_report(run: RunDir) -> Path:
    """Write report.json and report.html for `run` (finished or in progress); returns report.html's path."""
    from pipegen.report.numbers import report_numbers
    from pipegen.report.page import render
    from pipegen.report.plots import draw

    started, cpu = time.monotonic(), time.process_time()
    numbers, rows, line = report_numbers(run)
    plots = draw(numbers, rows, line)
    # the whole report, plots included: wall time, and this process's CPU time (what it costs the machine, which
    # a busy machine's other jobs do not inflate)
    numbers["report_seconds"] = round(time.monotonic() - started, 2)
    numbers["report_cpu_seconds"] = round(time.process_time() - cpu, 2)
    atomic_write_bytes(run.report_json, orjson.dumps(numbers, option=orjson.OPT_INDENT_2))
    atomic_write_bytes(run.report_html, render(numbers, plots).encode())
    return run.report_html


def end_of_run(cfg: Any, run: RunDir, code: int) -> int:
    """The launcher's last step (generation.report, on by default): write the report of a run that ended
    complete (code 0) or with failed units (code 1) and print the line naming it, the summary's last line, where
    the summary went (stdout, or stderr after failures). A report that cannot be written is one warning, never
    the launch's failure. Returns `code`."""
    if code not in (0, 1) or not cfg.generation.get("report", True):
        return code
    stream = sys.stdout if code == 0 else sys.stderr
    try:
        page = write_report(run)
    except Exception as e:  # the run's data is safe and reported already; the report is a view of it
        print(f"  report:       not written ({type(e).__name__}: {e}); retry: python -m pipegen.report {run.root}",
              file=stream, flush=True)
        return code
    print(f"  report:       {page}", file=stream, flush=True)
    if cfg.get("storage", {}).get("url"):  # a store run's report goes beside its outputs
        from pipegen.run.store import StoreError
        from pipegen.transport.store_read import upload

        try:
            upload(str(cfg.storage.url), run, [run.report_html, run.report_json])
        except StoreError as e:
            print(f"  report:       not uploaded ({e}); retry: python -m pipegen.report {cfg.storage.url}",
                  file=stream, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    from pipegen.config.invocation import command

    p = argparse.ArgumentParser(prog=command("report"),
                                description="write DIR/report.html and DIR/report.json for a pipegen run "
                                            "(finished or in progress)")
    p.add_argument("run_dir", help="the run directory (output_dir of the launch)")
    args = p.parse_args(argv)
    from pipegen.run.integrity import DamagedFile
    from pipegen.run.store import StoreError
    from pipegen.transport.store_read import StoreRun

    read = StoreRun(args.run_dir)  # a store url: its committed segments as a run directory, the report put back there
    try:
        with read as run:
            if not read.url and not run.config_file.exists():
                print(f"pipegen.report: {run.root} is not a pipegen run directory (no conf/config.yaml)",
                      file=sys.stderr)
                return 2
            page = write_report(run)
            read.put_back(run.report_html, run.report_json)
    except (StoreError, DamagedFile) as e:
        print(f"pipegen.report: {e}", file=sys.stderr)
        return 2
    uploaded = f"uploaded to {read.url}: {', '.join(read.keys)}" if read.url else f"numbers: {run.report_json}"
    print(f"pipegen.report: {page} ({uploaded})")
    return 0
