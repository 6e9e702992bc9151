"""Scaling of one job with data parallelism, gradients all-reduced through torch.distributed (gloo) or MPI.

Strong scaling: one GPT-2-like job (the accuracy bench's model), global batch 16 in micro-batches of 2, trained
at dp = 1, 2 and 4 (4 ranks oversubscribe these 2-core machines: flagged) with `harness train --backend torch`
and `--backend mpi4py`, the runs of one size back to back, then `analysis scaling` over all of them (a series
per backend) with the breakdown's shares; with --profile, each backend's profile of the dp = 2 job predicts
every run too. Runs on up to 2 ranks are bound to a core each.

    .venv/bin/python bench/scaling.py [--dp 1,2,4] [--iterations 12] [--profile] [--keep DIR] [--json]

Prints analysis scaling's table and the breakdown shares of each run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.accuracy import run  # noqa: E402 (needs the sys.path above: bench/ is run from a checkout)
from bench.accuracy import spec_text as accuracy_spec  # noqa: E402 (as above)

BACKENDS = ("torch", "mpi4py")
GLOBAL_BATCH, MICRO = 16, 2
CORES = os.cpu_count() or 2


def spec_text(dp: int) -> str:
    """The accuracy bench's job at `dp` replicas, the global batch fixed (strong scaling)."""
    return accuracy_spec(dp, 1, 1, "1f1b", GLOBAL_BATCH // (dp * MICRO), MICRO, repeats=20)


def launch(ranks: int) -> list[str]:
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    binding = ["--bind-to", "core"] if ranks <= CORES else []
    return [mpirun, *binding, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "harness"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", default="1,2,4", help="data-parallel sizes (default 1,2,4)")
    parser.add_argument("--iterations", type=int, default=12, help="iterations per run, 2 of them warm-up")
    parser.add_argument("--profile", action="store_true", help="profile the dp = 2 job per backend and predict")
    parser.add_argument("--keep", type=Path, help="keep the runs (and profiles) in this folder")
    parser.add_argument("--json", action="store_true", help="print analysis scaling's JSON")
    args = parser.parse_args()
    sizes = [int(d) for d in args.dp.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        runs, profiles = [], []
        for dp in sizes:
            spec = root / f"dp{dp}.toml"
            spec.write_text(spec_text(dp))
            for backend in BACKENDS:
                rundir = root / f"dp{dp}-{backend}"
                print(f"training dp={dp} with --backend {backend}"
                      + (" (oversubscribed)" if dp > CORES else ""), file=sys.stderr, flush=True)
                run(launch(dp) + ["train", str(spec), "-o", str(rundir), "--iterations", str(args.iterations),
                                  "--warmup", "2", "--backend", backend], env)
                runs.append(str(rundir))
                if args.profile and dp == 2:
                    outdir = root / f"profile-{backend}"
                    run(launch(2) + ["profile", str(spec), "-o", str(outdir), "--quiet", "--force", "--backend",
                                     backend], env)
                    profiles += ["--profile", str(outdir / "profile.h5")]
        scaling = run([sys.executable, "-m", "analysis", "scaling", *runs, *profiles,
                       *(["--json"] if args.json else [])], env)
        print(scaling.stdout, end="")
        if args.json:
            return 0
        shares = run([sys.executable, "-m", "analysis", "breakdown", *runs, "--json"], env)
        print("\nbreakdown shares (all ranks together; dp-sync: the gradient all-reduce phase per rank)")
        print(f"{'run':<16}{'compute %':>10}{'comm %':>8}{'idle %':>8}{'overlap %':>10}{'dp-sync/rank':>14}")
        for source, data in zip(runs, json.loads(shares.stdout)["runs"]):
            summary = data["summary"]
            sync = next((p["time_per_rank_s"] for p in data["phase_summary"] if p["phase"] == "dp-sync"), 0.0)
            overlap = summary["overlap_pct"]
            print(f"{Path(source).name:<16}{summary['compute_pct']:>10.1f}{summary['communication_pct']:>8.1f}"
                  f"{summary['idle_pct']:>8.1f}{'-' if overlap is None else f'{overlap:.1f}':>10}"
                  f"{sync * 1e3:>11.1f} ms")
        if any(dp > CORES for dp in sizes):
            print(f"NOTE: dp > {CORES} oversubscribes this machine's {CORES} cores: those rows measure sharing, "
                  "not scaling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
