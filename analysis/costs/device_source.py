"""Compute the profile did not measure, from the spec's device (`[cluster] device`): each compute event's kernels
(harness.plan.kernels, attention as the layer's signature says: the spec's `[model] attention`) on the device's
roofline and efficiency curves (analysis.device_model), marked `device`. Where the description gives the host's
time to issue a kernel (`[host] kernel_issue_us`), the event's issue time goes to Costs.host_issue, which the
simulation plays against the device's time as it does a GPU profile's; where the description costs every compute
event (a spec alone), without the host's wait after each inline collective that the harness's loop has
(Costs.host_waits_on_collectives) and with the description's engine gap between steps (`[host] step_gap_us`;
run_as_described); and where it gives a CPU's `[host] inline_collective_us`, each tensor-parallel collective of a
layer's pass at that a call plus its bytes' time on the network model (price_inline_collectives); and where it gives a
CPU's `[host] p2p_post_us`, `p2p_sender_busy_us` and `p2p_late_us`, each pipeline send's post, its wait for a
computing sender and, received late, the compute its library threads take from both ends (price_pipeline_sends).

Placed after the measured source, it answers every compute event the profile lacks; without a profile, every
compute event. An event whose kernels the plan cannot list (a factory model's layer, a Mixture-of-Experts block)
is refused before costing starts (`check_device_costable`), with what to profile.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from analysis.calibration import processor_of
from analysis.costs.records import FITTED, MEASURED, MODELLED, UNAVAILABLE, Costs, EventCost
from analysis.costs.samples import BARE_NOTE
from analysis.costs.source import CostSource
from analysis.device_model import DeviceModel, KernelTime
from analysis.network import network_op
from analysis.profile_reader import Profile
from harness.common.errors import UserError
from harness.plan.device import DeviceDescription
from harness.plan.events import Event, EventPlan
from harness.plan.kernels import (
    Attention,
    Gemm,
    Kernel,
    MemoryBound,
    accumulation_share,
    job_event_kernels,
    main_gradients_dtype,
)
from harness.plan.spec import JobSpec
from harness.store.hdf5_schema import STEP_GAPS

DEVICE = "device"  # EventCost.source of an event costed by the device model
# the exchanges of a layer's pass (a stage's tp_events by name): tensor parallelism's collectives, and context
# parallelism's (a ring's sends of keys and values and of their gradients, or its all-gather and reduce-scatter)
INLINE_PREFIXES = ("tp.", "cp.")
_MODELS: dict[str, DeviceModel] = {}  # `[cluster] device` text -> its model, per process
# (description's file, device, event id, recompute, accumulation share, gradient shard, master weights) -> the event's
# costing: the same event recurs in every candidate of a search (two files may give one name), its accumulation
# (harness.plan.kernels.job_event_kernels) by the candidate's micro-batches and ZeRO stage
_COSTED: dict[tuple[str, str, str, str, float, int, bool], DeviceCosting] = {}


@dataclass(frozen=True)
class DeviceCosting:
    """One compute event on the device: its kernels with their times, the host's seconds to issue them, and the
    note that says how it was costed."""

    kernels: tuple[Kernel, ...]
    times: tuple[KernelTime, ...]
    note: str
    issue_s: float = 0.0
    wrapper_s: float = 0.0  # the framework's around a wrapped layer, on the device's time (a CPU's, and any
    # optimizer step's: a step is costed by its time alone; a GPU's layer's is the host's, in issue_s)

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.times) + self.wrapper_s

    def breakdown(self) -> list[dict[str, Any]]:
        """Each kernel: its name, type, FLOPs, bytes, seconds and the side of the roofline it is on (--details);
        then, where the event pays its wrappers on the device, a row of type "wrapper" with their seconds."""
        rows = [{"kernel": k.name, "type": _kind(k), "flops": k.flops, "bytes": k.bytes, "seconds": t.seconds,
                 "compute_s": t.compute_s, "memory_s": t.memory_s, "launch_s": t.launch_s, "bound": t.bound}
                for k, t in zip(self.kernels, self.times)]
        if self.wrapper_s:
            rows.append({"kernel": "wrappers", "type": "wrapper", "flops": 0.0, "bytes": 0.0, "seconds": self.wrapper_s,
                         "compute_s": 0.0, "memory_s": 0.0, "launch_s": 0.0, "bound": "framework"})
        return rows


def device_model(text: str) -> DeviceModel:
    """The model of `[cluster] device = TEXT`, loaded once per process."""
    if text not in _MODELS:
        _MODELS[text] = DeviceModel.named(text)
    return _MODELS[text]


def device_model_for(plan: EventPlan) -> DeviceModel | None:
    """The spec's device model, None where `[cluster] device` is not given."""
    text = plan.spec.cluster.device
    return device_model(text) if text else None


