"""Chrome/Perfetto trace of a simulated iteration (JSON `{"traceEvents": [...]}`, gzipped for *.gz).

One process per device (pid = rank); thread 0 is the compute stream (compute and blocking tensor-parallel
all-reduces), threads 1, 2, ... hold communication (P2P transfers and data-parallel all-reduces), a new
thread only where transfers overlap so that slices nest within each thread. Complete events ("X") carry
ts/dur in microseconds; flow events ("s"/"f") link each send to its receive.
"""
from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from analysis.intervals import lanes
from analysis.report import strategy_label
from analysis.simulate import COMM_TRACK, Interval, Timeline, transfer_name
from harness.common.output import TRACE_NAMES, check_name

COMPUTE_TID = 0
_US = 1e6


def _microseconds(seconds: float) -> float:
    """Trace time: microseconds rounded to nanoseconds, the same for an end and the next start."""
    return round(seconds * _US, 3)


def comm_lanes(intervals: Sequence[Interval]) -> dict[int, int]:
    """Thread id (1, 2, ...) for each communication interval (by index), so none overlap within a thread."""
    comm = [i for i, iv in enumerate(intervals) if iv.track == COMM_TRACK]
    rows = lanes([intervals[i].start_s for i in comm], [intervals[i].end_s for i in comm])
    return {i: row + 1 for i, row in zip(comm, rows)}


def trace_events(timeline: Timeline, ranks: Sequence[int]) -> list[dict[str, Any]]:
    """The trace's events for the given devices, with flows between sends and receives of chosen devices."""
    chosen = set(ranks)
    costs = timeline.costs.events
    per_stage: dict[int, tuple[list[Interval], dict[int, int], dict[str, int]]] = {}
    events: list[dict[str, Any]] = []
    for rank in ranks:
        stage, dp_i, tp_i = timeline.stage_dp_tp(rank)
        if stage not in per_stage:
            intervals = timeline.intervals(stage)
            lanes = comm_lanes(intervals)
            per_stage[stage] = (intervals, lanes, {intervals[i].name: tid for i, tid in lanes.items()})
        intervals, lanes, _ = per_stage[stage]
        threads = max(lanes.values(), default=1)
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank} (stage {stage}, dp {dp_i}, tp {tp_i})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": COMPUTE_TID, "args": {"name": "compute"}})
        for tid in range(1, threads + 1):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": "communication" if tid == 1 else f"communication {tid}"}})
        for i, iv in enumerate(intervals):
            ts, end = _microseconds(iv.start_s), _microseconds(iv.end_s)
            cost = costs.get(iv.event_id) if iv.event_id else None  # where its duration came from
            events.append({"ph": "X", "name": iv.name, "cat": iv.category, "pid": rank,
                           "tid": lanes.get(i, COMPUTE_TID), "ts": ts, "dur": round(end - ts, 3),
                           "args": {"event": iv.event_id, "virtual_stage": iv.virtual_stage, "micro": iv.micro,
                                    "layer": iv.layer, **({"source": cost.source, "how": cost.note}
                                                          if cost is not None else {})}})
    flow_id = 0
    pp = timeline.spec.strategy.pp
    for rank in ranks:
        stage, dp_i, tp_i = timeline.stage_dp_tp(rank)
        for transfer in timeline.pipeline[stage].sends:
            dst_stage = transfer.dst_stage % pp
            receiver = timeline.plan.rank_of(dp_i, tp_i, dst_stage, timeline.plan.cp_index(rank))
            if receiver not in chosen:
                continue
            flow_id += 1
            common = {"name": "p2p", "cat": "p2p", "id": flow_id, "ts": _microseconds(transfer.start_s)}
            events.append({**common, "ph": "s", "pid": rank,
                           "tid": per_stage[stage][2][transfer_name(transfer, "send")]})
            events.append({**common, "ph": "f", "bp": "e", "pid": receiver,
                           "tid": per_stage[dst_stage][2][transfer_name(transfer, "recv")]})
    return events


def write_trace(path: str | Path, timeline: Timeline, ranks: Sequence[int]) -> Path:
    """Write the trace for `ranks` to `path` (gzip when it ends in .gz); open it in ui.perfetto.dev."""
    path = Path(path)
    document = {"traceEvents": trace_events(timeline, ranks), "displayTimeUnit": "ms",
                "otherData": {"model": timeline.spec.model.name, "strategy": strategy_label(timeline),
                              "batch_time_s": timeline.batch_time_s, "devices_in_trace": len(ranks),
                              "world": timeline.world}}
    return write_document(path, document)


def write_document(path: str | Path, document: dict[str, Any]) -> Path:
    """A Perfetto (Chrome trace event) document written to `path`: FILE.json, or FILE.json.gz gzipped; UserError
    for another name."""
    path = check_name(path, TRACE_NAMES)
    data = json.dumps(document, separators=(",", ":")).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.lower().endswith(".gz"):  # as check_name reads the suffix
        data = gzip.compress(data, compresslevel=6)
    path.write_bytes(data)
    return path
