"""The first source of durations: the profile's own measurements of an event (`MeasuredSource`), by the statistic
that stands for its kind (samples.statistic_of), compute referred to the profiling ranks' mean speed; and the
error that lists the compute events a profile lacks."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from analysis.costs.corrections import apply_corrections
from analysis.costs.records import MEASURED, Costs, EventCost, SampleSet
from analysis.costs.samples import compute_statistic, representative_seconds, statistic_of
from analysis.costs.source import CostSource
from analysis.profile_reader import MeasuredEvent, Profile
from harness.common.errors import UserError
from harness.plan.events import RUN_WRAPPERS, Event, EventPlan, composite_content, event_id, unwrapped_twin
from harness.store.hdf5_schema import BACKWARD_CALL_ATTR, COMPUTE_PHASE_ATTR, RANK_SPEED_PROBE_ENV, compute_phase_key


class MissingComputeError(UserError):
    """The profile lacks compute events that the plan needs; lists them and the command that profiles them."""

    def __init__(self, plan: EventPlan, missing: Sequence[str], ranks: int, spec_hint: str):
        self.missing = list(missing)
        s = plan.spec.strategy
        extra = (",sp=true" if s.sp else "") + (f",cp={s.cp}" if s.cp > 1 else "")
        lines = [f"the profile lacks {len(missing)} compute event(s) that {plan.spec.model.name} with "
                 f"dp={s.dp},tp={s.tp},pp={s.pp}{extra},micro={plan.spec.batch.micro} needs:"]
        for eid in missing:
            event = plan.events[eid]
            content = event.content
            signature = dict(content.get("signature", {}))
            detail = [f"{k} {content[k]}" for k in ("micro", "seq") if k in content]
            detail += [f"tp {signature['tp']}"] if "tp" in signature else []
            lines.append(f"  {eid}  {event.name}" + (f"  ({', '.join(detail)})" if detail else ""))
        lines.append(f"profile them with: mpirun -n {ranks} python -m mpi4py -m harness profile {spec_hint} -o OUTDIR")
        if spec_hint == "SPEC":
            lines.append(f"  (SPEC: a job spec with this model and strategy: dp = {s.dp}, tp = {s.tp}, pp = {s.pp}, "
                         + ("sp = true, " if s.sp else "") + (f"cp = {s.cp}, " if s.cp > 1 else "")
                         + f"micro = {plan.spec.batch.micro})")
        super().__init__("\n".join(lines))


def is_measured(profile: Profile, eid: str) -> bool:
    """Whether the profile holds samples of the event."""
    measurement = profile.measurements.get(eid)
    return measurement is not None and measurement.count > 0


def _composite(profile: Profile, event: Event):
    """The event's composite measurement (its layer with its tensor-parallel all-reduces), or for a wrapped event a
    profile from before wrapped events lacks, its unwrapped twin's; None where there is none."""
    for content in (event.content, {k: v for k, v in event.content.items() if k not in RUN_WRAPPERS}):
        measurement = profile.measurements.get(event_id(composite_content(content)))
        if measurement is not None and measurement.count:
            return measurement
    return None


def samples_for(profile: Profile, eid: str, event: Event) -> str | None:
    """The id whose samples cost the event: its own, or for a wrapped event that a profile from before wrapped
    events lacks, its unwrapped twin's (MeasuredSource warns); None where the profile has neither."""
    if is_measured(profile, eid):
        return eid
    twin = unwrapped_twin(event)
    return twin if twin is not None and is_measured(profile, twin) else None


def check_compute_measured(plan: EventPlan, profile: Profile, spec_hint: str) -> None:
    """MissingComputeError listing the plan's compute events the profile lacks (`spec_hint`: the spec path its
    command to profile them shows)."""
    missing = sorted((eid for eid, e in plan.events.items()
                      if e.kind == "compute" and samples_for(profile, eid, e) is None),
                     key=lambda eid: plan.events[eid].name)
    if missing:
        raise MissingComputeError(plan, missing, max(profile.world_size, 1), spec_hint)


def rank_speed_factors(profile: Profile) -> dict[str, list[float]]:
    """Per compute phase, each profiling rank's speed-probe median over the ranks' mean (1.1: that rank took
    10% longer than the ranks' mean); phases with fewer than two usable ranks are left out, and a rank
    without a usable probe gets 1."""
    speeds = profile.environment.get(RANK_SPEED_PROBE_ENV)
    if not isinstance(speeds, dict):
        return {}
    out = {}
    for key, medians in speeds.items():
        if not isinstance(medians, list):
            continue
        values = [float(v) if isinstance(v, (int, float)) and np.isfinite(v) and v > 0 else None for v in medians]
        usable = [v for v in values if v is not None]
        if len(usable) < 2:
            continue
        mean = sum(usable) / len(usable)
        out[str(key)] = [v / mean if v is not None else 1.0 for v in values]
    return out


def rank_factor(measurement: MeasuredEvent, factors: Mapping[str, list[float]]) -> float | None:
    """The speed factor of the rank that took a compute measurement: 1 where its rank had no usable probe,
    None where its profiling run has no probe in the profile at all."""
    phase = measurement.attrs.get(COMPUTE_PHASE_ATTR)
    per_rank = factors.get(compute_phase_key(phase)) if phase is not None else None
    if per_rank is None or not measurement.ranks:
        return None
    rank = measurement.ranks[0]
    return per_rank[rank] if 0 <= rank < len(per_rank) else 1.0


