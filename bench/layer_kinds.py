"""Where a suite's one-sided error goes, per event kind (issue 44): the layer rows of several validations pooled.

    python -m analysis validate --json RUNDIR PROFILE > job.json     # a run traced with harness train --layer-times
    python bench/layer_kinds.py job1.json job2.json ... [--json OUT.json]

Per event kind (`block fwd`, `head bwd`, ...; analysis.validate.layer_kind_ratios) over every file's layer rows:
how many jobs and rows, the median of the run's layer time over its cost, the 10th and 90th percentiles, and how
many rows lie above 1 (the run's layers costing more than the profile said). Noise has no sign: a kind whose
rows lie above 1 in most jobs is where the error goes. Files without layer rows (runs traced without
--layer-times) are named and skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.validate import layer_kind_ratios  # noqa: E402
from harness.common.errors import UserError  # noqa: E402
from harness.common.output import format_table  # noqa: E402


def pooled(reports: dict[str, dict]) -> list[dict]:
    """Per event kind over the reports' layer rows: jobs, rows, ratio median, p10, p90 and the rows above 1."""
    ratios: dict[str, list[float]] = {}
    jobs: dict[str, set[str]] = {}
    for name, report in reports.items():
        for row in report.get("layers", []):
            for kind in layer_kind_ratios([row]):  # the row's kind, named as validate names it
                ratios.setdefault(kind["kind"], []).append(kind["ratio_median"])
                jobs.setdefault(kind["kind"], set()).add(name)
    return [{"kind": kind, "jobs": len(jobs[kind]), "rows": len(values), "ratio_median": float(np.median(values)),
             "ratio_p10": float(np.percentile(values, 10)), "ratio_p90": float(np.percentile(values, 90)),
             "above_one": int(sum(v > 1 for v in values))} for kind, values in sorted(ratios.items())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="JSON of `python -m analysis validate --json`")
    parser.add_argument("--json", metavar="OUT.json")
    args = parser.parse_args()
    reports = {}
    for path in args.reports:
        try:
            reports[path] = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: not a validation report ({exc}); write one with "
                            "python -m analysis validate --json RUNDIR PROFILE > FILE.json") from None
    empty = [path for path, report in reports.items() if not report.get("layers")]
    for path in empty:
        print(f"{path}: no layer rows (its run was traced without harness train --layer-times); skipped")
    rows = pooled({path: report for path, report in reports.items() if path not in empty})
    print(format_table(("event kind", "jobs", "rows", "run / cost (median)", "p10", "p90", "rows above 1"),
                       [(r["kind"], r["jobs"], r["rows"], r["ratio_median"], r["ratio_p10"], r["ratio_p90"],
                         f"{r['above_one']} of {r['rows']}") for r in rows],
                       title=f"layer rows of {len(reports) - len(empty)} validations, per event kind"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"bench/layer_kinds.py: {exc}", file=sys.stderr)
        sys.exit(2)
