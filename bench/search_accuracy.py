"""Is the search right? Every candidate of a small grid run for real on 2 ranks (CPU, gloo), against the search's
prediction, in rounds interleaved in time.

The model of bench/accuracy.py (4 layers, hidden 256, seq 128; an iteration takes 200-600 ms here) at global
batch 8 on 2 ranks: dp=2, pp=2 and tp=2, micro-batch sizes 1, 2 and 4 (so 2 to 8 micro-batches), GPipe and
1F1B. `--rounds K` rounds (default 3), each one `harness profile` of the grid, one `analysis search`, then
`harness train` of every candidate, in an order turned by a K-th of the list each round and reversed every other
round, so that no candidate always runs at the same minute after its profile (the ranks bound to a core each,
as both commands run in bench/accuracy.py). A round's runs are paired with its own profile's predictions, so
the machine's drift between rounds cancels in each round's errors and ratios.

Per candidate: its predicted and measured batch time (the median over rounds of each round's prediction, and of
each round's run median), the measured range over rounds, its error (the median of the rounds' errors) and peak
memory (the largest device's). Then:
- the runs *tell apart* two candidates where their measured ranges over the rounds do not overlap (with three
  rounds two candidates of one true speed do so by chance 10% of the time: a 90% test); candidates that the
  runs cannot tell from the fastest of theirs form one *tier*, tier after tier from the fastest measured;
- Spearman's rank correlation of predicted and measured times, over every candidate (`spearman`) and with the
  candidates of one tier sharing their rank, what the runs can tell apart (`spearman_told_apart`), and the
  share of the pairs the runs tell apart that the predictions order the same way (`concordant_pct`);
- the regret: in each round the measured time of the search's recommended candidate (analysis search's
  `recommended`: the least memory among those indistinguishable from its fastest) over the same round's run of
  the best measured candidate (the smallest median over rounds), minus one; the median over rounds. Also for the
  fastest predicted. `regret_within_noise`: the runs cannot tell the pick from the best;
- the largest memory error over rounds.
Goals: Spearman over what the runs tell apart at least 0.9, regret at most 2%, memory within 3%.
`--rounds 1` is one profile against one run of each: the runs then tell nothing apart (one tier, no
`spearman_told_apart`).

--grid strategies searches activation recompute and ZeRO instead (pp 1 and 2, recompute none and full, zero 0, 1
and 3 where dp = 2) with a device memory just below the smallest peak of the candidates that neither recompute
nor shard (from the first round's search, kept for the others), so that only a strategy that recomputes or shards
fits: the search must find one, and the rows say which fit (ZeRO runs have no meter peak on a CPU: FSDP2 refills
storages in place; docs/analysis.md).

--grid schedules ranks the pipeline schedules, zero-bubble among them: pp = 2 with GPipe, 1F1B and ZB-H1 at
micro-batch sizes 1, 2 and 4 (9 candidates).

--grid experts searches a Mixture-of-Experts form of the model (4 experts of 512, top-2, zipf:1.2 routing): ep 1
and 2 (out of dp), pp 1 and 2, micro-batch sizes 1, 2 and 4.

    python bench/search_accuracy.py [--grid parallelism|strategies|schedules|experts] [--rounds 3]
                                    [--iterations 12] [--repeats 40] [--keep DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.accuracy import MODEL, ROOT, run  # noqa: E402

MPIRUN = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
LAUNCH = [MPIRUN, "--bind-to", "core", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "harness"]

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


def told_apart(a: list[float], b: list[float]) -> bool:
    """Whether two candidates' measured times over the rounds (paired by round) can be told apart: their ranges
    do not overlap. One round each tells nothing apart."""
    if len(a) < 2 or len(b) < 2:
        return False
    return max(a) < min(b) or max(b) < min(a)


def tiers(measured: list[list[float]]) -> list[int]:
    """Each candidate's tier: from the fastest measured (by its median over rounds), each tier holds the
    candidates not yet in one that the runs cannot tell from the tier's first; tier 0 is the fastest."""
    order = sorted(range(len(measured)), key=lambda i: (float(np.median(measured[i])), i))
    out = [-1] * len(measured)
    tier = -1
    for i in order:
        if out[i] >= 0:
            continue
        tier += 1
        for k in order:
            if out[k] < 0 and (k == i or not told_apart(measured[i], measured[k])):
                out[k] = tier
    return out


