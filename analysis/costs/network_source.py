"""Communication beyond the measured points: the network model (analysis.network) of the spec's
`[[cluster.network]]`, else tiers calibrated from the profile's own alpha-beta fits (`network_for`), or a
what-if network (`what_if_network`), costing a collective by NCCL's algorithms or the profiling backend's ring
over where its group lies (`NetworkSource`, marked `network`); and each tier's share of the communication. A spec's
tiers are costed by the library that runs the job's collectives (`collective_library`: gloo on CPUs, NCCL on
GPUs, MPI under the mpi4py backend)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from analysis.calibration import device_kind
from analysis.costs.device_source import device_model
from analysis.costs.fits import CommFit, comm_fits
from analysis.costs.records import MODELLED, Costs, EventCost
from analysis.costs.samples import PLACEMENTS, CommPoints, bare_collective_note, measured_comm_points
from analysis.costs.source import CostSource
from analysis.network import GLOO, MPI, NCCL, Estimate, NetworkModel, calibrated_network, network_op, spec_network
from analysis.profile_reader import Profile
from harness.common.errors import UserError
from harness.plan.events import COMM_KINDS, INTER, Event, EventPlan
from harness.plan.network import check_tiers, group_span, parse_overrides
from harness.plan.spec import JobSpec, load_spec


def collective_library(spec: JobSpec, profile: Profile | None = None) -> str:
    """The library that runs the target's collectives: MPI under the mpi4py backend (`[profile] backend`); else
    torch.distributed's choice for the target's device, gloo on a CPU and NCCL on a GPU. The device is the spec's
    (`[cluster] device`: the target's, whatever the profile was taken on), else the profile's; NCCL where neither
    says."""
    if spec.profile.backend == "mpi4py":
        return MPI
    if spec.cluster.device:
        return GLOO if device_model(spec.cluster.device).description.processor == "cpu" else NCCL
    if profile is not None and profile.environment:
        return GLOO if device_kind(profile.environment) == "cpu" else NCCL
    return NCCL


def network_for(spec: JobSpec, profile: Profile, points: CommPoints | None = None,
                fits: Mapping[tuple[str, str], CommFit] | None = None) -> NetworkModel | None:
    """The target's network: the spec's `[[cluster.network]]` (its collectives by collective_library's), else tiers
    calibrated from the profile's points (a node of the spec's gpus_per_node, then the rest); None when the profile
    measured no communication."""
    cluster = spec.cluster
    if points is None:
        points = measured_comm_points(profile)
    if fits is None:
        fits = comm_fits(points)
    library = collective_library(spec, profile)
    if cluster.network:
        return spec_network(cluster.network, library)
    return calibrated_network(points, cluster.gpus_per_node, profile.path.name,
                              lambda kind, placement, _: fits[(kind, placement)], library)


def what_if_network(spec: JobSpec, profile: Profile, what_if: str, points: CommPoints | None = None,
                    fits: Mapping[tuple[str, str], CommFit] | None = None) -> NetworkModel:
    """The network of `--network`: another spec's `[[cluster.network]]` (a TOML path), or 'TIER.FIELD=VALUE,...'
    changes to `spec`'s network (network_for's); UserError when it is neither or breaks a tier's rule."""
    devices = spec.cluster.devices
    if what_if.endswith(".toml") or Path(what_if).is_file():
        other = load_spec(what_if, import_factory=False)
        if not other.cluster.network:
            raise UserError(f"--network {what_if}: that spec has no [[cluster.network]] to take the tiers from")
        check_tiers(other.cluster.network, devices, f"--network {what_if} for {devices} GPUs")
        return NetworkModel(other.cluster.network, origin=f"what-if {what_if}",
                            library=collective_library(spec, profile))
    overrides = parse_overrides(what_if)
    base = network_for(spec, profile, points, fits)
    if base is None:
        raise UserError(f"--network {what_if}: {profile.path.name} measured no communication, so it has no network "
                        "to change; give a spec with [[cluster.network]] instead")
    return base.with_overrides(overrides, devices)


def slowest_group(plan: EventPlan, eid: str, network: NetworkModel) -> Estimate:
    """The network model's estimate for the slowest of the groups the plan keeps for a communication event (they
    may lie differently on the tiers: one pipeline boundary inside a leaf, the next across the spine)."""
    event = plan.events[eid]
    op = network_op(event.kind)
    groups = plan.group_ranks.get(eid) or [tuple(range(event.group_size))]
    return max((network.estimate_group(op, float(event.bytes), ranks) for ranks in groups),
               key=lambda estimate: estimate.seconds)


class NetworkSource(CostSource):
    """A communication event by the network model over the slowest of its groups, its note naming the
    algorithm, protocol and tiers (and the fit whose link it borrowed). Placed after the measured and
    interpolated sources it costs what they pass on; placed first as a what-if network (`what_if`), every
    communication event."""

    def __init__(self, plan: EventPlan, network: NetworkModel, what_if: bool = False):
        self.plan, self.network, self.what_if = plan, network, what_if

    def cost(self, eid: str, event: Event, costs: Costs) -> EventCost | None:
        if event.kind not in COMM_KINDS:
            return None
        if self.what_if:
            prefix = "what-if network; "
        else:
            bare = bare_collective_note(event.content)
            prefix = bare.removeprefix("; ") + "; " if bare else ""
        network = self.network
        estimate = slowest_group(self.plan, eid, network)
        tier = network.tiers[estimate.span.crossing].name
        fit = network.link_fits.get((event.kind, estimate.span.crossing))
        borrowed = ""
        if fit is not None and fit != (event.kind, tier):
            borrowed = (f"; no {event.kind} measured {tier}: the {fit[0]} {fit[1]} fit's link"
                        + (" (the same link alpha and beta)" if fit[0] != event.kind else ""))
        return EventCost(eid, event.name, event.kind, estimate.seconds, MODELLED, fit,
                         f"{prefix}network model ({network.origin}): {estimate.describe(network.tiers)}{borrowed}")


def communication_by_tier(plan: EventPlan, costs: Costs) -> dict[str, float]:
    """Each network tier's share of an iteration's communication time, summed over every device (an event's
    seconds x its count), by the outermost tier any of its groups crosses; without a network model, by
    placement."""
    seconds: dict[str, float] = {}
    tiers = costs.network.tiers if costs.network is not None else None
    for eid, event in plan.events.items():
        if event.kind not in COMM_KINDS or eid not in costs.events:
            continue
        if tiers is not None:
            groups = plan.group_ranks.get(eid) or [tuple(range(event.group_size))]
            name = tiers[max(group_span(ranks, tiers).crossing for ranks in groups)].name
        else:
            name = event.placement or INTER
        seconds[name] = seconds.get(name, 0.0) + costs.seconds(eid) * plan.multiplicity[eid]
    total = sum(seconds.values())
    order = [t.name for t in tiers] if tiers is not None else list(PLACEMENTS)
    return {name: seconds[name] / total for name in order if name in seconds} if total > 0 else {}
