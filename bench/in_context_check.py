"""A profile's compute events in context against alone, and the prediction of one real run costed each way
(issue 44; bench/gpu_check.sh runs it per model size).

    python bench/in_context_check.py RUNDIR PROFILE [--json OUT.json]

Prints, per event with in-context samples (compute, ZeRO's reduce-scatters), its median alone and inside its
stages' chains and their ratio; then the run's median batch time against the prediction from the in-context
figures (what the costs use) and from the isolated ones alone (the same profile with its in-context series set
aside). Exit 1 when the profile holds no in-context samples (profiled before they were taken, or every chain
failed); a file that cannot be read is one message and exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.profile_reader import load_profile  # noqa: E402
from analysis.trace_reader import read_trace  # noqa: E402
from analysis.validate import validate  # noqa: E402
from harness.common.errors import UserError  # noqa: E402
from harness.store.hdf5_schema import IN_CONTEXT_SERIES  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="RUNDIR or trace.h5 of `harness train`")
    parser.add_argument("profile", help="OUTDIR or profile.h5 of `harness profile`")
    parser.add_argument("--json", metavar="OUT.json")
    args = parser.parse_args()
    try:
        profile, trace = load_profile(args.profile), read_trace(args.run)
    except UserError as exc:
        print(f"in_context_check: {exc}", file=sys.stderr)
        return 2
    rows = []
    for eid, m in sorted(profile.measurements.items(), key=lambda item: profile.event_name(item[0])):
        if m.in_context_samples_s.size:
            in_context = float(np.median(m.in_context_samples_s))
            name = profile.event_name(eid)
            if m.kind == "composite":  # a context-parallel block with its ring, timed in its pairs' chains
                name = f"{m.content['signature'].get('family')}.{m.content['layer']}.{m.content['phase']} with its ring"
            rows.append({"event": name, "alone_ms": m.median_s * 1e3,
                         "in_context_ms": in_context * 1e3, "ratio": in_context / m.median_s})
            print(f"{rows[-1]['event']:48s} alone {rows[-1]['alone_ms']:9.3f} ms  in context "
                  f"{rows[-1]['in_context_ms']:9.3f} ms  x{rows[-1]['ratio']:.3f}")
    if not rows:
        print(f"{args.profile}: no in-context samples (docs/profiling.md, 'In context')")
        return 1
    in_context = validate(trace, profile)
    for m in profile.measurements.values():  # the same profile, costed from the layers alone
        m.series[IN_CONTEXT_SERIES] = np.empty(0)
    alone = validate(trace, profile)
    result = {"events": rows, "measured_batch_s": in_context.measured_batch_s,
              "predicted_in_context_s": in_context.predicted_batch_s, "predicted_alone_s": alone.predicted_batch_s,
              "error_in_context_pct": in_context.batch_time_error_pct, "error_alone_pct": alone.batch_time_error_pct}
    print(f"batch time: run {in_context.measured_batch_s * 1e3:.3f} ms; predicted in context "
          f"{in_context.predicted_batch_s * 1e3:.3f} ms ({in_context.batch_time_error_pct:+.1f}%), alone "
          f"{alone.predicted_batch_s * 1e3:.3f} ms ({alone.batch_time_error_pct:+.1f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