def processor_mismatch(device: DeviceModel | None, profile: Profile) -> str | None:
    """A warning where a profile's measured compute and the spec's device are different processors (a CPU profile
    beside a GPU description): the events it measured then cost the profile's processor's times, the rest the
    description's. None where they agree, or where there is no device or nothing measured."""
    if device is None or not profile.measurements:
        return None
    measured_on = processor_of(profile.environment)
    if measured_on == device.description.processor:
        return None
    return (f"{profile.path.name} was measured on a {measured_on.upper()} "
            f"({profile.environment.get('device', '?')}) and the spec's device {device.name} is a "
            f"{device.description.processor.upper()}: the events it measured cost the {measured_on.upper()}'s "
            "times and the rest the description's; give a profile taken on the spec's device, or none")


def device_costing(device: DeviceModel, eid: str, event: Event, spec: JobSpec) -> DeviceCosting:
    """`event`'s kernels as `spec`'s job runs them (harness.plan.kernels.job_event_kernels) and their times on
    `device` (UserError where the plan cannot list its kernels)."""
    strategy = spec.strategy
    key = (device.description.source, device.name, eid, strategy.recompute, accumulation_share(spec),
           strategy.dp if strategy.zero >= 2 else 1, main_gradients_dtype(spec))
    if key not in _COSTED:
        kernels = tuple(job_event_kernels(event.content, spec))
        times = tuple(device.kernel_time(k) for k in kernels)
        issue = host_issue_seconds(device, event.content, kernels)
        note = describe_costing(device, kernels, times)
        if issue:
            note += f"; the host issues its {sum(k.launches for k in kernels):.0f} launches in {issue * 1e3:.3g} ms"
        wrapper = device.wrapper_seconds(event.content, kernels)
        if wrapper:
            names = " and ".join(device.wrappers_of(event.content))
            note += f"; {names} around it {wrapper * 1e3:.3g} ms"
        # a GPU's host runs a layer's wrappers while its device computes; an optimizer step is costed by its time
        # alone (host_issue_seconds), so its wrapper's is that time's too
        on_host = device.description.processor == "gpu" and event.content.get("phase") != "optimizer"
        _COSTED[key] = DeviceCosting(kernels, times, note, issue + wrapper if on_host else issue,
                                     0.0 if on_host else wrapper)
    return _COSTED[key]


def host_issue_seconds(device: DeviceModel, content: dict[str, Any], kernels: Sequence[Kernel]) -> float:
    """The host's seconds to issue a forward or backward event's kernels (DeviceModel.issue_seconds): what the
    simulation plays against the device's time within a step. An optimizer step's is 0: it runs after the
    steps, costed by its device time alone, as a GPU profile's is."""
    return 0.0 if content.get("phase") == "optimizer" else device.issue_seconds(kernels)


def describe_costing(device: DeviceModel, kernels: Sequence[Kernel], times: Sequence[KernelTime]) -> str:
    """'device model (a100-80gb): 6 GEMMs compute-bound, 2 attention, 9 memory-bound; 61% of the matrix peak':
    the kernels by type (each type's bound where all of its kernels share one) and the FLOPs achieved over the
    event's seconds against the device's matrix peak in the event's dtype."""
    parts = []
    for label, kind in (("GEMM", Gemm), ("attention", Attention), ("memory-bound", MemoryBound)):
        mine = [t for k, t in zip(kernels, times) if isinstance(k, kind)]
        if not mine:
            continue
        bounds = {t.bound for t in mine}
        plural = "s" if len(mine) > 1 and label == "GEMM" else ""
        bound = f" {bounds.pop()}-bound" if len(bounds) == 1 and kind is not MemoryBound else ""
        parts.append(f"{len(mine)} {label}{plural}{bound}")
    seconds = sum(t.seconds for t in times)
    flops = sum(k.flops for k in kernels)
    dtype = next((k.dtype for k in kernels if isinstance(k, (Gemm, Attention))), None)
    share = ""
    if dtype is not None and seconds > 0:
        share = f"; {100 * flops / seconds / device.description.matrix_peak[dtype]:.0f}% of the {dtype} matrix peak"
    return f"device model ({device.name}): {', '.join(parts) or 'no kernels'}{share}"


def _kind(kernel: Kernel) -> str:
    return "gemm" if isinstance(kernel, Gemm) else "attention" if isinstance(kernel, Attention) else "memory"


