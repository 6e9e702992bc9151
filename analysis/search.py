"""The strategy search: every candidate of a spec's [search] grid predicted from one profile, checked against
device memory and ranked (docs/analysis.md, "Search").

Each candidate is planned, costed from the profile (analysis.costs), simulated (analysis.simulate) and given
its per-device peak memory (analysis.memory). A candidate is feasible when its largest device fits the
memory capacity (none: every candidate fits); one whose weights, gradients and optimizer state alone exceed it
(analysis.memory.model_state_floor) is infeasible without being planned or simulated (`memory_floor_bytes`).
A candidate the profile cannot cost (compute events it lacks:
a profile of another spec) is infeasible with that reason; one costed partly from fits (a group larger than
the profiling run, a tensor-parallel layer measured without its all-reduces) is flagged. Feasible candidates
come first, fastest (or smallest) first. Candidates are spread over processes (fork) when there are many, or
over the ranks of an MPI job started as `mpirun -n N python -m mpi4py.futures -m analysis search ...` (its N - 1
workers; the analysis uses the pool that launch made and never imports mpi4py itself).

Telling candidates apart (docs/analysis.md, "Search"): each feasible candidate's reach is its prediction T
from T (1 - down) to T (1 + up) (analysis.uncertainty.relative_reach: every sampled duration at its own 5th or
95th percentile at once), which holds its 90% interval. A feasible candidate whose reach overlaps the
fastest's is within reach of it: it and the fastest get the batch time's 90% interval (as `simulate` gives
it), and it is indistinguishable from the fastest (within its noise) where the two intervals overlap; one out of
reach is told apart without resampling. The search recommends the fastest that fits, and one within its noise
instead only where it buys what the user asked for (Recommendation): fewer devices, or memory headroom where the
memory limit was asked for.
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

import numpy as np

from analysis.costs import MODELLED, communication_by_tier, estimate_costs
from analysis.costs.device_source import DEVICE, source_counts
from analysis.memory import (
    GB,
    activation_bytes,
    estimate_memory,
    in_flight_floor,
    model_state_floor,
    released_bytes,
    temporary_bytes,
)
from analysis.profile_reader import Profile, layers_for, load_profile
from analysis.simulate import least_batch_time, simulate, stage_costs
from analysis.spec_only import check_spec_only, is_spec_file, is_spec_only, spec_profile
from analysis.uncertainty import (
    DEFAULT_RESAMPLES,
    SEED,
    BatchTimeInterval,
    batch_time_interval,
    has_samples,
    interval_of,
    relative_reach,
    resampled_batch_times,
)
from harness.common.errors import UserError
from harness.common.output import format_bytes
from harness.plan.candidates import Grid, Rejected, candidate_label, expand, rejected_by_reason
from harness.plan.events import build_plan
from harness.plan.spec import JobSpec, load_spec

REJECTED_EXAMPLES = 3  # the choices the JSON shows of each rule the grid's combinations broke
# 2: intervals, indistinguishable_from_best, recommended, recommendation; 3: the fastest recommended unless another
# buys something (recommendation.preferred_for, memory_headroom_asked); 4: rejected grouped by reason, and what does
# not fit neither costed nor simulated (too_large, memory_floor_bytes); 5: what cannot come near the fastest is not
# simulated (least_batch_time_s, pruned)
SEARCH_SCHEMA_VERSION = 5
SEARCH_KIND = "distsim-search"
PARALLEL_FROM = 24  # candidates: fewer run in this process (a worker's start costs more than they take)
# a grid's candidates differ in cost by 100x (a memory floor rules one out at once, another is planned, sized and
# costed), and alike ones lie together in the grid: small chunks keep the workers busy to the end
CHUNKS_PER_WORKER = 32
SORTS = ("time", "memory")
PARALLEL_INTERVALS_FROM_S = 0.5  # estimated serial seconds of resampling from which it is spread over processes
# A candidate whose least batch time is this far above the fastest of its device count is not simulated (unless
# --exhaustive): what a user weighs against the fastest (fewer devices, headroom) lies within its noise, which
# the prune never crosses (_bounded_out), and the rows near the top keep their exact times.
PRUNE_MARGIN = 0.25


@dataclass
class CandidateResult:
    """One candidate's prediction, memory and standing."""

    spec: JobSpec
    batch_time_s: float | None = None
    bubble_fraction: float | None = None
    comm_fraction: float | None = None  # device time communicating while not computing (mean over devices)
    comm_by_tier: dict[str, float] = field(default_factory=dict)  # analysis.costs.communication_by_tier
    peak_memory_bytes: int | None = None
    # what its model states alone need where they exceed the device's memory (then it is not planned)
    memory_floor_bytes: int | None = None
    too_large: bool = False  # ruled out by its memory, so neither costed nor simulated
    # what no schedule of its steps beats (analysis.simulate.least_batch_time), for a candidate that fits
    least_batch_time_s: float | None = None
    pruned: bool = False  # fits, but its least batch time is out of the fastest's reach: not simulated
    peak_stage: int | None = None
    dominant: str | None = None  # the memory part that holds the most on the largest device
    memory_stages: list[dict[str, Any]] = field(default_factory=list)
    feasible: bool = False
    reason: str = ""  # why infeasible (empty when feasible)
    flags: list[str] = field(default_factory=list)  # what the prediction could not measure
    # per kind of event (compute, communication), how many unique events each source costed
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    speedup: float | None = None  # over the slowest feasible candidate simulated
    interval: BatchTimeInterval | None = None  # the fastest's and those within reach of it (module docstring)
    reach_s: tuple[float, float] | None = None  # feasible, with samples: what holds its interval (module docstring)
    indistinguishable_from_best: bool | None = None  # None: not known (no resamples or no samples)
    recommended: bool = False
    simulate_s: float = 0.0  # the point simulation's wall time: what one resample costs
    relative_reach: tuple[float, float] | None = None  # (down, up) of its costs' samples, before it is simulated

    @property
    def label(self) -> str:
        return candidate_label(self.spec)

    @property
    def predicted(self) -> bool:
        return self.batch_time_s is not None

    @property
    def throughput_samples_s(self) -> float | None:
        """None where the candidate was not predicted or takes no time (nothing costed)."""
        return self.spec.batch.global_size / self.batch_time_s if self.batch_time_s else None

    @property
    def throughput_tokens_s(self) -> float | None:
        samples = self.throughput_samples_s
        return samples * self.spec.model.seq_len if samples is not None else None

    def training(self, iterations: int | None = None, tokens: float | None = None) -> tuple[float, float] | None:
        """(seconds, GPU-hours) to train `iterations` iterations or `tokens` tokens."""
        if self.batch_time_s is None or (iterations is None and tokens is None):
            return None
        steps = iterations if iterations is not None else tokens / (self.spec.batch.global_size
                                                                    * self.spec.model.seq_len)
        seconds = steps * self.batch_time_s
        return seconds, seconds * self.spec.strategy.world / 3600

    def to_dict(self, iterations: int | None = None, tokens: float | None = None) -> dict[str, Any]:
        s = self.spec.strategy
        out = {"strategy": self.label, "gpus": s.world, "dp": s.dp, "tp": s.tp, "pp": s.pp, "sp": s.sp, "cp": s.cp,
               "cp_comm": s.cp_comm, "ep": s.ep, "schedule": s.schedule,
               "chunks": s.chunks, "recompute": s.recompute, "zero": s.zero, "micro": self.spec.batch.micro,
               "micro_batches": self.spec.micro_batches,
               "batch_time_s": self.batch_time_s, "throughput_samples_s": self.throughput_samples_s,
               "throughput_tokens_s": self.throughput_tokens_s, "bubble_fraction": self.bubble_fraction,
               "comm_fraction": self.comm_fraction, "comm_by_tier": self.comm_by_tier,
               "peak_memory_bytes": self.peak_memory_bytes, "memory_floor_bytes": self.memory_floor_bytes,
               "too_large": self.too_large, "least_batch_time_s": self.least_batch_time_s, "pruned": self.pruned,
               "peak_stage": self.peak_stage, "dominant_memory": self.dominant, "memory_stages": self.memory_stages,
               "feasible": self.feasible, "reason": self.reason, "flags": self.flags, "sources": self.sources,
               "speedup": self.speedup,
               "batch_time_p5_s": self.interval.p5_s if self.interval else None,
               "batch_time_p95_s": self.interval.p95_s if self.interval else None,
               "indistinguishable_from_best": self.indistinguishable_from_best, "recommended": self.recommended}
        trained = self.training(iterations, tokens)
        if trained is not None:
            out["train_s"], out["gpu_hours"] = trained
        return out


