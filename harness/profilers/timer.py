"""Timing one region on the CPU (perf_counter_ns) or a CUDA device (CUDA events)."""
from __future__ import annotations

import time
from typing import Callable

import torch


def time_region(run: Callable[[], object], device: torch.device) -> float:
    """Seconds that `run()` takes on `device`: CUDA events around it on a GPU, perf_counter_ns on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter_ns()
    run()
    return (time.perf_counter_ns() - t0) / 1e9


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
