"""From a profile (and optionally another spec or strategy), or from a spec alone (its device and network
models), to a simulated timeline, in one call; and the command-line options that shape a prediction, shared by
every command that predicts."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from analysis.costs import Costs, estimate_costs, held_out_checks
from analysis.memory import MemoryEstimate, activation_bytes, estimate_memory, released_bytes, temporary_bytes
from analysis.profile_reader import Profile, layers_for, load_profile, resolve_spec
from analysis.simulate import Timeline, simulate
from analysis.spec_only import check_spec_only, plan_communication, spec_profile
from analysis.uncertainty import DEFAULT_RESAMPLES, BatchTimeInterval, prediction_interval
from harness.common.subcommands import non_empty
from harness.plan.events import EventPlan, build_plan
from harness.plan.spec import JobSpec


@dataclass
class Prediction:
    """Everything one simulation used and produced."""

    profile: Profile  # a spec-only prediction's measured nothing (analysis.spec_only.spec_profile)
    spec: JobSpec
    plan: EventPlan
    costs: Costs
    timeline: Timeline
    memory: MemoryEstimate
    interval: BatchTimeInterval | None = None  # the batch time's, from the profile's samples (analysis.uncertainty)


def predict(profile: Profile | str | Path, spec_path: str | Path | None = None, strategy: str | None = None,
            dp_overlap: bool | None = None, compute_stat: str = "mean", rank_speed: bool = True,
            resamples: int = DEFAULT_RESAMPLES, collectives: Sequence[str | Path] = (),
            network: str | None = None) -> Prediction:
    """Load the profile (if a path), resolve the spec (--spec, --strategy) and predict it (predict_spec).
    Raises UserError on bad input."""
    if not isinstance(profile, Profile):
        profile = load_profile(profile)
    spec = resolve_spec(profile, spec_path, strategy)
    return predict_spec(spec, profile, dp_overlap=dp_overlap, compute_stat=compute_stat, rank_speed=rank_speed,
                        resamples=resamples, collectives=collectives, network=network, source=spec_path)


def predict_spec(spec: JobSpec, profile: Profile | None = None, dp_overlap: bool | None = None,
                 compute_stat: str = "mean", rank_speed: bool = True, resamples: int = DEFAULT_RESAMPLES,
                 collectives: Sequence[str | Path] = (), network: str | None = None,
                 source: str | Path | None = None) -> Prediction:
    """Build `spec`'s plan, cost its events (analysis.costs: what `profile` measured, compute by `compute_stat`,
    referred to the ranks' mean speed unless not `rank_speed`; the rest from the spec's device and network
    models; with no profile every event from them), simulate one iteration and, with `resamples` and samples to
    resample, the batch time's interval (none without a profile). dp_overlap None follows the spec.
    `collectives`: benchmark files (harness collectives -o) whose points join the profile's communication; for a spec
    alone they are its communication's measurements (interpolated, then fitted per kind where the spec has no
    [[cluster.network]]), whatever backend took them.
    `network`: a what-if network (--network: a spec's [[cluster.network]] or TIER.FIELD=VALUE changes) that
    costs every communication event. `source`: the spec's file, for messages.
    Raises UserError on bad input, or where neither the profile nor the models can cost an event (a spec alone
    without [cluster] device or [[cluster.network]], a factory model's layers without a profile)."""
    hint = str(source) if source else "SPEC"
    spec_only = profile is None
    # a spec alone costs its communication from collective benchmarks where they are given, as from a network
    network_given = network is not None or bool(collectives)
    if profile is None:
        check_spec_only(spec, hint, {}, network_given=network_given)  # a factory model, no device
        profile = spec_profile(spec, hint)
    plan = build_plan(spec, layers_for(profile, spec))
    if spec_only:
        check_spec_only(spec, hint, plan_communication(plan), network_given=network_given)
    extra = None
    if collectives:
        from analysis.collectives import load, profile_points

        extra = profile_points(load(collectives), None if spec_only else str(profile.environment.get("backend", "?")),
                               str(profile.environment.get("device", "?")), profile.path.name)
    costs = estimate_costs(plan, profile, spec_hint=hint, compute_stat=compute_stat, rank_speed=rank_speed,
                           extra_points=extra, what_if=network)
    costs.held_out = held_out_checks(profile, extra)
    return Prediction(profile, spec, plan, costs, simulate(plan, costs, dp_overlap),
                      estimate_memory(plan, activation_bytes(profile), released_bytes(profile),
                                      temporary_bytes(profile)),
                      prediction_interval(plan, costs, dp_overlap, resamples))


def add_prediction_arguments(parser: argparse.ArgumentParser, interval: bool = True) -> None:
    """--no-overlap, --compute-stat, --no-rank-speed: how events become a prediction (docs/analysis.md); with
    `interval`, --resamples for the batch time's interval (commands that report one)."""
    parser.add_argument("--no-overlap", action="store_true",
                        help="all-reduce gradients after the whole backward (DistSim), not during it (DDP)")
    parser.add_argument("--compute-stat", choices=("mean", "median"), default="mean",
                        help="the statistic of a compute event's samples that stands for it: mean (default: an "
                             "iteration sums many events) or median (DistSim's)")
    parser.add_argument("--no-rank-speed", action="store_true",
                        help="keep every compute sample as its profiling rank took it, instead of referring it to the "
                             "ranks' mean speed by the profile's speed probe")
    if not interval:
        return
    parser.add_argument("--resamples", type=_resamples, default=DEFAULT_RESAMPLES, metavar="N",
                        help="bootstrap resamples of the profile's samples for the batch time's 90%% interval "
                             f"(default {DEFAULT_RESAMPLES}; 0: no interval)")


def add_network_argument(parser: argparse.ArgumentParser) -> None:
    """--network: the what-if network of simulate and search."""
    parser.add_argument("--network", metavar="TIER.FIELD=VALUE,...|SPEC", type=non_empty,
                        help="what-if: cost all communication on a changed network (e.g. inter.bandwidth_gbs=100; "
                             "the tiers are the spec's [[cluster.network]], else intra and inter calibrated from the "
                             "profile) or on another spec's [[cluster.network]]")


def _resamples(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of resamples from 0 to 100000")
    return value


def prediction_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of predict() and validate() that add_prediction_arguments' options give."""
    options = {"dp_overlap": False if args.no_overlap else None, "compute_stat": args.compute_stat,
               "rank_speed": not args.no_rank_speed}
    if hasattr(args, "resamples"):
        options["resamples"] = args.resamples
    return options
