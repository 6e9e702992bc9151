"""Measuring this machine's device (one CUDA GPU, else this CPU with torch) for a description in the format of
harness.plan.device, its curves fitted by harness.plan.device_fit: what `python -m harness device` runs.

Rules:
- every kernel is described as harness.plan.kernels describes a layer's (Gemm, Attention, MemoryBound), so the
  device model costs exactly what was measured; shapes are drawn log-uniformly from a seed within the ranges of
  the device's kind (SCALES: a CPU's are the sizes of the jobs that run on it here, a GPU's those of real jobs);
- every kernel runs `warmup` untimed rounds, then `repeats` timed ones; each round times every kernel once, one
  after another (interleaved, so that the machine's drift over the run falls on every kernel alike); a kernel's
  figure is the median of its samples. Timing: CUDA events on a GPU, perf_counter_ns on a CPU
  (harness.profile.timer.time_region);
- peaks: the matrix peak of a dtype is the best FLOP/s of its GEMMs; the vector peak the best of an elementwise
  multiply-add (2 FLOPs an element) on a tensor that fits in cache, VECTOR_LOOP of them a sample; the memory
  bandwidth the best bytes/s of the memory-bound kernels; a launch the time of a tiny elementwise kernel with
  autograd recording, as a training pass issues it (LAUNCH_LOOP of them a sample). On a GPU that loop is timed
  with the GPU held busy while the host issues it (timer.time_issued): the events give the device's time a
  launch (`launch_us`), the host's clock its issue time (`[host] kernel_issue_us`); on a CPU the host is the
  device, and a kernel in a training pass costs the framework's time around it too (nn.Module calls, autograd's
  graph and its engine, the views between kernels): `launch_us` is then taken from tiny built-in blocks
  (FRAMEWORK_FAMILIES, FRAMEWORK_SIZES) run forward and backward as a pass runs them, their time beyond their
  kernels' modelled work over the launches harness.plan.kernels lists for them (at least the bare launch; the
  curves are fitted with the bare launch, as their kernels ran bare), and no `[host]` is written;
- a dtype the device cannot run (the kernel raises) takes float32's peaks, and the description says so.
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from harness.common.errors import UserError
from harness.common.progress import Progress
from harness.plan.device import REQUIRED_DTYPES, Curve, DeviceDescription
from harness.plan.device_fit import Observation, curve_of, error_summary, fit_description, kernel_seconds
from harness.plan.kernels import Attention, Gemm, Kernel, MemoryBound, PassShape, layer_kernels
from harness.plan.layers import describe_builtin
from harness.plan.spec import DTYPES, ModelSpec
from harness.profile.timer import can_time_issued, synchronize, time_issued, time_region

FIT_SEED = 43  # the fit's shapes; a held-out set draws from another seed and leaves these out
LAUNCH_LOOP = 50
LEAD_S = 0.02  # on a GPU: how long a spin kernel holds it while the host issues a launch sample
VECTOR_LOOP = 20  # multiply-adds a vector sample runs back to back (its tensors stay in cache)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# memory-bound kernels: bytes moved per element in units of the dtype's size, as harness.plan.kernels counts them
MEMORY_OPS = {"add": 3, "gelu": 2, "layer_norm": 2, "copy": 2, "gelu_backward": 3}
MEMORY_WIDTH = 256  # a memory-bound kernel's tensor is (rows, MEMORY_WIDTH)
# on a CPU, the blocks a training pass's per-kernel framework time is measured on: small enough that their kernels'
# own work is a small part of their time, within the fitted kernels' smallest sizes (no curve extrapolated)
FRAMEWORK_FAMILIES = ("gpt2", "bert", "llama")
FRAMEWORK_SIZES = {"hidden": 64, "heads": 2, "ffn": 128, "seq_len": 32, "vocab": 64, "micro": 1}


@dataclass(frozen=True)
class Scale:
    """The shapes a device kind is measured at: ranges drawn log-uniformly, FLOPs capped per kernel."""

    gemm_m: tuple[int, int]
    gemm_nk: tuple[int, int]
    gemm_max_flops: float
    peak_gemms: tuple[tuple[int, int, int], ...]  # large GEMMs for each dtype's peak (quick: the first)
    attention_batch: tuple[int, int]
    attention_heads: tuple[int, int]
    attention_seq: tuple[int, int]
    head_dims: tuple[int, ...]
    attention_max_flops: float
    memory_rows: tuple[int, int]
    vector_elements: int


SCALES = {
    "cpu": Scale(gemm_m=(16, 1024), gemm_nk=(32, 4096), gemm_max_flops=1.5e9,
                 peak_gemms=((256, 256, 256), (512, 512, 512)),
                 attention_batch=(1, 4), attention_heads=(1, 8), attention_seq=(32, 512), head_dims=(16, 32, 64),
                 attention_max_flops=6e8, memory_rows=(4, 32768), vector_elements=1 << 14),
    "cuda": Scale(gemm_m=(128, 16384), gemm_nk=(128, 16384), gemm_max_flops=2e12,
                  peak_gemms=((4096, 4096, 4096), (8192, 8192, 8192)),
                  attention_batch=(1, 8), attention_heads=(8, 32), attention_seq=(256, 8192), head_dims=(64, 128),
                  attention_max_flops=5e12, memory_rows=(256, 1 << 20), vector_elements=1 << 26),
}


@dataclass(frozen=True)
class Counts:
    """How many shapes of each kind a set draws: GEMMs, fused attentions (each forward and backward),
    materialised attentions (each forward and backward), memory-bound kernels."""

    gemm: int
    sdpa: int
    materialized: int
    memory: int


FULL = Counts(gemm=24, sdpa=8, materialized=5, memory=15)
QUICK = Counts(gemm=6, sdpa=2, materialized=1, memory=5)


@dataclass
class Calibration:
    """A measured and fitted description, with what it was fitted on."""

    description: DeviceDescription
    observations: list[Observation]
    dtype: str
    repeats: int
    warmup: int
    unsupported: list[str] = field(default_factory=list)
    seconds: float = 0.0
    held_out: list[Observation] = field(default_factory=list)  # measured in the same rounds, not fitted on
    bare_launch_s: float = 0.0  # a bare operator's launch (the curves' fit's); launch_s beside it on a CPU
    framework_blocks: dict[str, float] = field(default_factory=dict)  # family -> seconds a kernel (CPU)

    def bare(self) -> DeviceDescription:
        """The description with the bare launch: what a kernel run alone (a held-out one) takes."""
        return dataclasses.replace(self.description, launch_s=self.bare_launch_s or self.description.launch_s)

    def fit_errors(self) -> dict[str, dict[str, float]]:
        return error_summary(self.bare(), self.observations)


def pick_device(choice: str) -> torch.device:
    """auto: the current CUDA device if there is one, else the CPU; cpu; cuda (UserError without one)."""
    if choice not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {choice!r}: give auto, cpu or cuda")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no CUDA device here; use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def runs_dtype(device: torch.device, dtype: str) -> bool:
    """Whether `device` runs a small GEMM in `dtype` (some CPUs' torch builds lack a 16-bit kernel)."""
    try:
        a = torch.ones(8, 8, dtype=TORCH_DTYPES[dtype], device=device)
        torch.mm(a, a)
        synchronize(device)
        return True
    except RuntimeError:
        return False


def _log_uniform(rng: np.random.Generator, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def draw_kernels(kind: str, dtype: str, counts: Counts, seed: int, exclude: Sequence[Kernel] = ()) -> list[Kernel]:
    """Kernels of `counts` shapes for a device kind (SCALES), drawn from `seed`, none of `exclude`: GEMMs, fused
    attention forward and backward (causal), materialised attention forward and backward (of GEMMs and each
    attention kind the first is the range's smallest, unless excluded, so that a fitted curve does not
    extrapolate below its sizes), memory-bound kernels of MEMORY_OPS in turn."""
    scale, rng, left_out = SCALES[kind], np.random.default_rng(seed), set(exclude)
    out: list[Kernel] = []

    def take(kernel: Kernel) -> bool:
        if kernel in left_out or kernel in out:
            return False
        out.append(kernel)
        return True

    corner = Gemm("gemm", scale.gemm_m[0], scale.gemm_nk[0], scale.gemm_nk[0], dtype)  # the smallest GEMM drawn
    drawn = 1 if counts.gemm and take(corner) else 0
    while drawn < counts.gemm:
        m, n, k = _log_uniform(rng, *scale.gemm_m), _log_uniform(rng, *scale.gemm_nk), _log_uniform(rng, *scale.gemm_nk)
        gemm = Gemm("gemm", m, n, k, dtype)
        if gemm.flops <= scale.gemm_max_flops and take(gemm):
            drawn += 1
    for kernel_kind, count in (("sdpa", counts.sdpa), ("materialized", counts.materialized)):
        drawn, smallest = 0, (scale.attention_batch[0], scale.attention_heads[0], scale.attention_seq[0],
                              scale.head_dims[0])
        while drawn < count:
            if smallest is not None:  # the range's smallest first, as for GEMMs
                (batch, heads, seq, head_dim), smallest = smallest, None
            else:
                batch, heads = _log_uniform(rng, *scale.attention_batch), _log_uniform(rng, *scale.attention_heads)
                seq, head_dim = _log_uniform(rng, *scale.attention_seq), int(rng.choice(scale.head_dims))
            forward = Attention("attention", kernel_kind, batch, heads, seq, seq, head_dim, dtype,
                                launches=3 if kernel_kind == "materialized" else 1)
            if forward.flops > scale.attention_max_flops or forward in left_out or forward in out:
                continue
            out += [forward, Attention("attention.grad", kernel_kind, batch, heads, seq, seq, head_dim, dtype,
                                       backward=True, launches=5 if kernel_kind == "materialized" else 1)]
            drawn += 1
    ops, drawn = list(MEMORY_OPS), 0
    while drawn < counts.memory:
        op = ops[drawn % len(ops)]
        rows = _log_uniform(rng, *scale.memory_rows)
        if take(MemoryBound(op, float(MEMORY_OPS[op] * rows * MEMORY_WIDTH * DTYPES[dtype]), dtype)):
            drawn += 1
    return out


def peak_kernels(kind: str, dtypes: Sequence[str], quick: bool) -> list[Gemm]:
    """The large GEMMs each dtype's matrix peak is taken from (quick: the first shape only)."""
    shapes = SCALES[kind].peak_gemms[:1] if quick else SCALES[kind].peak_gemms
    return [Gemm("peak", m, n, k, dtype) for dtype in dtypes for m, n, k in shapes]


def _runner(kernel: Kernel, device: torch.device) -> Callable[[], object]:
    """A closure that runs `kernel` once on `device`, its tensors made here (random normal)."""
    dtype = TORCH_DTYPES[kernel.dtype]

    def randn(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=grad)

    if isinstance(kernel, Gemm):
        a, b = randn(kernel.m, kernel.k), randn(kernel.k, kernel.n)
        return lambda: torch.mm(a, b)
    if isinstance(kernel, Attention):
        backward = kernel.backward
        shape = (kernel.batch, kernel.heads, kernel.q_len, kernel.head_dim)
        q, k, v = (randn(*shape, grad=backward) for _ in range(3))
        if kernel.kind == "sdpa":
            def forward():
                return F.scaled_dot_product_attention(q, k, v, is_causal=kernel.causal)
        else:
            rows, scale = kernel.batch * kernel.heads, 1.0 / math.sqrt(kernel.head_dim)
            bias = torch.full((kernel.q_len, kernel.kv_len), float("-inf"), dtype=dtype, device=device).triu(1)

            def forward():  # Megatron-LM's older core: baddbmm (scaled scores, masked), softmax, bmm
                q3, k3, v3 = (t.reshape(rows, -1, kernel.head_dim) for t in (q, k, v))
                scores = torch.baddbmm(bias.expand(rows, -1, -1), q3, k3.transpose(1, 2), alpha=scale)
                return torch.bmm(torch.softmax(scores, dim=-1), v3)
        if not backward:
            return forward
        out = forward()
        grad = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    if isinstance(kernel, MemoryBound):
        rows = round(kernel.bytes / (MEMORY_OPS[kernel.name] * MEMORY_WIDTH * DTYPES[kernel.dtype]))
        x, y = randn(rows, MEMORY_WIDTH), randn(rows, MEMORY_WIDTH)
        return {"add": lambda: x + y, "gelu": lambda: F.gelu(x), "copy": lambda: x.clone(),
                "layer_norm": lambda: F.layer_norm(x, (MEMORY_WIDTH,)),
                "gelu_backward": lambda: torch.ops.aten.gelu_backward(y, x)}[kernel.name]
    raise TypeError(f"not a kernel: {kernel!r}")


def framework_block(family: str, dtype: str, device: torch.device) -> tuple[Callable[[], object], list[Kernel]]:
    """A tiny built-in block of `family` (FRAMEWORK_SIZES) as a training pass runs it, forward and backward
    through nn.Module and autograd: (a closure that runs it once, the kernels harness.plan.kernels lists for
    that pass)."""
    from harness.models.transformer import build_layer

    sizes = FRAMEWORK_SIZES
    model = ModelSpec(name=f"{family}-framework", family=family, layers=1, hidden=sizes["hidden"],
                      heads=sizes["heads"], kv_heads=1 if family == "llama" else sizes["heads"], ffn=sizes["ffn"],
                      seq_len=sizes["seq_len"], vocab=sizes["vocab"], dtype=dtype)
    block = build_layer(model, "block").to(device)
    desc = next(layer for layer in describe_builtin(model, 1) if layer.kind == "block")
    shape = PassShape(micro=sizes["micro"], seq=sizes["seq_len"])
    kernels = layer_kernels(desc, shape, "fwd") + layer_kernels(desc, shape, "bwd")
    x = torch.randn(sizes["micro"], sizes["seq_len"], sizes["hidden"], dtype=TORCH_DTYPES[dtype], device=device,
                    requires_grad=True)

    def run():
        out = block(x)
        out.backward(torch.ones_like(out))
        return out
    return run, kernels


def framework_launch(description: DeviceDescription, blocks: Sequence[tuple[list[Kernel], float]]) -> list[float]:
    """Per block (kernels, measured seconds), its seconds a launch beyond its kernels' modelled work on
    `description` (launches costed 0): a list in the blocks' order."""
    workless = dataclasses.replace(description, launch_s=0.0)
    return [(seconds - sum(kernel_seconds(workless, k) for k in kernels)) / sum(k.launches for k in kernels)
            for kernels, seconds in blocks]


def _launch_runner(device: torch.device) -> Callable[[], object]:
    x = torch.ones(1, device=device, requires_grad=True)
    y = torch.ones(1, device=device)

    def run():
        for _ in range(LAUNCH_LOOP):
            out = x + y
        return out
    return run


def _vector_runner(device: torch.device, dtype: str, elements: int) -> Callable[[], object]:
    x, y, z, out = (torch.rand(elements, dtype=TORCH_DTYPES[dtype], device=device) for _ in range(4))

    def run():
        for _ in range(VECTOR_LOOP):
            torch.addcmul(x, y, z, out=out)
        return out
    return run


def measure_launch_on_gpu(device: torch.device, repeats: int, warmup: int) -> tuple[float, float]:
    """(device seconds, host seconds) of one launch on a GPU: LAUNCH_LOOP tiny kernels issued while the GPU is
    held busy (timer.time_issued), medians of the samples in which the host stayed ahead (all, if none did)."""
    run = _launch_runner(device)
    samples = [time_issued(run, device, LEAD_S) for _ in range(warmup + repeats)][warmup:]
    ahead = [s for s in samples if s.ahead] or samples
    return (float(np.median([s.device_s for s in ahead])) / LAUNCH_LOOP,
            float(np.median([s.host_s for s in ahead])) / LAUNCH_LOOP)


def measure(runners: Sequence[Callable[[], object]], device: torch.device, repeats: int, warmup: int,
            progress: Progress | None = None) -> list[float]:
    """Each runner's median seconds over `repeats` interleaved rounds after `warmup` untimed ones (module
    docstring); `progress` advances once a round per runner."""
    samples: list[list[float]] = [[] for _ in runners]
    for round_index in range(warmup + repeats):
        for index, run in enumerate(runners):
            seconds = time_region(run, device)
            if round_index >= warmup:
                samples[index].append(seconds)
            if progress is not None:
                progress.advance()
    return [float(np.median(s)) for s in samples]


def measure_kernels(kernels: Sequence[Kernel], device: torch.device, repeats: int, warmup: int,
                    progress: Progress | None = None) -> list[Observation]:
    """Each kernel measured (measure) as an Observation of the curve that costs it."""
    torch.manual_seed(0)
    seconds = measure([_runner(k, device) for k in kernels], device, repeats, warmup, progress)
    return [Observation(curve_of(k), k, s) for k, s in zip(kernels, seconds)]


def describe_machine(device: torch.device) -> tuple[str, float]:
    """(title, memory in GB) of `device`: the GPU's name and memory, or the CPU's model name and this machine's
    memory."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, props.total_memory / 1e9
    title = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                title = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 if hasattr(os, "sysconf") else 1.0
    return f"{title} (CPU, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''})", memory


def calibrate(device: torch.device, dtype: str, repeats: int, quick: bool, name: str, warmup: int = 2,
              show_progress: bool = True, held_out: Sequence[Kernel] = ()) -> Calibration:
    """Measure `device` (module docstring) and fit a description of it named `name`, its curves in `dtype`.
    `held_out`: kernels measured in the same rounds (the same minutes of the machine) but not fitted on, returned
    as Calibration.held_out (bench/device_model.py sets them against the description)."""
    started = time.monotonic()
    kind = device.type if device.type in SCALES else "cpu"
    unsupported = [d for d in REQUIRED_DTYPES if not runs_dtype(device, d)]
    if dtype in unsupported:
        raise UserError(f"--dtype {dtype}: this device ({device}) cannot run a {dtype} GEMM; use "
                        f"{', '.join(d for d in REQUIRED_DTYPES if d not in unsupported)}")
    runnable = [d for d in REQUIRED_DTYPES if d not in unsupported]
    fit_set = draw_kernels(kind, dtype, QUICK if quick else FULL, FIT_SEED)
    peaks = peak_kernels(kind, runnable, quick)
    scale = SCALES[kind]
    torch.manual_seed(0)
    runners = [_launch_runner(device)] + [_vector_runner(device, d, scale.vector_elements) for d in runnable]
    blocks = [framework_block(family, dtype, device) for family in FRAMEWORK_FAMILIES] if kind == "cpu" else []
    runners += [run for run, _ in blocks]
    runners += [_runner(k, device) for k in [*fit_set, *peaks, *held_out]]
    progress = Progress(f"device {device}", len(runners) * (warmup + repeats), enabled=show_progress, unit="sample")
    try:
        seconds = measure(runners, device, repeats, warmup, progress)
    finally:
        progress.close()
    launch_s, issue_s = seconds[0] / LAUNCH_LOOP, 0.0
    if device.type == "cuda" and can_time_issued(device):
        launch_s, issue_s = measure_launch_on_gpu(device, repeats, warmup)
    vector = {d: 2.0 * scale.vector_elements * VECTOR_LOOP / s for d, s in zip(runnable, seconds[1:1 + len(runnable)])}
    block_seconds = seconds[1 + len(runnable):1 + len(runnable) + len(blocks)]
    timed = seconds[1 + len(runnable) + len(blocks):]
    observations = [Observation(curve_of(k), k, s) for k, s in zip(fit_set, timed)]
    peak_seconds = timed[len(fit_set):len(fit_set) + len(peaks)]
    held_out_observations = [Observation(curve_of(k), k, s)
                             for k, s in zip(held_out, timed[len(fit_set) + len(peaks):])]
    matrix = {d: max([p.flops / s for p, s in zip(peaks, peak_seconds) if p.dtype == d]
                     + [o.kernel.flops / o.seconds for o in observations if o.curve == "gemm" and d == dtype])
              for d in runnable}
    observations += [Observation("gemm", p, s) for p, s in zip(peaks, peak_seconds) if p.dtype == dtype]
    bandwidth = max(o.kernel.bytes / o.seconds for o in observations if o.curve == "memory")
    for missing in unsupported:
        matrix[missing], vector[missing] = matrix["float32"], vector["float32"]
    title, memory_gb = describe_machine(device)
    flat = {curve: Curve(max_fraction=1.0, half_at=0.0) for curve in
            ("gemm", "sdpa_forward", "sdpa_backward", "materialized_attention", "memory")}
    start = DeviceDescription(name=name, title=title, memory_gb=memory_gb, memory_bandwidth=bandwidth,
                              matrix_peak={d: matrix[d] for d in REQUIRED_DTYPES},
                              vector_peak={d: vector[d] for d in REQUIRED_DTYPES}, launch_s=launch_s, curves=flat,
                              fitted=True, fitted_on="", kernel_issue_s=issue_s)
    fitted = fit_description(start, observations)
    framework = {}
    if blocks:  # a CPU: a kernel in a pass costs the framework's time around it too (module docstring)
        per_launch = framework_launch(fitted, [(kernels, s) for (_, kernels), s in zip(blocks, block_seconds)])
        framework = dict(zip(FRAMEWORK_FAMILIES, per_launch))
        fitted = dataclasses.replace(fitted, launch_s=max(launch_s, float(np.median(per_launch))))
    calibration = Calibration(fitted, observations, dtype, repeats, warmup, unsupported,
                              held_out=held_out_observations, bare_launch_s=launch_s, framework_blocks=framework)
    calibration.description = _with_note(calibration, kind, quick)
    calibration.seconds = time.monotonic() - started
    return calibration


def _with_note(calibration: Calibration, kind: str, quick: bool) -> DeviceDescription:
    """The description with `fitted_on`: what was measured (kernels and their ranges, repeats, date)."""
    scale, obs = SCALES[kind], calibration.observations
    count = {curve: sum(o.curve == curve for o in obs) for curve in
             ("gemm", "sdpa_forward", "sdpa_backward", "materialized_attention", "memory")}
    note = (f"harness device {time.strftime('%Y-%m-%d %H:%M')}{' --quick' if quick else ''}, torch "
            f"{torch.__version__}: curves in {calibration.dtype} on {count['gemm']} GEMMs (m {scale.gemm_m[0]}-"
            f"{scale.gemm_m[1]}, n and k {scale.gemm_nk[0]}-{scale.gemm_nk[1]}), {count['sdpa_forward']} fused "
            f"attentions forward and backward and {count['materialized_attention']} materialised ones (seq "
            f"{scale.attention_seq[0]}-{scale.attention_seq[1]}), {count['memory']} memory-bound kernels "
            f"({', '.join(MEMORY_OPS)}); medians of {calibration.repeats} interleaved repeats after "
            f"{calibration.warmup} warm-up; peaks the best measured"
            + (f"; launch_us the framework's time a kernel in tiny {', '.join(FRAMEWORK_FAMILIES)} blocks' "
               f"forward and backward ({', '.join(f'{v * 1e6:.1f}' for v in calibration.framework_blocks.values())}"
               f" us; their median), a bare operator's {calibration.bare_launch_s * 1e6:.2f} us"
               if calibration.framework_blocks else "")
            + (f"; {', '.join(calibration.unsupported)} not run here: float32's peaks" if calibration.unsupported
               else ""))
    return dataclasses.replace(calibration.description, fitted_on=note)


def observation_rows(calibration: Calibration) -> list[dict[str, Any]]:
    """Each measured kernel: its curve, shape, measured and modelled seconds (the --json rows)."""
    rows = []
    for o in calibration.observations:
        modelled = kernel_seconds(calibration.bare(), o.kernel)
        rows.append({"curve": o.curve, "kernel": kernel_fields(o.kernel), "flops": o.kernel.flops,
                     "bytes": o.kernel.bytes, "measured_s": o.seconds, "modelled_s": modelled,
                     "error_pct": (modelled / o.seconds - 1) * 100})
    return rows


def kernel_fields(kernel: Kernel) -> dict[str, Any]:
    """A kernel as plain data: its type and fields."""
    return {"type": type(kernel).__name__, **dataclasses.asdict(kernel)}
