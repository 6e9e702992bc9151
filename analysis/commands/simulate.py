"""`python -m analysis simulate PROFILE.h5|SPEC.toml`: every device's timeline of one iteration from measured
events, or from a spec's device and network models (with --profile beside it: what the profile measured)."""
from __future__ import annotations

import argparse
import json
import sys

from analysis.devices import plot_devices, select_devices
from analysis.predict import add_network_argument, add_prediction_arguments, predict_spec, prediction_options
from analysis.report import format_report, summary
from analysis.spec_only import command_input, is_spec_only
from analysis.uncertainty import explain_interval
from harness.common.output import PNG_NAMES, TRACE_NAMES, named, writable, write_csv

NAME = "simulate"
HELP = ("predict one training iteration's timeline on every device from a profile or a spec alone (table, --json, "
        "trace, PNG)")
OUTPUTS = {"csv": "--csv", "trace": "--trace", "png": "--png", "out": "--out"}
INPUTS = ("input", "spec", "profile", "collectives", "network")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="PROFILE.h5|SPEC.toml",
                        help="profile.h5 written by `python -m harness profile`, or a job spec with [cluster] device "
                             "and [[cluster.network]] (every event from the device and network models)")
    parser.add_argument("--spec", help="simulate this TOML job spec instead of the profile's own")
    parser.add_argument("--profile", metavar="PROFILE.h5",
                        help="beside a spec: cost what this profile measured, the rest from the spec's models")
    parser.add_argument("--strategy", metavar="K=V,...",
                        help="change the strategy, e.g. dp=4,tp=2,pp=2,micro=1,schedule=interleaved-1f1b,chunks=2")
    parser.add_argument("--devices", metavar="all|stages|RANKS",
                        help="devices to report, trace, draw and store: all, one per pipeline stage, or ranks like "
                             "0,3,8-11 (default: all up to 1024 devices, else stages; the chart: up to 16 rows)")
    add_prediction_arguments(parser)
    add_network_argument(parser)
    parser.add_argument("--collectives", nargs="+", default=(), metavar="FILE.h5",
                        help="collective benchmarks (harness collectives -o) of the profile's backend and device: "
                             "their points join the profile's, to interpolate and fit communication; beside a spec "
                             "alone, they cost its communication (in place of [[cluster.network]])")
    parser.add_argument("--details", action="store_true",
                        help="also print a layer's passes, the model's corrections and the communication fits "
                             "(--json always has them)")
    parser.add_argument("--json", action="store_true", help="print a JSON document (docs/analysis.md)")
    parser.add_argument("--csv", metavar="FILE.csv", help="write the chosen devices' usage as CSV (docs/analysis.md)")
    parser.add_argument("--trace", metavar="FILE.json[.gz]", type=named(TRACE_NAMES),
                        help="write a Chrome/Perfetto trace")
    parser.add_argument("--png", metavar="FILE.png", type=named(PNG_NAMES), help="write a Gantt chart")
    parser.add_argument("--out", metavar="TIMELINE.h5", help="write the timeline in HDF5 (docs/timeline.md)")


def run(args: argparse.Namespace) -> int:
    spec, profile, source = command_input(args.input, args.profile, args.spec, args.strategy)
    prediction = predict_spec(spec, profile, collectives=args.collectives, network=args.network, source=source,
                              **prediction_options(args))
    profile_path = None if is_spec_only(prediction.profile) else prediction.profile.path
    timeline = prediction.timeline
    ranks, selection = select_devices(prediction.spec, args.devices)
    explanation = explain_interval(prediction.plan, prediction.costs, prediction.interval, timeline.dp_overlap)
    report = summary(timeline, ranks, selection, profile_path, prediction.memory, prediction.interval, explanation)
    report["spec"] = source
    written = []
    if args.trace:
        from analysis.perfetto import write_trace

        written.append(("trace (open in https://ui.perfetto.dev)",
                        writable(args.trace, lambda: write_trace(args.trace, timeline, ranks))))
    if args.png:
        from analysis.plot import write_gantt

        rows, note = plot_devices(prediction.spec, ranks if args.devices else None)
        written.append(("chart", writable(args.png, lambda: write_gantt(args.png, timeline, rows, note))))
    if args.csv:
        columns = ("rank", "stage", "dp", "tp", "compute_s", "comm_s", "overlapped_comm_s", "idle_s")
        rows = [[d.to_dict()[c] for c in columns] + [timeline.batch_time_s] for d in timeline.devices(ranks)]
        written.append(("CSV", write_csv(args.csv, (*columns, "batch_time_s"), rows)))
    if args.out:
        from analysis.timeline_file import write_timeline

        written.append(("timeline", writable(args.out, lambda: write_timeline(args.out, timeline, ranks, report))))
    if args.json:
        print(json.dumps(report, indent=2))
        for warning in timeline.costs.warnings:
            print(f"WARNING: {warning}", file=sys.stderr)
    else:
        print(format_report(timeline, ranks if args.devices else None, details=args.details,
                            memory=prediction.memory, interval=prediction.interval, explanation=explanation))
    for what, path in written:
        print(f"wrote {path}: {what}", file=sys.stderr if args.json else sys.stdout)
    return 0
