"""Fitting a device description's efficiency curves (harness.plan.device.Curve) to measured kernels.

What `python -m harness device` (harness.profile.device_curves measures, this module fits) and bench/device_model.py
use. Pure Python and numpy. Rules:

- a kernel's modelled seconds are the device model's roofline, written here (kernel_time) because the harness may
  not import the analysis, which costs by it (analysis.device_model): launches x launch_s plus the longer
  of compute (executed FLOPs, harness.plan.kernels.Attention.executed_flops for an attention, over the unit's
  peak x the curve's fraction) and memory (bytes over the bandwidth x the memory curve's fraction);
- a curve is fitted by least squares of log(modelled / measured) over its kernels, every other part of the
  description held fixed, by Nelder-Mead from several starts; max_fraction is kept in (0, 1], steepness in
  [STEEPNESS_RANGE], half_at and half_dim above 0; a curve with fewer than FREE_SHAPE_AT kernels fits
  max_fraction and half_at alone (steepness 1, no half_dim);
- the order is the dependency order: memory (which every kernel's memory side uses), then each memory-bound
  kind's vector operations an element (fit_vector_ops), then gemm, then the attention curves. The memory curve is
  fitted on the bandwidth kinds alone (BANDWIDTH_KINDS: copy, add, fill, and kernels of no kind), whose time is
  their bytes; a kind bound by its arithmetic (GELU's erf, a norm's reductions on a CPU core) would bend it;
- a kind's vector operations an element ([vector_ops], format 2) are the least-squares slope of its kernels'
  seconds (less launches x launch_s) over their elements x the vector peak in its dtype (at least 0; one kernel:
  its seconds over its elements): the operations an element that make the roofline's compute side its measured
  time, a fixed time a call left out. The device model then costs a kernel of that kind as the longer of those
  operations at the vector peak and its bytes on the memory curve.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from harness.plan.device import FIGURE_RANGE, OPTIMIZER_KINDS, Curve, DeviceDescription
from harness.plan.kernels import Attention, Gemm, Kernel, MemoryBound
from harness.plan.spec import DTYPES

# above 1, size / fraction(size) falls as size grows: a smaller kernel would take longer than a larger one
STEEPNESS_RANGE = (0.25, 1.0)
FREE_SHAPE_AT = 6  # kernels a curve needs before its steepness (and a GEMM's half_dim) is fitted; fewer: 1 and 0
FIT_ORDER = ("memory", "gemm", "sdpa_forward", "sdpa_backward", "materialized_attention")
BANDWIDTH_KINDS = ("copy", "add", "fill")  # memory-bound kinds that fit the memory curve (their time: their bytes)


@dataclass(frozen=True)
class Observation:
    """One measured kernel: the harness.plan.kernels description the model costs, and its median seconds."""

    curve: str  # the curve it informs (harness.plan.device.CURVES)
    kernel: Kernel
    seconds: float


def curve_of(kernel: Kernel) -> str:
    """The efficiency curve that costs `kernel` (harness.plan.device.CURVES)."""
    if isinstance(kernel, Gemm):
        return "gemm"
    if isinstance(kernel, Attention):
        if kernel.kind == "materialized":
            return "materialized_attention"
        return "sdpa_backward" if kernel.backward else "sdpa_forward"
    return "optimizer" if kernel.op in OPTIMIZER_KINDS else "memory"


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


def kernel_time(device: DeviceDescription, kernel: Kernel) -> KernelTime:
    """`kernel`'s compute, memory and launch seconds on `device`: the device model's roofline
    (analysis.device_model's module docstring), written once here for the harness's fit and the analysis."""
    curves = device.curves
    if isinstance(kernel, Gemm):
        peak, executed = device.matrix_peak[kernel.dtype], kernel.flops
        fraction = curves["gemm"].fraction(kernel.flops, min(kernel.m, kernel.n, kernel.k))
    elif isinstance(kernel, Attention):
        peak = device.matrix_peak[kernel.dtype]
        executed = kernel.executed_flops(device.causal_tile)
        fraction = curves[curve_of(kernel)].fraction(kernel.flops)
    elif isinstance(kernel, MemoryBound):
        if kernel.op in device.optimizer and kernel.tensors:
            return optimizer_time(device, kernel)
        peak, fraction, executed = device.vector_peak[kernel.dtype], 1.0, kernel.flops
        if kernel.op in device.vector_ops:
            executed = kernel.elements * device.vector_ops[kernel.op]
    else:
        raise TypeError(f"not a kernel: {kernel!r}")
    compute = executed / (peak * fraction) if executed > 0 else 0.0
    return KernelTime(compute, memory_seconds(device, kernel.bytes), device.kernel_launches(kernel) * device.launch_s)


def kernel_seconds(device: DeviceDescription, kernel: Kernel) -> float:
    """`kernel`'s seconds on `device` (kernel_time's)."""
    return kernel_time(device, kernel).seconds


def memory_seconds(device: DeviceDescription, nbytes: float) -> float:
    """One kernel's `nbytes` over the bandwidth x the memory curve's fraction at them."""
    return nbytes / (device.memory_bandwidth * device.curves["memory"].fraction(nbytes)) if nbytes > 0 else 0.0


def optimizer_time(device: DeviceDescription, kernel: MemoryBound) -> KernelTime:
    """An optimizer step on a description with its [optimizer.NAME]: T tensors (kernel.tensors, runs of (elements,
    count)) of P parameters launch kernels_per_step + kernels_per_tensor x T kernels, each kernel_s beyond its bytes,
    and move P x bytes_per_parameter (counted on float32 parameters: scaled to the step's dtype) at the optimizer's
    measured bandwidth."""
    cost = device.optimizer[kernel.op]
    params = sum(elements * count for elements, count in kernel.tensors)
    nbytes = params * cost.bytes_per_parameter * DTYPES[kernel.dtype] / DTYPES["float32"]
    return KernelTime(0.0, nbytes / cost.bandwidth, launched(device, kernel) * cost.kernel_s)


def launched(device: DeviceDescription, kernel: Kernel) -> float:
    """The kernels the framework launches for `kernel`: an optimizer step's by its [optimizer.NAME]
    (optimizer_time), any other's by its listing and [launches]."""
    cost = device.optimizer.get(getattr(kernel, "op", ""))
    if cost is not None and isinstance(kernel, MemoryBound) and kernel.tensors:
        return cost.kernels_per_step + cost.kernels_per_tensor * sum(count for _, count in kernel.tensors)
    return device.kernel_launches(kernel)


def log_errors(device: DeviceDescription, observations: Sequence[Observation]) -> np.ndarray:
    """log(modelled / measured) of each observation."""
    return np.array([math.log(kernel_seconds(device, o.kernel) / o.seconds) for o in observations])


def relative_errors(device: DeviceDescription, observations: Sequence[Observation]) -> list[float]:
    """modelled / measured - 1 of each observation."""
    return [kernel_seconds(device, o.kernel) / o.seconds - 1 for o in observations]


def _curve_from(params: np.ndarray, with_dim: bool) -> Curve:
    """A curve from the fit's unconstrained parameters: max_fraction, half_at, [steepness, [half_dim]] (a
    steepness left out is 1)."""
    fraction = 1.0 / (1.0 + math.exp(-float(np.clip(params[0], -30, 30))))
    low, high = STEEPNESS_RANGE
    share = 1.0 / (1.0 + math.exp(-float(np.clip(params[2], -30, 30)))) if len(params) > 2 else 0.5
    steepness = low * (high / low) ** share if len(params) > 2 else 1.0  # smooth within the range
    half_dim = math.exp(float(np.clip(params[3], -10, 12))) if with_dim and len(params) > 3 else 0.0
    # half_at no higher than a description may say (FIGURE_RANGE): a fit that never saturates writes a file read back
    half_at = min(FIGURE_RANGE[1], math.exp(float(np.clip(params[1], -50, math.log(FIGURE_RANGE[1])))))
    return Curve(max_fraction=fraction, half_at=half_at, steepness=steepness,
                 half_dim=half_dim)


def fit_curve(device: DeviceDescription, name: str, observations: Sequence[Observation]) -> Curve:
    """The curve `name` of `device` that best explains `observations` (module docstring), the rest held fixed."""
    if not observations:
        raise ValueError(f"no measured kernels to fit the {name} curve on")
    with_dim = name == "gemm"
    free = 2 if len(observations) < FREE_SHAPE_AT else (4 if with_dim else 3)
    sizes = np.array([o.kernel.bytes if name == "memory" else o.kernel.flops for o in observations])

    def loss(params: np.ndarray) -> float:
        trial = dataclasses.replace(device, curves={**device.curves, name: _curve_from(params, with_dim)})
        return float(np.sum(log_errors(trial, observations) ** 2))

    middle = math.log(float(np.median(sizes)))
    starts = [[2.0, middle, 0.0, math.log(16.0)], [0.0, middle - 3, -1.5, math.log(4.0)],
              [4.0, math.log(float(sizes.min())), 1.5, math.log(64.0)], [1.0, middle + 2, -0.5, math.log(1.0)]]
    best = min((nelder_mead(loss, np.array(start[:free])) for start in starts), key=lambda r: r[1])
    return _curve_from(best[0], with_dim)


def nelder_mead(loss: Callable[[np.ndarray], float], start: np.ndarray, step: float = 1.0, iterations: int = 600,
                tolerance: float = 1e-10) -> tuple[np.ndarray, float]:
    """(argmin, min) of `loss` by the Nelder-Mead simplex from `start` (standard coefficients)."""
    dims = len(start)
    simplex = [start.astype(float)] + [start + step * np.eye(dims)[i] for i in range(dims)]
    values = [loss(point) for point in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] <= tolerance:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        value = loss(reflected)
        if values[0] <= value < values[-2]:
            simplex[-1], values[-1] = reflected, value
            continue
        if value < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            expanded_value = loss(expanded)
            simplex[-1], values[-1] = (expanded, expanded_value) if expanded_value < value else (reflected, value)
            continue
        contracted = centroid + 0.5 * (simplex[-1] - centroid)
        contracted_value = loss(contracted)
        if contracted_value < values[-1]:
            simplex[-1], values[-1] = contracted, contracted_value
            continue
        simplex = [simplex[0]] + [simplex[0] + 0.5 * (point - simplex[0]) for point in simplex[1:]]
        values = [values[0]] + [loss(point) for point in simplex[1:]]
    index = int(np.argmin(values))
    return simplex[index], values[index]


def fit_description(device: DeviceDescription, observations: Sequence[Observation]) -> DeviceDescription:
    """`device` with every curve that has observations fitted to them, in FIT_ORDER; a curve without any keeps
    its value."""
    for name in FIT_ORDER:
        mine = [o for o in observations if o.curve == name]
        if name == "memory":
            mine = [o for o in mine if o.kernel.op in BANDWIDTH_KINDS or not o.kernel.op]
        if mine:
            device = dataclasses.replace(device, curves={**device.curves, name: fit_curve(device, name, mine)})
        if name == "memory":
            ops = fit_vector_ops(device, observations)
            if ops:
                device = dataclasses.replace(device, vector_ops=ops)
    return device


def fit_vector_ops(device: DeviceDescription, observations: Sequence[Observation]) -> dict[str, float]:
    """Each measured memory-bound kind's vector operations an element (module docstring): the kinds other than
    the bandwidth ones among `observations`, in first-seen order."""
    kinds: dict[str, list[tuple[float, float, str]]] = {}
    for o in observations:
        kernel = o.kernel
        if isinstance(kernel, MemoryBound) and kernel.op and kernel.op not in BANDWIDTH_KINDS \
                and o.curve == "memory" and kernel.elements > 0:
            work = o.seconds - device.kernel_launches(kernel) * device.launch_s
            kinds.setdefault(kernel.op, []).append((kernel.elements, work, kernel.dtype))
    return {op: vector_ops_of(points, device.vector_peak[points[0][2]]) for op, points in kinds.items()}


def vector_ops_of(points: Sequence[tuple[float, float, str]], peak: float) -> float:
    """One kind's vector operations an element from its kernels' (elements, seconds of work): the least-squares
    slope of seconds over elements where they have two sizes or more (a fixed time a call, beyond the launch,
    left out: autograd's, a module's), else the one kernel's seconds over its elements; x `peak` (FLOP/s), at
    least 0."""
    elements = np.array([p[0] for p in points])
    seconds = np.array([p[1] for p in points])
    if len(set(elements.tolist())) >= 2:
        slope = float(np.polyfit(elements, seconds, 1)[0])
    else:
        slope = float(np.mean(seconds / elements))
    return max(0.0, slope) * peak


def error_summary(device: DeviceDescription, observations: Sequence[Observation]) -> dict[str, dict[str, float]]:
    """Per curve: kernels, median and 90th percentile of |modelled / measured - 1| in %."""
    out = {}
    for name in (*FIT_ORDER, "optimizer"):
        errors = [abs(e) * 100 for e in relative_errors(device, [o for o in observations if o.curve == name])]
        if errors:
            out[name] = {"kernels": len(errors), "median_abs_error_pct": float(np.median(errors)),
                         "p90_abs_error_pct": float(np.percentile(errors, 90))}
    return out
