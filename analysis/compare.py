"""Measured and predicted timelines side by side: a Perfetto trace holding both, and a PNG one above the other."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from analysis.simulate import COMPUTE_TRACK
from analysis.trace import trace_events
from analysis.validate import Validation, measured_intervals

MEASURED_PID_OFFSET = 100_000  # measured device r is process 100000 + r; predicted device r is process r
KIND_COLOURS = {"compute": "#55A868", "optimizer": "#8C613C", "allreduce": "#C44E52", "p2p": "#8C8C8C"}
PHASE_COLOURS = {"F": "#4C72B0", "B": "#55A868"}


def _ranks(validation: Validation) -> list[int]:
    """One device per pipeline stage (dp 0, tp 0): replicas look alike."""
    return sorted(r for r, d in validation.trace.devices.items() if d.dp == 0 and d.tp == 0)


def _lanes(intervals: list[tuple[float, float, str, str, str]]) -> list[int]:
    """Thread 0 for compute and optimizer; communication on threads 1.. so that nothing overlaps in a thread."""
    ends: list[float] = []
    out = []
    for start, end, kind, _, _ in intervals:
        if kind in ("compute", "optimizer"):
            out.append(0)
            continue
        lane = next((k for k, e in enumerate(ends) if e <= start), None)
        if lane is None:
            ends.append(end)
            lane = len(ends) - 1
        else:
            ends[lane] = end
        out.append(lane + 1)
    return out


def write_comparison_trace(path: str | Path, validation: Validation) -> Path:
    """One Perfetto trace: predicted devices (pid = rank) and the measured ones (pid = 100000 + rank)."""
    ranks = _ranks(validation)
    events: list[dict[str, Any]] = trace_events(validation.timeline, ranks)
    for event in events:
        if event.get("ph") == "M" and event["name"] == "process_name":
            event["args"]["name"] = "predicted " + event["args"]["name"]
    iteration = validation.representative_iteration
    for rank in ranks:
        pid = MEASURED_PID_OFFSET + rank
        device = validation.trace.devices[rank]
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"measured rank {rank} (stage {device.pp}), iteration {iteration}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        intervals = sorted(measured_intervals(validation.trace, rank, iteration), key=lambda iv: (iv[0], iv[1]))
        for (start, end, kind, _, name), tid in zip(intervals, _lanes(intervals)):
            ts = round(start * 1e6, 3)
            events.append({"ph": "X", "name": name, "cat": kind, "pid": pid, "tid": tid, "ts": ts,
                           "dur": round(end * 1e6 - ts, 3)})
    data = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")).encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def write_comparison_png(path: str | Path, validation: Validation) -> Path:
    """Two Gantt panels sharing the time axis: measured (one iteration, the median) above, predicted below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = _ranks(validation)
    iteration = validation.representative_iteration
    timeline = validation.timeline
    fig, axes = plt.subplots(2, 1, figsize=(14, 2.2 + 1.1 * len(ranks)), sharex=True)
    for panel, ax in enumerate(axes):
        for row, rank in enumerate(ranks):
            y = len(ranks) - 1 - row
            if panel == 0:
                for start, end, kind, phase, name in measured_intervals(validation.trace, rank, iteration):
                    comm = kind == "p2p" or phase == "dp"  # asynchronous: the communication row
                    colour = KIND_COLOURS.get(kind, "#999999")
                    if kind == "compute":
                        colour = PHASE_COLOURS.get(phase, colour)
                    ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (y + (0.08 if comm else 0.38), 0.26 if comm
                                   else 0.5), facecolors=colour, edgecolor="white", linewidth=0.3)
            else:
                stage = timeline.stage_dp_tp(rank)[0]
                for iv in timeline.intervals(stage):
                    compute = iv.track == COMPUTE_TRACK
                    kind = "compute" if iv.category in ("forward", "backward") else (
                        "optimizer" if iv.category == "optimizer" else ("p2p" if "p2p" in iv.category else "allreduce"))
                    colour = PHASE_COLOURS[iv.name[0]] if kind == "compute" else KIND_COLOURS[kind]
                    ax.broken_barh([(iv.start_s * 1e3, (iv.end_s - iv.start_s) * 1e3)],
                                   (y + (0.38 if compute else 0.08), 0.5 if compute else 0.26), facecolors=colour,
                                   edgecolor="none")
        ax.set_ylim(0, len(ranks))
        ax.set_yticks([len(ranks) - 1 - row + 0.5 for row in range(len(ranks))])
        ax.set_yticklabels([f"rank {r} (stage {validation.trace.devices[r].pp})" for r in ranks], fontsize=8)
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
    axes[0].set_title(f"measured (iteration {iteration}): {validation.measured_batch_s * 1e3:.2f} ms median", fontsize=10)
    axes[1].set_title(f"predicted: {validation.predicted_batch_s * 1e3:.2f} ms "
                      f"(error {validation.batch_time_error_pct:+.1f}%)", fontsize=10)
    axes[1].set_xlabel("time (ms)")
    handles = [Patch(color=PHASE_COLOURS["F"], label="forward"), Patch(color=PHASE_COLOURS["B"], label="backward"),
               Patch(color=KIND_COLOURS["allreduce"], label="all-reduce"), Patch(color=KIND_COLOURS["p2p"], label="P2P"),
               Patch(color=KIND_COLOURS["optimizer"], label="optimizer")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