def concordance(predicted: list[float], measured: list[list[float]]) -> tuple[int, int]:
    """(pairs the runs tell apart that the predictions order the same way, pairs the runs tell apart); a pair
    predicted alike (to rounding: GPipe and 1F1B without a pipeline are one timeline) is not ordered."""
    same = told = 0
    for i in range(len(measured)):
        for k in range(i + 1, len(measured)):
            if told_apart(measured[i], measured[k]):
                told += 1
                same += bool(not math.isclose(predicted[i], predicted[k], rel_tol=1e-9)
                             and (predicted[i] < predicted[k]) == (np.median(measured[i]) < np.median(measured[k])))
    return same, told


def paired_regret(chosen: list[int], measured: list[list[float]]) -> list[float]:
    """Per round r, in %: the run of the candidate chosen in that round (chosen[r]) over the same round's run of
    the best measured candidate (the smallest median over rounds), minus one."""
    best = min(range(len(measured)), key=lambda i: (float(np.median(measured[i])), i))
    return [(measured[c][r] / measured[best][r] - 1) * 100 for r, c in enumerate(chosen)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of one profile, one search and a run of every candidate (default 3)")
    parser.add_argument("--iterations", type=int, default=12, help="training iterations per candidate (2 warm-up)")
    parser.add_argument("--repeats", type=int, default=40, help="profile repeats per event")
    parser.add_argument("--keep", metavar="DIR", help="keep the spec, profiles and every run under DIR")
    parser.add_argument("--json", action="store_true", help="print the rows and figures as JSON")
    parser.add_argument("--grid", choices=list(GRIDS), default="parallelism",
                        help="what to search: dp, tp, pp, micro-batches and schedules (default), recompute and ZeRO "
                        "under a memory limit that only they fit, the pipeline schedules with zero-bubble, or ep "
                        "with pp and micro-batches for a Mixture-of-Experts model")
    args = parser.parse_args()
    if args.rounds < 1 or args.iterations < 3 or args.repeats < 1:
        print("search_accuracy: --rounds and --repeats must be at least 1 and --iterations at least 3 (2 are "
              "warm-up)", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory() as root:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        spec = root / "grid.toml"
        micro, grid, model = GRIDS[args.grid]
        spec.write_text(MODEL.replace("[model]\n", "[model]\n" + model) + JOB.format(micro=micro, repeats=args.repeats)
                        + grid)
        limit_gb, rounds, profiling = None, [], None
        for r in range(args.rounds):
            found, limit_gb = search_round(spec, root / f"round{r}", limit_gb, args.grid == "strategies", env)
            profiling = profiling or found["profiling"]  # the first round's: every round profiles the same grid
            rounds.append(run_round(found, spec, root / f"round{r}", r, args, env))
    labels = [label for label in rounds[0] if all(label in runs for runs in rounds)]
    rows = [candidate_row(label, [runs[label] for runs in rounds]) for label in labels]
    figures = {**paired_figures(rows, rounds, limit_gb), "profiling": profiling}
    if args.json:
        print(json.dumps({"rows": rows, **figures}, indent=2))
        return 0
    print(f"\n{args.rounds} round{'s' if args.rounds > 1 else ''}, each candidate's median over them:")
    for row in sorted(rows, key=lambda row: (row["tier"], row["measured_s"])):
        print(_line(row))
    return report(figures)


def search_round(spec: Path, folder: Path, limit_gb: float | None, strategies: bool,
                 env: dict) -> tuple[dict, float | None]:
    """One round's profile of the grid and its search (JSON); for the strategies grid, the memory limit just
    below every plain candidate's peak, from the first round (passed on to the others)."""
    folder.mkdir(parents=True, exist_ok=True)
    run(LAUNCH + ["profile", str(spec), "-o", str(folder / "prof"), "--quiet", "--force"], env)
    # every candidate's prediction, to rank them all against their runs
    search = [sys.executable, "-m", "analysis", "search", str(folder / "prof"), "--json", "--quiet", "--exhaustive"]
    found = json.loads(run(search, env).stdout)
    if strategies:
        if limit_gb is None:
            plain = [c["peak_memory_bytes"] for c in found["candidates"] if c["peak_memory_bytes"] is not None
                     and "recompute=" not in c["strategy"] and "zero=" not in c["strategy"]]
            limit_gb = 0.999 * min(plain) / 1e9
        found = json.loads(run(search + ["--memory-gb", repr(limit_gb)], env).stdout)
    return found, limit_gb


def run_round(found: dict, spec: Path, folder: Path, index: int, args: argparse.Namespace, env: dict) -> dict:
    """Run every predicted candidate of one round's search, in the round's order; per candidate label, its
    prediction, the run's median and both peaks."""
    from analysis.trace_reader import read_trace
    from harness.plan.candidates import candidate_label, expand
    from harness.plan.spec import load_spec
    from harness.store.hdf5_schema import PEAK_MEMORY_ATTR

    jobs = {candidate_label(job): job for job in expand(load_spec(spec, import_factory=False)).candidates}
    candidates = [c for c in found["candidates"] if c["batch_time_s"] is not None]
    turn = index * len(candidates) // args.rounds
    order = candidates[turn:] + candidates[:turn]
    out = {}
    for number, candidate in enumerate(order[::-1] if index % 2 else order):
        folder_c = folder / f"c{number:02d}"
        folder_c.mkdir(exist_ok=True)
        (folder_c / "job.toml").write_text(jobs[candidate["strategy"]].to_toml())
        run(LAUNCH + ["train", str(folder_c / "job.toml"), "-o", str(folder_c / "run"), "--iterations",
                      str(args.iterations), "--warmup", "2"], env)
        trace = read_trace(folder_c / "run")
        measured_s = float(np.median(trace.iteration_times()))
        peaks = [int(d.attrs[PEAK_MEMORY_ATTR]) for d in trace.devices.values() if PEAK_MEMORY_ATTR in d.attrs]
        measured_peak = max(peaks) if peaks else None
        # as analysis validate compares: the meter cannot see a recomputed layer's re-made activations
        compared = max(s["metered_bytes"] for s in candidate["memory_stages"])
        out[candidate["strategy"]] = {
            "predicted_s": candidate["batch_time_s"], "measured_s": measured_s,
            "predicted_peak_bytes": candidate["peak_memory_bytes"], "measured_peak_bytes": measured_peak,
            "memory_error_pct": (compared - measured_peak) / measured_peak * 100 if measured_peak else None,
            "feasible": candidate["feasible"], "recommended": candidate["recommended"]}
        if not args.json:
            print(f"round {index + 1}/{args.rounds}  {candidate['strategy']:<48} predicted "
                  f"{candidate['batch_time_s'] * 1e3:7.1f} ms  measured {measured_s * 1e3:7.1f} ms", flush=True)
    return out


def candidate_row(label: str, per_round: list[dict]) -> dict:
    """One candidate over the rounds: medians of the predictions, of the runs and of the paired errors."""
    predicted = [r["predicted_s"] for r in per_round]
    measured = [r["measured_s"] for r in per_round]
    memory = [abs(r["memory_error_pct"]) for r in per_round if r["memory_error_pct"] is not None]
    peaks = [r["measured_peak_bytes"] for r in per_round if r["measured_peak_bytes"] is not None]
    return {"strategy": label, "predicted_s": float(np.median(predicted)), "measured_s": float(np.median(measured)),
            "measured_range_s": [min(measured), max(measured)],
            "error_pct": float(np.median([(p - m) / m * 100 for p, m in zip(predicted, measured)])),
            "predicted_round_s": predicted, "measured_round_s": measured,
            "predicted_peak_bytes": per_round[0]["predicted_peak_bytes"],
            "measured_peak_bytes": max(peaks) if peaks else None,
            "memory_error_pct": max(memory) if memory else None,
            "feasible": all(r["feasible"] for r in per_round),
            "recommended_rounds": sum(r["recommended"] for r in per_round)}


def paired_figures(rows: list[dict], rounds: list[dict], limit_gb: float | None) -> dict:
    """The grid's figures from the candidates' rows (module docstring); sets each row's tier."""
    measured = [row["measured_round_s"] for row in rows]
    for row, tier in zip(rows, tiers(measured)):
        row["tier"] = tier
    predicted = [row["predicted_s"] for row in rows]
    same, told = concordance(predicted, measured)
    fitting = [i for i, row in enumerate(rows) if row["feasible"]] if limit_gb is not None else list(range(len(rows)))
    figures = {"rounds": len(rounds), "candidates": len(rows),
               "spearman": spearman(predicted, [row["measured_s"] for row in rows]),
               # None where the runs tell nothing apart (one tier)
               "spearman_told_apart": spearman(predicted, [row["tier"] for row in rows])
               if len({row["tier"] for row in rows}) > 1 else None,
               "concordant_pairs": same, "told_apart_pairs": told,
               "concordant_pct": 100 * same / told if told else None,
               "regret_pct": None, "regret_rounds_pct": None, "regret_within_noise": None,
               "fastest_predicted_regret_pct": None, "recommended": None,
               "memory_error_pct": max((row["memory_error_pct"] for row in rows if row["memory_error_pct"] is not None),
                                       default=None),
               "memory_limit_gb": limit_gb, "feasible": [rows[i]["strategy"] for i in fitting] if limit_gb else None}
    if not fitting:
        return figures
    fit_measured = [measured[i] for i in fitting]
    # each round's pick: the search's recommended candidate (among what fits), else its fastest
    chosen, fastest = [], []
    for runs in rounds:
        picks = [k for k, i in enumerate(fitting) if runs[rows[i]["strategy"]]["recommended"]]
        times = [runs[rows[i]["strategy"]]["predicted_s"] for i in fitting]
        fastest.append(int(np.argmin(times)))
        chosen.append(picks[0] if picks else fastest[-1])
    regrets = paired_regret(chosen, fit_measured)
    best = min(range(len(fitting)), key=lambda k: (float(np.median(fit_measured[k])), k))
    picked = max(set(chosen), key=chosen.count)
    figures.update({"regret_pct": float(np.median(regrets)), "regret_rounds_pct": regrets,
                    "fastest_predicted_regret_pct": float(np.median(paired_regret(fastest, fit_measured))),
                    "recommended": rows[fitting[picked]]["strategy"],
                    "best_measured": rows[fitting[best]]["strategy"],
                    "regret_within_noise": all(not told_apart(fit_measured[c], fit_measured[best]) for c in chosen)})
    return figures


def report(figures: dict) -> int:
    """Print the figures against the goals; 1 where no candidate fits."""
    if figures["memory_limit_gb"] is not None:
        print(f"\nmemory limit {figures['memory_limit_gb'] * 1e3:.2f} MB per device: {len(figures['feasible'])} of "
              f"{figures['candidates']} candidates fit ({', '.join(figures['feasible']) or 'none'})")
    if figures["regret_pct"] is None:
        print("no candidate fits: the search found no strategy (MISSED)")
        return 1
    told = figures["spearman_told_apart"]
    goals = {"spearman_told_apart": told is not None and told >= GOALS["spearman"],
             "regret_pct": figures["regret_pct"] <= GOALS["regret_pct"],
             "memory_error_pct": figures["memory_error_pct"] is not None
             and figures["memory_error_pct"] <= GOALS["memory_error_pct"]}
    concordant = (f"{figures['concordant_pairs']} of {figures['told_apart_pairs']} pairs the runs tell apart "
                  f"ordered right" if figures["told_apart_pairs"] else "the runs tell no pair apart")
    memory = f"{figures['memory_error_pct']:.2f}%" if figures["memory_error_pct"] is not None else "-"
    print(f"\nSpearman {figures['spearman']:.3f} over every candidate, "
          + (f"{told:.3f}" if told is not None else "none") + f" over what the runs tell apart (goal >= "
          f"{GOALS['spearman']}: {_met(goals['spearman_told_apart'])}); {concordant}")
    rounds = ", ".join(f"{r:+.1f}%" for r in figures["regret_rounds_pct"])
    print(f"regret {figures['regret_pct']:.2f}% (goal <= {GOALS['regret_pct']:g}%: {_met(goals['regret_pct'])}), "
          f"rounds {rounds}: the search recommends {figures['recommended']}, the runs' best is "
          f"{figures['best_measured']}"
          + (" (the runs cannot tell them apart)" if figures["regret_within_noise"] else "")
          + f"; the fastest predicted: {figures['fastest_predicted_regret_pct']:.2f}%")
    print(f"memory within {memory} (goal <= {GOALS['memory_error_pct']:g}%: {_met(goals['memory_error_pct'])})")
    if figures.get("profiling"):
        print(f"profiling the grid: {figures['profiling']['profile_device_s']:.1f} device-s, "
              f"{100 * figures['profiling']['fraction']:.1f}% of running every candidate with the same repeats")
    return 0


def _line(r: dict) -> str:
    low, high = r["measured_range_s"]
    measured = (f"{r['measured_peak_bytes'] / 1e6:6.2f} MB ({r['memory_error_pct']:.2f}%)"
                if r["measured_peak_bytes"] else "     - MB")
    return (f"tier {r['tier']:>2}  {r['strategy']:<48} predicted {r['predicted_s'] * 1e3:7.1f} ms  measured "
            f"{r['measured_s'] * 1e3:7.1f} ms [{low * 1e3:.1f}-{high * 1e3:.1f}] ({r['error_pct']:+5.1f}%)  peak "
            f"{r['predicted_peak_bytes'] / 1e6:6.2f} / {measured}{'' if r['feasible'] else '  (does not fit)'}"
            f"{'  recommended' if r['recommended_rounds'] else ''}")


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


if __name__ == "__main__":
    sys.exit(main())
