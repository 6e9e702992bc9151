"""Gantt charts (PNG, matplotlib's Agg backend: no display needed), drawn one way for every chart.

One row per device: the compute stream above (forward and backward steps, one bar per micro-batch, with
tensor-parallel all-reduces and the optimizer), communication below (P2P transfers, data-parallel
all-reduces); time in milliseconds. A predicted timeline (`write_gantt`) and a measured one
(`analysis.compare`) are drawn with the same categories, colours and bar geometry (`draw_row`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from analysis.report import strategy_label
from analysis.simulate import (
    BACKWARD,
    BACKWARD_WEIGHT,
    DP_ALLREDUCE,
    FORWARD,
    OPTIMIZER,
    P2P_POST,
    P2P_RECV,
    P2P_SEND,
    RECOMPUTE,
    TP_ALLREDUCE,
    ZERO_ALLGATHER,
    ZERO_REDUCESCATTER,
    Timeline,
)
from harness.common.errors import UserError
from harness.common.output import PNG_NAMES, check_name

COLOURS = {FORWARD: "#4C72B0", BACKWARD: "#55A868", TP_ALLREDUCE: "#C44E52", OPTIMIZER: "#8C613C",
           P2P_SEND: "#8C8C8C", P2P_RECV: "#BDBDBD", DP_ALLREDUCE: "#8172B2", P2P_POST: "#CCB974",
           RECOMPUTE: "#64B5CD", ZERO_ALLGATHER: "#DA8BC3", ZERO_REDUCESCATTER: "#BCBD22", BACKWARD_WEIGHT: "#2E7D32"}
LABELS = {FORWARD: "forward", BACKWARD: "backward", TP_ALLREDUCE: "tensor-, context- or expert-parallel collective",
          OPTIMIZER: "optimizer", P2P_SEND: "P2P send", P2P_RECV: "P2P receive",
          DP_ALLREDUCE: "data-parallel all-reduce", P2P_POST: "posting a P2P send",
          RECOMPUTE: "recomputed forward (in the backward)", ZERO_ALLGATHER: "ZeRO weight all-gather",
          ZERO_REDUCESCATTER: "ZeRO gradient reduce-scatter", BACKWARD_WEIGHT: "weight gradients (zero-bubble W)"}
STEP_CATEGORY = {"F": FORWARD, "B": BACKWARD, "W": BACKWARD_WEIGHT}  # a step's phase -> its bars' category
COMMUNICATION_ROW = frozenset({P2P_SEND, P2P_RECV, DP_ALLREDUCE})  # drawn below the compute stream
COMPUTE_BAR = (0.38, 0.5)  # (bottom offset, height) within a row of height 1
COMM_BAR = (0.08, 0.26)
SEPARATE_STEPS_UP_TO = 256  # steps of a row drawn with a white edge between them up to this many

Bars = Mapping[str, Sequence[tuple[float, float]]]  # category -> (start_s, end_s) of each bar


def timeline_bars(timeline: Timeline, stage: int) -> dict[str, list[tuple[float, float]]]:
    """A simulated pipeline device's bars: whole steps, and every interval that is not a step's compute."""
    bars: dict[str, list[tuple[float, float]]] = {FORWARD: [], BACKWARD: []}
    for step in timeline.pipeline[stage].steps:
        bars.setdefault(STEP_CATEGORY[step.phase], []).append((step.start_s, step.end_s))
    for iv in timeline.intervals(stage):
        if iv.category not in STEP_CATEGORY.values():
            bars.setdefault(iv.category, []).append((iv.start_s, iv.end_s))
    return bars


def measured_category(kind: str, phase: str) -> str:
    """The timeline category of a row of a real run's trace (docs/train.md: its kind and phase)."""
    if kind == "compute":
        return STEP_CATEGORY.get(phase, BACKWARD)
    if phase in ("tp", "cp") or (phase == "ep" and kind == "alltoall"):
        return TP_ALLREDUCE
    if kind == "p2p":
        return P2P_SEND if phase == "send" else P2P_RECV
    if kind == "allreduce":
        return DP_ALLREDUCE
    if kind in ("allgather", "reducescatter") and phase != "tp":
        return ZERO_ALLGATHER if kind == "allgather" else ZERO_REDUCESCATTER
    return OPTIMIZER


def draw_row(ax, y: float, bars: Bars) -> set[str]:
    """Draw one device's bars in the row whose bottom is `y`; returns the categories it drew."""
    used = set()
    separate = len(bars.get(FORWARD, ())) + len(bars.get(BACKWARD, ())) <= SEPARATE_STEPS_UP_TO
    for category in sorted(bars, key=list(COLOURS).index):
        spans = [(start * 1e3, (end - start) * 1e3) for start, end in bars[category]]
        offset, height = COMM_BAR if category in COMMUNICATION_ROW else COMPUTE_BAR
        steps = category in STEP_CATEGORY.values()
        ax.broken_barh(spans, (y + offset, height), facecolors=COLOURS[category],
                       edgecolor="white" if steps and separate else "none", linewidth=0.4)
        if any(width > 0 for _, width in spans):
            used.add(category)
    return used


def label_rows(ax, labels: Sequence[str]) -> None:
    """Row labels top to bottom (row 0 at the top), a dotted time grid."""
    rows = len(labels)
    ax.set_ylim(0, rows)
    ax.set_yticks([rows - 1 - row + 0.5 for row in range(rows)])
    ax.set_yticklabels(labels, fontsize=8)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)


