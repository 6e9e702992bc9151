"""Held against runs nobody here made: the 1,549 published Megatron-DeepSpeed iterations on A100 clusters of
../shared/data/vtrain/ (vTrain's ground truth: README there), each predicted from its spec alone.

Each CSV row becomes Megatron's arguments (megatron_arguments) and then a spec through the project's own importer
(harness.plan.importers.megatron: GPT, vocabulary 50,257 padded, fp16, full recompute, 1F1B, the data-parallel
all-reduce after the backward, attention materialised and dropout 0.1 as Megatron-DeepSpeed ran them, 8 GPUs a
node), on the cluster the README states (vtrain_network): the A100 description (DEVICE) and DGX A100's NVLink
tier of harness/jobs/dgx-a100.toml with the inter-node link at 800 Gb/s a node, 12.5 GB/s a GPU. The reported
predictions are analysis.predict.predict_spec's (no profile); the fit evaluates the same costs faster
(SpecOnlyRun: the communication and the kernels made once per run).

Fitted, and on what: the description's figures FITTED (the GEMM curve, the launch time, the host's issue time a
kernel and a collective, the engine's gap between steps) on a seeded half of the single-node set (split_half:
within every (model, GPUs) group, a permutation by SPLIT_SEED; the seed is printed), by a coarse search
(fit_description: the step gap on a grid, FIT_GRID, the others by coordinate passes over a multiplicative grid at
each of its values, least mean |error|; the GEMM plateau no higher than an A100's best measured matmul,
FIT_CEILINGS). The other half and the whole multi-node set are held out: nothing is fitted on them.
The fitted description is written to bench/out/a100-vtrain-fitted.toml.

Printed per set (fit half, held-out half, multi-node) and per model size: MAPE, median, p90 and worst |error|;
Spearman's rank correlation of predicted against measured time within each (model, GPUs) group; each group's
regret of the fastest predicted configuration (the search's pick) against the measured best, and the worst such
regret within one job (one model, GPU count and global batch: max_job_regret_pct); the 90% interval's
coverage (the model's out-of-sample error on GPUs, analysis.uncertainty.spec_only_interval: within the single-node
runs' domain, residuals from both folds of the single-node halves, each half scored on a description fitted on the
other, the held-out half's coverage 2-fold within its own; on more than one node, the multi-node runs' own held-out
errors, each (model, GPUs) group's coverage from the other groups' errors: leave_group_out_coverage; outside the
single-node domain on one node, the errors of fits on the narrowest width, the widest, or fewer than the most GPUs,
scored on the other single-node runs: beyond_splits, fits that serve the residuals only); vTrain's
and Calculon's published errors beside them; the worst ten rows with where their time went; a PNG of predicted
against measured. `--json PATH` writes the figures; `--residuals` writes analysis/data/gpu_residuals.json.

Run: .venv/bin/python bench/published.py [--json out.json] [--png out.png] [--residuals] [--limit N]
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analysis.calibration import ResidualDomain, ratios_of, residuals_text  # noqa: E402
from analysis.costs.device_source import host_issue_seconds, run_as_described  # noqa: E402
from analysis.costs.network_source import slowest_group  # noqa: E402
from analysis.costs.records import Costs  # noqa: E402
from analysis.device_model import DeviceModel  # noqa: E402
from analysis.device_refine import (  # noqa: E402
    HOST,
    LAUNCH,
    coordinate_search,
    describe_step,
    figure_name,
    figure_of,
    with_figures,
)
from analysis.network import spec_network  # noqa: E402
from analysis.simulate import (  # noqa: E402
    BACKWARD,
    BACKWARD_WEIGHT,
    DP_ALLREDUCE,
    FORWARD,
    OPTIMIZER,
    RECOMPUTE,
    TP_ALLREDUCE,
    batch_time,
)
from analysis.uncertainty import interval_coverage_pct  # noqa: E402
from bench.search_accuracy import spearman  # noqa: E402
from harness.plan.device import DeviceDescription, load_device  # noqa: E402
from harness.plan.events import COMM_KINDS, EventPlan, build_plan  # noqa: E402
from harness.plan.importers.megatron import from_megatron  # noqa: E402
from harness.plan.kernels import Kernel, job_event_kernels  # noqa: E402
from harness.plan.network import NetworkTier  # noqa: E402
from harness.plan.spec import JobSpec, load_spec  # noqa: E402

VTRAIN = ROOT.parent / "shared" / "data" / "vtrain"
SETS = {"single": "ground_truth_single.csv", "multi": "ground_truth_multi.csv"}
OUT = ROOT / "bench" / "out"
FITTED_PATH = OUT / "a100-vtrain-fitted.toml"
GPU_RESIDUALS = ROOT / "analysis" / "data" / "gpu_residuals.json"
SPLIT_SEED = 20261203
GPUS_PER_NODE = 8
# the README: "inter-node 800 Gb/s per node" over a node's 8 GPUs (DGX A100 ships 8 x 200 Gb/s: these runs had half)
INTER_NODE_GBS_PER_GPU = 800 / 8 / GPUS_PER_NODE
VOCAB = 50257
# the A100 80GB: the configs do not say, but 48 of the 83 runs of the 18B, 39B and 175B models need more than 40 GB a
# GPU by analysis.memory (fp16 with fp32 master weights and Adam, no distributed optimizer; up to 77 GB) and none more
# than 80 GB: they ran, so they fit (the single-node runs need at most 30 GB and say nothing either way)
DEVICE = "a100-80gb"
FITTED_NAME = "a100-80gb-vtrain-fit"  # a name of its own: analysis.costs.device_source caches costings by name
# (curve, field) the fit moves; every other figure stays the shipped description's
FITTED = (("gemm", "max_fraction"), ("gemm", "half_at"), (LAUNCH, "us"), (HOST, "kernel_issue_us"),
          (HOST, "collective_issue_us"), (HOST, "step_gap_us"))
# where the multiplicative search starts a figure the description leaves at 0 (the shipped A100s give no host time):
# eager PyTorch's few microseconds a kernel on the host, times a few for Megatron's Python around each; tens of
# microseconds to issue a collective (eager c10d and NCCL's enqueue)
FIT_START = {(HOST, "kernel_issue_us"): 20.0, (HOST, "collective_issue_us"): 20.0}
# a figure fitted on a grid instead (the others searched at each value): the engine's host time between steps, 0 to
# 2 ms (Megatron's batch broadcast, DeepSpeed's hooks and timers), which moves only together with the host's issue
# times and the GEMM curve (a search from one start walks it to 0 and never comes back)
FIT_GRID = {(HOST, "step_gap_us"): (0.0, 500.0, 1000.0, 1500.0, 2000.0)}
FIT_STEPS = (1.5, 1.2, 1.07)  # the coarse search's multiplicative steps, coarse to fine
# a move must lower the fit half's MAPE by more than this (0.001 of a point): a figure the runs no longer see (a host
# time walking to 0) stops there instead of drifting a step at a time
FIT_MIN_GAIN = 1e-3
# the most a fitted figure may be, from outside these runs: a GEMM curve's plateau no higher than the best an A100 SXM
# was measured to multiply at (271.2 of 312 TFLOP/s in bf16, the best of a search over shapes: stas00/ml-engineering,
# compute/accelerator, "Maximum Achievable Matmul FLOPS comparison table", torch 2.6 with CUDA 12.6)
FIT_CEILINGS = {("gemm", "max_fraction"): 271.2 / 312.0}
# published mean |error| (%) on these runs: (single node, multi-node); Calculon's from issue 46 (its A100 file, the
# inter-node link at 12.5 GB/s, 103 of the 109 multi-node runs it can express)
PUBLISHED = {"vTrain (MICRO'24, profiled kernels)": (8.37, 14.73), "Calculon (as a new user runs it)": (38.9, 11.1)}
GROUP_MIN_RUNS = 5  # Spearman and regret goals hold for groups of at least this many runs
WORST_SHOWN = 10
MIN_LIMIT = 20  # --limit: the fewest runs a set that fill both halves, the folds and more than one group
JSON_VERSION = 2  # of --json's document (docs/benchmarks.md, "Published A100 runs"; 2: worst[].spent_ms.idle)
COMPUTE_CATEGORIES = (FORWARD, BACKWARD, BACKWARD_WEIGHT, RECOMPUTE, OPTIMIZER)


# ----- the runs -----

@dataclass(frozen=True)
class Run:
    """One published iteration: its set (single | multi), row number in its CSV, configuration and measured time."""

    set: str
    row: int
    gpus: int
    global_batch: int
    micro: int
    hidden: int
    heads: int
    layers: int
    seq: int
    tp: int
    dp: int
    pp: int
    measured_ms: float

    @property
    def model(self) -> str:
        """The model by its parameter count (the groups and the per-size table)."""
        return f"{parameters(self.hidden, self.layers, self.seq) / 1e9:.2f}B"

    @property
    def group(self) -> tuple[str, int]:
        return self.model, self.gpus

    @property
    def label(self) -> str:
        return (f"{self.set}#{self.row} {self.model} h{self.hidden} L{self.layers} {self.gpus} GPUs "
                f"tp{self.tp} dp{self.dp} pp{self.pp} mb{self.micro} gb{self.global_batch}")


def parameters(hidden: int, layers: int, seq: int, vocab: int = VOCAB) -> float:
    """GPT's parameters: 12 h^2 + 13 h a block, the token and position embeddings and the final norm."""
    return layers * (12 * hidden * hidden + 13 * hidden) + (vocab + seq) * hidden + 2 * hidden


