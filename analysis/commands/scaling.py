"""`python -m analysis scaling RUN...`: how real runs of one model scale with the devices, series side by side
(by default one series per communication backend), with predictions from profiles beside them."""
from __future__ import annotations

import argparse
import json
import sys

from harness.common.output import PNG_NAMES, named, writable, write_csv

NAME = "scaling"
HELP = "compare real runs of one model at several device counts: speed-up, parallel efficiency, shares, series"
OUTPUTS = {"csv": "--csv", "png": "--png"}
INPUTS = ("runs", "profile")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="runs as `analysis breakdown` takes them: trace.h5 or RUNDIR of `harness train`, or a "
                             "folder of one run's PyTorch profiler traces")
    parser.add_argument("--label", action="append", default=[], metavar="NAME=RUN[,RUN...]",
                        help="put these runs in the series NAME (repeatable; default: a series per backend)")
    parser.add_argument("--profile", action="append", default=[], metavar="PROFILE.h5",
                        help="predict every run from a profile too (repeatable: each run takes the profile of its "
                             "backend, else the first)")
    parser.add_argument("--mode", choices=("strong", "weak"),
                        help="how runs that do not record their batch scale (profiler traces)")
    parser.add_argument("--json", action="store_true", help="print JSON (docs/runs.md, \"Scaling\")")
    parser.add_argument("--csv", metavar="FILE.csv", help="write the table as CSV")
    parser.add_argument("--png", metavar="FILE.png", type=named(PNG_NAMES),
                        help="draw efficiency and throughput against devices")


def run(args: argparse.Namespace) -> int:
    from analysis.activity import load_runs
    from analysis.profile_reader import load_profile
    from analysis.scaling import format_scaling, parse_labels, rows, scaling, to_json, write_png

    labels = parse_labels(args.label)
    profiles = [load_profile(p) for p in args.profile]
    result = scaling(load_runs(args.runs), labels, profiles, args.mode)
    written = []
    if args.png:
        written.append(("chart", writable(args.png, lambda: write_png(args.png, result))))
    if args.csv:
        written.append(("CSV", write_csv(args.csv, *rows(result))))
    print(json.dumps(to_json(result), indent=1) if args.json else format_scaling(result))
    for what, path in written:
        print(f"wrote {path}: {what}", file=sys.stderr if args.json else sys.stdout)
    return 0
