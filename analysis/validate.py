"""Validation: a real run's trace (harness train) against the prediction from a profile, error by error.

Compared, per measured iteration and then as medians:
- the iteration (batch) time;
- each device's busy time: its forward and backward steps (tensor-parallel all-reduces inside them
  included, as the real run cannot separate them from the step) plus its optimizer step (and, with data
  parallelism, the zeroing of its gradient buckets that follows);
- each virtual stage's forward and backward step per micro-batch;
- with data parallelism, per pipeline stage: how far the slowest replica finished its compute behind the
  replicas' mean (analysis.skew predicts it from the profile);
- for a run traced with `harness train --layer-times`, per virtual stage and phase each layer event: the
  median of its layers' own times (tensor-parallel all-reduces taken off) against the event's cost;
- the replay: the same simulation with every stage's compute steps and optimizer step as the run measured
  them, so that its error against the run is the timeline model's own (schedule, transfers, buckets,
  replica lag) and the rest of the batch-time error is the profile's compute costs.
Errors are (predicted - measured) / measured in percent; `device_error_pct` is the largest absolute
device error.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from analysis.costs import Costs, estimate_costs
from analysis.memory import PARTS, MemoryEstimate, activation_bytes, estimate_memory, released_bytes, temporary_bytes
from analysis.profile_reader import Profile, parse_spec_offline
from analysis.simulate import StageCosts, StepCost, Timeline, simulate
from analysis.trace_reader import Trace
from analysis.uncertainty import DEFAULT_RESAMPLES, BatchTimeInterval, prediction_interval
from harness.common.errors import UserError
from harness.plan.events import EventPlan, build_plan
from harness.plan.layers import LayerDesc
from harness.store.hdf5_schema import CUDA_PEAK_MEMORY_ATTR, MEMORY_PARTS_ATTR, PEAK_MEMORY_ATTR

REPORT_VERSION = 1


def _pct(predicted: float, measured: float) -> float | None:
    """Relative error in percent; None (JSON null) when nothing was measured."""
    return (predicted - measured) / measured * 100.0 if measured > 0 else None


@dataclass
class Validation:
    """Measured against predicted; `rows` hold the per-device and per-step comparisons."""

    timeline: Timeline
    trace: Trace
    measured_batch_s: float
    predicted_batch_s: float
    iterations: list[float]
    devices: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    replica_lag: list[dict[str, Any]] = field(default_factory=list)  # dp > 1: per pipeline stage
    layers: list[dict[str, Any]] = field(default_factory=list)  # runs traced with --layer-times
    representative_iteration: int = 0
    # each side's binding: bound, shared, single or unknown
    cpu_binding: dict[str, str] = field(default_factory=lambda: {"profile": "unknown", "run": "unknown"})
    replay_batch_s: float | None = None  # the prediction with the run's own compute (replay_stage_costs)
    memory: list[dict[str, Any]] = field(default_factory=list)  # per pipeline stage, runs that recorded it
    interval: BatchTimeInterval | None = None  # the predicted batch time's, from the profile's samples

    @property
    def measured_in_interval(self) -> bool | None:
        """Whether the measured median batch time lies inside the prediction's 90% interval."""
        return None if self.interval is None else self.interval.contains(self.measured_batch_s)

    @property
    def memory_error_pct(self) -> float | None:
        """The largest |error| of a stage's predicted peak memory."""
        return max((abs(r["error_pct"]) for r in self.memory if r["error_pct"] is not None), default=None)

    @property
    def replay_error_pct(self) -> float | None:
        """The timeline model's own error: the replay against the run."""
        return None if self.replay_batch_s is None else _pct(self.replay_batch_s, self.measured_batch_s)

    @property
    def compute_cost_error_pct(self) -> float | None:
        """The part of the batch-time error that the profile's compute costs make: prediction minus replay."""
        batch, replay = self.batch_time_error_pct, self.replay_error_pct
        return None if batch is None or replay is None else batch - replay

    @property
    def batch_time_error_pct(self) -> float | None:
        return _pct(self.predicted_batch_s, self.measured_batch_s)

    @property
    def device_error_pct(self) -> float | None:
        return max((abs(d["error_pct"]) for d in self.devices if d["error_pct"] is not None), default=None)

    def stage_rows(self) -> list[dict[str, Any]]:
        """Per virtual stage and phase: median measured and predicted step, and the worst micro-batch."""
        groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for row in self.steps:
            groups.setdefault((row["virtual_stage"], row["phase"]), []).append(row)
        out = []
        for (vs, phase), rows in sorted(groups.items()):
            measured = float(np.median([r["measured_s"] for r in rows]))
            predicted = float(np.median([r["predicted_s"] for r in rows]))
            out.append({"virtual_stage": vs, "phase": phase, "measured_s": measured, "predicted_s": predicted,
                        "error_pct": _pct(predicted, measured),
                        "max_micro_error_pct": max((abs(r["error_pct"]) for r in rows if r["error_pct"] is not None),
                                                   default=None)})
        return out

    def to_dict(self) -> dict[str, Any]:
        sampling = (self.interval.sampling or self.interval) if self.interval else None
        return {
            "report_version": REPORT_VERSION,
            "trace": str(self.trace.path),
            "measured_iterations": len(self.iterations),
            "measured_iteration_s": self.iterations,
            "measured_batch_time_s": self.measured_batch_s,
            "predicted_batch_time_s": self.predicted_batch_s,
            "predicted_batch_time_p5_s": self.interval.p5_s if self.interval else None,
            "predicted_batch_time_p95_s": self.interval.p95_s if self.interval else None,
            "interval_resamples": self.interval.resamples if self.interval else 0,
            "predicted_batch_time_sampling_p5_s": sampling.p5_s if sampling else None,
            "predicted_batch_time_sampling_p95_s": sampling.p95_s if sampling else None,
            "measured_in_sampling_interval": sampling.contains(self.measured_batch_s) if sampling else None,
            "measured_in_interval": self.measured_in_interval,
            "in_interval": self.measured_in_interval,  # the same, by the name bench/generalization.py's jobs use
            "compute_statistic": self.timeline.costs.compute_stat,
            "rank_speed": self.timeline.costs.rank_speed,
            "batch_time_error_pct": self.batch_time_error_pct,
            "device_error_pct": self.device_error_pct,
            "replay_batch_time_s": self.replay_batch_s,
            "replay_error_pct": self.replay_error_pct,
            "compute_cost_error_pct": self.compute_cost_error_pct,
            "cpu_binding": self.cpu_binding,
            "devices": self.devices,
            "stages": self.stage_rows(),
            "steps": self.steps,
            "replica_lag": self.replica_lag,
            "layers": self.layers,
            "layer_kinds": layer_kind_ratios(self.layers),
            "memory": self.memory,
            "memory_error_pct": self.memory_error_pct,
            "extrapolated": [c.to_dict() for c in self.timeline.costs.extrapolated],
            "warnings": list(self.timeline.costs.warnings),
        }