def read_runs(set_name: str, folder: Path = VTRAIN) -> list[Run]:
    """Every row of one set's CSV (README: columns), in file order."""
    runs = []
    with open(folder / SETS[set_name], newline="") as f:
        for number, row in enumerate(csv.DictReader(f)):
            value = {key: int(row[column]) for key, column in (
                ("gpus", "# GPUs"), ("global_batch", "global batch"), ("micro", "micro batch"),
                ("hidden", "hidden size"), ("heads", "attention heads"), ("layers", "# layers"),
                ("seq", "sequence length"), ("tp", "tensor parallelism"), ("dp", "data parallelism"),
                ("pp", "pipeline parallelism"))}
            runs.append(Run(set_name, number, measured_ms=float(row["iteration time (ms)"]), **value))
    return runs


def megatron_arguments(run: Run) -> str:
    """The run as Megatron-DeepSpeed's arguments, as vTrain's README states it (GPT-2's vocabulary files, fp16,
    activation checkpointing, dropout 0.1)."""
    return (f"--num-layers {run.layers} --hidden-size {run.hidden} --num-attention-heads {run.heads} "
            f"--seq-length {run.seq} --max-position-embeddings {run.seq} --micro-batch-size {run.micro} "
            f"--global-batch-size {run.global_batch} --tensor-model-parallel-size {run.tp} "
            f"--pipeline-model-parallel-size {run.pp} --fp16 --checkpoint-activations "
            "--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --hidden-dropout 0.1 "
            "--attention-dropout 0.1")


