"""`harness train --torch-profiler DIR`: each rank's measured iterations as a PyTorch profiler (Kineto) trace.

torch.profiler records the rank's operators; the engine marks every interval its main thread records with an
annotation (harness.train.recorder.ANNOTATIONS). Communication that completes in the background (P2P sends,
gradient buckets) runs on no thread torch's profiler sees as such: gloo's own thread shows its collectives, but
not its P2P, and an MPI all-reduce is invisible. So the trace gets, after export, one complete event per send
(`distsim:send.activation`, `distsim:send.gradient`) and, when MPI all-reduces the gradients, per bucket
(`mpi4py:allreduce`) on a thread of its own (BACKGROUND_THREAD), from its launch to its completion as the
harness timed it for trace.h5 (docs/train.md). Communications in flight together overlap without nesting, which
events of one thread must not, so each takes the first of the threads `distsim background communication 0, 1,
...` free by its start. Kineto's `ts` is wall-clock microseconds since the trace's `baseTimeNanoseconds`; the
harness's times are `perf_counter_ns`, mapped through the two clocks' difference taken at export.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

BACKGROUND_THREAD = "distsim background communication"  # a name, not a number: no real thread has it


def start_profiler(device):
    """torch.profiler over the CPU (and CUDA kernels on a GPU), recording every thread, marking steps."""
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        from torch._C._profiler import _ExperimentalConfig

        options = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):  # a torch that records the threads it knows only
        options = {}
    # a schedule that always records: torch marks the steps (ProfilerStep#N) only when given a schedule
    profiler = profile(activities=activities, schedule=lambda step: ProfilerAction.RECORD, **options)
    profiler.start()
    return profiler


def background_events(rows: Sequence[tuple], first_iteration: int, base_ns: int, pid: int,
                      mpi_buckets: bool) -> list[dict]:
    """Complete events of the recorder's sends (and, with `mpi_buckets`, gradient buckets) from
    `first_iteration` on.
    A row is harness.train.recorder.Recorder's: (start_ns, end_ns, wait_ns, kind, name, phase, event_id, vs,
    micro, iteration, peer), on perf_counter_ns."""
    wall_minus_perf = time.time_ns() - time.perf_counter_ns()
    chosen = sorted((row for row in rows if row[9] >= first_iteration and (row[5] == "send" or
                                                                           (row[5] == "dp" and mpi_buckets))),
                    key=lambda row: (row[0], row[1]))
    lane_ends: list[int] = []  # when each background thread is free again
    out = []
    for start_ns, end_ns, _, _kind, name, phase, event_id, vs, micro, iteration, peer in chosen:
        lane = next((i for i, free in enumerate(lane_ends) if free <= start_ns), len(lane_ends))
        if lane == len(lane_ends):
            lane_ends.append(end_ns)
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": f"{BACKGROUND_THREAD} {lane}",
                        "args": {"name": f"{BACKGROUND_THREAD} {lane}"}})
        lane_ends[lane] = end_ns
        out.append({"ph": "X", "cat": "user_annotation", "name": f"distsim:{name}" if phase == "send" else
                    "mpi4py:allreduce", "pid": pid, "tid": f"{BACKGROUND_THREAD} {lane}",
                    "ts": (start_ns + wall_minus_perf - base_ns) / 1e3, "dur": (end_ns - start_ns) / 1e3,
                    "args": {"iteration": iteration, "virtual_stage": vs, "micro": micro, "peer": peer,
                             "event_id": event_id, "row": name}})
    return out


def write_profiler_trace(profiler, path: Path, rows: Sequence[tuple], first_iteration: int,
                         mpi_buckets: bool) -> Path:
    """Stop the profiler, export its trace to `path` and add the background communications to it (gradient
    buckets too with `mpi_buckets`: gloo's thread shows its own)."""
    profiler.stop()
    profiler.export_chrome_trace(str(path))
    with open(path) as f:
        trace = json.load(f)
    base_ns = int(trace.get("baseTimeNanoseconds", 0))
    pid = os.getpid()
    events = trace.setdefault("traceEvents", [])
    events.extend(background_events(rows, first_iteration, base_ns, pid, mpi_buckets))
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w") as f:
        json.dump(trace, f)
    temporary.replace(path)
    return path