def best_per_gpu_count(candidates: Sequence[CandidateResult]) -> dict[int, CandidateResult]:
    """Device count -> its fastest feasible candidate (the booking curve)."""
    best: dict[int, CandidateResult] = {}
    for c in candidates:
        n = c.spec.strategy.world
        if c.feasible and c.batch_time_s is not None and (n not in best or c.batch_time_s < best[n].batch_time_s):
            best[n] = c
    return best


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two ranges (low, high) share a point (the edges included)."""
    return a[0] <= b[1] and b[0] <= a[1]


def span(interval: BatchTimeInterval) -> tuple[float, float]:
    """(p5, p95): the 90% interval as a range."""
    return interval.p5_s, interval.p95_s


def _share(fraction: float) -> str:
    """'23%', or '4.5%' below 10%."""
    return f"{fraction:.0%}" if fraction >= 0.1 else f"{fraction:.1%}"


@dataclass
class Recommendation:
    """The candidate to run: the fastest that fits, unless one within its noise (indistinguishable from it) buys
    what the user asked for - fewer devices, or, where the memory limit was asked for (`headroom_asked`: search's
    --memory-gb), more headroom under it on as many devices; then the fewest devices, the least peak memory (where
    asked), the fastest. Without samples to tell by, the fastest."""

    candidate: CandidateResult
    fastest: CandidateResult
    indistinguishable: list[CandidateResult]  # the fastest first, then by batch time
    basis: str  # intervals (some computed) | reach (every other one out of reach) | none (nothing to tell by)
    headroom_asked: bool = False
    capacity_bytes: float | None = None

    @property
    def memory_saving(self) -> float | None:
        """1 - the recommended candidate's peak memory over the fastest's."""
        ours, theirs = self.candidate.peak_memory_bytes, self.fastest.peak_memory_bytes
        return 1 - ours / theirs if ours is not None and theirs else None

    @property
    def devices_saved(self) -> int:
        return self.fastest.spec.strategy.world - self.candidate.spec.strategy.world

    @property
    def preferred_for(self) -> list[str]:
        """What the recommended candidate buys over the fastest: fewer_devices, memory_headroom (empty: the
        fastest itself)."""
        if self.candidate is self.fastest:
            return []
        bought = ["fewer_devices"] if self.devices_saved > 0 else []
        if self.headroom_asked and self.candidate.peak_memory_bytes < self.fastest.peak_memory_bytes:
            bought.append("memory_headroom")
        return bought

    def _slower(self, c: CandidateResult) -> str:
        """'predicted 9.7% slower' (or 'as fast', where the point predictions agree to 0.05%)."""
        slower = c.batch_time_s / self.fastest.batch_time_s - 1
        return "predicted as fast" if slower < 5e-4 else f"predicted {_share(slower)} slower"

    def _versus_fastest(self, c: CandidateResult) -> str:
        """'9.7% slower, 1.4% less memory per device, on 4 fewer devices': a candidate against the fastest."""
        fastest = self.fastest
        parts = [self._slower(c)]
        saving = 1 - c.peak_memory_bytes / fastest.peak_memory_bytes if fastest.peak_memory_bytes else 0.0
        if saving:
            parts.append(f"{_share(abs(saving))} {'less' if saving > 0 else 'more'} memory per device")
        fewer = fastest.spec.strategy.world - c.spec.strategy.world
        if fewer:
            parts.append(f"on {abs(fewer):,} {'fewer' if fewer > 0 else 'more'} devices")
        return ", ".join(parts)

    def _headroom(self, c: CandidateResult) -> str:
        """'2.1 MB free': a candidate's headroom under the memory limit."""
        return f"{format_bytes(self.capacity_bytes - c.peak_memory_bytes)} free"

    def text(self) -> str:
        """One line, the answer first: what to run and why, and which others are within the fastest's noise."""
        chosen, fastest = self.candidate, self.fastest
        if self.basis == "none":
            return (f"recommended: {chosen.label}, the fastest by its prediction - without resamples (--resamples 0) "
                    "or samples the search cannot tell which others are as fast")
        if self.basis == "reach":
            return (f"recommended: {chosen.label}, the fastest - no other candidate comes within its sampling "
                    "noise (every measured duration at its 5th or 95th percentile keeps them apart)")
        others = [c for c in self.indistinguishable if c is not fastest and c is not chosen]
        shown = "; ".join(f"{c.label} ({self._versus_fastest(c)})" for c in others[:3])
        if len(others) > 3:
            shown += f"; {len(others) - 3:,} more"
        if chosen is fastest:
            if not others:
                return (f"recommended: {chosen.label}, the fastest - no other candidate's 90% interval overlaps "
                        "its own")
            unasked = ("" if self.headroom_asked or all(c.peak_memory_bytes >= fastest.peak_memory_bytes
                                                        for c in others)
                       else "; memory headroom is weighed only where --memory-gb asks for it")
            none_buys = ("runs on fewer devices or leaves more memory headroom on as many" if self.headroom_asked
                         else "runs on fewer devices")
            return (f"recommended: {chosen.label}, the fastest - within its noise (90% intervals overlap): "
                    f"{shown}; none of them {none_buys}{unasked}")
        bought = []
        if "fewer_devices" in self.preferred_for:
            bought.append(f"{self.devices_saved:,} fewer devices")
        saving = self.memory_saving
        if "memory_headroom" in self.preferred_for:
            bought.append(f"{_share(saving)} less memory per device ({self._headroom(chosen)} of "
                          f"{format_bytes(self.capacity_bytes)}, the fastest {self._headroom(fastest)})")
        elif saving and saving < 0:
            bought.append(f"at {_share(-saving)} more memory per device")
        also = f"; also within its noise: {shown}" if others else ""
        return (f"recommended: {chosen.label} - within the noise of the fastest, {fastest.label} (90% intervals "
                f"overlap; {self._slower(chosen)}), for {', '.join(bought)}{also}")

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.candidate.label, "fastest": self.fastest.label,
                "indistinguishable": [c.label for c in self.indistinguishable], "basis": self.basis,
                "memory_saving_fraction": self.memory_saving, "devices_saved": self.devices_saved,
                "memory_headroom_asked": self.headroom_asked, "preferred_for": self.preferred_for,
                "text": self.text()}


