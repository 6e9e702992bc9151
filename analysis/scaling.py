"""How a model's real runs scale with the number of devices, series side by side (docs/runs.md, "Scaling").

Runs are grouped into series by a label (by default the data-parallel communication backend the run recorded).
In each series, the smallest run is the base; with devices N against the base's N0:
- strong scaling (every run of the series trains the same global batch): speed-up = T0 / T,
  efficiency = speed-up / (N / N0);
- weak scaling (the same batch per data-parallel replica): speed-up = (N / N0) x T0 / T,
  efficiency = T0 / T.
T is the median measured iteration time, throughput the global batch over it (iterations per second, for
every run, when a run does not say its batch). The compute, communication and idle shares are the breakdown's (all ranks
together). With profiles, each run's iteration is also predicted (analysis.simulate) from the profile of its
backend (else the first one given), and the predicted efficiency is figured from the predicted times the same
way.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.activity import RunActivity
from analysis.breakdown import breakdown
from harness.common.errors import UserError

MODES = ("strong", "weak")
SCHEMA_VERSION = 1  # of the JSON (docs/runs.md)


@dataclass
class ScalingPoint:
    source: str
    devices: int
    iterations: int
    median_s: float
    min_s: float
    max_s: float
    throughput: float
    speedup: float = 1.0
    efficiency_pct: float = 100.0
    compute_pct: float = 0.0
    communication_pct: float = 0.0
    idle_pct: float = 0.0
    predicted_s: float | None = None
    predicted_efficiency_pct: float | None = None

    @property
    def spread_pct(self) -> float:
        """(max - min) / median of the measured iterations."""
        return 100.0 * (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else 0.0


@dataclass
class Series:
    label: str
    mode: str
    points: list[ScalingPoint]


@dataclass
class Scaling:
    model: str
    unit: str  # of throughput: "samples/s" or "iterations/s"
    series: list[Series]
    notes: list[str] = field(default_factory=list)


def parse_labels(items: Sequence[str]) -> dict[str, str]:
    """--label NAME=RUN[,RUN...] (repeatable) -> run path (resolved) -> label; a run labelled twice is refused."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, paths = item.partition("=")
        if not sep or not name.strip() or not paths.strip():
            raise UserError(f"--label {item!r}: expected NAME=RUN[,RUN...], e.g. --label mpi=runs/dp2-mpi")
        for path in filter(None, (p.strip() for p in paths.split(","))):
            key = str(Path(path).resolve())
            if key in out and out[key] != name.strip():
                raise UserError(f"--label: {path} is labelled both {out[key]!r} and {name.strip()!r}; give each run "
                                "one label")
            out[key] = name.strip()
    return out


def _check_one_model(runs: Sequence[RunActivity], notes: list[str]) -> str:
    known = [r for r in runs if r.model_config]
    if len(known) < len(runs):
        notes.append(f"{len(runs) - len(known)} run(s) do not record their model (profiler traces): taken to be "
                     "the same model")
    for run in known[1:]:
        if run.model_config != known[0].model_config:
            differs = sorted(k for k in set(run.model_config) | set(known[0].model_config)
                             if run.model_config.get(k) != known[0].model_config.get(k))
            raise UserError(f"{run.source} trains {run.model} and {known[0].source} trains {known[0].model} "
                            f"({', '.join(differs)} differ): a scaling table compares runs of one model")
    return known[0].model if known and known[0].model else "unknown model"


def _mode(label: str, runs: Sequence[RunActivity], forced: str | None) -> str:
    globals_ = {r.global_batch for r in runs}
    replicas = {r.replica_batch for r in runs}
    if None in globals_ or len(runs) == 1:
        if forced is None and len(runs) > 1:
            raise UserError(f"series {label!r}: the runs do not record their batch (profiler traces); say how they "
                            "scale with --mode strong (one global batch) or --mode weak (one batch per replica)")
        return forced or "strong"
    mode = "strong" if len(globals_) == 1 else "weak" if len(replicas) == 1 else None
    if mode is None:
        raise UserError(f"series {label!r}: the runs train neither one global batch ({sorted(globals_)}) nor one "
                        f"batch per replica ({sorted(replicas)}); a scaling series keeps one of them fixed")
    if forced and forced != mode:
        raise UserError(f"series {label!r}: --mode {forced}, but its runs train "
                        + ("one global batch" if mode == "strong" else "one batch per replica"))
    return mode