def add_legend(fig, used: set[str]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=COLOURS[c], label=LABELS[c]) for c in COLOURS if c in used]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)


def save(fig, path: str | Path) -> Path:
    """Write `fig` to `path` as a PNG (a name ending in .png: matplotlib would otherwise pick the format from the
    suffix, or add .png to a name without one)."""
    import matplotlib.pyplot as plt

    try:
        path = check_name(path, PNG_NAMES)
    except UserError:
        plt.close(fig)
        raise
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_gantt(path: str | Path, timeline: Timeline, ranks: Sequence[int], note: str | None = None) -> Path:
    """Draw one row per rank in `ranks` (top to bottom) and save a PNG to `path`."""
    plt = pyplot()
    rows = len(ranks)
    height_in = 1.6 + 0.55 * rows
    fig, ax = plt.subplots(figsize=(14, height_in))
    used: set[str] = set()
    bars = {}
    for row, rank in enumerate(ranks):
        stage = timeline.stage_dp_tp(rank)[0]
        if stage not in bars:
            bars[stage] = timeline_bars(timeline, stage)
        used |= draw_row(ax, rows - 1 - row, bars[stage])
    label_rows(ax, [f"rank {r} (stage {timeline.stage_dp_tp(r)[0]})" for r in ranks])
    ax.set_xlim(0, max(timeline.batch_time_s * 1e3, 1e-9) * 1.01)
    ax.set_xlabel("time (ms)")
    spec = timeline.spec
    title = (f"{spec.model.name}  {strategy_label(timeline)}  ({timeline.world:,} devices)  "
             f"batch time {timeline.batch_time_s * 1e3:.3f} ms, bubble {timeline.bubble_fraction:.1%}")
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=10)
    add_legend(fig, used)
    fig.tight_layout(rect=(0, 0.3 / height_in, 1, 1))
    return save(fig, path)


def write_search_chart(path: str | Path, result, iterations: int | None = None, tokens: float | None = None) -> Path:
    """Throughput against peak memory per device, one point per predicted candidate (filled where it fits),
    the feasible Pareto front joined, the memory limit as a line, the best candidate named; where the grid
    has several device counts, beside it the booking curve (booking_panel)."""
    from analysis.search import best_per_gpu_count, pareto_front
    from harness.common.output import byte_unit

    plt = pyplot()
    per_count = best_per_gpu_count(result.candidates)
    if len(per_count) > 1:
        fig, (ax, booking) = plt.subplots(1, 2, figsize=(16, 6))
        booking_panel(booking, per_count, iterations, tokens)
    else:
        fig, ax = plt.subplots(figsize=(10, 6))
    predicted = [c for c in result.candidates if c.predicted]
    unit, GB = byte_unit([c.peak_memory_bytes for c in predicted] + [result.capacity_bytes or 0])
    for feasible, marker in ((True, "o"), (False, "x")):
        points = [c for c in predicted if c.feasible == feasible]
        if points:
            ax.scatter([c.peak_memory_bytes / GB for c in points], [c.throughput_samples_s for c in points],
                       marker=marker, s=28, color="#4C72B0" if feasible else "#C44E52",
                       label="fits" if feasible else "does not fit")
    front = pareto_front(result.candidates)
    if front:
        ax.plot([c.peak_memory_bytes / GB for c in front], [c.throughput_samples_s for c in front], color="#55A868",
                linewidth=1.5, label="Pareto front (fits)")
    if result.capacity_bytes:
        ax.axvline(result.capacity_bytes / GB, color="#8C8C8C", linestyle="--", label="device memory")
    best = result.best
    if best is not None:
        ax.annotate(best.label, (best.peak_memory_bytes / GB, best.throughput_samples_s), fontsize=8,
                    xytext=(6, 6), textcoords="offset points")
    ax.set_xlabel(f"peak memory per device ({unit})")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"{result.spec.model.name}: {len(predicted)} candidates", fontsize=10)
    ax.grid(linestyle=":", linewidth=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, path)


def booking_panel(ax, per_count, iterations: int | None, tokens: float | None) -> None:
    """The curve an operator books from: the fastest feasible candidate per device count, its time to train
    (or, without --iterations/--tokens, its batch time) and GPU-hours (GPU-seconds per iteration) on a second
    axis, each point named by its strategy."""
    counts = sorted(per_count)
    best = [per_count[n] for n in counts]
    if iterations is not None or tokens is not None:
        trained = [c.training(iterations, tokens) for c in best]
        times, cost = [t[0] / 3600 for t in trained], [t[1] for t in trained]
        time_label, cost_label = "time to train (h)", "GPU-hours"
    else:
        times = [c.batch_time_s * 1e3 for c in best]
        cost = [c.batch_time_s * c.spec.strategy.world for c in best]
        time_label, cost_label = "batch time (ms)", "GPU-seconds per iteration"
    ax.plot(counts, times, marker="o", color="#4C72B0", label=time_label)
    for n, t, c in zip(counts, times, best):
        ax.annotate(c.label, (n, t), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [f"{n:,}" for n in counts])
    ax.set_xlabel("devices")
    ax.set_ylabel(time_label, color="#4C72B0")
    twin = ax.twinx()
    twin.plot(counts, cost, marker="s", color="#DD8452", label=cost_label)
    twin.set_ylabel(cost_label, color="#DD8452")
    ax.set_title("the fastest candidate that fits, per device count", fontsize=10)
    ax.grid(linestyle=":", linewidth=0.5)