def fastest_feasible(results: Sequence[CandidateResult]) -> CandidateResult | None:
    """The feasible candidate of the least batch time (then the least memory, then by label)."""
    return min((r for r in results if r.feasible and r.predicted),
               key=lambda r: (r.batch_time_s, r.peak_memory_bytes, r.label), default=None)


def indistinguishable(candidate: CandidateResult, fastest: CandidateResult) -> bool | None:
    """Whether a feasible candidate cannot be told from the fastest: its reach overlaps the fastest's and so do
    their intervals. None where that is not known (no reach, or intervals not computed within reach)."""
    if candidate is fastest:
        return True
    if candidate.reach_s is None or fastest.reach_s is None:
        return None
    if not overlap(candidate.reach_s, fastest.reach_s):
        return False
    if candidate.interval is None or fastest.interval is None:
        return None
    return overlap(span(candidate.interval), span(fastest.interval))


def recommend(results: Sequence[CandidateResult], headroom_asked: bool = False,
              capacity_bytes: float | None = None) -> Recommendation | None:
    """Mark every candidate's indistinguishable_from_best (infeasible ones False; None where not known) and
    recommended from the reaches and intervals they carry, and return the recommendation (None without a
    feasible candidate; the rule: Recommendation). `headroom_asked`: the user gave the memory limit
    (`capacity_bytes`), so headroom under it counts. Without the fastest's reach (no resamples or no samples)
    nothing is marked and the fastest is recommended."""
    headroom_asked = headroom_asked and capacity_bytes is not None
    for r in results:
        r.recommended, r.indistinguishable_from_best = False, None
    fastest = fastest_feasible(results)
    if fastest is None:
        return None
    if fastest.reach_s is None:
        fastest.recommended = True
        return Recommendation(fastest, fastest, [fastest], "none", headroom_asked, capacity_bytes)
    for r in results:
        r.indistinguishable_from_best = indistinguishable(r, fastest) if r.feasible and r.predicted else False
    alike = sorted((r for r in results if r.indistinguishable_from_best),
                   key=lambda r: (r is not fastest, r.batch_time_s, r.label))
    chosen = min(alike, key=lambda r: (r.spec.strategy.world, r.peak_memory_bytes if headroom_asked else 0,
                                       r.batch_time_s, r.label))
    chosen.recommended = True
    return Recommendation(chosen, fastest, alike, "intervals" if fastest.interval is not None else "reach",
                          headroom_asked, capacity_bytes)