def _point(run: RunActivity, per_sample: bool) -> ScalingPoint:
    times = run.iteration_s
    if not len(times):
        raise UserError(f"{run.source}: no measured iteration")
    median = float(np.median(times))
    throughput = (run.global_batch if per_sample else 1) / median
    result = breakdown(run)
    return ScalingPoint(str(run.source), run.world_size or len(run.ranks), len(times), median, float(times.min()),
                        float(times.max()), throughput, compute_pct=result.mean_share("compute"),
                        communication_pct=result.mean_share("communication"), idle_pct=result.mean_share("idle"))


def _efficiency(mode: str, base_devices: int, base_s: float, devices: int, time_s: float) -> tuple[float, float]:
    """(speed-up, efficiency %) of a run against its series' base."""
    ratio = devices / base_devices
    if mode == "strong":
        speedup = base_s / time_s
        return speedup, 100.0 * speedup / ratio
    return ratio * base_s / time_s, 100.0 * base_s / time_s


def _predict(run: RunActivity, profiles: Sequence[Any]) -> float:
    from analysis.costs import estimate_costs
    from analysis.profile_reader import layers_for, parse_spec_offline
    from analysis.simulate import simulate
    from harness.plan.events import build_plan

    if not run.spec:
        raise UserError(f"{run.source}: --profile predicts runs of `harness train` (a trace.h5), whose spec it "
                        "records; profiler traces do not say the strategy")
    profile = next((p for p in profiles if p.environment.get("backend") == run.backend), profiles[0])
    spec = parse_spec_offline(run.spec, source=f"{run.source}:spec_json")
    if profile.spec.model != spec.model:
        differ = [f"{key} {mine!r} against {theirs!r}" for key, mine, theirs in (
            (f.name, getattr(profile.spec.model, f.name), getattr(spec.model, f.name))
            for f in dataclasses.fields(spec.model)) if mine != theirs]
        raise UserError(f"{profile.path} profiles another model than {run.source} ran ({'; '.join(differ)}); give a "
                        "profile of the same model")
    plan = build_plan(spec, layers_for(profile, spec))
    return simulate(plan, estimate_costs(plan, profile)).batch_time_s


def scaling(runs: Sequence[RunActivity], labels: dict[str, str] | None = None, profiles: Sequence[Any] = (),
            mode: str | None = None) -> Scaling:
    """The scaling table of `runs` (labels: run source -> series name; default the run's backend)."""
    if not runs:
        raise UserError("give the runs to compare")
    notes: list[str] = []
    model = _check_one_model(runs, notes)
    labels = labels or {}
    per_sample = all(r.global_batch for r in runs)
    grouped: dict[str, list[RunActivity]] = {}
    def named(run: RunActivity) -> list[str]:  # what --label may name a run by: its file, else its folder
        return [str(Path(run.source).resolve()), str(Path(run.source).resolve().parent)]

    for run in runs:
        label = next((labels[key] for key in named(run) if key in labels), None) or run.backend or "run"
        grouped.setdefault(label, []).append(run)
    unknown = set(labels) - set().union(*(named(r) for r in runs))
    if unknown:
        raise UserError(f"--label names runs that are not given: {', '.join(sorted(unknown))}")
    series = []
    for label, members in grouped.items():
        members = sorted(members, key=lambda r: r.world_size or len(r.ranks))
        devices = [r.world_size or len(r.ranks) for r in members]
        if len(set(devices)) < len(devices):
            twice = sorted({d for d in devices if devices.count(d) > 1})
            raise UserError(f"series {label!r} has two runs on {twice[0]} devices; give one run per device count, "
                            "or put them in different series with --label")
        series_mode = _mode(label, members, mode)
        points = [_point(r, per_sample) for r in members]
        base = points[0]
        predicted = [_predict(r, profiles) for r in members] if profiles else None
        for i, point in enumerate(points):
            point.speedup, point.efficiency_pct = _efficiency(series_mode, base.devices, base.median_s, point.devices,
                                                              point.median_s)
            if predicted:
                point.predicted_s = predicted[i]
                point.predicted_efficiency_pct = _efficiency(series_mode, base.devices, predicted[0], point.devices,
                                                             predicted[i])[1]
        series.append(Series(label, series_mode, points))
    return Scaling(model, "samples/s" if per_sample else "iterations/s", series, notes)


