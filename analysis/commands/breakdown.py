"""`python -m analysis breakdown RUN...`: where a real run's time went, per rank, per time window and per phase,
and its stragglers; RUN a trace.h5 of `harness train` (or its RUNDIR), or PyTorch profiler traces."""
from __future__ import annotations

import argparse
import json
import math
import sys

from harness.common.errors import UserError
from harness.common.output import PNG_NAMES, named, writable, write_csv

NAME = "breakdown"
SPAN_CHOICES = ("trace", "hta")  # analysis.activity.SPANS, spelled here so that --help imports no numpy
HELP = ("break a real run's time into compute, communication, memory and idle per rank, window and phase, and "
        "find its stragglers (trace.h5 or PyTorch profiler traces)")
OUTPUTS = {"csv": "--csv", "png": "--png"}
INPUTS = ("runs",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="a trace.h5 of `harness train` or its RUNDIR; a folder of PyTorch profiler traces "
                             "(.json or .json.gz, one per rank); or such trace files, the ranks of one run")
    windowing = parser.add_mutually_exclusive_group()
    windowing.add_argument("--windows", type=int, metavar="N", help="N equal time windows over the run (default 20)")
    windowing.add_argument("--window-ms", type=float, metavar="W", help="time windows of W milliseconds")
    parser.add_argument("--span", choices=SPAN_CHOICES, default="trace",
                        help="which part of PyTorch profiler traces to break down: trace, all of it (default); hta, "
                             "HolisticTraceAnalysis's: its last profiler step left out, from the first to the last "
                             "GPU event of the rest, times rounded to whole microseconds as HTA does (docs/runs.md)")
    parser.add_argument("--json", action="store_true", help="print JSON (docs/runs.md)")
    parser.add_argument("--csv", metavar="FILE.csv", help="write every rank's categories, whole and per window")
    parser.add_argument("--png", metavar="FILE.png", type=named(PNG_NAMES),
                        help="draw ranks by time windows coloured by the compute share, and the shares over time")


def run(args: argparse.Namespace) -> int:
    from analysis.activity import load_runs
    from analysis.breakdown import SCHEMA_VERSION, breakdown, csv_rows, format_breakdown, to_json, write_png

    if args.windows is not None and args.windows < 1:
        raise UserError(f"--windows must be at least 1, got {args.windows}")
    if args.window_ms is not None and not (0 < args.window_ms < math.inf):
        raise UserError(f"--window-ms must be a positive number of milliseconds, got {args.window_ms}")
    runs = load_runs(args.runs, args.span)
    if len(runs) > 1 and (args.png or args.csv):
        raise UserError(f"--png and --csv draw one run, but {len(runs)} runs were given; give them one at a time")
    windowing = {"windows": args.windows, "window_s": args.window_ms / 1e3 if args.window_ms else None}
    results = [breakdown(r, **windowing) for r in runs]
    written = []
    if args.png:
        written.append(("heat map", writable(args.png, lambda: write_png(args.png, results[0]))))
    if args.csv:
        written.append(("CSV", write_csv(args.csv, *csv_rows(results[0]))))
    if args.json:
        data = [to_json(r) for r in results]
        print(json.dumps(data[0] if len(data) == 1 else {"schema_version": SCHEMA_VERSION, "kind": "distsim-breakdown",
                                                          "runs": data}, indent=1))
    else:
        print("\n\n".join(format_breakdown(r) for r in results))
    for what, path in written:
        print(f"wrote {path}: {what}", file=sys.stderr if args.json else sys.stdout)
    return 0
