"""Is the search right? Every candidate of a small grid run for real on 2 ranks (CPU, gloo), against the search's
prediction from one profile of the grid.

The model of bench/accuracy.py (4 layers, hidden 256, seq 128; an iteration takes 200-600 ms here) at global
batch 8 on 2 ranks: dp=2, pp=2 and tp=2, micro-batch sizes 1, 2 and 4 (so 2 to 8 micro-batches), GPipe and
1F1B. One `harness profile` of the grid, one `analysis search`, then `harness train` of every candidate (the
ranks bound to a core each, as both commands run in bench/accuracy.py). Prints, per candidate, predicted
against measured batch time (the median of the run's measured iterations) and peak memory (the largest
device's), then Spearman's rank correlation of the two times, the regret (the measured time of the
predicted best over the measured best, minus one) and the largest memory error.
Goals: Spearman at least 0.9, regret at most 2%, memory within 3%.

--grid strategies searches activation recompute and ZeRO instead (pp 1 and 2, recompute none and full, zero 0, 1
and 3 where dp = 2) with a device memory just below the smallest peak of the candidates that neither recompute
nor shard, so that only a strategy that recomputes or shards fits: the search must find one, and the rows say
which fit (ZeRO runs have no meter peak on a CPU: FSDP2 refills storages in place; docs/analysis.md).

--grid schedules ranks the pipeline schedules, zero-bubble among them: pp = 2 with GPipe, 1F1B and ZB-H1 at
micro-batch sizes 1, 2 and 4 (9 candidates).

--grid experts searches a Mixture-of-Experts form of the model (4 experts of 512, top-2, zipf:1.2 routing): ep 1
and 2 (out of dp), pp 1 and 2, micro-batch sizes 1, 2 and 4.

    python bench/search_accuracy.py [--grid parallelism|strategies|schedules|experts] [--iterations 12] [--repeats 40]
                                    [--keep DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.accuracy import MODEL, ROOT, run  # noqa: E402

GOALS = {"spearman": 0.9, "regret_pct": 2.0, "memory_error_pct": 3.0}
JOB = """[batch]
global = 8
micro = {micro}
[strategy]
dp = 2
[cluster]
nodes = 1
gpus_per_node = 2
[profile]
warmup = 3
repeats = {repeats}
[search]
"""
# each grid: the job's micro-batch size, its [search] lines and [model] lines it adds
GRIDS = {"parallelism": (1, 'tp = [1, 2]\npp = [1, 2]\nmicro = [1, 2, 4]\nschedule = ["gpipe", "1f1b"]\n', ""),
         "strategies": (2, 'pp = [1, 2]\nrecompute = ["none", "full"]\nzero = [0, 1, 3]\n', ""),
         "schedules": (1, 'pp = [2]\nmicro = [1, 2, 4]\nschedule = ["gpipe", "1f1b", "zb-h1"]\n', ""),
         "experts": (2, 'ep = [1, 2]\npp = [1, 2]\nmicro = [1, 2, 4]\n',
                     'experts = 4\ntop_k = 2\nexpert_ffn = 512\nrouting = "zipf:1.2"\n')}


def ranks(values: list[float]) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    order = np.argsort(values, kind="stable")
    out = np.empty(len(values))
    sorted_values = np.asarray(values)[order]
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and sorted_values[j + 1] == sorted_values[i]:
            j += 1
        out[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks."""
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def regret_pct(predicted: list[float], measured: list[float]) -> float:
    """How much slower the predicted best runs than the measured best, in %."""
    chosen = int(np.argmin(predicted))
    return (measured[chosen] / min(measured) - 1) * 100


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=12, help="training iterations per candidate (2 warm-up)")
    parser.add_argument("--repeats", type=int, default=40, help="profile repeats per event")
    parser.add_argument("--keep", metavar="DIR", help="keep the spec, profile and every run under DIR")
    parser.add_argument("--json", action="store_true", help="print the rows and figures as JSON")
    parser.add_argument("--grid", choices=list(GRIDS), default="parallelism",
                        help="what to search: dp, tp, pp, micro-batches and schedules (default), recompute and ZeRO "
                        "under a memory limit that only they fit, the pipeline schedules with zero-bubble, or ep "
                        "with pp and micro-batches for a Mixture-of-Experts model")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    launch = [mpirun, "--bind-to", "core", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "harness"]
    from analysis.trace_reader import read_trace
    from harness.candidates import candidate_label, expand
    from harness.hdf5_schema import PEAK_MEMORY_ATTR
    from harness.spec import load_spec

    with nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory() as root:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        spec = root / "grid.toml"
        micro, grid, model = GRIDS[args.grid]
        spec.write_text(MODEL.replace("[model]\n", "[model]\n" + model) + JOB.format(micro=micro, repeats=args.repeats)
                        + grid)
        run(launch + ["profile", str(spec), "-o", str(root / "prof"), "--quiet", "--force"], env)
        search = [sys.executable, "-m", "analysis", "search", str(root / "prof"), "--json", "--quiet"]
        found = json.loads(run(search, env).stdout)
        limit_gb = None
        if args.grid == "strategies":  # just below every plain candidate: only recompute or ZeRO can fit
            plain = [c["peak_memory_bytes"] for c in found["candidates"] if c["peak_memory_bytes"] is not None
                     and "recompute=" not in c["strategy"] and "zero=" not in c["strategy"]]
            limit_gb = 0.999 * min(plain) / 1e9
            found = json.loads(run(search + ["--memory-gb", repr(limit_gb)], env).stdout)
        jobs = {candidate_label(job): job for job in expand(load_spec(spec, import_factory=False)).candidates}
        rows = []
        for index, candidate in enumerate(c for c in found["candidates"] if c["batch_time_s"] is not None):
            folder = root / f"c{index:02d}"
            folder.mkdir(exist_ok=True)
            (folder / "job.toml").write_text(jobs[candidate["strategy"]].to_toml())
            run(launch + ["train", str(folder / "job.toml"), "-o", str(folder / "run"), "--iterations",
                          str(args.iterations), "--warmup", "2"], env)
            trace = read_trace(folder / "run")
            measured_s = float(np.median(trace.iteration_times()))
            peaks = [int(d.attrs[PEAK_MEMORY_ATTR]) for d in trace.devices.values() if PEAK_MEMORY_ATTR in d.attrs]
            measured_peak = max(peaks) if peaks else None
            # as analysis validate compares: the meter cannot see a recomputed layer's re-made activations
            compared = max(s["metered_bytes"] for s in candidate["memory_stages"])
            rows.append({"strategy": candidate["strategy"], "predicted_s": candidate["batch_time_s"],
                         "measured_s": measured_s,
                         "error_pct": (candidate["batch_time_s"] - measured_s) / measured_s * 100,
                         "predicted_peak_bytes": candidate["peak_memory_bytes"], "measured_peak_bytes": measured_peak,
                         "memory_error_pct": (compared - measured_peak) / measured_peak * 100
                         if measured_peak else None,
                         "feasible": candidate["feasible"]})
            if not args.json:
                print(_line(rows[-1]), flush=True)
    predicted, measured = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    fitting = [r for r in rows if r["feasible"]] if limit_gb is not None else rows
    figures = {"candidates": len(rows), "spearman": spearman(predicted, measured),
               # among what fits: with a memory limit, the best is the best of the feasible candidates
               "regret_pct": regret_pct([r["predicted_s"] for r in fitting], [r["measured_s"] for r in fitting])
               if fitting else None,
               "memory_error_pct": max((abs(r["memory_error_pct"]) for r in rows if r["memory_error_pct"] is not None),
                                       default=None),
               "memory_limit_gb": limit_gb, "feasible": [r["strategy"] for r in fitting] if limit_gb else None,
               "profiling": found["profiling"]}
    if args.json:
        print(json.dumps({"rows": rows, **figures}, indent=2))
    else:
        if limit_gb is not None:
            print(f"\nmemory limit {limit_gb * 1e3:.2f} MB per device: {len(fitting)} of {len(rows)} candidates fit "
                  f"({', '.join(figures['feasible']) or 'none'}); the search chose "
                  f"{fitting[int(np.argmin([r['predicted_s'] for r in fitting]))]['strategy'] if fitting else '-'}")
        if not fitting:
            print("no candidate fits: the search found no strategy (MISSED)")
            return 1
        met = {k: figures[k] is not None and (figures[k] >= v if k == "spearman" else figures[k] <= v)
               for k, v in GOALS.items()}
        memory = f"{figures['memory_error_pct']:.2f}%" if figures["memory_error_pct"] is not None else "-"
        print(f"\nSpearman {figures['spearman']:.3f} (goal >= {GOALS['spearman']}: {_met(met['spearman'])}), regret "
              f"{figures['regret_pct']:.2f}% (goal <= {GOALS['regret_pct']:g}%: {_met(met['regret_pct'])}), "
              f"memory within {memory} (goal <= {GOALS['memory_error_pct']:g}%: {_met(met['memory_error_pct'])})")
        if found["profiling"]:
            print(f"profiling the grid: {found['profiling']['profile_device_s']:.1f} device-s, "
                  f"{100 * found['profiling']['fraction']:.1f}% of running every candidate with the same repeats")
    return 0


def _line(r: dict) -> str:
    measured = (f"{r['measured_peak_bytes'] / 1e6:6.2f} MB ({r['memory_error_pct']:+.2f}%)"
                if r["measured_peak_bytes"] else "     - MB")
    return (f"{r['strategy']:<48} predicted {r['predicted_s'] * 1e3:7.1f} ms  measured {r['measured_s'] * 1e3:7.1f} ms "
            f"({r['error_pct']:+5.1f}%)  peak {r['predicted_peak_bytes'] / 1e6:6.2f} / {measured}"
            f"{'' if r['feasible'] else '  (does not fit)'}")


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    sys.exit(main())
