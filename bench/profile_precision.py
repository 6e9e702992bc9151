"""How far independent profiles of one job agree: the precision of `harness profile` on this machine.

For each of the accuracy bench's configurations (bench/accuracy.py), --profiles independent profiles on 2 ranks
(each with --force into its own folder, bound to cores as the accuracy bench binds), each sampled to
--precision within --budget-s (harness profile; docs/profiling.md, "Precision"), and each one's predicted
batch time (analysis simulate). A row prints the predictions, their spread (max over min, minus one), the mean
width of each prediction's own 90% interval (docs/analysis.md, "How far to trust a prediction"), how many of
the other profiles' predictions fall inside each one's interval, the compute events that missed the precision
(over all profiles) and the mean profiling wall time. Goal: a spread within 2% in every row.
--baseline also takes the same profiles the old way, `repeats` samples and no more (a precision of 50% whose
budget the repeats spend), for the spread side by side.
Run: .venv/bin/python bench/profile_precision.py [--profiles 5] [--precision 0.02] [--budget-s 60]
     [--repeats 10] [--only NAME] [--baseline] [--keep DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.accuracy import CONFIGS, spec_text  # noqa: E402

GOAL_PCT = 2.0  # issue 22: five profiles' predictions within 2% of each other in every row


def run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{result.stderr[-3000:]}")
    return result


def profile_once(spec: Path, outdir: Path, precision: float, budget_s: float, env: dict) -> dict:
    """One profile of `spec` into `outdir` and its prediction: batch time, interval, wall time, misses."""
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    start = time.perf_counter()
    out = run([mpirun, "--bind-to", "core", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "harness", "profile",
               str(spec), "-o", str(outdir), "--force", "--quiet", "--precision", repr(precision),
               "--budget-s", repr(budget_s)], env)
    wall = time.perf_counter() - start
    missed = next((int(line.split()[0]) for line in out.stdout.splitlines() if "missed the precision" in line), 0)
    report = json.loads(run([sys.executable, "-m", "analysis", "simulate", str(outdir), "--json"], env).stdout)
    return {"batch_time_s": report["batch_time_s"], "p5_s": report["batch_time_p5_s"],
            "p95_s": report["batch_time_p95_s"], "wall_s": wall, "missed": missed}


def row_of(profiles: list[dict]) -> dict:
    times = [p["batch_time_s"] for p in profiles]
    inside = sum(1 for i, p in enumerate(profiles) for j, q in enumerate(profiles)
                 if i != j and p["p5_s"] <= q["batch_time_s"] <= p["p95_s"])
    pairs = len(profiles) * (len(profiles) - 1)
    return {"predicted_ms": [t * 1e3 for t in times], "spread_pct": (max(times) / min(times) - 1) * 100,
            "interval_width_pct": float(np.mean([(p["p95_s"] - p["p5_s"]) / p["batch_time_s"] * 100
                                                 for p in profiles])),
            "others_inside": f"{inside}/{pairs}", "missed": sum(p["missed"] for p in profiles),
            "wall_s": float(np.mean([p["wall_s"] for p in profiles]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=int, default=5, help="independent profiles per configuration")
    parser.add_argument("--precision", type=float, default=0.02, help="harness profile --precision (a fraction)")
    parser.add_argument("--budget-s", dest="budget_s", type=float, default=60.0, help="harness profile --budget-s")
    parser.add_argument("--repeats", type=int, default=10, help="the spec's repeats (the minimum)")
    parser.add_argument("--only", choices=list(CONFIGS), help="one configuration by name")
    parser.add_argument("--baseline", action="store_true", help="also profile with the repeats alone")
    parser.add_argument("--keep", metavar="DIR", help="keep every profile under DIR (CONFIG-WAY-pN/)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if args.profiles < 2:
        print("bench/profile_precision.py: --profiles must be at least 2 to have a spread", file=sys.stderr)
        sys.exit(2)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ways = [("precision", args.precision, args.budget_s)] + ([("repeats only", 0.5, 1e-3)] if args.baseline else [])
    rows: dict[str, dict] = {}
    if not args.json:
        print(f"{'configuration':<16} {'sampling':<13} {'spread %':>9} {'interval %':>11} {'others in':>10} "
              f"{'missed':>7} {'wall s':>7}  predicted ms")
    with nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory() as root:
        for name in (n for n in CONFIGS if not args.only or n == args.only):
            slug = name.replace(' ', '_').replace('=', '')
            Path(root).mkdir(parents=True, exist_ok=True)
            spec = Path(root) / f"{slug}.toml"
            spec.write_text(spec_text(*CONFIGS[name], repeats=args.repeats))
            for way, precision, budget in ways:
                profiles = [profile_once(spec, Path(root) / f"{slug}-{way.replace(' ', '_')}-p{i}", precision,
                                         budget, env) for i in range(args.profiles)]
                row = rows.setdefault(name, {})[way] = row_of(profiles)
                if not args.json:
                    print(f"{name:<16} {way:<13} {row['spread_pct']:>9.2f} {row['interval_width_pct']:>11.2f} "
                          f"{row['others_inside']:>10} {row['missed']:>7} {row['wall_s']:>7.1f}  "
                          + " ".join(f"{t:.1f}" for t in row["predicted_ms"]), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    within = sum(1 for r in rows.values() if r["precision"]["spread_pct"] <= GOAL_PCT)
    print(f"\nrows whose {args.profiles} profiles' predictions spread within {GOAL_PCT:g}% "
          f"(precision {args.precision:.1%}, budget {args.budget_s:g} s): {within} of {len(rows)}")


if __name__ == "__main__":
    main()