@dataclass
class SearchResult:
    """Every candidate, ranked, and what the grid rejected."""

    profile: Profile
    spec: JobSpec
    candidates: list[CandidateResult]  # ranked: feasible first
    rejected: list[Rejected]
    capacity_bytes: float | None
    sort: str = "time"
    recommendation: Recommendation | None = None
    resamples: int = DEFAULT_RESAMPLES

    @property
    def best(self) -> CandidateResult | None:
        return next((c for c in self.candidates if c.feasible), None)

    @property
    def to_run(self) -> CandidateResult | None:
        """The candidate to run (what --write-spec writes): the recommendation's, else the best."""
        return self.recommendation.candidate if self.recommendation is not None else self.best

    def profiling_cost(self) -> dict[str, float] | None:
        """What profiling held its devices for (its wall time x its ranks, as bench/profile_scaling.py counts it)
        against running every predicted candidate for real with the same warm-up and repeats (each candidate's
        devices x (warm-up + repeats) x its predicted batch time, a pruned one's least)."""
        env = self.profile.environment
        wall, ranks = env.get("profiling_wall_s"), env.get("world_size")
        repeats = int(env.get("warmup", 0)) + int(env.get("repeats", 0))
        brute = sum(c.spec.strategy.world * repeats * (c.batch_time_s if c.predicted else c.least_batch_time_s)
                    for c in self.candidates if c.predicted or c.pruned)
        if not isinstance(wall, (int, float)) or not isinstance(ranks, int) or brute <= 0:
            return None
        spent = float(wall) * ranks
        return {"profile_device_s": spent, "brute_force_device_s": brute, "fraction": spent / brute}

    def to_dict(self, iterations: int | None = None, tokens: float | None = None) -> dict[str, Any]:
        best = self.best
        spec_only = is_spec_only(self.profile)
        return {"schema_version": SEARCH_SCHEMA_VERSION, "kind": SEARCH_KIND,
                "profile": None if spec_only else str(self.profile.path),
                "spec": str(self.profile.path) if spec_only else None,
                "model": self.spec.model.name, "device_memory_bytes": self.capacity_bytes, "sort": self.sort,
                "candidates": [c.to_dict(iterations, tokens) for c in self.candidates],
                "best": best.to_dict(iterations, tokens) if best is not None else None,
                "rejected": [{"reason": reason, "count": len(group),
                              "choices": [dict(r.choice) for r in group[:REJECTED_EXAMPLES]]}
                             for reason, group in rejected_by_reason(self.rejected)],
                "profiling": self.profiling_cost(), "iterations": iterations, "tokens": tokens,
                "interval_resamples": self.resamples,
                "recommendation": self.recommendation.to_dict() if self.recommendation is not None else None}


