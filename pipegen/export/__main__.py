"""`python -m pipegen.export DIR --format parquet|jsonl|atif [--output PATH] [--row-group-rows N]`

Writes DIR/trajectories.parquet (or .jsonl): one row per trajectory, in the merged output's order, from the
batch files the checkpoint lists, and beside the Parquet file its Hugging Face dataset card, README.md
(export/card.py); or DIR/trajectories.atif/, one ATIF document per trajectory (export/atif.py). Works on any run
with committed batches, finished or not, merged or not.
A storage url (s3://bucket/prefix) is read from the store alone (transport/store_read.py's StoreRun) and its export
put back there.
Owns: argument parsing and the one-line errors. Must never: touch the run's own files, or import the writer
(the writer starts this command after its merge; nothing leads back).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipegen.export.writers import FORMATS, ROW_GROUP_ROWS, export_plan

if TYPE_CHECKING:
    from pipegen.run.layout import RunDir
    from pipegen.transport.store_read import StoreRun


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipegen.export",
                                description="export a pipegen run's trajectories as Parquet or JSON lines")
    p.add_argument("run_dir", help="the run directory (output_dir of the launch)")
    p.add_argument("--format", choices=(*FORMATS, "atif"), default="parquet")
    p.add_argument("--output", help="file to write (default: DIR/trajectories.<format>; atif: a folder, "
                                    "default DIR/trajectories.atif)")
    p.add_argument("--row-group-rows", type=int, default=ROW_GROUP_ROWS,
                   help="rows per Parquet row group / per write (bounds memory; default %(default)s)")
    args = p.parse_args(argv)
    from pipegen.run.store import StoreError
    from pipegen.transport.store_read import StoreRun

    read = StoreRun(args.run_dir)  # a store url: the store alone, its committed segments as a run directory
    try:
        with read as run:
            code = export_run(run, args, read)
    except StoreError as e:
        if read.run is None:
            print(f"pipegen.export: {e}", file=sys.stderr)
            return 2
        print(f"pipegen.export: written to {read.run.root} but not uploaded: {e}", file=sys.stderr)
        return 1
    if read.url and code == 0:  # a store run's export goes back to the store (an --output outside it stays local)
        print(f"pipegen.export: uploaded to {read.url}: "
              f"{', '.join(read.keys) or 'nothing (the output is outside the run)'}")
    return code


def export_run(run: RunDir, args: argparse.Namespace, read: StoreRun) -> int:
    """The export of one run directory; what it writes is named to `read` (a StoreRun) to go back to a store."""
    from pipegen.run.batchfile import BatchFileError, legacy_format_message
    from pipegen.run.checkpoint import load_checkpoint
    from pipegen.run.config import load_run_config
    from pipegen.run.rows import SortedRows

    if not run.root.is_dir():
        print(f"pipegen.export: {run.root} does not exist: pass a run directory", file=sys.stderr)
        return 2
    legacy = run.legacy_batch_files()
    if legacy:
        print(f"pipegen.export: {legacy_format_message(run.root, legacy)}", file=sys.stderr)
        return 2
    cfg = load_run_config(run)
    ckpt = load_checkpoint(run.checkpoint)
    if not len(ckpt.batches):
        print(f"pipegen.export: {run.root} has no committed batches yet: run or resume it first "
              f"(python -m pipegen.launch output_dir={run.root})", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else run.atif_dir if args.format == "atif" else run.export_file(args.format)
    started = time.monotonic()
    try:
        plan = SortedRows.committed(run, ckpt)
        if args.format == "atif":
            from pipegen.export.atif import export_atif

            docs = export_atif(cfg, plan, out, max(1, args.row_group_rows))
            print(f"pipegen.export: {docs} ATIF documents -> {out}/ ({time.monotonic() - started:.1f}s)")
            read.put_back(out)
            return 0
        rows = export_plan(cfg, plan, out, args.format, max(1, args.row_group_rows))
    except BatchFileError as exc:
        print(f"pipegen.export: {exc}", file=sys.stderr)
        return 2
    took = time.monotonic() - started
    print(f"pipegen.export: {rows} rows -> {out} ({out.stat().st_size / 2**20:.1f} MiB, {took:.1f}s)")
    if args.format == "parquet":
        from pipegen.export.card import write_card

        card = write_card(cfg, run, out)
        print(f"pipegen.export: dataset card -> {card}" if card is not None else
              f"pipegen.export: no dataset card: {run.export_card(out)} exists and pipegen did not write it")
        read.put_back(out, *([card] if card is not None else []))
        return 0
    read.put_back(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
