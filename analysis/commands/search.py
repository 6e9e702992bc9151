"""`python -m analysis search PROFILE.h5|SPEC.toml`: every candidate strategy of the spec's [search] grid, predicted
from one profile, or from a spec's device and network models (with --profile beside it: what the profile
measured), checked against device memory and ranked (table, --json, --csv, --png, --write-spec)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from analysis.costs.device_source import DEVICE, describe_sources
from analysis.memory import GB
from analysis.predict import add_network_argument, add_prediction_arguments, prediction_options
from analysis.search import (
    PRUNE_MARGIN,
    SORTS,
    CandidateResult,
    SearchResult,
    best_per_gpu_count,
    mpi_futures_pool,
    search,
)
from analysis.spec_only import command_input, spec_profile
from harness.common.errors import UserError
from harness.common.launch_env import promised_world_size
from harness.common.output import (
    PNG_NAMES,
    byte_unit,
    format_bytes,
    format_duration,
    format_seconds,
    format_table,
    named,
    writable,
    write_csv,
)
from harness.common.progress import Progress
from harness.plan.spec import MAX_DEVICES

NAME = "search"
HELP = "rank every strategy of a [search] grid by predicted batch time, with the memory each device needs"
CSV_COLUMNS = ("rank", "strategy", "gpus", "dp", "tp", "pp", "schedule", "chunks", "micro", "micro_batches",
               "batch_time_s", "throughput_samples_s", "throughput_tokens_s", "bubble_fraction", "comm_fraction",
               "comm_by_tier",
               "peak_memory_bytes", "feasible", "speedup", "reason", "train_s", "gpu_hours", "batch_time_p5_s",
               "batch_time_p95_s", "indistinguishable_from_best", "recommended", "least_batch_time_s", "pruned")
OUTPUTS = {"csv": "--csv", "png": "--png", "write_spec": "--write-spec"}
INPUTS = ("input", "spec", "profile", "network")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="PROFILE.h5|SPEC.toml",
                        help="profile.h5 of `harness profile` on a spec with a [search] grid, or a job spec with "
                             "[cluster] device and [[cluster.network]] (every event from the device and network "
                             "models)")
    parser.add_argument("--spec", help="search this spec's grid instead of the profile's own")
    parser.add_argument("--profile", metavar="PROFILE.h5",
                        help="beside a spec: cost what this profile measured, the rest from the spec's models")
    parser.add_argument("--gpus", type=int, metavar="N", help="the device count (replaces the grid's gpus)")
    parser.add_argument("--auto", action="store_true",
                        help="every valid value of each field the grid does not list: every dp x tp x pp, micro-batch "
                             "size, schedule, recompute and ZeRO stage (docs/spec.md, [search])")
    parser.add_argument("--memory-gb", type=float, metavar="G",
                        help="each device's memory in GB (1e9 bytes); default: the spec's [cluster] device_memory_gb. "
                             "Given here, the recommendation also weighs headroom under it")
    parser.add_argument("--top", type=int, default=20, metavar="K", help="rows to print (default 20; 0: all)")
    parser.add_argument("--sort", choices=SORTS, default="time", help="rank by batch time (default) or peak memory")
    parser.add_argument("--exhaustive", action="store_true",
                        help="simulate every candidate that fits (by default one whose least possible batch time is "
                             "over 25%% above the fastest's, out of its reach, is listed with that bound, not "
                             "simulated; --png and --sort memory simulate all)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--iterations", type=int, metavar="I", help="also the time and GPU-hours to train I iterations")
    group.add_argument("--tokens", type=float, metavar="T", help="also the time and GPU-hours to train T tokens")
    parser.add_argument("--jobs", type=int, metavar="N", help="worker processes (default: one per core)")
    add_prediction_arguments(parser)  # --resamples: the fastest's interval and those within reach of it
    add_network_argument(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON document (docs/analysis.md)")
    parser.add_argument("--csv", metavar="FILE.csv", help="write every candidate as CSV")
    parser.add_argument("--png", metavar="FILE.png", type=named(PNG_NAMES),
                        help="throughput against peak memory, the Pareto front marked")
    parser.add_argument("--write-spec", metavar="BEST.toml",
                        help="write the recommended candidate (the fastest that fits, or one within its noise on "
                             "fewer devices or, with --memory-gb, with more headroom) as a runnable spec")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


MAX_JOBS = max(1, 4 * (os.cpu_count() or 1))  # worker processes at most: a few a core


def _check(args: argparse.Namespace) -> None:
    if args.memory_gb is not None and not 0 < args.memory_gb < math.inf:
        raise UserError(f"--memory-gb {args.memory_gb:g}: give each device's memory in GB, a finite number above 0")
    if args.top < 0:
        raise UserError(f"--top {args.top}: give a row count of 0 (all) or more")
    if args.iterations is not None and args.iterations < 1:
        raise UserError(f"--iterations {args.iterations}: give 1 or more")
    if args.tokens is not None and not (args.tokens > 0 and math.isfinite(args.tokens)):
        raise UserError(f"--tokens {args.tokens:g}: give a finite token count above 0")
    if args.jobs is not None and not 1 <= args.jobs <= MAX_JOBS:
        raise UserError(f"--jobs {args.jobs}: give 1 to {MAX_JOBS} worker processes (default: one per core)")
    if args.gpus is not None and not 1 <= args.gpus <= MAX_DEVICES:
        raise UserError(f"--gpus {args.gpus:,}: give a device count from 1 to {MAX_DEVICES:,}")


def run(args: argparse.Namespace) -> int:
    _check(args)
    promised = promised_world_size()
    if promised is not None and promised[0] > 1 and mpi_futures_pool() is None:
        raise UserError(f"launched on {promised[0]} ranks ({promised[1]}), each of which would run the whole search; "
                        f"spread it over them with mpi4py.futures: mpirun -n {promised[0]} python -m mpi4py.futures "
                        "-m analysis search ...")
    spec, profile, source = command_input(args.input, args.profile, args.spec)
    if profile is None:
        profile = spec_profile(spec, source)
    elif spec.cluster.device:
        from analysis.costs.device_source import device_model, processor_mismatch

        mismatch = processor_mismatch(device_model(spec.cluster.device), profile)
        if mismatch:  # every candidate's costs carry it; said once, before the search
            print(f"WARNING: {mismatch}", file=sys.stderr)
    from harness.plan.candidates import expand

    grid = expand(spec, args.gpus, auto=args.auto or None)
    if args.network:  # bad --network is one message here, for every device count, before the workers start
        from analysis.costs import what_if_network

        for candidate in {c.strategy.world: c for c in grid.candidates}.values():
            what_if_network(candidate, profile, args.network)
    progress = Progress("search", len(grid), enabled=not args.quiet and not args.json, unit="candidate")
    options = prediction_options(args)
    result = search(profile, spec, gpus=args.gpus, capacity_bytes=args.memory_gb * GB if args.memory_gb else None,
                    sort=args.sort, dp_overlap=options["dp_overlap"], compute_stat=options["compute_stat"],
                    rank_speed=options["rank_speed"], jobs=args.jobs, progress=progress.advance, grid=grid,
                    resamples=options["resamples"], network=args.network, headroom_asked=args.memory_gb is not None,
                    exhaustive=args.exhaustive or args.png is not None)
    progress.close()
    written = []
    training = {"iterations": args.iterations, "tokens": args.tokens}
    if args.csv:
        rows = [[i + 1] + [_csv_cell(c.to_dict(**training).get(k)) for k in CSV_COLUMNS[1:]]
                for i, c in enumerate(result.candidates)]
        written.append(("CSV", write_csv(args.csv, CSV_COLUMNS, rows)))
    if args.png:
        from analysis.plot import write_search_chart

        written.append(("chart", writable(args.png, lambda: write_search_chart(args.png, result, **training))))
    best = result.to_run
    if args.write_spec and best is not None:
        header = spec_header(result, args.input)
        path = Path(args.write_spec)

        def write_spec() -> Path:
            path.write_text(best.spec.to_toml(header))
            return path
        written.append(("spec", writable(path, write_spec)))
    if args.json:
        print(json.dumps(result.to_dict(**training), indent=2))
        for what, path in written:
            print(f"wrote {path}: {what}", file=sys.stderr)
        return 0
    print(format_search(result, args.top, **training))
    for what, path in written:
        print(f"wrote {path}: {what}")
    if args.write_spec and best is None:
        print(f"no feasible candidate: {args.write_spec} not written")
    return 0


def spec_header(result: SearchResult, profile: str) -> str:
    """The comment atop --write-spec's file: which candidate, its prediction and, where it is not the fastest,
    the recommendation's line."""
    best = result.to_run
    header = (f"The recommended candidate of `python -m analysis search {profile}`: {best.label}, "
              f"predicted {format_seconds(best.batch_time_s)} per iteration.")
    if result.recommendation is not None and best is not result.recommendation.fastest:
        header += "\n" + result.recommendation.text()
    return header


