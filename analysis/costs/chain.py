"""The cost chain: the sources asked, in order, for each event's duration (`cost_chain`), and `estimate_costs`,
which costs a plan by asking them (the interface a source implements: source.py)."""
from __future__ import annotations

from analysis.calibration import device_kind
from analysis.costs.device_source import (
    DeviceSource,
    check_device_costable,
    device_model_for,
    processor_mismatch,
    with_fsdp2,
)
from analysis.costs.fits import FitSource, UnavailableSource, comm_fits
from analysis.costs.interpolated import InterpolatedSource, comm_curves
from analysis.costs.measured import MeasuredSource, check_compute_measured, rank_speed_factors, samples_for
from analysis.costs.network_source import NetworkSource, network_for, what_if_network
from analysis.costs.records import Costs, EventCost
from analysis.costs.samples import CommPoints, check_statistic, comm_points
from analysis.costs.source import CostSource
from analysis.network import NetworkModel
from analysis.profile_reader import Profile
from analysis.skew import machine_drift
from harness.plan.events import Event, EventPlan


class UnmeasuredLedger(CostSource):
    """Answers nothing: notes each event that reaches it, past every source of measurements, in
    costs.unmeasured with the profile's reason for lacking it."""

    def __init__(self, profile: Profile):
        self.profile = profile

    def cost(self, eid: str, event: Event, costs: Costs) -> EventCost | None:
        reason = self.profile.unmeasured.get(eid, "not in the profile (its spec or strategy differs from this one)"
                                             if self.profile.measurements else "no profile")
        costs.unmeasured.append({"id": eid, "name": event.name, "kind": event.kind, "reason": reason})
        return None


def cost_chain(plan: EventPlan, profile: Profile, costs: Costs, network_only: bool = False) -> list[CostSource]:
    """The sources, in the order they are asked: the what-if network (`network_only`: every communication
    event), the profile's measurements, the device model (costs.device_model: the compute the profile lacks),
    interpolation between measured sizes, then, past the measurements, the network model (costs.network), the
    nearest alpha-beta fit, and 0 with a warning. With a device model, a ZeRO all-gather or reduce-scatter none
    measured gains FSDP2's unshard or reduce on the device (device_source.with_fsdp2, in estimate_costs).

    A what-if device (every compute event on another device) would plug in first, as the what-if network does."""
    network = costs.network
    what_if = [NetworkSource(plan, network, what_if=True)] if network_only and network is not None else []
    # a profile that measured nothing (a spec alone) has nothing to answer or correct
    measured = [MeasuredSource(plan, profile)] if profile.measurements else []
    device = [DeviceSource(plan, costs.device_model)] if costs.device_model is not None else []
    modelled = [NetworkSource(plan, network)] if network is not None else []
    return [*what_if, *measured, *device, InterpolatedSource(costs.curves),
            UnmeasuredLedger(profile), *modelled, FitSource(costs.fits), UnavailableSource(profile)]


def first_answer(chain: list[CostSource], eid: str, event: Event, costs: Costs) -> EventCost:
    """The cost of the first source in `chain` that answers for the event."""
    for source in chain:
        cost = source.cost(eid, event, costs)
        if cost is not None:
            return cost
    raise ValueError(f"no source in the cost chain answers for {event.kind} event {eid} ({event.name})")


def estimate_costs(plan: EventPlan, profile: Profile, spec_hint: str = "SPEC", compute_stat: str = "mean",
                   rank_speed: bool = True, extra_points: CommPoints | None = None,
                   network: NetworkModel | None = None, network_only: bool = False,
                   what_if: str | None = None) -> Costs:
    """The duration of every event of `plan` from `profile`, by the cost chain (rules: docs/analysis.md,
    "Where durations come from").

    Compute the profile lacks comes from the spec's device (`[cluster] device`, device_source.py); raises
    MissingComputeError (a UserError) listing the compute events the profile lacks where the spec names no
    device, or a UserError listing those the device model cannot cost either; `spec_hint` is the spec path to
    show in the command that profiles them. `compute_stat`: mean or median.
    `rank_speed`: refer each compute event to the profiling ranks' mean speed (where the profile has the probe).
    `extra_points`: more communication points (a collective benchmark's), interpolated and fitted with the
    profile's. `network`: the network model beyond the measured curves (default: network_for's); with
    `network_only` (a what-if network) every communication event comes from it. `what_if`: --network's text
    (what_if_network), which sets both.
    """
    check_statistic(compute_stat)
    device = device_model_for(plan)
    if device is None:
        check_compute_measured(plan, profile, spec_hint)
    else:
        missing = [eid for eid, e in plan.events.items()
                   if e.kind == "compute" and samples_for(profile, eid, e) is None]
        check_device_costable(plan, device, missing, max(profile.world_size, 1), spec_hint)
    points = comm_points(profile, extra_points)
    fits = comm_fits(points)
    if what_if:
        network, network_only = what_if_network(plan.spec, profile, what_if, points, fits), True
    network = network or network_for(plan.spec, profile, points, fits)
    costs = Costs(events={}, fits=fits, curves=comm_curves(points), compute_stat=compute_stat,
                  rank_speed=rank_speed_factors(profile) if rank_speed else {}, network=network,
                  machine_drift=machine_drift(profile), device=device_kind(profile.environment),
                  device_model=device)
    mismatch = processor_mismatch(device, profile)
    if mismatch:
        costs.warnings.append(mismatch)
    chain = cost_chain(plan, profile, costs, network_only)
    for eid, event in plan.events.items():
        cost = first_answer(chain, eid, event, costs)
        costs.events[eid] = with_fsdp2(device, event, cost) if device is not None else cost
    for source in chain:
        source.finish(costs)
    return costs