def uncostable(plan: EventPlan, device: DeviceModel, ids: Iterable[str]) -> dict[str, str]:
    """Of the compute events `ids`, those whose kernels the plan cannot list: id -> why."""
    out = {}
    for eid in ids:
        try:
            device_costing(device, eid, plan.events[eid], plan.spec)
        except UserError as exc:
            out[eid] = str(exc)
    return out


def check_device_costable(plan: EventPlan, device: DeviceModel, missing: Sequence[str], ranks: int,
                          spec_hint: str) -> None:
    """UserError listing the compute events `missing` from the profile that the device model cannot cost either
    (their kernels are the user's code or a MoE block's), with the command that profiles them."""
    refused = uncostable(plan, device, missing)
    if not refused:
        return
    lines = [f"{len(refused)} compute event(s) of {plan.spec.model.name} are neither in a profile nor costable by "
             f"the device model ({device.name}):"]
    lines += [f"  {eid}  {plan.events[eid].name}: {why.splitlines()[0]}" for eid, why in sorted(
        refused.items(), key=lambda item: plan.events[item[0]].name)]
    lines.append(f"profile them with: mpirun -n {ranks} python -m mpi4py -m harness profile {spec_hint} -o OUTDIR, and "
                 "give the profile (simulate PROFILE.h5 --spec SPEC, or SPEC --profile PROFILE.h5)")
    raise UserError("\n".join(lines))


def with_fsdp2(device: DeviceModel, event: Event, cost: EventCost) -> EventCost:
    """A ZeRO all-gather or reduce-scatter costed as the bare collective (not measured: the profile's own is timed
    through FSDP2) with FSDP2's work around it on the device: an all-gather's unshard (DeviceModel.unshard_seconds),
    a reduce-scatter's reduce (DeviceModel.reduce_seconds), each its copies and the framework's time; any other cost
    as it is."""
    if event.kind not in ("allgather", "reducescatter") or not event.content.get("fsdp") or cost.source == MEASURED:
        return cost
    unshard = event.kind == "allgather"
    copies, framework = (device.unshard_seconds if unshard else device.reduce_seconds)(event.content)
    bare = BARE_NOTE.removeprefix("; ")
    parts = [part for part in cost.note.split("; ") if part and part != bare]
    parts.append(f"FSDP2's {'unshard' if unshard else 'reduce'} on the device model ({device.name}): "
                 f"{'copies' if unshard else 'copy-in'} {copies * 1e3:.3g} ms"
                 + (f", framework {framework * 1e3:.3g} ms" if framework else ""))
    return dataclasses.replace(cost, seconds=cost.seconds + copies + framework, note="; ".join(parts))


class DeviceSource(CostSource):
    """A compute event from its kernels on the spec's device (module docstring); the kernels' breakdown of each
    event it answers goes to costs.device_kernels (what --details prints)."""

    def __init__(self, plan: EventPlan, device: DeviceModel):
        self.plan, self.device = plan, device

    def cost(self, eid: str, event: Event, costs: Costs) -> EventCost | None:
        if event.kind != "compute":
            return None
        costing = device_costing(self.device, eid, event, self.plan.spec)
        costs.device_kernels[eid] = costing
        if costing.issue_s:
            costs.host_issue[eid] = costing.issue_s
        return EventCost(eid, event.name, event.kind, costing.seconds, DEVICE, note=costing.note)

    def finish(self, costs: Costs) -> None:
        """Where every compute event is the description's (a spec alone), the host runs as the description says
        (run_as_described); a profile's measured events keep the waits and gaps of the harness's loop that timed
        them."""
        compute = [cost for cost in costs.events.values() if cost.kind == "compute"]
        if compute and all(cost.source == DEVICE for cost in compute):
            run_as_described(costs, self.device.description)
            price_inline_collectives(self.plan, costs, self.device.description)
            price_pipeline_sends(self.plan, costs, self.device.description)


def price_pipeline_sends(plan: EventPlan, costs: Costs, description: DeviceDescription) -> None:
    """Each pipeline send (a stage's send_forward, send_backward) posts in the description's p2p_post at its bytes and,
    where its receiver posts late while its sender computes, takes p2p_sender_busy more (Costs.send_post and
    sender_busy_extra, what a profile's P2P measurements give the timeline; harness device measures both on a CPU's
    ranks as the profile does); received late, it takes p2p_late from each of its two devices' compute
    (Costs.late_transfer_cpu). None without the figures; a send a profile measured keeps its own."""
    sends = {eid for program in plan.stages for eid in (program.send_forward, program.send_backward) if eid}
    for eid in sorted(sends):
        nbytes = float(plan.events[eid].bytes)
        for table, seconds in ((costs.send_post, description.p2p_post(nbytes)),
                               (costs.sender_busy_extra, description.p2p_sender_busy(nbytes)),
                               (costs.late_transfer_cpu, description.p2p_late(nbytes))):
            if seconds:
                table.setdefault(eid, seconds)