def vtrain_network() -> tuple[NetworkTier, ...]:
    """The README's cluster: DGX A100's NVLink tier (harness/jobs/dgx-a100.toml, fitted on vTrain's all-reduce
    tables, not on these runs) and its InfiniBand tier at 800 Gb/s a node (12.5 GB/s a GPU)."""
    tiers = load_spec(ROOT / "harness" / "jobs" / "dgx-a100.toml", import_factory=False).cluster.network
    return tuple(dataclasses.replace(tier, bandwidth_gbs=INTER_NODE_GBS_PER_GPU) if i else tier
                 for i, tier in enumerate(tiers))


def run_spec(run: Run, device: str = DEVICE, network: tuple[NetworkTier, ...] | None = None) -> JobSpec:
    """The run's spec: its Megatron arguments through the importer, on the README's cluster."""
    spec = from_megatron(megatron_arguments(run), gpus=run.gpus).spec
    cluster = dataclasses.replace(spec.cluster, device=device,
                                  network=vtrain_network() if network is None else network)
    return dataclasses.replace(spec, cluster=cluster)


def split_half(runs: Sequence[Run], seed: int = SPLIT_SEED) -> tuple[list[Run], list[Run]]:
    """(fit, held out): within each (model, GPUs) group in file order, a seeded permutation's first half (the
    smaller half of an odd group) to the fit, the rest held out. Stable for a seed; disjoint; covers every run."""
    groups: dict[tuple[str, int], list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.group].append(run)
    rng = np.random.default_rng(seed)
    fit, held = [], []
    for key in sorted(groups):
        members = groups[key]
        order = rng.permutation(len(members))
        half = len(members) // 2
        fit += [members[i] for i in sorted(order[:half])]
        held += [members[i] for i in sorted(order[half:])]
    return fit, held


# ----- statistics -----

