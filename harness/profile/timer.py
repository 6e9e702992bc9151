"""Timing one region on the CPU (perf_counter_ns) or a CUDA device (CUDA events)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch


def time_region(run: Callable[[], object], device: torch.device) -> float:
    """Seconds that `run()` takes on `device`: CUDA events around it on a GPU, perf_counter_ns on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = run()
        end.record()
        end.synchronize()
        del result
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter_ns()
    result = run()  # held: freeing a forward's graph is not part of the forward (training frees it in backward)
    seconds = (time.perf_counter_ns() - t0) / 1e9
    del result
    return seconds


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class IssuedSample(NamedTuple):
    """One GPU sample timed with the queue full: the device's time, the host's time to issue it, and whether
    the host finished issuing before the GPU reached the sample (else the device time holds launch gaps)."""

    device_s: float
    host_s: float
    ahead: bool


_SPIN_CYCLES_PER_S: dict[int, float] = {}


def can_time_issued(device: torch.device) -> bool:
    """Whether `time_issued` works here: a CUDA device and torch's spin kernel (torch.cuda._sleep)."""
    return device.type == "cuda" and hasattr(torch.cuda, "_sleep")


def _spin_cycles_per_s(device: torch.device) -> float:
    """Clock cycles of torch.cuda._sleep per second on `device`, measured once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SPIN_CYCLES_PER_S:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # the first launch loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SPIN_CYCLES_PER_S[index] = cycles / (start.elapsed_time(end) / 1e3)
    return _SPIN_CYCLES_PER_S[index]


def time_issued(run: Callable[[], object], device: torch.device, lead_s: float) -> IssuedSample:
    """Time `run()` on a GPU as a training loop runs it, with the host ahead of the device.

    A synchronized sample starts on an idle GPU whose kernels then wait for their own launches; in training
    the host issues a layer while the GPU still runs earlier work. So a spin kernel holds the GPU busy for
    `lead_s` while the host issues `run()`: the CUDA events then time the device's work alone, and the
    host's issue time is returned beside it (the analysis composes a step from both, docs/analysis.md).
    """
    torch.cuda.synchronize(device)
    torch.cuda._sleep(max(1, int(lead_s * _spin_cycles_per_s(device))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter_ns()
    result = run()  # held until the host time is read: freeing the graphs is not issuing
    host_s = (time.perf_counter_ns() - t0) / 1e9
    ahead = not start.query()  # the GPU is still spinning: every kernel of run() was queued before it began
    end.record()
    end.synchronize()
    del result
    return IssuedSample(start.elapsed_time(end) / 1e3, host_s, ahead)