def environment_differences(profiled: dict[str, Any], ran: dict[str, Any]) -> list[str]:
    """Warnings where the profile and the run were taken in different conditions (a compared pair then
    measures the difference as much as the model)."""
    def kind(device: Any) -> str:  # a CPU profile names the processor, a run says "cpu"
        text = str(device)
        return "cpu" if text.startswith("cpu") else text

    out = []
    checks = (("device", kind), ("host_memory", str), ("torch_version", str), ("backend", str))
    for key, norm in checks:
        if key in profiled and key in ran and norm(profiled[key]) != norm(ran[key]):
            out.append(f"the profile and the run differ in {key}: {profiled[key]} (profile) against {ran[key]} "
                       "(run); profile and run in the same conditions to compare the model alone")
    bindings = (str(profiled.get("cpu_binding", "unknown")), str(ran.get("cpu_binding", "unknown")))
    if all(b in _BINDING for b in bindings) and bindings[0] != bindings[1]:
        out.append(f"the profile's ranks were {_BINDING[bindings[0]]} and the run's {_BINDING[bindings[1]]}: ranks "
                   "that share cores take each other's communication threads (and the host's tasks) on whichever "
                   "core is idle, the core of the stage that waits, which slows its compute; launch both alike, "
                   "bound (mpirun --bind-to core, srun --cpu-bind=cores)")
    return out