def _csv_cell(value):
    """A CSV cell: a tier's shares as 'name share' pairs ('intra 0.25; inter 0.75'), else the value."""
    if isinstance(value, dict):
        return "; ".join(f"{name} {share:.4f}" for name, share in value.items())
    return value


def tier_shares(shares: dict[str, float]) -> str:
    """'inter 75%, intra 25%': the tiers, largest share first."""
    return ", ".join(f"{name} {100 * share:.0f}%" for name, share in sorted(shares.items(), key=lambda kv: -kv[1]))


def against_fastest(c: CandidateResult, fastest: CandidateResult | None) -> str:
    """The table's word for a candidate against the fastest: fastest, overlaps (indistinguishable), apart, or
    '-' (not feasible, or no intervals to tell by)."""
    if c is fastest:
        return "fastest"
    if c.indistinguishable_from_best is None or not c.feasible:
        return "-"
    return "overlaps" if c.indistinguishable_from_best else "apart"


def _row(rank: int, c: CandidateResult, iterations: int | None, tokens: float | None, memory_scale: float,
         fastest: CandidateResult | None) -> tuple:
    trained = c.training(iterations, tokens)
    interval = f"{c.interval.p5_s * 1e3:.1f}-{c.interval.p95_s * 1e3:.1f}" if c.interval is not None else "-"
    cells = [rank, c.label, c.batch_time_s * 1e3 if c.predicted else None, interval, against_fastest(c, fastest),
             c.throughput_samples_s,
             c.throughput_tokens_s, 100 * c.bubble_fraction if c.predicted else None,
             100 * c.comm_fraction if c.predicted else None, tier_shares(c.comm_by_tier) if c.predicted else None,
             c.peak_memory_bytes / memory_scale if c.peak_memory_bytes is not None else None,
             "yes" if c.feasible or c.pruned else "no", c.speedup]
    if iterations is not None or tokens is not None:
        cells += [trained[0] / 3600 if trained else None, trained[1] if trained else None]
    note = c.reason or "; ".join(c.flags)
    return (*cells, note)


