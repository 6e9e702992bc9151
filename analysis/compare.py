"""Measured and predicted timelines side by side: a Perfetto trace holding both, and a PNG one above the other."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis.intervals import lanes
from analysis.perfetto import trace_events, write_document
from analysis.plot import add_legend, draw_row, label_rows, measured_category, pyplot, save, timeline_bars
from analysis.validate import Validation, measured_intervals

MEASURED_PID_OFFSET = 100_000  # measured device r is process 100000 + r; predicted device r is process r


def _ranks(validation: Validation) -> list[int]:
    """One device per pipeline stage (dp 0, tp 0): replicas look alike."""
    return sorted(r for r, d in validation.trace.devices.items() if d.dp == 0 and d.tp == 0)


def _threads(intervals: list[tuple[float, float, str, str, str]]) -> list[int]:
    """Thread 0 for compute and optimizer; communication on threads 1.. so that nothing overlaps in a thread."""
    comm = [i for i, iv in enumerate(intervals) if iv[2] not in ("compute", "optimizer")]
    rows = lanes([intervals[i][0] for i in comm], [intervals[i][1] for i in comm])
    out = [0] * len(intervals)
    for i, row in zip(comm, rows):
        out[i] = row + 1
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
        for (start, end, kind, _, name), tid in zip(intervals, _threads(intervals)):
            ts = round(start * 1e6, 3)
            events.append({"ph": "X", "name": name, "cat": kind, "pid": pid, "tid": tid, "ts": ts,
                           "dur": round(end * 1e6 - ts, 3)})
    return write_document(path, {"traceEvents": events, "displayTimeUnit": "ms"})


def write_comparison_png(path: str | Path, validation: Validation) -> Path:
    """Two Gantt panels sharing the time axis: measured (one iteration, the median) above, predicted below."""
    plt = pyplot()
    ranks = _ranks(validation)
    iteration = validation.representative_iteration
    timeline = validation.timeline
    fig, axes = plt.subplots(2, 1, figsize=(14, 2.2 + 1.1 * len(ranks)), sharex=True)
    used: set[str] = set()
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        measured: dict[str, list[tuple[float, float]]] = {}
        for start, end, kind, phase, _ in measured_intervals(validation.trace, rank, iteration):
            measured.setdefault(measured_category(kind, phase), []).append((start, end))
        used |= draw_row(axes[0], y, measured)
        used |= draw_row(axes[1], y, timeline_bars(timeline, timeline.stage_dp_tp(rank)[0]))
    labels = [f"rank {r} (stage {validation.trace.devices[r].pp})" for r in ranks]
    for ax in axes:
        label_rows(ax, labels)
    axes[0].set_title(f"measured (iteration {iteration}): {validation.measured_batch_s * 1e3:.2f} ms median",
                      fontsize=10)
    axes[1].set_title(f"predicted: {validation.predicted_batch_s * 1e3:.2f} ms "
                      f"(error {validation.batch_time_error_pct:+.1f}%)", fontsize=10)
    axes[1].set_xlabel("time (ms)")
    add_legend(fig, used)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return save(fig, path)
