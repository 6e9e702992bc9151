"""The generalization suite: jobs drawn from a seed, each profiled and run for real in interleaved pairs.

    .venv/bin/python bench/generalization.py [--seed S] [--jobs N] [--ranks 2|4] [--pairs K] [--json]
        [--iterations 10] [--repeats 20] [--budget-s 5] [--keep DIR] [--no-tracker] [--list]

Drawing (numpy's Generator from --seed; the same seed and --ranks give the same jobs on any machine): each
job picks, uniformly, a model family (gpt2, bert, llama, or the factory model bench/factory_model.py), a
layout dp x tp x pp of exactly --ranks devices (tp = 1 for the factory model), a schedule (any of
harness.plan.schedules.SCHEDULES when pp > 1, the zero-bubble ones only at tp = 1; 1f1b without a pipeline),
2 or 3 chunks for an interleaved schedule, then layers (at most 6), hidden (64-320, a multiple of 32), heads
(hidden divisible by heads, an even head size, tp dividing heads), kv_heads (llama: a divisor of heads that tp
divides), ffn (2-4 x hidden, a multiple of 32), seq_len (32-128), vocab (256-8192, a multiple of tp), the
micro-batch size (1-4) and count (2-8, as the schedule allows), recompute (none or full, except under a split
backward), zero (0-3 where dp > 1, tp = 1 and the backward is not split) and, last and only where tp > 1,
sequence parallelism (sp) on or off, then where dp > 1 for a built-in family without zero or a split backward,
context parallelism: cp a divisor of dp (1 included) that divides seq_len / 2, taken out of dp; then, for a
built-in family with tp = 1, cp = 1, no zero and no split backward, Mixture-of-Experts blocks or not: 2, 4 or
8 experts, top-1 or top-2, expert_ffn 1-2 x hidden, uniform, zipf:0.8 or zipf:1.2 routing, and ep a divisor of dp
that divides the experts. Every drawn spec is validated by the project's own loader
(harness.plan.spec.parse_spec); one it refuses is drawn again from the same Generator, so the redraws are as
deterministic as the draws. The sizes stay small: a job profiles and runs in seconds on 2 CPU cores.

Measuring: per job, --pairs K pairs, in time order P R P R ...: a profile (harness profile, --repeats, at
most --budget-s a phase) and right after it a run (harness train, --iterations with 2 warm-up), both on
--ranks ranks bound to cores, validated (analysis validate --json). A pair's ratio (its batch-time error)
cancels the machine's drift over minutes, not what moves within a pair. A job reports the median over its pairs of the
batch-time error, with its confidence interval: the 5th-95th percentiles of the median over 2,000
resamples of the pairs (bootstrap) for K >= 3, the pairs' min and max for K < 3 (error_ci_method says
which); the median over pairs of the largest device busy-time error and of the largest stage memory error
against the run's meter (a job the meter cannot see, ZeRO on a CPU, runs once more after its pairs under torch's
MemTracker, and its error is against that: memory_source "tracker", a "t" in the table; --no-tracker leaves
it unmeasured);
each pair's in_interval (validate's measured_in_interval: the run's median inside the prediction's 90%
interval; a list in pair order); the median interval width (p95 - p5 over the prediction); and the noise
floor: the larger of the runs' spread against each other and the profiles' predictions' spread against
each other across the pairs ((max - min) / median; null for K < 2). The suite reports the median and 90th
percentile of |batch-time error| over jobs and the coverage (pairs whose run lay inside its interval, of
the pairs with an interval). Goals (issue 33, N >= 12 on 2 ranks, any seed): median |batch error| <= 3%,
p90 <= 6%, device busy-time median <= 4%, memory <= 3% on every job, read beside the noise floor.

A job whose profile, run or validation fails is reported with the failing command's message (its figures
null), left out of the statistics, and makes the exit status 1; bad options exit 2 with one message.
--ranks: 2 or 4 (4 share 2 cores here: two ranks a core, which times sharing as much as the job), and never
more than two ranks a core of this machine. --list prints the drawn jobs and measures nothing.

The default seed (DEFAULT_SEED) was picked once, before any job of it was seen; it must never be changed
or tuned to its jobs: a figure is only worth something if any seed does as well.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.accuracy import ROOT, interval_width_pct, median_of, run, tracker_rows, validate  # noqa: E402
from harness.common.errors import UserError  # noqa: E402
from harness.plan.schedules import INTERLEAVED, SCHEDULES, SPLIT_BACKWARD, zero_bubble_rounds  # noqa: E402
from harness.plan.spec import RECOMPUTE, ZERO_STAGES, JobSpec, parse_spec  # noqa: E402

DEFAULT_SEED = 20261201  # picked once; never tune it to its jobs (the docstring's last paragraph)
RANK_CHOICES = (2, 4)
RANKS_PER_CORE = 2  # at most: beyond it a run times the scheduler's sharing, not the job
FAMILIES = ("gpt2", "bert", "llama", "factory")
PRESET_OF_FAMILY = {"gpt2": "gpt2-small", "bert": "bert-base", "llama": "llama-1b"}
FACTORY = "bench.factory_model:build"
MAX_LAYERS = 6
HIDDEN_CHOICES = tuple(range(64, 321, 32))
MAX_HEADS = 8
SEQ_CHOICES = (32, 64, 96, 128)
VOCAB_RANGE = (256, 8192)
MICRO_CHOICES = (1, 2, 3, 4)
MICRO_BATCH_COUNTS = tuple(range(2, 9))
CHUNK_CHOICES = (2, 3)
EXPERT_CHOICES = (2, 4, 8)
ROUTING_CHOICES = ("uniform", "zipf:0.8", "zipf:1.2")
MAX_DRAWS_PER_JOB = 1000
WARMUP_ITERATIONS = 2
BOOTSTRAP_RESAMPLES = 2000
GOALS = {"median_abs_error_pct": 3.0, "p90_abs_error_pct": 6.0, "device_median_error_pct": 4.0,
         "memory_max_error_pct": 3.0}


@dataclass(frozen=True)
class DrawnJob:
    """One drawn job: its place in the draw, a short name, the validated spec and how many draws it took."""

    index: int
    name: str
    spec: JobSpec
    draws: int


def layer_counts(family: str, pp: int, chunks: int) -> list[int]:
    """The layer counts up to MAX_LAYERS that split evenly over pp x chunks virtual stages (the factory model
    counts its embedding and head as layers: 3 at least)."""
    least = 3 if family == "factory" else 1
    return [n for n in range(least, MAX_LAYERS + 1) if n % (pp * chunks) == 0]


def micro_batch_counts(schedule: str, pp: int) -> list[int]:
    """The micro-batch counts the schedule runs: interleaved-1f1b a multiple of pp, the zero-bubble schedules a
    multiple of their rounds (harness.plan.schedules.zero_bubble_rounds)."""
    if schedule == "interleaved-1f1b":
        return [m for m in MICRO_BATCH_COUNTS if m % pp == 0]
    if schedule in SPLIT_BACKWARD:
        return [m for m in MICRO_BATCH_COUNTS if m % zero_bubble_rounds(m, pp) == 0]
    return list(MICRO_BATCH_COUNTS)


def pick(rng: np.random.Generator, options):
    """One of the options, uniformly."""
    options = list(options)
    return options[int(rng.integers(len(options)))]


def draw_spec_data(rng: np.random.Generator, ranks: int, *, repeats: int, budget_s: float) -> dict:
    """One job as plain spec data (the form parse_spec reads), drawn in a fixed order from rng. The options
    of each draw follow the spec's rules where they are cheap to state; the loader checks the rest."""
    family = pick(rng, FAMILIES)
    layouts = [(dp, tp, ranks // (dp * tp)) for dp in range(1, ranks + 1) for tp in range(1, ranks + 1)
               if ranks % (dp * tp) == 0 and not (family == "factory" and tp > 1)]
    dp, tp, pp = pick(rng, layouts)
    schedules = [s for s in SCHEDULES if not (s in SPLIT_BACKWARD and tp > 1)
                 and any(layer_counts(family, pp, c) for c in (CHUNK_CHOICES if s in INTERLEAVED else (1,)))]
    schedule = pick(rng, schedules) if pp > 1 else "1f1b"
    chunks = pick(rng, [c for c in CHUNK_CHOICES if layer_counts(family, pp, c)]) if schedule in INTERLEAVED else 1
    layers = pick(rng, layer_counts(family, pp, chunks))
    hidden = pick(rng, [h for h in HIDDEN_CHOICES if h % tp == 0])
    heads = pick(rng, [h for h in range(1, MAX_HEADS + 1) if hidden % h == 0 and (hidden // h) % 2 == 0
                       and h % tp == 0])
    kv_heads = pick(rng, [k for k in range(1, heads + 1) if heads % k == 0 and k % tp == 0]) \
        if family == "llama" else heads
    ffn = pick(rng, range(2 * hidden, 4 * hidden + 1, 32))
    seq_len = pick(rng, SEQ_CHOICES)
    vocab = tp * int(rng.integers(VOCAB_RANGE[0] // tp, VOCAB_RANGE[1] // tp + 1))  # tp splits the embedding
    micro = pick(rng, MICRO_CHOICES)
    micro_batches = pick(rng, micro_batch_counts(schedule, pp))
    split = schedule in SPLIT_BACKWARD
    recompute = pick(rng, RECOMPUTE) if not split else "none"
    zero = pick(rng, ZERO_STAGES) if dp > 1 and tp == 1 and not split else 0
    model = {"factory": FACTORY} if family == "factory" else {"name": PRESET_OF_FAMILY[family], "kv_heads": kv_heads}
    model.update(layers=layers, hidden=hidden, heads=heads, ffn=ffn, seq_len=seq_len, vocab=vocab, dtype="float32")
    strategy = {"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "recompute": recompute, "zero": zero}
    if tp > 1:  # drawn after everything else of the job (later jobs of a seed draw from where it leaves off)
        strategy["sp"] = bool(rng.integers(2))
    if dp > 1 and family != "factory" and not zero and not split:  # context parallelism: part of the dp ranks
        cp = pick(rng, [c for c in range(1, dp + 1) if dp % c == 0 and seq_len % (2 * c) == 0])
        if cp > 1:
            dp //= cp
            strategy.update(dp=dp, cp=cp)
    if family != "factory" and tp == 1 and strategy.get("cp", 1) == 1 and not zero and not split \
            and rng.integers(2):  # Mixture-of-Experts blocks, their experts over ep ranks out of dp
        experts = pick(rng, EXPERT_CHOICES)
        model.update(experts=experts, top_k=pick(rng, [k for k in (1, 2) if k <= experts]),
                     expert_ffn=pick(rng, range(hidden, 2 * hidden + 1, 32)),
                     routing=pick(rng, ROUTING_CHOICES))
        strategy["ep"] = pick(rng, [e for e in range(1, dp + 1) if dp % e == 0 and experts % e == 0])
    if schedule in INTERLEAVED:
        strategy["chunks"] = chunks
    return {"model": model, "batch": {"global": micro * micro_batches * dp, "micro": micro},
            "strategy": strategy, "cluster": {"nodes": 1, "gpus_per_node": ranks},
            "profile": {"warmup": 2, "repeats": repeats, "budget_s": budget_s}}


def job_name(spec: JobSpec) -> str:
    """A short, readable description: family, sizes (L layers, h hidden / a heads [/ kv], f ffn, s seq, v vocab),
    micro-batches (count x size), layout, schedule (x chunks), recompute (rc), zero (z), sp, cp and experts."""
    m, s = spec.model, spec.strategy
    family = "factory" if m.factory else m.family
    heads = f"{m.heads}/{m.kv_heads}" if m.family == "llama" else f"{m.heads}"
    schedule = f" {s.schedule}" + (f"x{s.chunks}" if s.schedule in INTERLEAVED else "") if s.pp > 1 else ""
    extras = ((" rc" if s.recompute != "none" else "") + (f" z{s.zero}" if s.zero else "") + (" sp" if s.sp else "")
              + (f" cp{s.cp}" if s.cp > 1 else "")
              + (f" moe{m.experts}x{m.top_k} {m.routing} ep{s.ep}" if m.moe else ""))
    return (f"{family} L{m.layers} h{m.hidden}/a{heads} f{m.ffn} s{m.seq_len} v{m.vocab} "
            f"m{spec.micro_batches}x{spec.batch.micro} dp{s.dp} tp{s.tp} pp{s.pp}{schedule}{extras}")


def draw_jobs(seed: int, count: int, ranks: int, *, repeats: int = 20, budget_s: float = 5.0) -> list[DrawnJob]:
    """`count` jobs drawn from `seed` for `ranks` devices, each accepted by harness.plan.spec's loader (a refused
    draw is drawn again). repeats and budget_s go into every spec's [profile] and draw nothing."""
    rng = np.random.default_rng(seed)
    jobs = []
    for index in range(count):
        for draws in range(1, MAX_DRAWS_PER_JOB + 1):
            data = draw_spec_data(rng, ranks, repeats=repeats, budget_s=budget_s)
            try:
                spec = parse_spec(data, source=f"seed {seed}, job {index + 1}")
            except UserError:
                continue
            jobs.append(DrawnJob(index, job_name(spec), spec, draws))
            break
        else:
            raise RuntimeError(f"no valid job in {MAX_DRAWS_PER_JOB} draws: the drawing rules contradict the spec's")
    return jobs


def measure_pair(job: DrawnJob, folder: Path, args: argparse.Namespace, env: dict) -> dict:
    """Profile, then run, then validate one pair in folder; validate's JSON. A failing command ends the
    process through bench.accuracy.run (SystemExit with its message), which the caller turns into a failure."""
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    launch = [mpirun, "--bind-to", "core", "-n", str(args.ranks), sys.executable, "-m", "mpi4py", "-m", "harness"]
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "job.toml"
    spec_path.write_text(job.spec.to_toml(header=f"bench/generalization.py --seed {args.seed}, job {job.index + 1}: "
                                                 f"{job.name}"))
    run(launch + ["profile", str(spec_path), "-o", str(folder / "prof"), "--quiet", "--force"], env)
    run(launch + ["train", str(spec_path), "-o", str(folder / "run"), "--iterations", str(args.iterations),
                  "--warmup", str(WARMUP_ITERATIONS)], env)
    return validate(folder, env)


def spread_pct(values: list[float]) -> float | None:
    """(max - min) / median of the values, in %; None for fewer than two."""
    return (max(values) - min(values)) / float(np.median(values)) * 100.0 if len(values) >= 2 else None


def error_interval(errors: list[float], rng: np.random.Generator) -> tuple[list[float], str]:
    """The confidence interval of the median of the pairs' errors and how it was made: for 3 pairs or more
    the 5th-95th percentiles of the median over bootstrap resamples of the pairs, else their min and max."""
    if len(errors) < 3:
        return [min(errors), max(errors)], "min-max"
    picks = rng.integers(0, len(errors), size=(BOOTSTRAP_RESAMPLES, len(errors)))
    medians = np.median(np.asarray(errors)[picks], axis=1)
    return [float(v) for v in np.percentile(medians, [5, 95])], "bootstrap-90"


def job_result(job: DrawnJob, pairs: list[dict], seed: int) -> dict:
    """A job's row from its pairs' validate JSON (the docstring's "Measuring" says what each field is)."""
    errors = [p["batch_time_error_pct"] for p in pairs]
    interval, method = error_interval(errors, np.random.default_rng([seed, job.index]))
    run_spread = spread_pct([p["measured_batch_time_s"] for p in pairs])
    profile_spread = spread_pct([p["predicted_batch_time_s"] for p in pairs])
    return {"name": job.name, "spec": job.spec.to_dict(), "error_pct": float(np.median(errors)),
            "error_ci_pct": interval, "error_ci_method": method,
            "device_error_pct": median_of(p.get("device_error_pct") for p in pairs),
            "memory_error_pct": median_of(p.get("memory_error_pct") for p in pairs),
            "in_interval": [p.get("measured_in_interval") for p in pairs],
            "interval_width_pct": median_of(interval_width_pct(p) for p in pairs),
            "noise_floor_pct": None if run_spread is None else max(run_spread, profile_spread),
            "run_spread_pct": run_spread, "profile_spread_pct": profile_spread,
            "memory_source": "meter" if any(p.get("memory_error_pct") is not None for p in pairs) else None,
            "pair_errors_pct": errors,
            "measured_ms": [p["measured_batch_time_s"] * 1e3 for p in pairs],
            "predicted_ms": [p["predicted_batch_time_s"] * 1e3 for p in pairs],
            "failed": None}


def failed_result(job: DrawnJob, message: str) -> dict:
    """A job whose profile, run or validation failed: its figures null, the failing command's message kept."""
    return {"name": job.name, "spec": job.spec.to_dict(), "error_pct": None, "error_ci_pct": None,
            "error_ci_method": None, "device_error_pct": None, "memory_error_pct": None, "memory_source": None,
            "in_interval": [], "interval_width_pct": None, "noise_floor_pct": None, "failed": message}


def measure_job(job: DrawnJob, args: argparse.Namespace, env: dict, root: Path) -> dict:
    """The job's K pairs, one progress line each on stderr; its row, or a failed row."""
    pairs = []
    for pair in range(args.pairs):
        started = time.monotonic()
        try:
            result = measure_pair(job, root / f"job{job.index + 1:02d}-pair{pair + 1}", args, env)
        except SystemExit as exc:  # bench.accuracy.run's failure: the command and the tail of its stderr
            print(f"[job {job.index + 1}/{args.jobs} pair {pair + 1}/{args.pairs}] {job.name}: FAILED",
                  file=sys.stderr)
            return failed_result(job, str(exc.code))
        pairs.append(result)
        print(f"[job {job.index + 1}/{args.jobs} pair {pair + 1}/{args.pairs}] {job.name}: measured "
              f"{result['measured_batch_time_s'] * 1e3:.1f} ms, predicted "
              f"{result['predicted_batch_time_s'] * 1e3:.1f} ms, error {result['batch_time_error_pct']:+.1f}% "
              f"({time.monotonic() - started:.0f} s)",
              file=sys.stderr, flush=True)
    row = job_result(job, pairs, args.seed)
    if row["memory_error_pct"] is None and not args.no_tracker:
        row["memory_error_pct"], row["memory_source"] = tracked_memory_error(job, root, args, env), "tracker"
    return row


def tracked_memory_error(job: DrawnJob, root: Path, args: argparse.Namespace, env: dict) -> float | None:
    """A job the meter cannot see (FSDP2 refills storages in place on a CPU): its largest stage error against
    torch's MemTracker, from a short run of its own under the tracker (bench/accuracy.py's --tracked-run) beside
    its first pair's profile; None if that run fails (its message on stderr)."""
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    folder = root / f"job{job.index + 1:02d}-pair1"
    try:
        run([mpirun, "--bind-to", "core", "-n", str(args.ranks), sys.executable, "-m", "mpi4py",
             str(Path(__file__).resolve().parent / "accuracy.py"), "--tracked-run", str(folder / "job.toml"),
             str(folder / "tracked")], env)
    except SystemExit as exc:
        print(f"[job {job.index + 1}/{args.jobs}] {job.name}: the run under MemTracker FAILED: {exc.code}",
              file=sys.stderr)
        return None
    rows = tracker_rows(folder)
    return max(abs(r["error_pct"]) for r in rows) if rows else None


def suite_summary(rows: list[dict]) -> dict:
    """The suite's figures over the jobs that were measured, and each goal met or not."""
    measured = [r for r in rows if r["failed"] is None]
    errors = [abs(r["error_pct"]) for r in measured]
    held = [v for r in measured for v in r["in_interval"] if v is not None]
    devices = [r["device_error_pct"] for r in measured if r["device_error_pct"] is not None]
    memories = [r["memory_error_pct"] for r in measured if r["memory_error_pct"] is not None]
    summary = {"median_abs_error_pct": float(np.median(errors)) if errors else None,
               "p90_abs_error_pct": float(np.percentile(errors, 90)) if errors else None,
               "coverage_pct": sum(held) / len(held) * 100.0 if held else None,
               "coverage_pairs": len(held),
               "device_median_error_pct": float(np.median(devices)) if devices else None,
               "memory_max_error_pct": max(memories) if memories else None,
               "memory_unmetered_jobs": len(measured) - len(memories),
               "memory_tracker_jobs": sum(r.get("memory_source") == "tracker" and r["memory_error_pct"] is not None
                                          for r in measured),
               "noise_floor_median_pct": median_of(r["noise_floor_pct"] for r in measured),
               "mean_interval_width_pct": (float(np.mean(widths)) if (widths := [
                   r["interval_width_pct"] for r in measured if r["interval_width_pct"] is not None]) else None),
               "failed_jobs": len(rows) - len(measured)}
    summary["goals_met"] = {key: summary[key] is not None and summary[key] <= goal for key, goal in GOALS.items()}
    return summary


def cell(value: float | None, form: str = ".1f") -> str:
    return "-" if value is None else format(value, form)


def print_table(rows: list[dict], summary: dict, args: argparse.Namespace) -> None:
    """One row per job, then the summary line set against the goals beside the noise floor."""
    width = max(len(r["name"]) for r in rows)
    ci_title = "CI (bootstrap 90%)" if args.pairs >= 3 else "CI (min..max)"
    print(f"generalization suite: seed {args.seed}, {len(rows)} jobs, {args.ranks} ranks, {args.pairs} pairs each")
    print(f"{'job':<{width}} {'error %':>8} {ci_title:>18} {'device %':>9} {'memory %':>9} {'in 90%':>7} "
          f"{'width %':>8} {'noise run/prof %':>17}  pair errors %")
    for r in rows:
        if r["failed"] is not None:
            last_line = next((line for line in reversed(r["failed"].splitlines()) if line.strip()), "")
            print(f"{r['name']:<{width}} FAILED: {last_line.strip()} (--json has the command and its output)")
            continue
        low, high = r["error_ci_pct"]
        held = [v for v in r["in_interval"] if v is not None]
        noise = ("-" if r["noise_floor_pct"] is None
                 else f"{cell(r['run_spread_pct'])}/{cell(r['profile_spread_pct'])}")
        print(f"{r['name']:<{width}} {r['error_pct']:>+8.1f} {f'{low:+.1f}..{high:+.1f}':>18} "
              f"{cell(r['device_error_pct']):>9} {memory_cell(r):>9} "
              f"{f'{sum(held)}/{len(held)}' if held else '-':>7} {cell(r['interval_width_pct']):>8} "
              f"{noise:>17}  {' '.join(f'{e:+.1f}' for e in r['pair_errors_pct'])}")
    s, met = summary, summary["goals_met"]

    def against(key: str, text: str, form: str = ".1f") -> str:
        return f"{text} {cell(s[key], form)}% (goal <= {GOALS[key]:g}%: {'met' if met[key] else 'MISSED'})"

    floor = (f"noise floor median {cell(s['noise_floor_median_pct'])}% (runs against runs, profiles against "
             "profiles)" if s["noise_floor_median_pct"] is not None else "noise floor: needs --pairs 2 or more")
    coverage = (f"the 90% interval held {cell(s['coverage_pct'], '.0f')}% of {s['coverage_pairs']} pairs "
                f"(mean width {cell(s['mean_interval_width_pct'])}%)" if s["coverage_pairs"] else "no intervals")
    unmetered = ((f" ({s['memory_tracker_jobs']} by MemTracker, t)" if s["memory_tracker_jobs"] else "")
                 + (f", {s['memory_unmetered_jobs']} jobs unmetered" if s["memory_unmetered_jobs"] else ""))
    print(f"\n{against('median_abs_error_pct', 'median |batch error|')}, {against('p90_abs_error_pct', 'p90')}, "
          f"{against('device_median_error_pct', 'device median')}, "
          f"{against('memory_max_error_pct', 'memory worst job', '.2f')}{unmetered}; {floor}; {coverage}"
          + (f"; jobs FAILED: {s['failed_jobs']}" if s["failed_jobs"] else ""))


def memory_cell(row: dict) -> str:
    """A job's memory error; "t" after it where torch's MemTracker measured it (the meter could not)."""
    return cell(row["memory_error_pct"], ".2f") + ("t" if row.get("memory_source") == "tracker"
                                                   and row["memory_error_pct"] is not None else "")


class OneMessageParser(argparse.ArgumentParser):
    """argparse that reports bad input as one line (what is wrong, what to do) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"bench/generalization.py: {message}; see --help for the options\n")


def seed_value(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed: give a whole number from 0 up, e.g. "
                                         f"--seed {DEFAULT_SEED}")
    return value


def at_least_one(what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of {what}, 1 or more")
        return value
    return parse


def rank_count(text: str) -> int:
    cores = os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value not in RANK_CHOICES:
        raise argparse.ArgumentTypeError(f"{text!r}: the suite runs on {' or '.join(map(str, RANK_CHOICES))} ranks")
    if value > RANKS_PER_CORE * cores:
        raise argparse.ArgumentTypeError(f"{value} ranks need {-(-value // RANKS_PER_CORE)} cores at least (at most "
                                         f"{RANKS_PER_CORE} ranks a core) and this machine has {cores}; use --ranks "
                                         f"{RANK_CHOICES[0]}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneMessageParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=seed_value, default=DEFAULT_SEED,
                        help=f"draw the jobs from this seed (default {DEFAULT_SEED}, never tuned to)")
    parser.add_argument("--jobs", type=at_least_one("jobs"), default=12, help="jobs to draw (default 12)")
    parser.add_argument("--ranks", type=rank_count, default=2, help="ranks of every job: 2 (default) or 4")
    parser.add_argument("--pairs", type=at_least_one("pairs"), default=3,
                        help="profile-and-run pairs per job (default 3)")
    parser.add_argument("--iterations", type=at_least_one("iterations, warm-up included"), default=10,
                        help=f"training iterations per run, {WARMUP_ITERATIONS} of them warm-up (default 10)")
    parser.add_argument("--repeats", type=at_least_one("repeats"), default=20, help="profile repeats per event")
    parser.add_argument("--budget-s", dest="budget_s", type=seconds, default=5.0,
                        help="the profile's budget per phase for its precision (the spec's profile.budget_s)")
    parser.add_argument("--keep", metavar="DIR", help="keep every pair's spec, profile and run under DIR")
    parser.add_argument("--no-tracker", dest="no_tracker", action="store_true",
                        help="leave the memory of jobs the meter cannot see (ZeRO on a CPU) unmeasured instead of "
                        "running each once more under torch's MemTracker")
    parser.add_argument("--list", action="store_true", help="print the drawn jobs and measure nothing")
    parser.add_argument("--json", action="store_true", help="print the suite as JSON instead of a table")
    args = parser.parse_args(argv)
    if args.iterations <= WARMUP_ITERATIONS:
        parser.error(f"--iterations {args.iterations}: give more than the {WARMUP_ITERATIONS} warm-up iterations")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = draw_jobs(args.seed, args.jobs, args.ranks, repeats=args.repeats, budget_s=args.budget_s)
    if args.list:
        for job in jobs:
            print(json.dumps({"name": job.name, "draws": job.draws, "spec": job.spec.to_dict()}) if args.json
                  else f"{job.index + 1:>3}  {job.name}  ({job.draws} draw{'s' if job.draws > 1 else ''})")
        return 0
    mpirun = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    if not Path(mpirun).exists():
        print(f"bench/generalization.py: no mpirun at {mpirun}: run `make setup` and use .venv/bin/python, or set "
              "DISTSIM_MPIRUN", file=sys.stderr)
        return 2
    print(f"drew {len(jobs)} jobs from seed {args.seed} for {args.ranks} ranks "
          f"({sum(j.draws - 1 for j in jobs)} draws refused by the spec loader)", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="generalization-") as root:
        rows = [measure_job(job, args, env, Path(root)) for job in jobs]
    summary = suite_summary(rows)
    if args.json:
        print(json.dumps({"seed": args.seed, "ranks": args.ranks, "pairs": args.pairs, "jobs": rows, **summary},
                         indent=2))
    else:
        print_table(rows, summary, args)
    return 1 if summary["failed_jobs"] else 0


if __name__ == "__main__":
    sys.exit(main())
