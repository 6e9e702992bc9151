"""Profiling cost: the same profile on 1 and 2 ranks, the harness's overhead, and DistSim's brute-force ratio.

For each rank count: wall time of `harness profile` (start-up excluded: the profile's own clock), the
device-seconds spent measuring, the harness overhead (wall minus time inside measurements, per rank),
and the speed-up from 1 to 2 ranks. Then the profiling cost in device-seconds against brute force:
running the whole iteration on every device of the target job for the same warm-up + repeats.
Run: .venv/bin/python bench/profile_scaling.py   (uses DISTSIM_MPIRUN or the venv's mpirun)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.plan.events import build_plan  # noqa: E402
from harness.plan.spec import loads_spec  # noqa: E402

SPEC = """
[model]
name = "gpt2-small"
layers = {layers}
hidden = 256
heads = 8
ffn = 1024
seq_len = 128
vocab = 4096
[batch]
global = {global_batch}
micro = 2
[strategy]
dp = {dp}
tp = {tp}
pp = {pp}
schedule = "1f1b"
[cluster]
nodes = {nodes}
gpus_per_node = 8
[profile]
warmup = 2
repeats = 10
"""
TARGETS = {  # name: (layers, global batch, dp, tp, pp, nodes)
    "8 devices (dp2 tp2 pp2)": (8, 32, 2, 2, 2, 1),
    "512 devices (dp32 tp2 pp8)": (32, 1024, 32, 2, 8, 64),
}


def profile(spec_text: str, ranks: int, outdir: Path) -> dict:
    spec_path = outdir / "job.toml"
    spec_path.write_text(spec_text)
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    subprocess.run([mpirun, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "harness", "profile",
                    str(spec_path), "-o", str(outdir / "out"), "--quiet"], check=True, env=env, capture_output=True)
    with h5py.File(outdir / "out" / "profile.h5") as f:
        env_attrs = dict(f["environment"].attrs)
        medians = {eid: float(g.attrs["median_s"]) for eid, g in f["measurements"].items()}
        samples = sum(float(g["samples_s"][()].sum()) for g in f["measurements"].values())
    return {"wall_s": float(env_attrs["profiling_wall_s"]), "compute_wall_s": float(env_attrs["compute_wall_s"]),
            "comm_wall_s": float(env_attrs["comm_wall_s"]), "device_s": float(env_attrs["device_seconds"]),
            "samples_s": samples, "medians": medians}


def brute_force_device_seconds(spec_text: str, medians: dict[str, float]) -> float:
    """Every event of one iteration on every device (collectives count once per member), x (warm-up + repeats)."""
    spec = loads_spec(spec_text)
    plan = build_plan(spec)
    per_iteration = 0.0
    for eid, event in plan.events.items():
        if eid in medians:
            members = 1 if event.kind == "compute" else event.group_size
            per_iteration += plan.multiplicity[eid] * members * medians[eid]
    return per_iteration * (spec.profile.warmup + spec.profile.repeats)


def main() -> None:
    print(f"{'target job':<28} {'ranks':>5} {'wall s':>8} {'compute s':>9} {'comm s':>7} {'device s':>9} "
          f"{'overhead s':>11} {'compute speed-up':>17} {'brute force dev-s':>18} {'profile/brute':>14}")
    results = {}
    for name, (layers, global_batch, dp, tp, pp, nodes) in TARGETS.items():
        text = SPEC.format(layers=layers, global_batch=global_batch, dp=dp, tp=tp, pp=pp, nodes=nodes)
        base = None
        for ranks in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                r = profile(text, ranks, Path(tmp))
            overhead = r["wall_s"] * ranks - r["device_s"]
            base = base or r["compute_wall_s"]
            brute = brute_force_device_seconds(text, r["medians"])
            cost = r["wall_s"] * ranks
            print(f"{name:<28} {ranks:>5} {r['wall_s']:>8.2f} {r['compute_wall_s']:>9.2f} {r['comm_wall_s']:>7.2f} "
                  f"{r['device_s']:>9.2f} {overhead:>11.2f} {base / r['compute_wall_s']:>17.2f} {brute:>18.1f} "
                  f"{cost / brute:>13.2%}")
            results[(name, ranks)] = r["wall_s"]
    print(json.dumps({f"{k[0]} / {k[1]} ranks": round(v, 3) for k, v in results.items()}))


if __name__ == "__main__":
    main()
