"""`python -m harness show OUTDIR/profile.h5`: what a profile holds (table, --json, --csv).

The profile is read whole, checked and verified, by the reader the analysis builds on (harness.store.profile_reader).
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

from harness.common.output import format_seconds, format_table, write_csv
from harness.plan.events import human_bytes
from harness.plan.precision import precision_statistic, relative_half_width
from harness.store.profile_reader import load_profile
from harness.store.profile_store import summarize

NAME = "show"
HELP = "summarise a profile.h5: environment, measured events with statistics, what is unmeasured"
COLUMNS = ("id", "kind", "name", "needed", "ranks", "median_s", "p5_s", "p95_s", "mean_s", "min_s", "max_s", "count",
           "precision", "in_context_median_s")
OUTPUTS = {"csv": "--csv"}
INPUTS = ("profile",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="a profile.h5 written by `harness profile` (or its folder)")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.add_argument("--csv", metavar="FILE", help="write the measurements table as CSV")


def load_summary(path: str) -> dict:
    """The profile as plain data: schema version, environment, measurements with statistics, unmeasured."""
    profile = load_profile(path)
    rows = []
    for eid, m in sorted(profile.measurements.items(), key=lambda item: (item[1].kind, item[0])):
        # the 95% interval's half-width of the statistic the analysis uses, over it (null: too few samples)
        precision = relative_half_width(m.samples_s, precision_statistic(m.kind))
        rows.append({"id": eid, "kind": m.kind, "name": profile.events.get(eid, {}).get("name", _describe(m.content)),
                     "needed": eid in profile.events, "ranks": m.ranks, **summarize(m.samples_s),
                     "precision": precision if math.isfinite(precision) else None,
                     # timed inside its stages' chains too (docs/profiling.md, "In context"): that median
                     "in_context_median_s": (float(np.median(m.in_context_samples_s))
                                             if m.in_context_samples_s.size else None)})
    return {"schema_version": profile.schema_version, "path": str(profile.path), "spec": json.loads(profile.spec_json),
            "environment": profile.environment, "measurements": rows,
            "unmeasured": [{"id": k, "name": profile.event_name(k), "reason": v}
                           for k, v in profile.unmeasured.items()]}


def _describe(content: dict) -> str:
    if content["kind"] == "composite":
        sig = content["signature"]
        group = (f"cp={sig['cp']}" if int(sig.get("cp", 1)) > 1 else f"ep={sig['ep']}" if int(sig.get("ep", 1)) > 1
                 else f"tp={sig.get('tp')}")
        return f"{sig.get('family')}.{content['layer']}.{content['phase']} composite on {group}"
    extra = f" x{content['group']}" if "group" in content else ""
    return (f"{content['kind']} {human_bytes(content.get('bytes', 0))}{extra} {content.get('placement', '')} "
            "(sweep point)")


def run(args: argparse.Namespace) -> int:
    summary = load_summary(args.profile)
    if args.csv:
        write_csv(args.csv, COLUMNS, [[",".join(map(str, r[c])) if c == "ranks" else r[c] for c in COLUMNS]
                                      for r in summary["measurements"]])
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    env = summary["environment"]
    print(f"{summary['path']} (schema {summary['schema_version']}): {summary['spec']['model']['name']}, "
          f"{env.get('world_size')} ranks on {env.get('nodes')} node(s), {env.get('device')}, {env.get('backend')}"
          + (f", cpu binding {env['cpu_binding']}" if "cpu_binding" in env else ""))
    rows = [(r["name"], r["kind"], ",".join(map(str, r["ranks"])), format_seconds(r["median_s"]),
             format_seconds(r["p5_s"]), format_seconds(r["p95_s"]), r["count"],
             f"{r['precision']:.1%}" if r["precision"] is not None else "-") for r in summary["measurements"]]
    if any(r["in_context_median_s"] is not None for r in summary["measurements"]):
        # beside the layer alone, its median inside its stages' chains and their ratio
        rows = [row + ((format_seconds(r["in_context_median_s"]), f"{r['in_context_median_s'] / r['median_s']:.2f}x")
                       if r["in_context_median_s"] is not None else ("-", "-"))
                for row, r in zip(rows, summary["measurements"])]
        header = ("event", "kind", "ranks", "median", "p5", "p95", "n", "+/- 95%", "in context", "ratio")
    else:
        header = ("event", "kind", "ranks", "median", "p5", "p95", "n", "+/- 95%")
    print(format_table(header, rows))
    for item in summary["unmeasured"]:
        print(f"unmeasured: {item['name']}: {item['reason']}")
    if args.csv:
        print(f"wrote {args.csv}")
    return 0
