"""Benchmark: a strategy search of over 1,000 candidates of up to 16,384 GPUs, from one synthetic profile.

The GPT-3-like model of bench/simulate_scale.py (96 layers, hidden 12288, bf16, global batch 16384), searched
over gpus 1,024..16,384, dp 16..256, tp 1..8, pp 1..16, micro-batch sizes 1..32 and the three schedules
(interleaved with 2 and 4 chunks), on 141 GB devices (an H200; without activation recompute no candidate fits
80 GB). The profile is synthetic (bench/synthetic.py): what a 2-node profile of the grid's union would hold.

    python bench/search_scale.py [--jobs N] [--keep DIR] [--ranks 1,2,3]
    python bench/search_scale.py --spec-only [--jobs N]

Prints the whole `python -m analysis search` process's wall time (goal: under 30 s on 2 cores) and the time
per candidate as the grid grows (it should grow no faster than linearly); exits 1 past the goal. `--ranks`:
instead, the whole grid (without intervals, `--resamples 0`: the part spread over ranks) once per rank count, in
one process (1) or under `mpirun -n R python -m mpi4py.futures` (R - 1 workers), and the candidates per second.
`--spec-only`: instead, `analysis search SPEC --auto` from a spec alone (no profile): Megatron-LM's own GPT-3 175B
example (tests/data/megatron) on 1,024 A100 80GB in DGX A100 nodes (harness/jobs/dgx-a100.toml's network), every
valid strategy; prints the whole process's wall and CPU seconds (goal: under 60 s on 2 cores), how many candidates
the memory ruled out before planning and before simulating, how many fit but were bounded out of the fastest's
reach (not simulated), and the pick.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.synthetic import write_synthetic_profile  # noqa: E402
from harness.plan.candidates import expand  # noqa: E402
from harness.plan.device import load_device  # noqa: E402
from harness.plan.importers.megatron import from_megatron  # noqa: E402
from harness.plan.spec import load_spec, parse_spec  # noqa: E402

GOAL_S = 30.0
SPEC_ONLY_GOAL_S = 60.0
ROOT = Path(__file__).resolve().parents[1]
SPEC = {
    "model": {"name": "gpt2-xl", "layers": 96, "hidden": 12288, "heads": 96, "ffn": 49152, "seq_len": 2048,
              "vocab": 51200, "dtype": "bfloat16"},
    "batch": {"global": 16384, "micro": 1},
    "strategy": {"dp": 256, "tp": 8, "pp": 8, "schedule": "1f1b"},
    "cluster": {"nodes": 2048, "gpus_per_node": 8, "device_memory_gb": 141},
    "optimizer": {"name": "adam", "master_weights": True},
    "profile": {"warmup": 5, "repeats": 20},
    "search": {"gpus": [1024, 2048, 4096, 8192, 16384], "dp": [16, 32, 64, 128, 256], "tp": [1, 2, 4, 8],
               "pp": [1, 2, 4, 8, 16], "micro": [1, 2, 4, 8, 16, 32],
               "schedule": ["gpipe", "1f1b", "interleaved-1f1b"], "chunks": [2, 4]},
}
# smaller grids, for the time per candidate as the grid grows
SUBSETS = ({"gpus": [16384], "micro": [1, 2]}, {"gpus": [8192, 16384], "micro": [1, 2, 4]},
           {"gpus": [4096, 8192, 16384]}, {})


def run_search(profile: Path, spec: dict, tmp: Path, jobs: int | None, ranks: int = 0,
               extra: tuple[str, ...] = ()) -> tuple[float, dict]:
    """The whole process of `python -m analysis search` on `spec`'s grid: wall seconds and its JSON; with `ranks`,
    under `mpirun -n ranks python -m mpi4py.futures`."""
    spec_path = tmp / "grid.toml"
    spec_path.write_text(parse_spec(spec, source="bench").to_toml(search=True))
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    launch = [mpirun, "-n", str(ranks), sys.executable, "-m", "mpi4py.futures"] if ranks else [sys.executable]
    command = launch + ["-m", "analysis", "search", str(profile), "--spec", str(spec_path), "--json",
                        "--quiet", *extra] + (["--jobs", str(jobs)] if jobs else [])
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"search failed: {done.stderr}")
    return elapsed, json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, help="worker processes of the search (default: one per core)")
    parser.add_argument("--keep", type=Path, help="keep the synthetic profile here")
    parser.add_argument("--ranks", help="rank counts to spread the whole grid over (1: one process, one core)")
    parser.add_argument("--spec-only", action="store_true",
                        help="a 175B --auto search from a spec alone on 1,024 A100s instead (module docstring)")
    args = parser.parse_args()
    if args.spec_only:
        return spec_only(args.jobs)
    spec = parse_spec(SPEC, source="bench")
    grid = expand(spec)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = args.keep or tmp
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        unique = write_synthetic_profile(folder / "profile.h5", spec, np.random.default_rng(0))
        print(f"grid: {len(grid)} candidates ({len(grid.rejected)} combinations rejected); synthetic profile of "
              f"their {unique} unique events written in {time.perf_counter() - start:.1f} s")
        if args.ranks:
            return by_ranks(folder / "profile.h5", [int(r) for r in args.ranks.split(",")], len(grid), tmp)
        print(f"\n{'candidates':>10} {'whole process s':>16} {'ms per candidate':>17} {'feasible':>9}  best")
        rows = []
        for subset in SUBSETS:
            sub = {**SPEC, "search": {**SPEC["search"], **subset}}
            count = len(expand(parse_spec(sub, source="bench")))
            seconds, report = run_search(folder / "profile.h5", sub, tmp, args.jobs)
            feasible = sum(c["feasible"] for c in report["candidates"])
            best = report["best"]["strategy"] if report["best"] else "-"
            rows.append((count, seconds))
            print(f"{count:>10,} {seconds:>16.1f} {seconds / count * 1e3:>17.2f} {feasible:>9,}  {best}")
    count, seconds = rows[-1]
    print(f"\nthe whole grid: {count:,} candidates in {seconds:.1f} s (goal: at least 1,000 in under {GOAL_S:.0f} s)")
    return 0 if count >= 1000 and seconds < GOAL_S else 1


def spec_only(jobs: int | None) -> int:
    """The 175B --auto search from a spec alone: wall and CPU seconds of the whole process, what the memory ruled
    out where, the pick."""
    imported = from_megatron(str(ROOT / "tests/data/megatron/train_gpt3_175b_distributed.sh"), gpus=1024).spec
    cluster = load_spec(ROOT / "harness/jobs/dgx-a100.toml").to_dict()["cluster"]
    data = imported.to_dict()
    data["cluster"] = {**data["cluster"], "device": "a100-80gb", "network": cluster["network"]}
    # that file's NVLink tier passes buffers through the A100 40GB's HBM: this one's is the 80GB's
    data["cluster"]["network"][0]["memory_gbs"] = load_device("a100-80gb").memory_bandwidth / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "gpt3-175b.toml"
        spec_path.write_text(parse_spec(data, source="bench").to_toml())
        command = [sys.executable, "-m", "analysis", "search", str(spec_path), "--auto", "--json", "--quiet"] + (
            ["--jobs", str(jobs)] if jobs else [])
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"search failed: {done.stderr}")
    report = json.loads(done.stdout)
    candidates = report["candidates"]
    floor = sum(c["memory_floor_bytes"] is not None for c in candidates)
    peak = sum(c["too_large"] and c["memory_floor_bytes"] is None for c in candidates)
    simulated = sum(c["batch_time_s"] is not None for c in candidates)
    pruned = sum(c["pruned"] for c in candidates)
    rejected = sum(r["count"] for r in report["rejected"])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"GPT-3 175B on 1,024 A100 80GB, --auto from a spec: {len(candidates):,} candidates ({rejected:,} "
          f"combinations rejected by the spec's rules)")
    print(f"  ruled out by a memory floor (model states, or with the micro-batches in flight; not planned): {floor:,}; "
          f"by the modelled peak (not simulated): {peak:,}; fit but out of the fastest's reach by their least batch "
          f"time (not simulated): {pruned:,}; simulated: {simulated:,}")
    best = report["best"]
    print(f"  pick: {best['strategy'] if best else '-'}"
          + (f", {best['batch_time_s']:.2f} s an iteration" if best else ""))
    print(f"whole process: {wall:.1f} s wall, {cpu:.1f} s CPU (goal: under {SPEC_ONLY_GOAL_S:.0f} s wall)")
    return 0 if wall < SPEC_ONLY_GOAL_S else 1


def by_ranks(profile: Path, ranks: list[int], count: int, tmp: Path) -> int:
    """The whole grid without intervals at each rank count: wall seconds and candidates per second."""
    print(f"\n{'ranks':>5} {'workers':>7} {'whole process s':>16} {'candidates/s':>13}  best")
    for r in ranks:
        seconds, report = run_search(profile, SPEC, tmp, 1, ranks=r if r > 1 else 0, extra=("--resamples", "0"))
        best = report["best"]["strategy"] if report["best"] else "-"
        print(f"{r:>5} {max(r - 1, 1):>7} {seconds:>16.1f} {count / seconds:>13.1f}  {best}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