# what each worker process evaluates against: set before the workers fork, so the profile is not pickled
_SHARED: dict[str, Any] = {}
_REACH: dict[tuple[str, str], tuple[float, float]] = {}  # each source's relative reach, per process
_COSTED: dict[str, tuple] = {}  # candidate label -> (plan, costs), per process, for the intervals


def _costed(spec: JobSpec) -> tuple:
    """The candidate's plan and costs, as _evaluate made them (kept for the resamples of one search)."""
    label = candidate_label(spec)
    if label not in _COSTED:
        profile, options = _SHARED["profile"], _SHARED["options"]
        plan = build_plan(spec, layers_for(profile, spec))
        _COSTED[label] = (plan, estimate_costs(plan, profile, **options["costs"]))
    return _COSTED[label]


def _resampled_times(task: tuple[JobSpec, int, int]) -> Any:
    """Resamples start..stop-1 of one candidate's batch time (a slice of uncertainty.resampled_batch_times)."""
    spec, start, stop = task
    plan, costs = _costed(spec)
    options = _SHARED["options"]
    return resampled_batch_times(plan, costs, options["dp_overlap"], options["resamples"], SEED, start, stop)


def _evaluate(spec: JobSpec, predict: bool | None = None) -> CandidateResult:
    """Size and cost one candidate; simulate it too where `predict` says (default: where the search is
    exhaustive), else leave that to _simulate_within_reach, its least batch time known."""
    profile, activations, capacity, options = (_SHARED[k] for k in ("profile", "activations", "capacity", "options"))
    result = CandidateResult(spec)
    try:
        layers = layers_for(profile, spec)
        floor, what = model_state_floor(spec, layers), "weights, gradients and optimizer state alone"
        if capacity is not None and floor <= capacity and not activations:  # a spec's activations: the formulas
            in_flight = in_flight_floor(spec, layers)
            if in_flight > capacity:
                floor, what = in_flight, "weights, optimizer state and the activations of the micro-batches in flight"
        if capacity is not None and floor > capacity:  # it cannot fit: not planned, costed or simulated
            result.memory_floor_bytes, result.too_large = floor, True
            result.reason = (f"needs {format_bytes(floor)} or more, {format_bytes(capacity)} per device ({what}); "
                             "not simulated")
            return result
        plan = build_plan(spec, layers)
    except UserError as exc:
        result.reason = f"not in the profile: {str(exc).splitlines()[0]}"
        return result
    try:
        memory = estimate_memory(plan, activations, _SHARED["released"], _SHARED["temporaries"])
    except UserError as exc:  # a strategy that makes no sense for this model (recompute where nothing is saved)
        result.reason = str(exc)
        return result
    peak = memory.peak
    result.peak_memory_bytes, result.peak_stage, result.dominant = peak.total, peak.stage, peak.dominant
    result.memory_stages = [s.to_dict() for s in memory.stages]
    if not memory.fits(capacity):  # what does not fit is not costed or simulated
        result.reason, result.too_large = f"{memory.shortfall(capacity)}; not simulated", True
        return result
    try:
        costs = estimate_costs(plan, profile, **options["costs"])
    except UserError as exc:
        result.reason = f"not in the profile: {str(exc).splitlines()[0]}"
        return result
    per_stage = stage_costs(plan, costs)
    result.least_batch_time_s = least_batch_time(plan, per_stage)
    result.comm_by_tier = communication_by_tier(plan, costs)
    result.sources = source_counts(costs)
    if options["resamples"] > 0 and has_samples(costs):
        result.relative_reach = relative_reach(costs, options["resamples"], SEED, _REACH)
    _flag(result, plan, costs)
    if memory.unmeasured:
        result.flags.append(f"activations not measured for {', '.join(memory.unmeasured)} (counted 0): profile "
                            "again")
    if options["exhaustive"] if predict is None else predict:
        _predict(result, plan, costs, per_stage)
    return result


def _predict(result: CandidateResult, plan, costs, per_stage) -> None:
    """Simulate a sized and costed candidate: its batch time, bubbles, exposed communication and reach."""
    started = time.perf_counter()
    timeline = simulate(plan, costs, _SHARED["options"]["dp_overlap"], per_stage)
    result.simulate_s = time.perf_counter() - started
    T = timeline.batch_time_s
    result.batch_time_s = T
    result.feasible, result.pruned, result.reason = True, False, ""
    result.bubble_fraction = timeline.bubble_fraction
    result.comm_fraction = (sum(d.usage.comm_s for d in timeline.pipeline) / (len(timeline.pipeline) * T)
                            if T > 0 else 0.0)
    if result.relative_reach is not None:
        down, up = result.relative_reach
        result.reach_s = (T * (1 - down), T * (1 + up))