_BINDING = {"bound": "bound to cores of their own", "shared": "free to share cores"}


def _predicted_busy(timeline: Timeline, stage: int) -> float:
    device = timeline.pipeline[stage]
    steps = sum(r.end_s - r.start_s for r in device.steps)
    return steps + device.optimizer_end_s - device.optimizer_start_s


def validate(trace: Trace, profile: Profile, dp_overlap: bool | None = None,
             compute_stat: str = "mean", rank_speed: bool = True, resamples: int = DEFAULT_RESAMPLES) -> Validation:
    """Predict the traced run's spec from `profile` (compute by `compute_stat`, analysis.costs; with
    `resamples`, the batch time's interval, analysis.uncertainty) and compare it with what the run measured."""
    spec = parse_spec_offline(trace.spec, source=f"{trace.path}:spec_json")
    layers = [LayerDesc.from_dict(d) for d in trace.layers] if spec.model.family == "user" else None
    plan = build_plan(spec, layers)
    costs = estimate_costs(plan, profile, compute_stat=compute_stat, rank_speed=rank_speed)
    costs.warnings.extend(environment_differences(profile.environment, trace.environment))
    timeline = simulate(plan, costs, dp_overlap)
    measured = [float(t) for t in trace.iteration_times()]
    if not measured:
        raise UserError(f"{trace.path}: no measured iterations (all are warm-up); run `harness train` with "
                        "--iterations larger than --warmup")
    kept = trace.measured()
    median_iteration = int(kept[int(np.argsort(measured)[len(measured) // 2])])
    result = Validation(timeline, trace, float(np.median(measured)), timeline.batch_time_s, measured,
                        representative_iteration=median_iteration,
                        cpu_binding={side: str(env.get("cpu_binding", "unknown"))
                                     for side, env in (("profile", profile.environment), ("run", trace.environment))})
    s = spec.strategy
    if trace.world_size != s.world:
        raise UserError(f"{trace.path}: the trace has {trace.world_size} devices but its spec has "
                        f"{s.layout} = {s.world}; validate reads a whole run: give the trace.h5 that harness train "
                        "merged from every rank (a rank-NNNNN.trace.h5 is one device's)")
    for rank, device in trace.devices.items():
        stage = device.pp
        busy = [trace.busy_time(rank, int(i)) for i in kept]
        measured_busy = float(np.median(busy))
        predicted_busy = _predicted_busy(timeline, stage)
        result.devices.append({"rank": rank, "stage": stage, "dp": device.dp, "tp": device.tp, "cp": device.cp,
                               "measured_busy_s": measured_busy, "predicted_busy_s": predicted_busy,
                               "error_pct": _pct(predicted_busy, measured_busy)})
    if s.gradient_replicas > 1 and not s.zero:  # FSDP2 holds the replicas together layer by layer: no lag to model
        result.replica_lag = _replica_lag_rows(trace, timeline, kept)
    predicted_steps: dict[tuple[int, str, int], float] = {}
    for device in timeline.pipeline:
        for r in device.steps:
            predicted_steps[(r.virtual_stage, r.phase, r.micro)] = r.end_s - r.start_s
    measured_steps = _measured_steps(trace, kept)
    for key in sorted(predicted_steps):
        if key not in measured_steps:
            continue
        m = float(np.median(measured_steps[key]))
        p = predicted_steps[key]
        result.steps.append({"virtual_stage": key[0], "phase": key[1], "micro": key[2], "measured_s": m,
                             "predicted_s": p, "error_pct": _pct(p, m)})
    result.layers = _layer_rows(trace, plan, costs)
    memory = estimate_memory(plan, activation_bytes(profile), released_bytes(profile), temporary_bytes(profile))
    result.memory = _memory_rows(trace, memory)
    replayed = simulate(plan, costs, dp_overlap, per_stage=replay_stage_costs(trace, timeline, kept, measured_steps))
    result.replay_batch_s = replayed.batch_time_s
    result.interval = prediction_interval(plan, costs, dp_overlap, resamples)
    return result


def _memory_rows(trace: Trace, estimate: MemoryEstimate) -> list[dict[str, Any]]:
    """Per pipeline stage: the model's peak against the largest peak its devices recorded (runs traced before
    harness train recorded memory have none), with the parts of both."""
    rows = []
    for stage in estimate.stages:
        # the meter's peak, else (zero > 0, which the meter cannot follow) the CUDA allocator's
        attr = next((a for a in (PEAK_MEMORY_ATTR, CUDA_PEAK_MEMORY_ATTR)
                     if any(d.pp == stage.stage and a in d.attrs for d in trace.devices.values())), None)
        if attr is None:
            continue
        devices = [d for d in trace.devices.values() if d.pp == stage.stage and attr in d.attrs]
        largest = max(devices, key=lambda d: int(d.attrs[attr]))
        measured = int(largest.attrs[attr])
        parts = json.loads(largest.attrs.get(MEMORY_PARTS_ATTR, "{}"))
        # the meter counts what saved-tensor hooks see; torch.utils.checkpoint keeps a recomputed layer's
        # re-made activations in its own frame, out of their sight: compared without them (docs/analysis.md);
        # the CUDA allocator sees everything
        meter = attr == PEAK_MEMORY_ATTR
        compared = stage.metered if meter else stage.total
        row = {"stage": stage.stage, "measured_bytes": measured, "predicted_bytes": stage.total,
               "error_pct": _pct(compared, measured), "measured_parts": parts,
               "predicted_parts": {part: getattr(stage, part) for part in PARTS}, "rank": largest.rank,
               "remade_bytes": stage.remade if meter else 0, "compared_bytes": compared,
               "measured_by": "meter" if meter else "cuda"}
        if CUDA_PEAK_MEMORY_ATTR in largest.attrs:
            row["cuda_max_allocated_bytes"] = int(largest.attrs[CUDA_PEAK_MEMORY_ATTR])
        rows.append(row)
    return rows


def _measured_steps(trace: Trace, kept: np.ndarray) -> dict[tuple[int, str, int], list[float]]:
    """(virtual stage, F|B|W, micro-batch) -> the duration of that compute step on every device and kept
    iteration."""
    out: dict[tuple[int, str, int], list[float]] = {}
    for device in trace.devices.values():
        cols = device.select(kind="compute")
        ok = np.isin(cols["iteration"], kept)
        for vs, phase, micro, dur in zip(cols["virtual_stage"][ok], cols["phase"][ok], cols["micro"][ok],
                                         (cols["end_s"] - cols["start_s"])[ok]):
            out.setdefault((int(vs), str(phase), int(micro)), []).append(float(dur))
    return out


def replay_stage_costs(trace: Trace, timeline: Timeline, kept: np.ndarray,
                       steps: dict[tuple[int, str, int], list[float]] | None = None) -> list[StageCosts]:
    """The timeline's stage costs with each virtual stage's compute as the run measured it: per phase, the
    mean over micro-batches of each micro-batch's median step (zero 1 and 2: the first forward and the last
    backward from their own micro-batch, the others from the rest; over the measured iterations and the
    stage's devices; tensor-parallel all-reduces inside included, and measured alike for the
    communication part; with the data-parallel all-reduce overlapped, less the buckets' division that
    the last micro-batch's backward holds in the run and the timeline runs with the buckets), the step's
    items stretched to it in proportion (spread evenly where the prediction is 0); the optimizer step
    (with its buckets' zeroing) the median per iteration and device. A stage or phase the run did not
    measure keeps its predicted costs. `steps`: _measured_steps(trace, kept), where the caller has them."""
    steps = _measured_steps(trace, kept) if steps is None else steps
    inline: dict[tuple[int, str, int], list[float]] = {}
    optimizer: dict[int, list[float]] = {}
    for device in trace.devices.values():
        cols = device.select()
        ok = np.isin(cols["iteration"], kept)
        per_step_comm: dict[tuple, float] = {}
        per_iteration_opt: dict[tuple[int, int], float] = {}
        for kind, phase, name, vs, micro, iteration, duration in zip(
                cols["kind"][ok], cols["phase"][ok], cols["name"][ok], cols["virtual_stage"][ok], cols["micro"][ok],
                cols["iteration"][ok], (cols["end_s"] - cols["start_s"])[ok]):
            vs, micro, iteration, duration = int(vs), int(micro), int(iteration), float(duration)
            if kind == "optimizer":
                per_iteration_opt[(vs, iteration)] = per_iteration_opt.get((vs, iteration), 0.0) + duration
            elif phase in ("tp", "zero", "cp", "ep") and micro >= 0:  # inline collectives, by their step
                # (micro -1: sp's replicated gradients, all-reduced after the backward, no step's)
                step_phase = "F" if str(name).endswith(".fwd") else "B"
                key = (vs, step_phase, micro, iteration)
                per_step_comm[key] = per_step_comm.get(key, 0.0) + duration
        for (vs, step_phase, micro, _), duration in per_step_comm.items():
            inline.setdefault((vs, step_phase, micro), []).append(duration)
        for (vs, _), duration in per_iteration_opt.items():
            optimizer.setdefault(vs, []).append(duration)

    plan, costs, m = timeline.plan, timeline.costs, timeline.spec.micro_batches
    # With the all-reduce overlapped, the trainer divides each bucket by the replica count in a gradient hook,
    # inside the last micro-batch's backward step, while the timeline runs the division with the bucket.
    # (A split backward's buckets are divided and launched after its last W, outside every step.)
    s = timeline.spec.strategy
    inside_last_backward = {vs: sum(costs.bucket_divide.get(b.event, 0.0) for b in program.buckets)
                            if timeline.dp_overlap and s.gradient_replicas > 1 and not s.split_backward else 0.0
                            for vs, program in enumerate(plan.stages)}

    def measured(vs: int, phase: str, table: dict, less_last: float = 0.0, micros=None) -> float | None:
        """The mean over micro-batches (those in `micros`, else all) of each one's median."""
        medians = [max(0.0, float(np.median(v)) - (less_last if micro == m - 1 else 0.0))
                   for (s, p, micro), v in table.items()
                   if s == vs and p == phase and (micros is None or micro in micros)]
        return float(np.mean(medians)) if medians else None

    def replayed(predicted: StepCost, seconds: float, comm_s: float | None) -> StepCost:
        """A predicted step stretched to its measured time (spread evenly over its items where costed 0)."""
        if predicted.seconds > 0:
            offsets = tuple(o * seconds / predicted.seconds for o in predicted.offsets)
        else:
            offsets = tuple(seconds * k / max(1, len(predicted.offsets) - 1) for k in range(len(predicted.offsets)))
        comm = (min(seconds, comm_s) if comm_s is not None
                else predicted.comm_s * seconds / predicted.seconds if predicted.seconds > 0 else 0.0)
        return StepCost(seconds, comm, offsets)

    out = []
    for vs, c in enumerate(timeline.stage_costs):
        changes: dict[str, Any] = {}
        for phase, variant, odd in (("F", "first_forward", 0), ("B", "last_backward", m - 1)):
            less_last = inside_last_backward[vs] if phase == "B" else 0.0
            # zero > 0: the micro-batch whose step differs (FSDP gathers or reduce-scatters there) on its own
            distinct = getattr(c, variant) is not None
            others = set(range(m)) - {odd} if distinct else None
            seconds = measured(vs, phase, steps, less_last, others)
            prefix = "forward" if phase == "F" else "backward"
            if seconds is not None:
                plain = StepCost(*(getattr(c, f"{prefix}{part}") for part in ("_s", "_comm_s", "_offsets")))
                step = replayed(plain, seconds, measured(vs, phase, inline, micros=others))
                changes |= {f"{prefix}_s": step.seconds, f"{prefix}_comm_s": step.comm_s,
                            f"{prefix}_offsets": step.offsets}
            if distinct:
                seconds = measured(vs, phase, steps, less_last, {odd})
                if seconds is not None:
                    changes[variant] = replayed(getattr(c, variant), seconds, measured(vs, phase, inline, micros={odd}))
        seconds = measured(vs, "W", steps)
        if seconds is not None:  # a split backward's weight gradients (no collectives inside)
            changes["weight"] = replayed(c.weight, seconds, None)
        if optimizer.get(vs):
            changes["optimizer_s"] = float(np.median(optimizer[vs]))
        out.append(replace(c, **changes))
    return out


def _layer_rows(trace: Trace, plan: EventPlan, costs: Costs) -> list[dict[str, Any]]:
    """Per virtual stage, phase and layer event of a --layer-times trace, in the order the stage runs them: the
    median of the layers' own times against the event's cost (the backward_call that a step's later backwards
    shed is not taken off)."""
    rows = []
    for (vs, phase, eid), durations in trace.layer_durations().items():
        if eid not in costs.events or not durations.size:
            continue
        measured = float(np.median(durations))
        predicted = costs.seconds(eid)
        rows.append({"virtual_stage": vs, "phase": phase, "event_id": eid, "name": plan.events[eid].name,
                     "samples": int(durations.size), "measured_s": measured, "predicted_s": predicted,
                     "error_pct": _pct(predicted, measured)})

    def in_stage_order(row: dict[str, Any]) -> tuple:
        program = plan.stages[row["virtual_stage"]]
        events = program.forward if row["phase"] == "F" else program.backward
        return row["virtual_stage"], row["phase"], events.index(row["event_id"]) if row["event_id"] in events else 0

    return sorted(rows, key=in_stage_order)


def layer_kind_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per event kind (the layer's kind and its phase, as `block fwd`): the run's time over the cost, the median
    over its layer rows (_layer_rows) and their range: where a run's layers cost more than the profile says
    (above 1) or less (issue 44; a cost from in-context samples says so in its note)."""
    by_kind: dict[str, list[float]] = {}
    for row in rows:
        if row["predicted_s"] > 0:
            parts = row["name"].split(".")
            kind = " ".join(parts[1:]) if len(parts) > 2 else row["name"]
            by_kind.setdefault(kind, []).append(row["measured_s"] / row["predicted_s"])
    return [{"kind": kind, "rows": len(ratios), "ratio_median": float(np.median(ratios)),
             "ratio_min": float(min(ratios)), "ratio_max": float(max(ratios))}
            for kind, ratios in sorted(by_kind.items())]


def _replica_lag_rows(trace: Trace, timeline: Timeline, kept: np.ndarray) -> list[dict[str, Any]]:
    """Per pipeline stage: the median over measured iterations (and tensor-parallel ranks) of how far the
    last of the stage's dp replicas to end its compute ended behind their mean, against the prediction."""
    replicas: dict[tuple[int, int], list[int]] = {}
    for rank, device in trace.devices.items():
        replicas.setdefault((device.pp, device.tp), []).append(rank)
    lags: dict[int, list[float]] = {}
    for (stage, _), ranks in sorted(replicas.items()):
        for i in kept:
            ends = []
            for rank in ranks:
                cols = trace.devices[rank].select(iteration=int(i), kind="compute")
                if cols["end_s"].size:
                    ends.append(float(cols["end_s"].max()))
            if len(ends) > 1:
                lags.setdefault(stage, []).append(max(ends) - float(np.mean(ends)))
    rows = []
    for stage, values in sorted(lags.items()):
        measured = float(np.median(values))
        predicted = timeline.pipeline[stage].replica_lag_s
        rows.append({"stage": stage, "measured_s": measured, "predicted_s": predicted,
                     "error_pct": _pct(predicted, measured)})
    return rows


def measured_intervals(trace: Trace, rank: int, iteration: int) -> list[tuple[float, float, str, str, str]]:
    """(start, end, kind, phase, name) of one device's measured iteration, relative to the iteration's start."""
    cols = trace.timeline(rank, iteration)
    return [(float(a), float(b), str(k), str(p), str(n)) for a, b, k, p, n in
            zip(cols["start_s"], cols["end_s"], cols["kind"], cols["phase"], cols["name"])]
