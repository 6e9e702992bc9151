"""`python -m analysis collectives FILE.h5 [FILE.h5 ...]`: collective benchmark results, one run's tables or
several side by side, and bus bandwidth against size as a PNG."""
from __future__ import annotations

import argparse
import json
import sys

from analysis.collectives import compare_json, compare_report, compare_rows, load, write_png
from harness.common.output import PNG_NAMES, named, writable, write_csv
from harness.store.collectives_report import run_report

NAME = "collectives"
HELP = "show collective benchmarks of `harness collectives -o`: one run's tables, several side by side, a PNG"
OUTPUTS = {"csv": "--csv", "png": "--png"}
INPUTS = ("files",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE.h5", help="results of `harness collectives -o FILE.h5`")
    parser.add_argument("--json", action="store_true", help="print JSON (docs/collectives.md)")
    parser.add_argument("--csv", metavar="FILE.csv", help="write the side-by-side table as CSV")
    parser.add_argument("--png", metavar="FILE.png", type=named(PNG_NAMES),
                        help="draw bus bandwidth against size, a line per operation and run")


def run(args: argparse.Namespace) -> int:
    runs = load(args.files)
    written = []
    if args.png:
        written.append(("chart", writable(args.png, lambda: write_png(args.png, runs))))
    if args.csv:
        headers, rows = compare_rows(runs)
        written.append(("CSV", write_csv(args.csv, headers, rows)))
    if args.json:
        print(json.dumps(compare_json(runs), indent=1))
    else:
        print(run_report(runs[0]) if len(runs) == 1 else compare_report(runs))
    for what, path in written:
        print(f"wrote {path}: {what}", file=sys.stderr if args.json else sys.stdout)
    return 0
