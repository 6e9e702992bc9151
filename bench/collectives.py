"""Collective bus bandwidth on this machine, and how well a profile's communication curves and fits hold.

    python bench/collectives.py [--ranks 2,4] [--backends torch,mpi4py] [-e 16M] [--iters 20] [--keep DIR]
                                [--profile PROFILE.h5 ...]

1. `harness collectives` for every backend at every rank count (4 ranks on 2 cores are oversubscribed: said
   in the table), all six operations from 8 B to -e by factors of 4; prints each run's average bus bandwidth
   per operation and the side-by-side table of `analysis collectives` (docs/collectives.md).
2. With --profile: every communication fit of each profile against its goal (mean relative error on its
   points within 5%, max within 10%), and every needed message costed from its neighbouring sizes without
   its own measurement against that measurement (goal: within 5%; analysis.costs.held_out_checks).
Figures and how to read them: docs/benchmarks.md ("Collectives").
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIT_MEAN_GOAL, FIT_MAX_GOAL, HELD_OUT_GOAL = 0.05, 0.10, 0.05


def run_collectives(n: int, backend: str, out: Path, end: str, iters: int, begin: str = "8", factor: int = 4,
                    ops: str | None = None, ranks_per_node: int | None = None) -> Path:
    """`harness collectives` on n ranks into `out` (nodes emulated with `ranks_per_node`); exits on failure."""
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if ranks_per_node:
        env["DISTSIM_EMULATE_RANKS_PER_NODE"] = str(ranks_per_node)
    command = [mpirun, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "harness", "collectives",
               "--backend", backend, "-b", begin, "-e", end, "-f", str(factor), "--iters", str(iters), "-o", str(out),
               "--quiet"] + (["--ops", ops] if ops else [])
    nodes = f" ({n // ranks_per_node} emulated node(s) of {ranks_per_node})" if ranks_per_node else ""
    print(f"# {' '.join(command[1:3])} harness collectives --backend {backend} -b {begin} -e {end}{nodes}", flush=True)
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"harness collectives failed:\n{result.stderr[-3000:]}")
    return out


def run_benchmarks(ranks: list[int], backends: list[str], end: str, iters: int, folder: Path) -> list[Path]:
    return [run_collectives(n, backend, folder / f"{backend}-{n}.h5", end, iters)
            for n in ranks for backend in backends]


def report_benchmarks(files: list[Path]) -> None:
    from analysis.collectives import compare_report, load

    runs = load(files)
    cores = os.cpu_count() or 1
    for run in runs:
        if len(run.ranks) > cores:
            print(f"# {run.label}: {len(run.ranks)} ranks on {cores} cores, oversubscribed")
    print(compare_report(runs))


def report_profile(path: str) -> None:
    from analysis.costs import estimate_costs, held_out_checks
    from analysis.profile_reader import layers_for, load_profile, resolve_spec
    from harness.plan.events import build_plan

    profile = load_profile(path)
    spec = resolve_spec(profile, None, None)
    costs = estimate_costs(build_plan(spec, layers_for(profile, spec)), profile)
    print(f"\n# {path}: communication fits (goal: mean error <= {FIT_MEAN_GOAL:.0%}, max <= {FIT_MAX_GOAL:.0%})")
    held = 0
    for (kind, placement), fit in sorted(costs.fits.items()):
        ok = fit.mean_rel_error <= FIT_MEAN_GOAL and fit.max_rel_error <= FIT_MAX_GOAL
        held += ok
        print(f"{kind:14s} {placement:6s} points {fit.points:3d}  mean {fit.mean_rel_error:6.1%}  "
              f"max {fit.max_rel_error:6.1%}  {'holds' if ok else 'misses'}")
    print(f"fits holding: {held} of {len(costs.fits)}")
    checks = held_out_checks(profile)
    within = [c for c in checks if abs(c.rel_error) <= HELD_OUT_GOAL]
    print(f"# needed messages costed from their neighbours, as if unmeasured (goal: within {HELD_OUT_GOAL:.0%})")
    for c in sorted(checks, key=lambda c: -abs(c.rel_error)):
        print(f"{c.kind:14s} {c.placement:6s} x{c.group} {c.nbytes / 1024:10.1f} KiB  measured "
              f"{c.measured_s * 1e6:9.1f} us  from neighbours {c.interpolated_s * 1e6:9.1f} us  {c.rel_error:+7.1%}")
    print(f"within {HELD_OUT_GOAL:.0%}: {len(within)} of {len(checks)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--backends", default="torch,mpi4py")
    parser.add_argument("-e", "--maxbytes", default="16M")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--keep", metavar="DIR", help="keep the benchmark files here")
    parser.add_argument("--profile", nargs="*", default=[], help="profiles whose fits and curves to check")
    parser.add_argument("--no-benchmark", action="store_true", help="only check the profiles")
    args = parser.parse_args()
    if not args.no_benchmark:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(args.keep) if args.keep else Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            files = run_benchmarks([int(n) for n in args.ranks.split(",")], args.backends.split(","),
                                   args.maxbytes, args.iters, folder)
            report_benchmarks(files)
    for path in args.profile:
        report_profile(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
