"""What the timeline adds beside an event's duration, from the profile's measurements (else from a measured
neighbour): a P2P's extra time while its sender computes (`sender_busy_extra`), its post (`send_post`) and the
compute it takes from both ends when received late (`late_transfer_cpu`), a gradient bucket's averaging and zeroing
(`bucket_divide`, `bucket_zero`), how far the slowest data-parallel replica lags (analysis.skew), and the training
engine's gaps between steps (`engine_gaps`). Rules and reasons: docs/analysis.md, "Where durations come from"."""
from __future__ import annotations

import math

import numpy as np

from analysis.costs.records import Costs
from analysis.costs.samples import compute_statistic, representative_seconds
from analysis.profile_reader import Profile
from analysis.skew import replica_skew
from harness.plan.events import INTER, EventPlan
from harness.store.hdf5_schema import DIVIDE_SERIES, ENGINE_GAPS_ENV, ZERO_SERIES


def apply_corrections(plan: EventPlan, profile: Profile, costs: Costs) -> None:
    """Fill every table below for the plan's events; with data-parallel replicas, the bucket passes and the
    replica skew too (each with a warning where the profile lacks them)."""
    sender_busy_extras(plan, profile, costs)
    send_posts(plan, profile, costs)
    late_transfers(plan, profile, costs)
    costs.engine_gaps = engine_gaps(profile)
    if plan.spec.strategy.gradient_replicas > 1:
        bucket_passes(plan, profile, costs)
        costs.replica_skew = replica_skew(profile)
        if costs.replica_skew is None:
            costs.warnings.append(
                f"{profile.path.name} does not show how its ranks' speeds differ (no compute sample times from "
                "two ranks at the same moments: a profile written before they were recorded, one rank, or too "
                "few repeats), so the prediction has no wait for the slowest data-parallel replica; profile "
                "again on 2 or more ranks with more repeats to include it")


def engine_gaps(profile: Profile) -> dict[str, float]:
    """The training engine's gaps between steps the profile measured (ENGINE_GAPS_ENV), in seconds by transition;
    none from a profile taken before they were."""
    gaps = profile.environment.get(ENGINE_GAPS_ENV)  # read_environment decodes its JSON
    if not isinstance(gaps, dict):
        return {}
    return {str(kind): max(0.0, float(seconds)) for kind, seconds in gaps.items()}


def sender_busy_extras(plan: EventPlan, profile: Profile, costs: Costs) -> None:
    """costs.sender_busy_extra for the plan's P2P events: the mean excess of its samples taken with the sender
    computing over its own time, else the largest such excess measured at its placement."""
    by_placement: dict[str, float] = {}
    measured_extra: dict[str, float] = {}
    for eid, m in profile.measurements.items():
        if m.kind != "p2p" or not m.count or m.sender_busy_samples_s.size == 0:
            continue
        extra = max(0.0, float(m.sender_busy_samples_s.mean()) - representative_seconds(m))
        measured_extra[eid] = extra
        by_placement[m.placement] = max(extra, by_placement.get(m.placement, 0.0))
    for eid, event in plan.events.items():
        if event.kind != "p2p":
            continue
        extra = measured_extra.get(eid, by_placement.get(event.placement or INTER))
        if extra:
            costs.sender_busy_extra[eid] = extra


def send_posts(plan: EventPlan, profile: Profile, costs: Costs) -> None:
    """costs.send_post for the plan's P2P events: the median of its measured posts, else that of the measured
    P2P at its placement nearest in size (on a log scale)."""
    _p2p_medians(plan, profile, costs.send_post, lambda m: m.send_post_samples_s)


def late_transfers(plan: EventPlan, profile: Profile, costs: Costs) -> None:
    """costs.late_transfer_cpu for the plan's P2P events: the median of its rounds of the stream of late receives
    (a CPU's profile), not below 0, else that of the measured P2P at its placement nearest in size; none where
    the profile has no such rounds (a GPU's, or one taken before they were measured)."""
    _p2p_medians(plan, profile, costs.late_transfer_cpu, lambda m: m.late_cpu_samples_s, floor=0.0)


def _p2p_medians(plan: EventPlan, profile: Profile, table: dict[str, float], series,
                 floor: float | None = None) -> None:
    """table[eid] for the plan's P2P events: the median of the event's measured `series(measurement)` (not below
    `floor`), else that of the measured P2P at its placement nearest in size (on a log scale)."""
    measured: dict[str, tuple[str, int, float]] = {}  # id -> placement, bytes, median
    for eid, m in profile.measurements.items():
        values = series(m) if m.kind == "p2p" and m.count else np.empty(0)
        values = values[np.isfinite(values)]
        if values.size:
            median = float(np.median(values))
            measured[eid] = (m.placement, m.bytes, median if floor is None else max(floor, median))
    for eid, event in plan.events.items():
        if event.kind != "p2p":
            continue
        if eid in measured:
            table[eid] = measured[eid][2]
            continue
        placement = event.placement or INTER
        peers = [(abs(math.log(max(nbytes, 1) / max(event.bytes, 1))), value)
                 for p, nbytes, value in measured.values() if p == placement]
        if peers:
            table[eid] = min(peers)[1]


def bucket_passes(plan: EventPlan, profile: Profile, costs: Costs) -> None:
    """costs.bucket_divide and costs.bucket_zero for the plan's gradient-bucket all-reduces: the compute
    statistic of the bucket's own samples, else the rate (seconds per byte) of the largest all-reduce that has
    them; a warning where no all-reduce has them."""
    passes = ((DIVIDE_SERIES, costs.bucket_divide, "averaging (the division by the replica count)"),
              (ZERO_SERIES, costs.bucket_zero, "zeroing after the optimizer step"))
    for series, target, what in passes:
        measured = {eid: compute_statistic(costs.compute_stat, float(samples.mean()), float(np.median(samples)))
                    for eid, m in profile.measurements.items()
                    if m.kind == "allreduce" and m.count and (samples := m.series[series]).size}
        rated = [(profile.measurements[eid].bytes, seconds) for eid, seconds in measured.items()
                 if profile.measurements[eid].bytes > 0]
        largest_bytes, largest_s = max(rated, default=(0, 0.0))
        for program in plan.stages:
            for bucket in program.buckets:
                if bucket.event in measured:
                    target[bucket.event] = measured[bucket.event]
                elif largest_bytes:
                    target[bucket.event] = largest_s / largest_bytes * plan.events[bucket.event].bytes
        if not target and any(program.buckets for program in plan.stages):
            costs.warnings.append(
                f"{profile.path.name} has no all-reduce with `{series}` (written before they were measured), so "
                f"the prediction leaves out each gradient bucket's {what}; profile again to include it")
