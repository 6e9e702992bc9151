"""A device description refined on a profile's own compute events: the profiled path's seconds for each layer's
forward and backward (the cost chain's measured source: in-context samples, rank speed and all) set against the
device model's on the same kernels, and the description's efficiency figures moved until they agree.

Rules:
- The events: every forward and backward compute event of the profile's own plan that it measured and whose
  kernels the plan can list (built-in layers, a factory model's are not); an optimizer step is not one (its
  figures are counted and timed by `harness device`, [optimizer.NAME]). At least MIN_EVENTS of them.
- The figures (REFINABLE): the GEMM curve's max_fraction and half_at, the memory curve's max_fraction, each
  attention curve's max_fraction and the launch. One moves only where its kernels hold at least MIN_SHARE of
  the events' modelled seconds on the base description (a figure the events cannot see stays as it was).
- The fit: coordinate_search over those figures, multiplicative steps STEPS coarse to fine, a fraction never
  above 1, a move taken only where it gains more than MIN_GAIN; the score is the mean |log(model / measured)|
  over the events, each event once.
- A GPU profile's host issue times (Costs.host_issue: the host's seconds to issue each event's kernels) give
  [host] kernel_issue_us directly: their sum over the events' launches on the description.
- The training engine's gaps the profile measured between two steps (analysis.costs.corrections.engine_gaps:
  F->B, B->F, F->F, B->B) give [host] step_gap_us directly: their mean.
- The profile's device and the description's processor agree (a CPU profile refines a CPU description).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from analysis.calibration import processor_of
from analysis.costs import estimate_costs
from analysis.costs.records import MEASURED
from analysis.device_model import DeviceModel
from analysis.profile_reader import Profile, layers_for
from harness.common.errors import UserError
from harness.plan.device import HOST_FIELDS, RUN_WRAPPERS, DeviceDescription
from harness.plan.events import build_plan
from harness.plan.kernels import Attention, Gemm, Kernel, MemoryBound, accumulation_kernels, event_kernels
from harness.store.hdf5_schema import STEP_GAPS

LAUNCH, HOST = "launch", "host"  # figure keys' first part for [efficiency] launch_us and the [host] table's
REFINABLE = (("gemm", "max_fraction"), ("gemm", "half_at"), ("memory", "max_fraction"),
             ("sdpa_forward", "max_fraction"), ("sdpa_backward", "max_fraction"),
             ("materialized_attention", "max_fraction"), (LAUNCH, "us"))
STEPS = (1.5, 1.2, 1.07)
MIN_EVENTS = 3
MIN_SHARE = 0.05
# a move must lower the mean |log error| by more than this (0.01%): a figure the events no longer see (a GEMM curve's
# half_at far below their smallest GEMM) stops there instead of drifting
MIN_GAIN = 1e-4
JSON_VERSION = 1  # of `analysis device --json` (docs/devices.md, "Refined on a profile")


# ----- a description's figures by key -----

def figure_name(key: tuple[str, str]) -> str:
    """A figure as the description's file names it (efficiency.CURVE.FIELD, efficiency.launch_us,
    host.kernel_issue_us, host.collective_issue_us, host.step_gap_us)."""
    if key[0] == LAUNCH:
        return "efficiency.launch_us"
    if key[0] == HOST:
        return f"host.{key[1]}"
    return f"efficiency.{key[0]}.{key[1]}"


def figure_of(description: DeviceDescription, key: tuple[str, str]) -> float:
    """A figure as the description holds it (the launch and the host's issue times in microseconds)."""
    if key[0] == LAUNCH:
        return description.launch_s * 1e6
    if key[0] == HOST:
        return getattr(description, HOST_FIELDS[key[1]]) * 1e6
    return getattr(description.curves[key[0]], key[1])


def with_figures(description: DeviceDescription, figures: Mapping[tuple[str, str], float],
                 fitted_on: str = "") -> DeviceDescription:
    """`description` with `figures` replaced (a max_fraction capped at 1); `fitted_on` given: marked fitted on it."""
    curves, launch_s, host = dict(description.curves), description.launch_s, {}
    for (curve, name), value in figures.items():
        if curve == LAUNCH:
            launch_s = value * 1e-6
        elif curve == HOST:
            host[HOST_FIELDS[name]] = value * 1e-6
        else:
            value = min(value, 1.0) if name == "max_fraction" else value
            curves[curve] = dataclasses.replace(curves[curve], **{name: value})
    changed = dataclasses.replace(description, curves=curves, launch_s=launch_s, **host)
    return dataclasses.replace(changed, fitted=True, fitted_on=fitted_on) if fitted_on else changed


def coordinate_search(start: Mapping[tuple[str, str], float], score: Callable[[dict], float],
                      steps: Sequence[float] = STEPS, ceilings: Mapping[tuple[str, str], float] | None = None,
                      progress: Callable[[float, float, dict], None] | None = None, min_gain: float = 0.0
                      ) -> tuple[dict[tuple[str, str], float], float]:
    """The figures of least `score` from `start`, and that score: for each step in turn, a figure times or over the
    step is taken wherever it lowers the score by more than `min_gain`, until no figure's move does; no figure
    above its entry in `ceilings` (without one: 1 for a max_fraction, else no ceiling). `progress(step, score,
    figures)` after each step."""
    def limit(key: tuple[str, str]) -> float:
        if ceilings and key in ceilings:
            return ceilings[key]
        return 1.0 if key[1] == "max_fraction" else math.inf

    figures, best = dict(start), score(dict(start))
    for step in steps:
        improved = True
        while improved:
            improved = False
            for key in list(figures):
                for factor in (step, 1 / step):
                    value = figures[key] * factor
                    if value > limit(key) or value <= 0:
                        continue
                    candidate = {**figures, key: value}
                    trial = score(candidate)
                    if trial < best - min_gain:
                        figures, best, improved = candidate, trial, True
                        break
        if progress:
            progress(step, best, figures)
    return figures, best


def describe_step(step: float, score: str, figures: Mapping[tuple[str, str], float]) -> str:
    """A search step's progress line: '  step x1.5: SCORE at efficiency.gemm.half_at=9.29e+05, ...'."""
    moved = ", ".join(f"{figure_name(key)}={value:.3g}" for key, value in figures.items())
    return f"  step x{step}: {score} at {moved}"


# ----- the profile's events -----

@dataclass(frozen=True)
class RefineEvent:
    """One measured compute event: its name, kernels, the profiled path's seconds for it, (a GPU profile) the
    host's seconds to issue it, and its content's wrappers (a checkpointed or FSDP2 layer's: their time is the
    description's [wrappers], not its curves')."""

    eid: str
    name: str
    kernels: tuple[Kernel, ...]
    measured_s: float
    host_issue_s: float = 0.0
    wrapped: tuple[tuple[str, Any], ...] = ()

    def modelled_s(self, device: DeviceModel) -> float:
        """Its seconds on `device`: its kernels' and, on a CPU, its wrappers' (DeviceModel.wrapper_seconds)."""
        wrapper = device.wrapper_seconds(dict(self.wrapped), self.kernels)
        return device.event_seconds(self.kernels) + (wrapper if device.description.processor == "cpu" else 0.0)


def profile_events(profile: Profile) -> list[RefineEvent]:
    """The profile's forward and backward compute events (module docstring) as its own plan costs them."""
    spec = dataclasses.replace(profile.spec, cluster=dataclasses.replace(profile.spec.cluster, device=""))
    plan = build_plan(spec, layers=layers_for(profile, spec))
    costs = estimate_costs(plan, profile, spec_hint=str(profile.path))
    events = []
    for eid, event in plan.events.items():
        cost = costs.events[eid]
        if event.kind != "compute" or event.content.get("phase") not in ("fwd", "bwd") or cost.source != MEASURED:
            continue
        try:
            # a profile's backward samples add into the gradients every time, each layer whole (one rank's FSDP2
            # unit), in the model's dtype (harness.profile.compute)
            kernels = tuple(event_kernels(event.content, spec.strategy.recompute)
                            + accumulation_kernels(event.content, 1.0))
        except (UserError, KeyError, ValueError):
            continue
        if kernels and cost.seconds > 0:
            wrapped = tuple((key, event.content[key]) for key in ("phase", "signature", *RUN_WRAPPERS)
                            if key in event.content)  # what DeviceModel.wrappers_of reads
            events.append(RefineEvent(eid, event.name, kernels, cost.seconds, costs.host_issue.get(eid, 0.0), wrapped))
    return events


# ----- the refinement -----

def figure_shares(device: DeviceModel, events: Sequence[RefineEvent]) -> dict[tuple[str, str], float]:
    """Each REFINABLE figure's share of the events' modelled seconds on `device`: the memory curve's the time of
    every memory-bound kind's kernels and of any kernel on the memory side of the roofline; a GEMM curve's the
    compute time of the compute-bound GEMMs, an attention curve's that of its attention kernels; the launch's
    every launch."""
    seconds: dict[tuple[str, str], float] = dict.fromkeys(REFINABLE, 0.0)
    total = 0.0
    for event in events:
        for kernel in event.kernels:
            time = device.kernel_time(kernel)
            total += time.seconds
            seconds[(LAUNCH, "us")] += time.launch_s
            if time.bound == "memory" or isinstance(kernel, MemoryBound):
                seconds[("memory", "max_fraction")] += max(time.compute_s, time.memory_s)
            elif isinstance(kernel, Gemm):
                seconds[("gemm", "max_fraction")] += time.compute_s
                seconds[("gemm", "half_at")] += time.compute_s
            elif isinstance(kernel, Attention):
                curve = "materialized_attention" if kernel.kind == "materialized" else (
                    "sdpa_backward" if kernel.backward else "sdpa_forward")
                seconds[(curve, "max_fraction")] += time.compute_s
    return {key: value / total if total > 0 else 0.0 for key, value in seconds.items()}


def log_errors(device: DeviceModel, events: Sequence[RefineEvent]) -> np.ndarray:
    """log(model / measured) of each event on `device`."""
    return np.array([math.log(e.modelled_s(device) / e.measured_s) for e in events])


@dataclass
class Refinement:
    """A refinement's result: the base and refined descriptions, the events, the figures moved (before, after) and
    each event's modelled seconds on both."""

    base: DeviceDescription
    refined: DeviceDescription
    events: list[RefineEvent]
    figures: dict[tuple[str, str], tuple[float, float]]
    before_s: list[float]
    after_s: list[float]

    def errors_pct(self, which: str) -> np.ndarray:
        modelled = np.array(self.before_s if which == "before" else self.after_s)
        measured = np.array([e.measured_s for e in self.events])
        return 100 * (modelled - measured) / measured

    def median_abs_pct(self, which: str) -> float:
        return float(np.median(np.abs(self.errors_pct(which))))

    def to_dict(self, profile_path: str = "") -> dict:
        return {"version": JSON_VERSION, "profile": profile_path, "base": self.base.name, "refined": self.refined.name,
                "median_abs_error_before_pct": self.median_abs_pct("before"),
                "median_abs_error_after_pct": self.median_abs_pct("after"),
                "figures": {figure_name(key): {"before": before, "after": after}
                            for key, (before, after) in self.figures.items()},
                "events": [{"id": e.eid, "name": e.name, "measured_s": e.measured_s, "before_s": before,
                            "after_s": after, "host_issue_s": e.host_issue_s}
                           for e, before, after in zip(self.events, self.before_s, self.after_s)]}


def refine(base: DeviceDescription, events: Sequence[RefineEvent], source: str = "the profile", name: str = "",
           progress: Callable[[str], None] | None = None,
           engine_gaps: Mapping[str, float] | None = None) -> Refinement:
    """`base` refined on `events` (module docstring); `source` names them in the refined description's fitted_on;
    `engine_gaps`: the profile's measured gaps by transition (seconds), which set the step gap."""
    if len(events) < MIN_EVENTS:
        raise UserError(f"{source}: {len(events)} measured compute event(s) whose kernels the plan can list; a "
                        f"refinement needs at least {MIN_EVENTS} (profile a job of built-in layers, forward and "
                        "backward)")
    device = DeviceModel(base)
    shares = figure_shares(device, events)
    start = {key: figure_of(base, key) for key in REFINABLE if shares[key] >= MIN_SHARE
             and (key[0] == LAUNCH or key[0] in base.curves) and figure_of(base, key) > 0}

    def score(figures: dict) -> float:
        return float(np.mean(np.abs(log_errors(DeviceModel(with_figures(base, figures)), events))))

    def step_done(step: float, best: float, figures: dict) -> None:
        if progress:
            progress(describe_step(step, f"mean |log error| {best:.4f}", figures))

    figures, _ = coordinate_search(start, score, progress=step_done, min_gain=MIN_GAIN) if start else ({}, 0.0)
    issued = [e for e in events if e.host_issue_s > 0]
    if issued:  # a GPU's wrappers are host time of their own ([wrappers]): the kernels' issue is the rest
        launches = sum(base.kernel_launches(k) for e in issued for k in e.kernels)
        wrappers = device.wrapper_seconds if base.processor == "gpu" else (lambda content, kernels: 0.0)
        figures[(HOST, "kernel_issue_us")] = sum(max(0.0, e.host_issue_s - wrappers(dict(e.wrapped), e.kernels))
                                                 for e in issued) / launches * 1e6
    between = [engine_gaps[key] for key in STEP_GAPS if key in (engine_gaps or {})]
    if between and sum(between) > 0:
        figures[(HOST, "step_gap_us")] = sum(between) / len(between) * 1e6
    note = (f"{base.fitted_on or base.name}; refined on {source}'s {len(events)} compute events "
            f"({datetime.date.today().isoformat()})")
    refined = with_figures(base, figures, fitted_on=note)
    refined = dataclasses.replace(refined, name=name or f"{base.name}-refined")
    after = DeviceModel(refined)
    return Refinement(base, refined, list(events),
                      {key: (figure_of(base, key), figure_of(refined, key)) for key in figures},
                      [e.modelled_s(device) for e in events], [e.modelled_s(after) for e in events])


def check_processor(profile: Profile, description: DeviceDescription) -> None:
    """UserError where the profile ran on another kind of device than the description describes."""
    ran = processor_of(profile.environment)
    if ran != description.processor:
        raise UserError(f"{profile.path} was measured on a {ran.upper()}, and the description {description.name!r} "
                        f"describes a {description.processor.upper()}: refine a description of the device the profile "
                        "ran on (`python -m harness device` on that machine writes one)")