# ---- output -------------------------------------------------------------------------------------------------
def answer(result: Scaling) -> str:
    """The answer first: each series' efficiency at its most devices."""
    parts = []
    for s in result.series:
        last = s.points[-1]
        if len(s.points) > 1:
            parts.append(f"{s.label}: {last.efficiency_pct:.0f}% {s.mode}-scaling efficiency at {last.devices} devices "
                         f"(speed-up {last.speedup:.2f}x over {s.points[0].devices})")
        else:
            parts.append(f"{s.label}: one run ({last.devices} devices), nothing to scale against")
    return f"scaling of {result.model}: " + "; ".join(parts)


def rows(result: Scaling) -> tuple[list[str], list[list[Any]]]:
    headers = ["series", "mode", "devices", "iteration_median_s", "iteration_min_s", "iteration_max_s", "spread_pct",
               f"throughput_{result.unit.replace('/', '_per_')}", "speedup", "efficiency_pct", "compute_pct",
               "communication_pct", "idle_pct", "predicted_s", "predicted_efficiency_pct", "source"]
    out = []
    for s in result.series:
        for p in s.points:
            out.append([s.label, s.mode, p.devices, p.median_s, p.min_s, p.max_s, p.spread_pct, p.throughput,
                        p.speedup, p.efficiency_pct, p.compute_pct, p.communication_pct, p.idle_pct, p.predicted_s,
                        p.predicted_efficiency_pct, p.source])
    return headers, out


def format_scaling(result: Scaling) -> str:
    from harness.common.output import format_seconds, format_table

    table = []
    with_prediction = any(p.predicted_s is not None for s in result.series for p in s.points)
    for s in result.series:
        for p in s.points:
            row = [s.label, p.devices, format_seconds(p.median_s), f"{p.spread_pct:.1f}", f"{p.throughput:.1f}",
                   f"{p.speedup:.2f}", f"{p.efficiency_pct:.1f}", f"{p.compute_pct:.1f}",
                   f"{p.communication_pct:.1f}", f"{p.idle_pct:.1f}"]
            if with_prediction:
                row += [format_seconds(p.predicted_s) if p.predicted_s is not None else "-",
                        "-" if p.predicted_efficiency_pct is None else f"{p.predicted_efficiency_pct:.1f}"]
            table.append(row)
    headers = ["series", "devices", "iteration", "spread %", result.unit, "speed-up", "efficiency %", "compute %",
               "comm %", "idle %"]
    if with_prediction:
        headers += ["predicted", "pred. eff. %"]
    modes = sorted({s.mode for s in result.series})
    lines = [answer(result), "", format_table(headers, table),
             f"iteration: median of the measured iterations; spread: (max - min) / median; {' and '.join(modes)} "
             "scaling (docs/runs.md, \"Scaling\")"]
    lines += [f"NOTE: {n}" for n in result.notes]
    return "\n".join(lines)


def to_json(result: Scaling) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "kind": "distsim-scaling", "model": result.model,
            "throughput_unit": result.unit, "notes": result.notes,
            "series": [{"label": s.label, "mode": s.mode,
                        "runs": [{**asdict(p), "spread_pct": p.spread_pct} for p in s.points]} for s in result.series]}


def write_png(path, result: Scaling):
    """Efficiency and throughput against devices, one line per series (dashed: predicted)."""
    from analysis.plot import pyplot, save

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    for s in result.series:
        devices = [p.devices for p in s.points]
        line, = left.plot(devices, [p.efficiency_pct for p in s.points], marker="o", label=f"{s.label} ({s.mode})")
        right.plot(devices, [p.throughput for p in s.points], marker="o", color=line.get_color(), label=s.label)
        if all(p.predicted_s is not None for p in s.points):
            left.plot(devices, [p.predicted_efficiency_pct for p in s.points], linestyle="--", color=line.get_color(),
                      label=f"{s.label} predicted")
    left.set_xlabel("devices")
    left.set_ylabel("parallel efficiency %")
    left.axhline(100, color="#999999", linewidth=0.8)
    left.set_ylim(bottom=0)
    right.set_xlabel("devices")
    right.set_ylabel(f"throughput ({result.unit})")
    for ax in (left, right):
        ax.set_xticks(sorted({p.devices for s in result.series for p in s.points}))
        ax.legend(fontsize="small")
    fig.suptitle(f"scaling of {result.model}")
    return save(fig, path)