def price_inline_collectives(plan: EventPlan, costs: Costs, description: DeviceDescription) -> None:
    """Each exchange of a layer's pass (a stage's tp_events named INLINE_PREFIXES: the hidden all-reduces, sequence
    parallelism's all-gathers and reduce-scatters, a vocabulary split's; a context-parallel ring's sends, or its
    all-gather and reduce-scatter) that the network model priced costs the description's inline_collective_s a
    call, as harness device measured it: the wait a call meets in a pass. A collective adds its bytes' time on that
    model (its estimate less the same collective's of one byte, over the slowest of its groups); a ring's send
    does not (the ring posts it before its step's compute, which its bytes travel behind). None without the
    figure or a network model; a measured or interpolated exchange keeps its own."""
    inline_s, network = description.inline_collective_s, costs.network
    if not inline_s or network is None:
        return
    inline = {eid for program in plan.stages for name, eid in program.tp_events.items()
              if name.startswith(INLINE_PREFIXES)}
    for eid in sorted(inline):
        cost = costs.events.get(eid)
        if cost is None or cost.source != MODELLED:
            continue
        event = plan.events[eid]
        if event.kind == "p2p":
            costs.events[eid] = dataclasses.replace(
                cost, seconds=inline_s, note=f"{cost.note}; a ring's send in a layer's pass on {description.name}: "
                                             f"{inline_s * 1e3:.3g} ms a call, its bytes behind the step's compute")
            continue
        op = network_op(event.kind)
        groups = plan.group_ranks.get(eid) or [tuple(range(event.group_size))]
        whole, empty = max((network.estimate_group(op, float(event.bytes), ranks).seconds,
                             network.estimate_group(op, 1.0, ranks).seconds) for ranks in groups)
        bytes_s = max(0.0, whole - empty)
        costs.events[eid] = dataclasses.replace(
            cost, seconds=inline_s + bytes_s,
            note=f"{cost.note}; inline in a layer's pass on {description.name}: {inline_s * 1e3:.3g} ms a call "
                 f"+ its bytes {bytes_s * 1e3:.3g} ms")


def run_as_described(costs: Costs, description: DeviceDescription) -> None:
    """Every compute event is the description's: the job runs as Megatron-LM runs it. The host enqueues a step's
    inline collectives, each in the description's collective_issue_s, and goes on
    (Costs.host_waits_on_collectives); between a device's steps the engine's host time, step_gap_s, which the
    device waits out (Costs.engine_gaps, each of STEP_GAPS), unless a profile given beside the spec measured the
    engine's gaps: measured gaps win."""
    costs.host_waits_on_collectives = False
    costs.collective_issue_s = description.collective_issue_s
    if description.step_gap_s and not costs.engine_gaps:
        costs.engine_gaps = dict.fromkeys(STEP_GAPS, description.step_gap_s)


def source_counts(costs: Costs) -> dict[str, dict[str, int]]:
    """Per kind of event (compute, communication), how many unique events each source costed."""
    out: dict[str, dict[str, int]] = {}
    for cost in costs.events.values():
        kind = "compute" if cost.kind == "compute" else "communication"
        out.setdefault(kind, {})
        out[kind][cost.source] = out[kind].get(cost.source, 0) + 1
    return out


def sources_line(costs: Costs) -> str:
    """'compute: 42 events, 30 from the device model (a100-80gb), 12 measured; communication: ...': where the
    unique events' durations came from (the report's line)."""
    return describe_sources(source_counts(costs), costs.device_model.name if costs.device_model else "")


def describe_sources(counts: dict[str, dict[str, int]], device: str = "") -> str:
    """source_counts' counts in words, largest first; `device` names the device model."""
    names = {DEVICE: "from the device model" + (f" ({device})" if device else ""),
             MODELLED: "from the network model", FITTED: "from a fit", UNAVAILABLE: "unavailable (costed 0)"}
    parts = []
    for kind, by_source in sorted(counts.items()):
        shares = [f"{n} {names.get(source, source)}" for source, n in sorted(by_source.items(), key=lambda kv: -kv[1])]
        parts.append(f"{kind}: {sum(by_source.values())} events, " + ", ".join(shares))
    return "; ".join(parts)
