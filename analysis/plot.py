"""Gantt chart of a simulated iteration (PNG, matplotlib's Agg backend: no display needed).

One row per device: the compute stream above (forward, backward, tensor-parallel all-reduces, optimizer),
communication below (P2P transfers, data-parallel all-reduces); time in milliseconds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from analysis.report import strategy_label
from analysis.simulate import (BACKWARD, DP_ALLREDUCE, FORWARD, OPTIMIZER, P2P_POST, P2P_RECV, P2P_SEND,
                               TP_ALLREDUCE, Timeline)

COLOURS = {FORWARD: "#4C72B0", BACKWARD: "#55A868", TP_ALLREDUCE: "#C44E52", OPTIMIZER: "#8C613C",
           P2P_SEND: "#8C8C8C", P2P_RECV: "#BDBDBD", DP_ALLREDUCE: "#8172B2", P2P_POST: "#CCB974"}
LABELS = {FORWARD: "forward", BACKWARD: "backward", TP_ALLREDUCE: "tensor-parallel all-reduce",
          OPTIMIZER: "optimizer", P2P_SEND: "P2P send", P2P_RECV: "P2P receive",
          DP_ALLREDUCE: "data-parallel all-reduce", P2P_POST: "posting a P2P send"}
COMPUTE_BAR = (0.38, 0.5)  # (bottom offset, height) within a row of height 1
COMM_BAR = (0.08, 0.26)


def write_gantt(path: str | Path, timeline: Timeline, ranks: Sequence[int], note: str | None = None) -> Path:
    """Draw one row per rank in `ranks` (top to bottom) and save a PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    rows = len(ranks)
    height_in = 1.6 + 0.55 * rows
    fig, ax = plt.subplots(figsize=(14, height_in))
    used: set[str] = set()
    details = {}
    for row, rank in enumerate(ranks):
        stage = timeline.stage_dp_tp(rank)[0]
        if stage not in details:
            details[stage] = timeline.intervals(stage)
        y = rows - 1 - row
        by_category: dict[str, list[tuple[float, float]]] = {FORWARD: [], BACKWARD: []}
        for step in timeline.pipeline[stage].steps:  # whole steps: one bar per micro-batch
            by_category[FORWARD if step.phase == "F" else BACKWARD].append(
                (step.start_s * 1e3, (step.end_s - step.start_s) * 1e3))
        for iv in details[stage]:  # tensor-parallel all-reduces drawn over their steps
            if iv.category not in (FORWARD, BACKWARD):
                by_category.setdefault(iv.category, []).append((iv.start_s * 1e3, (iv.end_s - iv.start_s) * 1e3))
        separate = len(timeline.pipeline[stage].steps) <= 256
        for category in sorted(by_category, key=list(COLOURS).index):
            spans = by_category[category]
            offset, height = COMM_BAR if category in (P2P_SEND, P2P_RECV, DP_ALLREDUCE) else COMPUTE_BAR
            steps = category in (FORWARD, BACKWARD)
            ax.broken_barh(spans, (y + offset, height), facecolors=COLOURS[category],
                           edgecolor="white" if steps and separate else "none", linewidth=0.4)
            if any(width > 0 for _, width in spans):
                used.add(category)
    ax.set_ylim(0, rows)
    ax.set_yticks([rows - 1 - row + 0.5 for row in range(rows)])
    ax.set_yticklabels([f"rank {r} (stage {timeline.stage_dp_tp(r)[0]})" for r in ranks], fontsize=8)
    ax.set_xlim(0, max(timeline.batch_time_s * 1e3, 1e-9) * 1.01)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    spec = timeline.spec
    title = (f"{spec.model.name}  {strategy_label(timeline)}  ({timeline.world:,} devices)  "
             f"batch time {timeline.batch_time_s * 1e3:.3f} ms, bubble {timeline.bubble_fraction:.1%}")
    ax.set_title(title + (f"\n{note}" if note else ""), fontsize=10)
    handles = [Patch(color=COLOURS[c], label=LABELS[c]) for c in COLOURS if c in used]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.3 / height_in, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
