"""A compute event's duration from its kernels on a device described as data (harness.plan.device): a roofline
made honest by the description's efficiency curves (rules in docs/devices.md, "The device model").

Each kernel takes its launches x the launch time plus the longer of its compute time and its memory time:
- compute: its executed FLOPs over the peak of its unit in its dtype (matrix for GEMMs and attention, vector for
  memory-bound kernels) x the curve's fraction at its size (GEMMs by FLOPs and smallest dimension; fused attention
  by FLOPs, forward and backward apart; materialised attention by FLOPs; memory-bound kernels at the full vector
  peak). A causal fused attention executes half its counted FLOPs (the masked half is skipped);
- memory: its bytes over the HBM bandwidth x the memory curve's fraction at those bytes.
The host issues each kernel in the description's `[host] kernel_issue_us` (per launch): a compute event's issue
time (`issue_seconds`), which analysis.simulate plays against the device's time (Costs.host_issue).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from harness.plan.device import DeviceDescription, load_device
from harness.plan.kernels import Attention, Gemm, Kernel, MemoryBound


@dataclass(frozen=True)
class KernelTime:
    """One kernel's seconds, split: compute and memory time (the longer counts) and its launches'."""

    compute_s: float
    memory_s: float
    launch_s: float

    @property
    def seconds(self) -> float:
        return self.launch_s + max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        """compute | memory: which side of the roofline the kernel is on."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


class DeviceModel:
    """Seconds of kernels (harness.plan.kernels) on one described device."""

    def __init__(self, description: DeviceDescription):
        self.description = description

    @classmethod
    def named(cls, text: str) -> DeviceModel:
        """The model of `[cluster] device = TEXT`: a shipped name or a description's path (harness.plan.device)."""
        return cls(load_device(text))

    @property
    def name(self) -> str:
        return self.description.name

    def kernel_time(self, kernel: Kernel) -> KernelTime:
        """`kernel`'s compute, memory and launch seconds (module docstring)."""
        device = self.description
        curves = device.curves
        if isinstance(kernel, Gemm):
            peak = device.matrix_peak[kernel.dtype]
            fraction = curves["gemm"].fraction(kernel.flops, min(kernel.m, kernel.n, kernel.k))
            executed = kernel.flops
        elif isinstance(kernel, Attention):
            peak = device.matrix_peak[kernel.dtype]
            if kernel.kind == "materialized":
                curve, executed = curves["materialized_attention"], kernel.flops
            else:
                curve = curves["sdpa_backward" if kernel.backward else "sdpa_forward"]
                executed = kernel.flops / 2 if kernel.causal else kernel.flops
            fraction = curve.fraction(kernel.flops)
        elif isinstance(kernel, MemoryBound):
            peak, fraction, executed = device.vector_peak[kernel.dtype], 1.0, kernel.flops
        else:
            raise TypeError(f"not a kernel: {kernel!r}")
        compute = executed / (peak * fraction) if executed > 0 else 0.0
        bandwidth = device.memory_bandwidth * curves["memory"].fraction(kernel.bytes)
        memory = kernel.bytes / bandwidth if kernel.bytes > 0 else 0.0
        return KernelTime(compute, memory, kernel.launches * device.launch_s)

    def kernel_seconds(self, kernel: Kernel) -> float:
        return self.kernel_time(kernel).seconds

    def event_seconds(self, kernels: Iterable[Kernel]) -> float:
        """A compute event's seconds: its kernels', one after another."""
        return sum(self.kernel_seconds(kernel) for kernel in kernels)

    def issue_seconds(self, kernels: Iterable[Kernel]) -> float:
        """The host's seconds to issue a compute event's kernels: their launches x the description's
        kernel_issue_s (0 where the description gives none: the host keeps ahead)."""
        return sum(kernel.launches for kernel in kernels) * self.description.kernel_issue_s