def errors_pct(predicted: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    """(predicted - measured) / measured, in percent."""
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    return (p - m) / m * 100.0


def error_summary(errors: Sequence[float]) -> dict[str, float]:
    """Mean, median, 90th percentile and largest |error| (%) and the median signed error of one set of runs."""
    e = np.asarray(errors, float)
    a = np.abs(e)
    return {"rows": int(a.size), "mape_pct": float(a.mean()), "median_abs_pct": float(np.median(a)),
            "p90_abs_pct": float(np.percentile(a, 90)), "worst_abs_pct": float(a.max()),
            "median_signed_pct": float(np.median(e))}


def group_spearman(predicted: Sequence[float], measured: Sequence[float]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None for fewer than 2 runs or a constant side."""
    if len(predicted) < 2 or len(set(predicted)) < 2 or len(set(measured)) < 2:
        return None
    return spearman(list(predicted), list(measured))


def regret_pct(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """How much slower the fastest predicted configuration ran than the fastest measured, in percent (the
    search's pick; among predicted ties, the one listed first)."""
    pick = int(np.argmin(np.asarray(predicted, float)))
    return (measured[pick] / min(measured) - 1.0) * 100.0


# ----- predicting from a spec alone -----

class SpecOnlyRun:
    """One run's plan with what does not depend on the device's figures made once: its communication events'
    seconds (the network model over the slowest of their groups) and its compute events' kernels (attention as the
    spec says). Costed as analysis.costs.device_source costs them: the kernels' seconds on the device, the
    host's issue time (host_issue_seconds) as Costs.host_issue, the host as the description runs it
    (run_as_described: each inline collective issued in collective_issue_s, no host wait after it, the engine's
    step_gap_s between steps)."""

    def __init__(self, run: Run, network: tuple[NetworkTier, ...]):
        self.run = run
        self.spec = run_spec(run, network=network)
        self.plan: EventPlan = build_plan(self.spec)
        model = spec_network(self.spec.cluster.network)
        self.comm: dict[str, float] = {}
        self.kernels: dict[str, list[Kernel]] = {}
        for eid, event in self.plan.events.items():
            if event.kind in COMM_KINDS:
                self.comm[eid] = slowest_group(self.plan, eid, model).seconds
            else:
                self.kernels[eid] = job_event_kernels(event.content, self.spec)

    def costs(self, device: DeviceModel, cache: dict[str, tuple[float, float]] | None = None) -> Costs:
        """Every event's seconds on `device` and the host's issue time of each compute event (`cache`: event id ->
        (seconds, issue seconds), shared by runs of one evaluation)."""
        seconds, issue = dict(self.comm), {}
        for eid, kernels in self.kernels.items():
            if cache is not None and eid in cache:
                seconds[eid], issue[eid] = cache[eid]
                continue
            seconds[eid] = device.event_seconds(kernels)
            issue[eid] = host_issue_seconds(device, self.plan.events[eid].content, kernels)
            if cache is not None:
                cache[eid] = seconds[eid], issue[eid]
        costs = Costs.from_seconds(self.plan, seconds)
        costs.host_issue.update({eid: s for eid, s in issue.items() if s})
        run_as_described(costs, device.description)  # every compute event is the description's (DeviceSource.finish)
        return costs

    def batch_time_s(self, device: DeviceModel, cache: dict[str, tuple[float, float]] | None = None) -> float:
        return batch_time(self.plan, self.costs(device, cache), dp_overlap=False)


def prepare(runs: Sequence[Run], progress: Callable[[str], None] | None = None) -> list[SpecOnlyRun]:
    network = vtrain_network()
    prepared = []
    for i, run in enumerate(runs):
        prepared.append(SpecOnlyRun(run, network))
        if progress and (i + 1) % 200 == 0:
            progress(f"  planned {i + 1} of {len(runs)} runs")
    return prepared


def predict_ms(prepared: Sequence[SpecOnlyRun], description: DeviceDescription) -> np.ndarray:
    """Each run's predicted iteration time (ms) on `description`."""
    device, cache = DeviceModel(description), {}
    return np.array([p.batch_time_s(device, cache) * 1e3 for p in prepared])


# ----- the fit -----

def fit_description(prepared: Sequence[SpecOnlyRun], base: DeviceDescription, steps: Sequence[float] = FIT_STEPS,
                    progress: Callable[[str], None] | None = None) -> tuple[dict[tuple[str, str], float], float]:
    """FITTED's figures that give the least mean |error| on `prepared`, and that error. For each value of
    FIT_GRID's figure, the others by coordinate_search (for each step in turn, a figure times or over the step
    wherever it lowers the error by more than FIT_MIN_GAIN, until no figure's move does; none above its
    FIT_CEILINGS); the best of those, then every figure once more at the finest step."""
    measured = np.array([p.run.measured_ms for p in prepared])
    start = {key: figure_of(base, key) or FIT_START.get(key, 0.0) for key in FITTED}

    def score(candidate: Mapping[tuple[str, str], float]) -> float:
        predicted = predict_ms(prepared, with_figures(base, candidate))
        return float(np.mean(np.abs(errors_pct(predicted, measured))))

    def step_done(step: float, best: float, figures: dict) -> None:
        if progress:
            progress(describe_step(step, f"MAPE {best:.2f}%", figures))

    (grid_key, values), = FIT_GRID.items()
    best: tuple[dict, float] | None = None
    for value in values:
        others = {key: v for key, v in start.items() if key != grid_key}
        figures, error = coordinate_search(others, lambda c, v=value: score({**c, grid_key: v}), steps, FIT_CEILINGS,
                                           min_gain=FIT_MIN_GAIN)
        if progress:
            progress(f"  {figure_name(grid_key)} = {value:g}: MAPE {error:.2f}%")
        if best is None or error < best[1]:
            best = {**figures, grid_key: value}, error
    return coordinate_search(best[0], score, steps[-1:], FIT_CEILINGS, step_done, min_gain=FIT_MIN_GAIN)


# ----- the report -----

@dataclass
class Scored:
    """One set's runs with their predictions (ms) and, for the worst rows, where their time went."""

    name: str
    runs: list[Run]
    predicted: np.ndarray

    @property
    def measured(self) -> np.ndarray:
        return np.array([run.measured_ms for run in self.runs])

    @property
    def errors(self) -> np.ndarray:
        return errors_pct(self.predicted, self.measured)

    def groups(self, key: Callable[[Run], tuple] = lambda run: run.group) -> dict[tuple, list[int]]:
        """The runs' indices by `key` (default: (model, GPUs))."""
        out: dict[tuple, list[int]] = defaultdict(list)
        for i, run in enumerate(self.runs):
            out[key(run)].append(i)
        return dict(sorted(out.items()))


def predict_runs(runs: Sequence[Run], description_path: Path,
                 progress: Callable[[str], None] | None = None) -> tuple[np.ndarray, list]:
    """Each run predicted by analysis.predict.predict_spec on the description at `description_path` (no profile,
    no overlap of the data-parallel all-reduce): the times (ms) and the Predictions."""
    from analysis.predict import predict_spec

    network, times, predictions = vtrain_network(), [], []
    for i, run in enumerate(runs):
        prediction = predict_spec(run_spec(run, str(description_path), network), dp_overlap=False, resamples=0)
        times.append(prediction.timeline.batch_time_s * 1e3)
        predictions.append(prediction)
        if progress and (i + 1) % 200 == 0:
            progress(f"  predicted {i + 1} of {len(runs)} runs")
    return np.array(times), predictions


def time_spent(timeline) -> dict[str, float]:
    """Where the first pipeline stage's iteration went (ms): compute (forward, backward, recompute, optimizer),
    tp (its blocking all-reduces), dp (the exposed all-reduce after the backward) and idle (the rest: the
    pipeline's bubble and its transfers, the engine's gaps between steps)."""
    spent: dict[str, float] = defaultdict(float)
    for interval in timeline.intervals(0):
        duration = (interval.end_s - interval.start_s) * 1e3
        if interval.category in COMPUTE_CATEGORIES:
            spent["compute"] += duration
        elif interval.category == TP_ALLREDUCE:
            spent["tp"] += duration
        elif interval.category == DP_ALLREDUCE:
            spent["dp"] += duration
    spent["idle"] = max(0.0, timeline.batch_time_s * 1e3 - sum(spent.values()))
    return {key: spent[key] for key in ("compute", "tp", "idle", "dp")}


def group_figures(scored: Scored) -> list[dict]:
    """Per (model, GPUs) group: runs, Spearman, regret and MAPE."""
    out = []
    predicted, measured, errors = scored.predicted, scored.measured, scored.errors
    for (model, gpus), members in scored.groups().items():
        p, m = predicted[members], measured[members]
        out.append({"model": model, "gpus": gpus, "runs": len(members),
                    "spearman": group_spearman(list(p), list(m)), "regret_pct": regret_pct(list(p), list(m)),
                    "mape_pct": float(np.mean(np.abs(errors[members])))})
    return out


def max_job_regret_pct(scored: Scored) -> float | None:
    """The worst regret among one job's configurations: runs of one model, GPU count and global batch (a search
    never changes the global batch; a (model, GPUs) group mixes several), in groups of GROUP_MIN_RUNS or more."""
    jobs = scored.groups(lambda run: (*run.group, run.global_batch))
    regrets = [regret_pct(list(scored.predicted[members]), list(scored.measured[members]))
               for members in jobs.values() if len(members) >= GROUP_MIN_RUNS]
    return max(regrets) if regrets else None


def set_figures(scored: Scored, coverage_pct: float | None, fitted_on: str) -> dict:
    """The JSON's figures of one set (docs/benchmarks.md, "Published A100 runs")."""
    groups = group_figures(scored)
    judged = [g for g in groups if g["runs"] >= GROUP_MIN_RUNS]
    spearmans = [g["spearman"] for g in judged if g["spearman"] is not None]
    by_model: dict[str, list[float]] = defaultdict(list)
    for run, error in zip(scored.runs, scored.errors):
        by_model[run.model].append(float(error))
    return {**error_summary(scored.errors),
            "min_group_spearman": min(spearmans) if spearmans else None,
            "max_group_regret_pct": max(g["regret_pct"] for g in judged) if judged else None,
            "max_job_regret_pct": max_job_regret_pct(scored),
            "interval_coverage_pct": coverage_pct, "fitted_on": fitted_on,
            "by_model": {model: error_summary(errors) for model, errors in sorted(by_model.items())},
            "groups": groups}


def print_tables(figures: Mapping[str, dict], worst: Sequence[dict]) -> None:
    names = list(figures)
    print(f"\n{'set':<18}{'rows':>6}{'MAPE%':>8}{'median%':>9}{'p90%':>7}{'worst%':>8}{'signed%':>9}"
          f"{'min rho':>9}{'max regret%':>13}{'job regret%':>13}{'90% cover%':>12}")
    for name in names:
        f = figures[name]
        rho = "-" if f["min_group_spearman"] is None else f"{f['min_group_spearman']:.2f}"
        regret = "-" if f["max_group_regret_pct"] is None else f"{f['max_group_regret_pct']:.1f}"
        job = "-" if f["max_job_regret_pct"] is None else f"{f['max_job_regret_pct']:.1f}"
        cover = "-" if f["interval_coverage_pct"] is None else f"{f['interval_coverage_pct']:.0f}"
        print(f"{name:<18}{f['rows']:>6}{f['mape_pct']:>8.2f}{f['median_abs_pct']:>9.2f}{f['p90_abs_pct']:>7.1f}"
              f"{f['worst_abs_pct']:>8.1f}{f['median_signed_pct']:>+9.1f}{rho:>9}{regret:>13}{job:>13}{cover:>12}")
    for who, (single, multi) in PUBLISHED.items():
        print(f"{who:<40} MAPE single node {single:.2f}%, multi-node {multi:.2f}% (published)")
    print(f"\n{'set':<18}{'model':>9}{'rows':>6}{'MAPE%':>8}{'median%':>9}{'p90%':>7}{'worst%':>8}")
    for name in names:
        for model, f in figures[name]["by_model"].items():
            print(f"{name:<18}{model:>9}{f['rows']:>6}{f['mape_pct']:>8.2f}{f['median_abs_pct']:>9.2f}"
                  f"{f['p90_abs_pct']:>7.1f}{f['worst_abs_pct']:>8.1f}")
    print(f"\n{'set':<18}{'model':>9}{'GPUs':>6}{'runs':>6}{'rho':>7}{'regret%':>9}{'MAPE%':>8}")
    for name in names:
        for g in figures[name]["groups"]:
            rho = "-" if g["spearman"] is None else f"{g['spearman']:.2f}"
            print(f"{name:<18}{g['model']:>9}{g['gpus']:>6}{g['runs']:>6}{rho:>7}{g['regret_pct']:>9.1f}"
                  f"{g['mape_pct']:>8.1f}")
    print(f"\nworst {len(worst)} held-out rows (ms; where the first stage's time went):")
    for w in worst:
        s = w["spent_ms"]
        print(f"  {w['error_pct']:+7.1f}%  {w['run']}: predicted {w['predicted_ms']:.1f}, measured "
              f"{w['measured_ms']:.1f}; compute {s['compute']:.1f}, tp {s['tp']:.1f}, idle {s['idle']:.1f}, "
              f"dp {s['dp']:.1f}")


def write_png(path: Path, sets: Sequence[Scored]) -> None:
    """Predicted against measured, log axes, one colour per model, one marker per set, the y = x line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({run.model for s in sets for run in s.runs}, key=lambda m: float(m[:-1]))
    colours = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(models)}
    markers = ("o", "^", "s")
    fig, ax = plt.subplots(figsize=(8, 7))
    for s, marker in zip(sets, markers):
        for model in models:
            idx = [i for i, run in enumerate(s.runs) if run.model == model]
            if idx:
                ax.scatter(s.measured[idx], s.predicted[idx], s=10, marker=marker, color=colours[model],
                           label=f"{model} ({s.name})", alpha=0.7)
    every = np.concatenate([np.concatenate([s.measured, s.predicted]) for s in sets])
    low, high = every.min() / 1.3, every.max() * 1.3
    ax.plot([low, high], [low, high], color="black", linewidth=0.8)
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured iteration (ms)",
           ylabel="predicted iteration (ms)", title="vTrain's published A100 runs, predicted from their specs")
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class Fold:
    """One fold's out-of-sample errors (%) on single-node runs: the description fitted on one half, scored on the
    other (`name` says which way)."""

    name: str
    runs: list[Run]
    errors: np.ndarray


def residual_domain(runs: Sequence[Run]) -> ResidualDomain:
    """The widths, GPU counts and nodes `runs` cover (analysis.uncertainty.gpu_residuals_for: a spec outside draws
    on the multi-node runs' errors, or on one node on the BEYOND folds')."""
    return ResidualDomain((min(r.hidden for r in runs), max(r.hidden for r in runs)),
                          (min(r.gpus for r in runs), max(r.gpus for r in runs)),
                          max(-(-r.gpus // GPUS_PER_NODE) for r in runs))


def beyond_splits(runs: Sequence[Run]) -> list[tuple[str, list[Run], list[Run]]]:
    """(name, fitted on, scored on) for the out-of-domain residuals: the description fitted on the narrowest width
    and scored on the wider ones, fitted on the widest and scored on the narrower, fitted on fewer than the most
    GPUs and scored on the most. Fixed before the multi-node coverage was computed with them."""
    widths, most = sorted({r.hidden for r in runs}), max(r.gpus for r in runs)
    return [(f"hidden-{widths[0]}-to-wider", [r for r in runs if r.hidden == widths[0]],
             [r for r in runs if r.hidden > widths[0]]),
            (f"hidden-{widths[-1]}-to-narrower", [r for r in runs if r.hidden == widths[-1]],
             [r for r in runs if r.hidden < widths[-1]]),
            (f"under-{most}-gpus-to-{most}", [r for r in runs if r.gpus < most], [r for r in runs if r.gpus == most])]


def beyond_folds(runs: Sequence[Run], base: DeviceDescription,
                 progress: Callable[[str], None] | None = None) -> list[Fold]:
    """beyond_splits' folds: each fit (fit_description) scored on its other runs."""
    folds = []
    for name, fitted_on, scored_on in beyond_splits(runs):
        if progress:
            progress(f"  out of domain: {name} ({len(fitted_on)} runs fitted, {len(scored_on)} scored)")
        figures, _ = fit_description(prepare(fitted_on), base)
        predicted = predict_ms(prepare(scored_on), with_figures(base, figures))
        folds.append(Fold(name, list(scored_on), errors_pct(predicted, [r.measured_ms for r in scored_on])))
    return folds


def leave_group_out_coverage(scored: Scored) -> tuple[float | None, dict[tuple[str, int], float]]:
    """interval_coverage_pct of the multi-node runs on their own held-out errors without scoring a run on its own
    model's: each (model, GPUs) group's runs from the ratios of every other group's. The mean over the runs, and
    each group's; None and no groups where the runs are of one group (a --limit too small for another)."""
    groups = [run.group for run in scored.runs]
    if len(set(groups)) < 2:
        return None, {}
    by_group = {}
    for group in dict.fromkeys(groups):
        mask = np.array([g == group for g in groups])
        by_group[group] = interval_coverage_pct(scored.predicted[mask], scored.measured[mask],
                                                ratios_of(scored.errors[~mask]))
    covered = sum(by_group[g] * groups.count(g) for g in by_group)
    return covered / len(groups), by_group


def residuals_document(folds: Sequence[Fold], seed: int, fitted_on: str,
                       beyond: Sequence[Fold] = (), domain: ResidualDomain | None = None,
                       multi_node: Fold | None = None) -> dict:
    """analysis/data/gpu_residuals.json: each fold's out-of-sample single-node errors (analysis.calibration's
    format, device kind 'cuda'), one job per run, one run entry per fold; the `beyond` folds' as `beyond_runs`,
    the runs' `domain`, and the multi-node runs' held-out errors as `multi_node_runs`."""
    def entries(of: Sequence[Fold], set_name: str = "single") -> list[dict]:
        return [{"run": f"vtrain-{set_name}-{fold.name}", "seed": seed, "date": datetime.date.today().isoformat(),
                 "jobs": [{"job": run.label, "pair_error_pct": [round(float(e), 2)]}
                          for run, e in zip(fold.runs, fold.errors)]} for fold in of]

    cuda = {"machine": "NVIDIA A100 SXM4 (DGX A100 nodes; vTrain's measurements, MICRO'24)", "runs": entries(folds)}
    if domain is not None:
        cuda["domain"] = domain.to_dict()
    if beyond:
        cuda["beyond_runs"] = entries(beyond)
    if multi_node is not None:
        cuda["multi_node_runs"] = entries([multi_node], "multi")
    return {"kind": "distsim-model-residuals", "version": 1,
            "what": ("Out-of-sample errors of a spec-only prediction on GPUs: vTrain's single-node A100 runs "
                     "(../shared/data/vtrain/) halved by bench/published.py's seeded split, each half's runs "
                     "predicted on the description fitted on the other half, each run's batch-time error "
                     "(predicted - measured) / measured in percent (the reported description: "
                     f"{fitted_on}). analysis.uncertainty.spec_only_interval draws from them for a spec within "
                     "`domain`; `multi_node_runs`, for a spec on more than one node, are the held-out errors of "
                     "vTrain's multi-node runs on the reported description; `beyond_runs`, for any other spec "
                     "outside the domain, are the errors of descriptions fitted on the narrowest width, the widest, "
                     "or fewer than the most GPUs and scored on the other runs."),
            "command": "python bench/published.py --residuals",
            "devices": {"cuda": cuda}}


def two_fold_coverage(held: Scored, seed: int) -> float:
    """The held-out half's interval coverage without scoring a run on its own residual: its runs split in two
    (seeded), each half's coverage from the other's residuals, the mean over the runs."""
    order = np.random.default_rng([seed, 2]).permutation(len(held.runs))
    folds = (order[: len(order) // 2], order[len(order) // 2:])
    covered = 0.0
    for scored_on, drawn_from in (folds, folds[::-1]):
        ratios = ratios_of(held.errors[drawn_from])
        covered += interval_coverage_pct(held.predicted[scored_on], held.measured[scored_on], ratios) * len(scored_on)
    return covered / len(order)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--png", type=Path, default=OUT / "published.png", help="predicted against measured")
    parser.add_argument("--residuals", action="store_true",
                        help=f"write the held-out half's errors to {GPU_RESIDUALS.relative_to(ROOT)}")
    parser.add_argument("--seed", type=int, default=SPLIT_SEED, help="the single-node split's seed")
    parser.add_argument("--limit", type=int, help=f"the first N runs of each set only (a quick look; at least "
                                                  f"{MIN_LIMIT})")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < MIN_LIMIT:
        parser.error(f"--limit {args.limit}: give at least {MIN_LIMIT} (fewer leave a fold or a set without runs)")
    if not VTRAIN.is_dir():
        print(f"no published runs at {VTRAIN} (../shared/data/vtrain/ beside the project)", file=sys.stderr)
        return 2

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    single, multi = read_runs("single"), read_runs("multi")
    if args.limit:
        single, multi = single[: args.limit], multi[: args.limit]
    fit_runs, held_runs = split_half(single, args.seed)
    fitted_on = (f"{', '.join(figure_name(key) for key in FITTED)} of {DEVICE} fitted on {len(fit_runs)} single-node "
                 f"runs (seeded half, seed {args.seed}); held out: the other {len(held_runs)} single-node runs and "
                 f"all {len(multi)} multi-node runs")
    print(f"split seed {args.seed}: fit on {len(fit_runs)} single-node runs, held out {len(held_runs)} single-node "
          f"and {len(multi)} multi-node runs")
    say("planning the fit half ...")
    base = load_device(DEVICE)
    figures, fit_mape = fit_description(prepare(fit_runs, say), base, progress=say)
    fitted = dataclasses.replace(with_figures(base, figures, fitted_on), name=FITTED_NAME,
                                 title=f"{base.title}, efficiency fitted on vTrain's runs")
    FITTED_PATH.parent.mkdir(parents=True, exist_ok=True)
    FITTED_PATH.write_text(fitted.to_toml("written by bench/published.py: " + fitted_on))
    print(f"fitted ({FITTED_PATH.relative_to(ROOT)}): " + ", ".join(
        f"{figure_name(key)} {figure_of(base, key):.3g} -> {v:.3g}" for key, v in figures.items())
          + f"; fit-half MAPE {fit_mape:.2f}%")

    scored, predictions = {}, {}
    for name, runs in (("single_fit", fit_runs), ("single_held_out", held_runs), ("multi", multi)):
        say(f"predicting {name} ({len(runs)} runs) ...")
        times, predictions[name] = predict_runs(runs, FITTED_PATH, say)
        scored[name] = Scored(name, list(runs), times)
    held = scored["single_held_out"]
    say("the other fold: fitting on the held-out half, scoring the fit half (the interval's residuals only) ...")
    other_figures, _ = fit_description(prepare(held_runs, say), base, progress=say)
    other = predict_ms(prepare(fit_runs), with_figures(base, other_figures))
    folds = (Fold("held-out-half", held.runs, held.errors),
             Fold("fit-half", list(fit_runs), errors_pct(other, [run.measured_ms for run in fit_runs])))
    say("out-of-domain folds: fits on part of the single-node runs, scored on the rest (the interval beyond them) ...")
    domain, beyond = residual_domain(single), beyond_folds(single, base, say)
    multi_coverage, multi_by_group = leave_group_out_coverage(scored["multi"])
    coverage = {"single_fit": None, "single_held_out": two_fold_coverage(held, args.seed), "multi": multi_coverage}
    sets = {name: set_figures(s, coverage[name], fitted_on) for name, s in scored.items()}
    worst = []
    for name in ("single_held_out", "multi"):
        s = scored[name]
        for i in np.argsort(-np.abs(s.errors))[:WORST_SHOWN]:
            worst.append({"set": name, "run": s.runs[i].label, "error_pct": float(s.errors[i]),
                          "predicted_ms": float(s.predicted[i]), "measured_ms": float(s.measured[i]),
                          "spent_ms": time_spent(predictions[name][i].timeline)})
    worst = sorted(worst, key=lambda w: -abs(w["error_pct"]))[:WORST_SHOWN]
    print_tables(sets, worst)
    print("\n90% interval: the single-node runs' out-of-sample errors (run / prediction ratios; each half scored on "
          "a description fitted on the other) around a prediction within their domain (" + domain.text() + "; the "
          "held-out half's coverage 2-fold within its own errors); on more than one node the multi-node runs' own "
          "held-out errors, each group's coverage from the other groups' errors:")
    for (model, gpus), pct in multi_by_group.items():
        print(f"  multi-node {model:>8s} on {gpus:3d} GPUs: {pct:5.1f}% covered by the other groups' errors")
    print("outside the domain on one node, the errors of fits scored beyond their runs:")
    for fold in beyond:
        low, mid, high = np.percentile(ratios_of(fold.errors), [5, 50, 95])
        print(f"  {fold.name:28s} {len(fold.runs):4d} runs  MAPE {np.mean(np.abs(fold.errors)):5.2f}%  "
              f"run / prediction {low:.3f} - {mid:.3f} - {high:.3f}")
    write_png(args.png, list(scored.values()))
    print(f"wrote {args.png}")
    if args.residuals:
        multi_node = Fold("held-out", scored["multi"].runs, scored["multi"].errors)
        GPU_RESIDUALS.write_text(residuals_text(residuals_document(folds, args.seed, fitted_on, beyond, domain,
                                                                   multi_node)))
        print(f"wrote {GPU_RESIDUALS.relative_to(ROOT)} ({sum(len(fold.runs) for fold in folds)} runs in two folds, "
              f"{sum(len(fold.runs) for fold in beyond)} out of domain, {len(multi_node.runs)} multi-node)")
    if args.json:
        document = {"version": JSON_VERSION,
                    "what": "bench/published.py: vTrain's published A100 runs predicted from their specs",
                    "split_seed": args.seed, "device": DEVICE, "inter_node_gbs_per_gpu": INTER_NODE_GBS_PER_GPU,
                    "fitted": {figure_name(key): v for key, v in figures.items()}, "fitted_on": fitted_on,
                    "published_mape_pct": {who: {"single": a, "multi": b} for who, (a, b) in PUBLISHED.items()},
                    "sets": {name: sets[name] for name in ("single_held_out", "multi")},
                    "residual_domain": domain.to_dict(),
                    "multi_coverage_by_group": [{"model": model, "gpus": gpus, "interval_coverage_pct": pct}
                                                for (model, gpus), pct in multi_by_group.items()],
                    "beyond_folds": [{"name": fold.name, "rows": len(fold.runs),
                                      "mape_pct": float(np.mean(np.abs(fold.errors))),
                                      "ratio_p5_p50_p95": [float(v) for v in
                                                           np.percentile(ratios_of(fold.errors), [5, 50, 95])]}
                                     for fold in beyond],
                    "fit_set": sets["single_fit"], "worst": worst}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