def _simulated(spec: JobSpec) -> CandidateResult:
    """_evaluate, simulated whatever the search's pass (a worker keeps no plans between the two passes)."""
    return _evaluate(spec, predict=True)


def _flag(result: CandidateResult, plan, costs) -> None:
    """What the candidate's prediction could not measure: events from the device or network model, tensor-parallel
    layers measured without their all-reduces."""
    spec = result.spec
    if costs.device_model is not None and result.sources["compute"].get(DEVICE):
        result.flags.append(f"{result.sources['compute'][DEVICE]} compute event(s) from the device model "
                            f"({costs.device_model.name})")
    if costs.extrapolated:
        names = sorted({c.name for c in costs.extrapolated})
        modelled = sum(c.source == MODELLED for c in costs.extrapolated)
        source = "the network model" if modelled == len(costs.extrapolated) else "models, not measurements"
        result.flags.append(f"{len(costs.extrapolated)} communication event(s) from {source} "
                            f"({', '.join(names[:2])}" + (", ..." if len(names) > 2 else "") + ")")
    tp = spec.strategy.tp
    # a block both tensor- and context-parallel has no composite by design (launcher.placement._composites)
    if tp > 1 and any(e.kind == "compute" and e.content.get("phase") in ("fwd", "bwd") and eid not in costs.composites
                      and costs.events[eid].source != DEVICE  # its all-reduces are their own events
                      for eid, e in plan.events.items() if e.content.get("signature", {}).get("tp") == tp
                      and not (e.content.get("layer") == "block" and spec.strategy.cp > 1)):
        result.flags.append(f"tp={tp} layers measured without their all-reduces (the profiling run has no "
                            f"{tp} ranks on one node): shard alone, all-reduces from the fit")


def _bounded_out(r: CandidateResult, fastest: dict[int, CandidateResult], overall: CandidateResult) -> bool:
    """Whether candidate `r` cannot come near the fastest: its least batch time over PRUNE_MARGIN above the
    fastest of its device count, and, where the costs have samples, the least its reach could start at
    (T >= least) above the reach of that fastest and of the fastest overall (so it is within neither's noise)."""
    best = fastest.get(r.spec.strategy.world)
    if best is None or r.least_batch_time_s <= best.batch_time_s * (1 + PRUNE_MARGIN):
        return False
    highs = [c.reach_s[1] for c in (best, overall) if c.reach_s is not None]
    if r.relative_reach is None or not highs:
        return True
    return r.least_batch_time_s * (1 - r.relative_reach[0]) > max(highs)


def _simulate_within_reach(results: list[CandidateResult], simulate_all) -> None:
    """Simulate the sized candidates of `results` in the order of their least batch times, a round at a time
    (`simulate_all(specs)` -> their results, put in their places), until every one left is bounded out
    (_bounded_out): those are marked pruned."""
    waiting = sorted((i for i, r in enumerate(results) if r.least_batch_time_s is not None and not r.predicted),
                     key=lambda i: (results[i].least_batch_time_s, results[i].label))
    fastest: dict[int, CandidateResult] = {}
    overall: CandidateResult | None = None
    round_size = 4  # doubling: the first rounds find the fastest, later ones fill in what is near it
    while waiting:
        if overall is not None:
            for i in waiting:
                r = results[i]
                if _bounded_out(r, fastest, overall):
                    above = r.least_batch_time_s / fastest[r.spec.strategy.world].batch_time_s - 1
                    r.pruned = True
                    r.reason = (f"at least {r.least_batch_time_s:.4g} s, {100 * above:.0f}% above the fastest on "
                                f"{r.spec.strategy.world} devices; not simulated (--exhaustive simulates it)")
            waiting = [i for i in waiting if not results[i].pruned]
        batch, waiting = waiting[:round_size], waiting[round_size:]
        round_size = min(2 * round_size, 64)
        for i, done in zip(batch, simulate_all([results[i].spec for i in batch])):
            results[i] = done
            world = done.spec.strategy.world
            if done.predicted:
                if world not in fastest or done.batch_time_s < fastest[world].batch_time_s:
                    fastest[world] = done
                if overall is None or done.batch_time_s < overall.batch_time_s:
                    overall = done