def format_search(result: SearchResult, top: int = 20, iterations: int | None = None,
                  tokens: float | None = None) -> str:
    """The answer first (the best candidate, the recommendation, what profiling cost), then the ranked table."""
    spec, best = result.spec, result.best
    capacity = (f"{format_bytes(result.capacity_bytes)} per device" if result.capacity_bytes
                else "no memory limit given")
    too_large = sum(c.too_large for c in result.candidates)
    pruned = sum(c.pruned for c in result.candidates)
    out = [f"{spec.model.name}: {len(result.candidates)} candidate strategies ({len(result.rejected)} combinations "
           f"rejected), {capacity}" + (f"; {too_large} do not fit (neither costed nor simulated)" if too_large
                                       else "")
           + (f"; {pruned} fit but cannot come within {100 * PRUNE_MARGIN:.0f}% of the fastest (not simulated: "
              "--exhaustive)" if pruned else "")]
    if best is None:
        out.append("no candidate fits: " + result.candidates[0].reason if result.candidates else "no candidate")
    else:
        line = (f"best: {best.label} on {best.spec.strategy.world:,} devices: {format_seconds(best.batch_time_s)} per "
                f"iteration, {best.throughput_samples_s or float('inf'):,.2f} samples/s, peak "
                f"{format_bytes(best.peak_memory_bytes)} per device ({best.dominant}), "
                f"{best.speedup or float('inf'):.2f}x the slowest simulated that fits")
        out.append(line)
        if result.recommendation is not None:
            out.append(result.recommendation.text())
        if any(DEVICE in by_source for by_source in best.sources.values()):  # the device model costed some
            out.append(f"its events: {describe_sources(best.sources, best.spec.cluster.device or '')}")
        trained = best.training(iterations, tokens)
        if trained:
            what = f"{iterations:,} iterations" if iterations is not None else f"{tokens:,.0f} tokens"
            out.append(f"training {what}: {format_duration(trained[0])}, {trained[1]:,.3g} GPU-hours")
    per_count = best_per_gpu_count(result.candidates)
    if len(per_count) > 1:
        rows = []
        for n, c in sorted(per_count.items()):
            trained = c.training(iterations, tokens)
            rows.append([n, c.label, c.batch_time_s * 1e3, trained[0] / 3600 if trained else None,
                         trained[1] if trained else c.batch_time_s * n, tier_shares(c.comm_by_tier)])
        cost_header = "GPU-h" if iterations is not None or tokens is not None else "GPU-s per iteration"
        out += ["", format_table(["devices", "fastest that fits", "batch ms", "train h", cost_header,
                                  "comm by tier"], rows, title="per device count (the booking curve; --png draws it):")]
    cost = result.profiling_cost()
    if cost:
        out.append(f"profiling the whole search held its devices for {cost['profile_device_s']:,.1f} device-s "
                   f"(wall time x ranks), {100 * cost['fraction']:.2f}% of running every candidate for real "
                   f"({cost['brute_force_device_s']:,.0f} device-s, the same warm-up and repeats)")
    shown = result.candidates if top == 0 else result.candidates[:top]
    unit, scale = byte_unit([c.peak_memory_bytes for c in shown])
    headers = ["#", "strategy", "batch ms", "90% ms", "vs fastest", "samples/s", "tokens/s", "bubble %", "comm %",
               "comm by tier", f"peak {unit}", "fits", "speed-up"]
    if iterations is not None or tokens is not None:
        headers += ["train h", "GPU-h"]
    headers.append("note")
    fastest = result.recommendation.fastest if result.recommendation is not None else None
    out += ["", format_table(headers, [_row(i + 1, c, iterations, tokens, scale, fastest)
                                       for i, c in enumerate(shown)])]
    if len(shown) < len(result.candidates):
        out.append(f"... {len(result.candidates) - len(shown)} more (--top 0 for all, --csv FILE for a spreadsheet)")
    return "\n".join(out)
