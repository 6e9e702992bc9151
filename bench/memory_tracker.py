"""The memory model's peak against PyTorch's own accounting (torch.distributed._tools.mem_tracker.MemTracker) on
the jobs whose backwards no formula knows or whose parameters FSDP2 gathers: a factory model of six
`nn.TransformerEncoderLayer`s (bench/factory_model.py) under GPipe and 1F1B, and GPT-2 and that factory model
under ZeRO-3. Each job is profiled (`harness profile`, 2 ranks; timings not meant: 2 repeats) and trained for 3
iterations under MemTracker (bench/accuracy.py's tracked run); the model predicts each stage's peak from the
profile. Usage:

    .venv/bin/python bench/memory_tracker.py [--only NAME | --drawn SEED] [--keep DIR] [--json]

--drawn SEED: instead, the GPT-2 and factory ZeRO-3 jobs among the first 12 that bench/generalization.py draws
from SEED for 2 ranks (any seed: the jobs are not picked to suit the model).

Per stage, MB: predicted / MemTracker, the error, and the temporaries of both at their peaks (goal: within 2%).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.accuracy import ROOT, TRACKER_GOAL_PCT, run, tracker_rows  # noqa: E402

RANKS = 2
DRAWN_JOBS = 12  # --drawn: a seed's first jobs, as bench/generalization.py draws them
FACTORY = 'factory = "bench.factory_model:build"\nlayers = 8\nhidden = 128\nheads = 4\nffn = 512\n' \
          'seq_len = 64\nvocab = 2048\n'
GPT2 = 'name = "gpt2-small"\nlayers = 4\nhidden = 256\nheads = 8\nffn = 1024\nseq_len = 128\nvocab = 2048\n'
# name: ([model] lines, [strategy] lines); 4 micro-batches of 2 each
JOBS = {
    "factory pp=2 gpipe": (FACTORY, 'dp = 1\npp = 2\nschedule = "gpipe"\n'),
    "factory pp=2 1f1b": (FACTORY, 'dp = 1\npp = 2\nschedule = "1f1b"\n'),
    "gpt2 dp=2 zero=3": (GPT2, 'dp = 2\npp = 1\nschedule = "1f1b"\nzero = 3\n'),
    "factory dp=2 zero=3": (FACTORY, 'dp = 2\npp = 1\nschedule = "1f1b"\nzero = 3\n'),
}


def spec_text(model: str, strategy: str) -> str:
    dp = int(strategy.split("dp = ")[1].split("\n")[0])
    return (f"[model]\n{model}dtype = \"float32\"\n[batch]\nglobal = {4 * 2 * dp}\nmicro = 2\n"
            f"[strategy]\n{strategy}tp = 1\n[cluster]\nnodes = 1\ngpus_per_node = {RANKS}\n"
            "[profile]\nwarmup = 1\nrepeats = 2\nprecision = 0.5\nbudget_s = 0.001\n")


def drawn_jobs(seed: int) -> dict[str, str]:
    """The GPT-2 and factory ZeRO-3 jobs among the first DRAWN_JOBS the generalization suite draws from `seed` for
    RANKS ranks (bench/generalization.py), by name -> spec text (2 repeats, as the others here)."""
    from bench.generalization import draw_jobs

    return {f"{seed}/{job.index + 1} {job.name}": job.spec.to_toml().replace(
        f"repeats = {job.spec.profile.repeats}", "repeats = 2") for job in draw_jobs(seed, DRAWN_JOBS, RANKS)
        if job.spec.strategy.zero == 3 and (job.spec.model.factory or job.spec.model.family == "gpt2")}


def measure(text: str, workdir: Path, env: dict) -> list[dict]:
    """Profile the job, train it under MemTracker, and return bench/accuracy.py's tracker rows (per stage)."""
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "job.toml"
    spec.write_text(text)
    launch = [mpirun, "-n", str(RANKS), sys.executable, "-m", "mpi4py"]
    run(launch + ["-m", "harness", "profile", str(spec), "-o", str(workdir / "prof"), "--quiet", "--force"], env)
    run(launch + [str(ROOT / "bench" / "accuracy.py"), "--tracked-run", str(spec), str(workdir / "tracked")], env)
    return tracker_rows(workdir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(JOBS), help="run one job by name")
    parser.add_argument("--keep", metavar="DIR", help="keep each job's spec, profile and tracked run under DIR")
    parser.add_argument("--drawn", type=int, metavar="SEED", help="instead, the GPT-2 and factory ZeRO-3 jobs "
                        f"among the first {DRAWN_JOBS} the generalization suite draws from SEED for {RANKS} ranks")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if args.drawn is not None:
        jobs = drawn_jobs(args.drawn)
        if not jobs:
            print(f"seed {args.drawn} draws no GPT-2 or factory ZeRO-3 job among its first {DRAWN_JOBS}")
            return
    else:
        jobs = {name: spec_text(*JOBS[name]) for name in JOBS if not args.only or name == args.only}
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.keep) if args.keep else Path(scratch)
        for name, text in jobs.items():
            results[name] = measure(text, root / "".join(c if c.isalnum() else "-" for c in name), env)
            if not args.json:
                for row in results[name]:
                    print(f"{name:<24} stage {row['stage']}: {row['predicted_bytes'] / 1e6:8.3f} / "
                          f"{row['tracker_bytes'] / 1e6:8.3f} MB {row['error_pct']:+6.2f}%   temporaries "
                          f"{row['predicted_temporaries_bytes'] / 1e6:.3f} / {row['tracker_temp_bytes'] / 1e6:.3f}",
                          flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    worst = max(abs(row["error_pct"]) for rows in results.values() for row in rows)
    print(f"largest |error| {worst:.2f}% (goal {TRACKER_GOAL_PCT:g}%)")


if __name__ == "__main__":
    main()
