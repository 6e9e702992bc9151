"""`python -m analysis validate RUNDIR/trace.h5 PROFILE.h5`: a real run against the prediction, error by error."""
from __future__ import annotations

import argparse
import json
import sys

from analysis.predict import add_prediction_arguments, prediction_options
from analysis.profile_reader import load_profile
from analysis.trace_reader import read_trace
from analysis.validate import layer_kind_ratios, validate
from harness.common.output import PNG_NAMES, TRACE_NAMES, format_table, named, writable, write_csv

NAME = "validate"
HELP = "compare a real run (trace.h5 of `harness train`) with the prediction from a profile"
OUTPUTS = {"csv": "--csv", "png": "--png", "trace_out": "--trace-out"}
INPUTS = ("trace", "profile")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace.h5 written by `python -m harness train` (or its RUNDIR)")
    parser.add_argument("profile", help="profile.h5 written by `python -m harness profile` (or its OUTDIR)")
    add_prediction_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON document (docs/analysis.md)")
    parser.add_argument("--csv", metavar="FILE.csv", help="write the per-device errors as CSV (docs/analysis.md)")
    parser.add_argument("--png", metavar="FILE.png", type=named(PNG_NAMES),
                        help="measured and predicted timelines, one above the other")
    parser.add_argument("--trace-out", "--perfetto", dest="trace_out", metavar="FILE.json[.gz]",
                        type=named(TRACE_NAMES),
                        help="one Perfetto trace holding the measured and the predicted timelines")


def run(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    profile = load_profile(args.profile)
    result = validate(trace, profile, **prediction_options(args))
    written = []
    if args.png:
        from analysis.compare import write_comparison_png

        written.append(("chart", writable(args.png, lambda: write_comparison_png(args.png, result))))
    if args.trace_out:
        from analysis.compare import write_comparison_trace

        written.append(("trace", writable(args.trace_out, lambda: write_comparison_trace(args.trace_out, result))))
    if args.csv:
        columns = ("rank", "stage", "dp", "tp", "measured_busy_s", "predicted_busy_s", "error_pct")
        written.append(("CSV", write_csv(args.csv, columns, [[d[c] for c in columns] for d in result.devices])))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        for what, path in written:
            print(f"wrote {path}: {what}", file=sys.stderr)
        return 0
    ms = lambda s: s * 1e3  # noqa: E731
    print(f"{trace.spec['model']['name']}: {len(result.iterations)} measured iterations")
    print(format_table(("", "measured ms", "predicted ms", "error %"),
                       [("batch time (median)", ms(result.measured_batch_s), ms(result.predicted_batch_s),
                         result.batch_time_error_pct)]
                       + ([("replay: the run's own compute", ms(result.measured_batch_s), ms(result.replay_batch_s),
                            result.replay_error_pct)] if result.replay_batch_s is not None else [])))
    if result.interval is not None:
        iv = result.interval
        where = "inside" if result.measured_in_interval else (
            "BELOW" if result.measured_batch_s < iv.p5_s else "ABOVE")
        print(f"in interval: {'yes' if result.measured_in_interval else 'no'}, the measured median is {where} "
              f"the prediction's 90% interval, {ms(iv.p5_s):.3f} to "
              f"{ms(iv.p95_s):.3f} ms ({iv.width:.1%} wide, "
              + ("with the model's held-out error)" if iv.residuals else "with the machine's drift)" if iv.sampling
                 else "from the profile's samples)"))
    else:
        print("in interval: not known (no interval: --resamples 0, or costs without samples)")
    if result.replay_error_pct is not None and result.compute_cost_error_pct is not None:
        print(f"of the batch-time error, {result.replay_error_pct:+.1f} points are the timeline model's (the replay) "
              f"and {result.compute_cost_error_pct:+.1f} the profile's compute costs")
    print()
    context = any(d["cp"] for d in result.devices)  # a cp column where the run is context-parallel
    print(format_table(("rank", "stage", "dp", "tp") + ("cp",) * context
                       + ("measured busy ms", "predicted busy ms", "error %"),
                       [(d["rank"], d["stage"], d["dp"], d["tp"]) + (d["cp"],) * context
                        + (ms(d["measured_busy_s"]), ms(d["predicted_busy_s"]), d["error_pct"])
                        for d in result.devices],
                       title=f"per device (max |error| {result.device_error_pct or 0:.1f}%)"))
    print()
    print(format_table(("virtual stage", "phase", "measured ms", "predicted ms", "error %", "worst micro-batch %"),
                       [(r["virtual_stage"], r["phase"], ms(r["measured_s"]), ms(r["predicted_s"]), r["error_pct"],
                         r["max_micro_error_pct"]) for r in result.stage_rows()],
                       title="per stage step (median over micro-batches)"))
    if result.memory:
        print()
        mb = lambda b: b / 1e6  # noqa: E731
        remade = any(r.get("remade_bytes") for r in result.memory)
        narrowed = any(r["compared_bytes"] != r["predicted_bytes"] for r in result.memory)
        title = "peak memory per pipeline stage (its largest device; docs/analysis.md, Memory)"
        if narrowed:
            title += ("; error against the predicted peak of what the meter sees (without a backward's temporaries "
                      "and the re-made activations of recompute)")
        print(format_table(("stage", "rank", "measured MB", "predicted MB")
                           + (("predicted, meter's MB",) if narrowed else ()) + ("error %", "largest part")
                           + (("re-made MB",) if remade else ()),
                           [(r["stage"], r["rank"], mb(r["measured_bytes"]), mb(r["predicted_bytes"]))
                            + ((mb(r["compared_bytes"]),) if narrowed else ())
                            + (r["error_pct"], max(r["predicted_parts"], key=r["predicted_parts"].get))
                            + ((mb(r["remade_bytes"]),) if remade else ()) for r in result.memory],
                           title=title))
    if result.replica_lag:
        print()
        print(format_table(("stage", "measured ms", "predicted ms", "error %"),
                           [(r["stage"], ms(r["measured_s"]), ms(r["predicted_s"]), r["error_pct"])
                            for r in result.replica_lag],
                           title="slowest data-parallel replica's compute end behind the replicas' mean "
                                 "(median over iterations)"))
    if result.layers:
        print()
        print(format_table(("virtual stage", "phase", "event", "layers", "measured ms", "predicted ms", "error %"),
                           [(r["virtual_stage"], r["phase"], r["name"], r["samples"], ms(r["measured_s"]),
                             ms(r["predicted_s"]), r["error_pct"]) for r in result.layers],
                           title="per layer event (harness train --layer-times; median over its layers)"))
        print()
        print(format_table(("event kind", "rows", "run / cost (median)", "min", "max"),
                           [(r["kind"], r["rows"], r["ratio_median"], r["ratio_min"], r["ratio_max"])
                            for r in layer_kind_ratios(result.layers)],
                           title="per event kind: the run's layer time over its cost (above 1: the run's layers "
                                 "cost more than the profile says)"))
    for warning in result.timeline.costs.warnings:
        print(f"WARNING: {warning}")
    for what, path in written:
        print(f"wrote {path}: {what}")
    return 0