class MeasuredSource(CostSource):
    """An event the profile measured: its samples' statistic (a compute event's divided by its measuring rank's
    speed factor, unless it is also measured as a composite), with its samples for the interval, and a GPU
    compute event's host issue time and a backward's call overhead. A compute event the profile also timed in
    context (inside its stages' chains: harness.profile.in_context), and a ZeRO reduce-scatter timed in its pairs'
    chains (its unit's post-backwards), is costed from those samples instead (a reduce-scatter's median), its
    figure alone kept in costs.isolated and both in its note; profiles without them are costed as before.
    Afterwards: the composites (tensor-parallel layers measured with their all-reduces; a context-parallel block's
    from its samples in its pairs' chains where the profile has them, the composite alone kept in
    costs.isolated_composites) and the corrections (corrections.py)."""

    def __init__(self, plan: EventPlan, profile: Profile):
        self.plan, self.profile = plan, profile
        self.composites = {eid: m for eid, event in plan.events.items() if event.kind == "compute"
                           and (m := _composite(profile, event)) is not None}
        self.uncorrected: list[str] = []  # compute events of a profiling run without a probe, where others have one
        self.unwrapped: list[str] = []  # wrapped events costed from their unwrapped twin (samples_for)

    def cost(self, eid: str, event: Event, costs: Costs) -> EventCost | None:
        measured = samples_for(self.profile, eid, event)
        if measured is None:
            return None
        if measured != eid:
            self.unwrapped.append(event.name)
        measurement = self.profile.measurements[measured]
        compute_stat = costs.compute_stat
        seconds = representative_seconds(measurement, compute_stat)
        factor = 1.0
        if event.kind == "compute" and costs.rank_speed and eid not in self.composites:
            factor = rank_factor(measurement, costs.rank_speed)
            if factor is None:
                self.uncorrected.append(event.name)
                factor = 1.0
        samples, note = measurement.samples_s, ""
        in_chains = event.kind == "compute" or (event.kind == "reducescatter" and event.content.get("fsdp"))
        in_context = measurement.in_context_samples_s if in_chains else np.empty(0)
        if in_context.size:  # timed inside its stages' chains: what a step meets, preferred to the layer alone
            costs.isolated[eid] = seconds / factor
            samples = in_context
            seconds = (compute_statistic(compute_stat, float(in_context.mean()), float(np.median(in_context)))
                       if event.kind == "compute" else float(np.median(in_context)))
            note = (f"in context: {seconds / factor * 1e3:.3f} ms inside its stages' chains, "
                    f"{costs.isolated[eid] * 1e3:.3f} ms alone ({seconds / factor / costs.isolated[eid]:.2f}x)")
        costs.sampled["events"][eid] = SampleSet(samples / factor, statistic_of(event.kind, compute_stat))
        host = measurement.host_issue_samples_s if event.kind == "compute" else np.empty(0)
        if host.size:
            costs.host_issue[eid] = compute_statistic(compute_stat, float(host.mean()), float(np.median(host)))
            costs.sampled["host_issue"][eid] = SampleSet(host, compute_stat)
        call = measurement.attrs.get(BACKWARD_CALL_ATTR) if event.kind == "compute" else None
        # an in-context backward ran inside the stage's one backward() call: no extra call to take off
        if call is not None and np.isfinite(call) and not in_context.size:
            costs.backward_call[eid] = float(call) / factor
        return EventCost(eid, event.name, event.kind, seconds / factor, MEASURED, note=note)

    def finish(self, costs: Costs) -> None:
        if self.unwrapped:
            costs.warnings.append(
                f"{len(self.unwrapped)} compute event(s) ({', '.join(sorted(set(self.unwrapped)))}) of layers a run "
                f"wraps (full recompute's torch.utils.checkpoint, ZeRO's FSDP2) come from {self.profile.path.name}'s "
                "samples of the same layers unwrapped (a profile from before wrapped events), which leave out what "
                "the wrapping costs; profile the spec again to time them as the run runs them")
        if self.uncorrected:
            costs.warnings.append(
                f"{len(self.uncorrected)} compute event(s) ({', '.join(sorted(set(self.uncorrected)))}) come from a "
                f"profiling run whose ranks' speeds {self.profile.path.name} cannot compare (it stopped before all "
                "its ranks had written their speed probe, or fewer than two of its ranks measured compute), so they "
                "keep their rank's speed while the others stand for the ranks' mean; profile again with --force to "
                "measure them alike")
        apply_corrections(self.plan, self.profile, costs)
        for eid, composite in self.composites.items():
            costs.composites[eid] = representative_seconds(composite, costs.compute_stat)
            samples = composite.samples_s
            in_context = composite.in_context_samples_s
            if in_context.size:  # a context-parallel block timed in its pairs' chains: preferred to it alone
                costs.isolated_composites[eid] = costs.composites[eid]
                costs.composites[eid] = compute_statistic(costs.compute_stat, float(in_context.mean()),
                                                          float(np.median(in_context)))
                samples = in_context
            costs.sampled["composites"][eid] = SampleSet(samples, costs.compute_stat)