def search(profile: Profile, spec: JobSpec | None = None, gpus: int | None = None,
           capacity_bytes: float | None = None, sort: str = "time", dp_overlap: bool | None = None,
           compute_stat: str = "mean", rank_speed: bool = True, jobs: int | None = None,
           progress: Callable[[int], None] | None = None, grid: Grid | None = None,
           resamples: int = DEFAULT_RESAMPLES, network: str | None = None,
           headroom_asked: bool = False, exhaustive: bool = False) -> SearchResult:
    """Predict, size and rank every candidate of `spec`'s grid (default: the profile's spec) from `profile`,
    then tell the fastest from those it cannot be told apart from and recommend one (module docstring).
    `capacity_bytes`: each device's memory (default: the spec's [cluster] device_memory_gb); `jobs`: worker
    processes (default: one per core); `progress(n)`: called as candidates complete; `grid`: the grid when
    the caller has expanded it already (harness.plan.candidates.expand(spec, gpus)); `resamples`: the intervals'
    bootstrap resamples (0: no intervals, the fastest recommended); `network`: a what-if network for every
    candidate (analysis.costs.what_if_network); `headroom_asked`: the user asked for the memory limit, so the
    recommendation weighs headroom under it (Recommendation); `exhaustive`: simulate every candidate that fits (by
    default, sorting by time, one whose least batch time puts it out of the fastest's reach is not:
    _simulate_within_reach; sorting by memory, all are)."""
    if sort not in SORTS:
        raise ValueError(f"unknown sort {sort!r}; known: {', '.join(SORTS)}")
    spec = spec or profile.spec
    if capacity_bytes is None and spec.cluster.device_memory_gb is not None:
        capacity_bytes = spec.cluster.device_memory_gb * GB
    if capacity_bytes is not None and capacity_bytes <= 0:
        raise UserError(f"the device memory must be above 0, got {capacity_bytes / GB:g} GB")
    grid = grid if grid is not None else expand(spec, gpus)
    if is_spec_only(profile):
        communicates = any(c.strategy.world > 1 for c in grid.candidates)
        check_spec_only(spec, str(profile.path), {"": 1} if communicates else {}, network_given=network is not None)
    _SHARED.update(profile=profile, activations=activation_bytes(profile), released=released_bytes(profile),
                   temporaries=temporary_bytes(profile),
                   capacity=capacity_bytes,
                   options={"costs": {"compute_stat": compute_stat, "rank_speed": rank_speed, "what_if": network},
                            "dp_overlap": dp_overlap, "resamples": max(0, resamples),
                            "exhaustive": exhaustive or sort != "time"})
    _REACH.clear()
    _COSTED.clear()
    jobs = jobs or len(os.sched_getaffinity(0)) or 1  # the cores this process may run on
    results: list[CandidateResult] = []
    mpi_pool = mpi_futures_pool()
    try:
        if mpi_pool is not None:
            options = _SHARED["options"]
            with mpi_pool() as pool:
                def run(function, specs, step=True):
                    tasks = [(str(profile.path), capacity_bytes, options, function, c) for c in specs]
                    chunk = max(1, len(tasks) // (CHUNKS_PER_WORKER * mpi_workers()))
                    return _advancing(pool.map(_evaluate_on_worker, tasks, chunksize=chunk), progress if step else None)
                results = run("evaluate", grid.candidates)
                _simulate_within_reach(results, lambda specs: run("simulate", specs, step=False))
        elif jobs > 1 and len(grid) >= PARALLEL_FROM:
            with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
                def run(function, specs, step=True):
                    chunk = max(1, len(specs) // (jobs * CHUNKS_PER_WORKER))
                    return _advancing(pool.map(function, specs, chunksize=chunk), progress if step else None)
                results = run(_evaluate, grid.candidates)
                _simulate_within_reach(results, lambda specs: run(_simulated, specs, step=False))
        else:
            results = _advancing(map(_evaluate, grid.candidates), progress)
            _simulate_within_reach(results, lambda specs: [_simulated(c) for c in specs])
        if not any(r.predicted or r.too_large for r in results):
            reasons = "; ".join(f"{r.label}: {r.reason}" for r in results[:3])
            raise UserError(f"{profile.path} cannot cost any candidate of the search ({reasons}); profile the "
                            "search spec itself: mpirun -n N python -m mpi4py -m harness profile SPEC -o OUTDIR")
        ranked = rank(results, sort)
        if resamples > 0:  # in this process alone under MPI: forking an MPI process is not safe on every transport
            _interval_pass(ranked, resamples, 1 if mpi_pool is not None else jobs)
    finally:
        _SHARED.clear()
        _REACH.clear()
        _COSTED.clear()
    return SearchResult(profile, spec, ranked, grid.rejected, capacity_bytes, sort,
                        recommend(ranked, headroom_asked, capacity_bytes), max(0, resamples))


def mpi_futures_pool():
    """mpi4py.futures' MPIPoolExecutor where this process is the master of `python -m mpi4py.futures` on 2 or more
    ranks (the others its workers), else None. Read from the modules that launch loaded: the analysis never
    imports mpi4py."""
    core = sys.modules.get("mpi4py.futures._core")
    if core is None or getattr(core, "SharedPool", None) is None or mpi_workers() < 1:
        return None
    return sys.modules["mpi4py.futures"].MPIPoolExecutor


def mpi_workers() -> int:
    """The workers of the mpi4py.futures job this process leads (its world size - 1), 0 outside one."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.COMM_WORLD.Get_size() - 1 if mpi is not None else 0


_WORKER: dict[str, Any] = {}  # an MPI worker's profile, by path, loaded at its first task


def _evaluate_on_worker(task: tuple[str, float | None, dict, str, JobSpec]) -> CandidateResult:
    """_evaluate ("evaluate") or _simulated ("simulate") on an MPI worker: the search's shared state from the task
    (the profile read once per worker)."""
    path, capacity, options, function, spec = task
    if _WORKER.get("path") != path:
        # a spec alone: the empty profile spec_profile makes of it
        profile = (spec_profile(load_spec(path, import_factory=False), path) if is_spec_file(path)
                   else load_profile(path))
        _WORKER.update(path=path, profile=profile, activations=activation_bytes(profile),
                       released=released_bytes(profile), temporaries=temporary_bytes(profile))
    _SHARED.update(profile=_WORKER["profile"], activations=_WORKER["activations"], released=_WORKER["released"],
                   temporaries=_WORKER["temporaries"],
                   capacity=capacity, options=options)
    return _simulated(spec) if function == "simulate" else _evaluate(spec)


def _advancing(results, progress: Callable[[int], None] | None) -> list[CandidateResult]:
    """The results as a list, `progress(1)` called as each arrives."""
    out = []
    for result in results:
        out.append(result)
        if progress:
            progress(1)
    return out


def _interval_pass(results: Sequence[CandidateResult], resamples: int, jobs: int) -> None:
    """The intervals of the fastest feasible candidate and of the feasible candidates within reach of it, where
    any is (module docstring)."""
    fastest = fastest_feasible(results)
    if fastest is None or fastest.reach_s is None:
        return
    near = [r for r in results if r.feasible and r is not fastest and r.reach_s is not None
            and overlap(r.reach_s, fastest.reach_s)]
    if near:
        _compute_intervals([fastest] + near, resamples, jobs)


def _compute_intervals(candidates: Sequence[CandidateResult], resamples: int, jobs: int) -> None:
    """Each candidate's interval, as `simulate` computes it; spread over `jobs` processes (slices of the
    resamples) where the resampling would take PARALLEL_INTERVALS_FROM_S or more in this one."""
    if not candidates:
        return
    dp_overlap = _SHARED["options"]["dp_overlap"]
    if jobs <= 1 or sum(c.simulate_s for c in candidates) * resamples < PARALLEL_INTERVALS_FROM_S:
        for c in candidates:
            plan, costs = _costed(c.spec)
            c.interval = batch_time_interval(plan, costs, dp_overlap, resamples, SEED)
        return
    step = -(-resamples // jobs)
    tasks = [(c.spec, start, min(start + step, resamples)) for c in candidates for start in range(0, resamples, step)]
    with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=get_context("fork")) as pool:
        slices = list(pool.map(_resampled_times, tasks))
    per_candidate = len(range(0, resamples, step))
    for i, c in enumerate(candidates):
        c.interval = interval_of(np.concatenate(slices[i * per_candidate:(i + 1) * per_candidate]))


def rank(results: Sequence[CandidateResult], sort: str = "time") -> list[CandidateResult]:
    """Feasible candidates first, by batch time (or peak memory), then those that fit but were not simulated (pruned),
    by their least batch time, then those that do not fit, nearest to fitting first (their peak, or the floor under
    it), then those that could not be sized; each feasible one's speed-up over the slowest feasible one simulated."""
    feasible = [r for r in results if r.feasible]
    slowest = max((r.batch_time_s for r in feasible), default=None)
    for r in feasible:
        r.speedup = slowest / r.batch_time_s if r.batch_time_s else None

    def key(r: CandidateResult) -> tuple:
        if r.feasible:
            time_then_memory = (r.batch_time_s, r.peak_memory_bytes)
            return (0, *(time_then_memory if sort == "time" else time_then_memory[::-1]), r.label)
        if r.pruned:
            return (1, r.least_batch_time_s, r.peak_memory_bytes, r.label)
        if r.too_large:
            return (2, r.memory_floor_bytes or r.peak_memory_bytes, 0, r.label)
        return (3, 0, 0, r.label)
    return sorted(results, key=key)


def pareto_front(results: Sequence[CandidateResult]) -> list[CandidateResult]:
    """The feasible candidates that no other feasible one beats in both throughput and peak memory."""
    feasible = sorted((r for r in results if r.feasible and r.throughput_samples_s is not None),
                      key=lambda r: (r.peak_memory_bytes, -r.throughput_samples_s))
    front, best = [], -math.inf
    for r in feasible:
        if r.throughput_samples_s > best:
            front.append(r)
            best = r.throughput_samples_s
    return front
