"""Measuring this machine's device (one CUDA GPU, else this CPU with torch) for a description in the format of
harness.plan.device, its curves fitted by harness.plan.device_fit: what `python -m harness device` runs.

Rules:
- every kernel is described as harness.plan.kernels describes a layer's (Gemm, Attention, MemoryBound), so the
  device model costs exactly what was measured; shapes are drawn log-uniformly from a seed within the ranges of
  the device's kind (SCALES: a CPU's are the sizes of the jobs that run on it here, a GPU's those of real jobs,
  their GEMM dimensions and attention lengths multiples of 64 as real models' are: on a GPU a bfloat16 GEMM of
  odd dimensions leaves the tensor cores' fast path and ran 3-5x slower on an H200);
- every kernel runs `warmup` untimed rounds, then `repeats` timed ones; each round times every kernel once, one
  after another (interleaved, so that the machine's drift over the run falls on every kernel alike); a kernel's
  figure is the median of its samples. Timing: perf_counter_ns on a CPU (harness.profile.timer.time_region);
  on a GPU CUDA events with the GPU held busy while the host issues (measure): the device's time alone;
- peaks: the matrix peak of a dtype is the best FLOP/s of its GEMMs; the vector peak the best of an elementwise
  multiply-add (2 FLOPs an element) on a tensor that fits in cache, VECTOR_LOOP of them a sample; the memory
  bandwidth the best bytes/s of the memory-bound kernels; a launch the time of a tiny elementwise kernel with
  autograd recording, as a training pass issues it (LAUNCH_LOOP of them a sample). On a GPU that loop is timed
  with the GPU held busy while the host issues it (timer.time_issued): the events give the device's time a
  launch (`launch_us`), the host's clock its issue time (`[host] kernel_issue_us`); on a CPU the host is the
  device, and a kernel in a training pass costs the framework's time around it too (nn.Module calls, autograd's
  graph and its engine, the views between kernels): `launch_us` is then taken from tiny built-in blocks
  (harness.profile.device_blocks) run forward and backward as a pass runs them, their time beyond their
  kernels' modelled work over the launches harness.plan.kernels lists for them (at least the bare launch; the
  curves are fitted with the bare launch, as their kernels ran bare), and no `[host]` is written. On a GPU the
  host issues a pass's kernels through the same framework: `kernel_issue_us` is the host's time a kernel of
  those blocks issued with the GPU held busy (at least the bare operator's issue);
- on a CPU, the same blocks run as a run wraps a layer (harness.profile.device_blocks: checkpoint, FSDP2 unit,
  split backward; [wrappers.NAME]); and an Adam step over FSDP2's sharded parameters (DTensors) against the plain
  step over the same tensors: its seconds a kernel more (`optimizer_kernel_us`, DTensor's dispatch);
- a dtype the device cannot run (the kernel raises) takes float32's peaks, and the description says so;
- memory-bound kernels of every kind harness.plan.kernels names (MemoryBound.op), as the models run them: the
  bandwidth kinds (BANDWIDTH_KINDS: copy, add, fill) fit the memory curve; every other kind (VECTOR_MEASURED: the
  norms, GELU, SwiGLU, dropout, rotary, the embedding's lookup, the loss, each forward and backward) gets the
  operations one call launches, counted by dispatch ([launches], format 2: count_kind_launches) and its
  vector operations an element ([vector_ops], format 2): the slope of its kernels' seconds over their elements
  (drawn from the range's two ends up) x the vector peak (harness.plan.device_fit.fit_vector_ops); the device
  model costs it as the longer of that and its bytes on the memory curve;
- the optimizers as harness train steps them (harness.models.make_optimizer: torch's default implementation for
  the device, one tensor at a time on a CPU, foreach on CUDA; OPTIMIZERS): their kernels and bytes counted by
  dispatch (count_optimizer: every aten operation a step dispatches and the bytes of its parameter-sized
  operands, at 1 and OPTIMIZER_COUNT_TENSORS tensors: kernels a step and a tensor), and a kernel's seconds beyond
  its bytes and the bandwidth its kernels move those bytes at, solved on two timed steps: over many small
  tensors and over a few large ones ([optimizer.NAME]; fit_optimizer); a third step between them, measured in
  the same rounds, is the check (the calibration's "optimizer" rows and fit error);
- under an MPI launcher with 2 or more ranks (mpirun -n 2 python -m mpi4py -m harness device): every rank
  calibrates at once (the ranks of a job share the memory bus and the cores) and fits the runners' measurements of
  the rank whose whole calibration ran fastest (least_disturbed: a core slowed for the minute by another tenant
  slows every kernel it times; a run's median iteration does not wait on such a minute), then measures what the
  ranks cost together (harness.profile.device_ranks: collectives in context; on a CPU FSDP2's unshard and reduce,
  the inline collectives of a tensor-parallel block and a pipeline send) and writes the figures fitted on it.
"""
from __future__ import annotations

import contextlib
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
from harness.models.transformer import TORCH_DTYPES
from harness.plan.device import (
    OPTIMIZER_KINDS,
    REQUIRED_DTYPES,
    Curve,
    DeviceDescription,
    OptimizerCost,
)
from harness.plan.device_fit import (
    BANDWIDTH_KINDS,
    Observation,
    curve_of,
    error_summary,
    fit_description,
    kernel_seconds,
)
from harness.plan.events import human_bytes
from harness.plan.kernels import (
    Attention,
    Gemm,
    Kernel,
    MemoryBound,
    causal_fraction,
)
from harness.plan.spec import DTYPES
from harness.profile.comm import LATE_STEP_S
from harness.profile.device_blocks import (
    FRAMEWORK_FAMILIES,
    WRAPPER_PASSES,
    framework_block,
    framework_launch,
    split_kernels,
    wrapper_costs,
    wrapper_runners,
)
from harness.profile.device_ranks import describe_over_ranks, measure_over_ranks
from harness.profile.timer import can_time_issued, synchronize, time_issued, time_region

FIT_SEED = 43  # the fit's shapes; a held-out set draws from another seed and leaves these out
LAUNCH_LOOP = 50
LEAD_S = 0.02  # on a GPU: how long a spin kernel holds it while the host issues a launch sample
ISSUE_LEAD_S = (1e-3, 0.5)  # on a GPU: the least and most a kernel's sample holds it busy (measure)
VECTOR_LOOP = 20  # multiply-adds a vector sample runs back to back (its tensors stay in cache)
# memory-bound kernels: a forward kind's bytes an element in units of the dtype's size, as harness.plan.kernels
# counts them (a backward's 1.5 x; dropout also writes a 1-byte mask an element)
KIND_BYTES = {"copy": 2, "add": 3, "fill": 1, "layer_norm": 2, "rms_norm": 2, "gelu": 2, "swiglu": 3, "dropout": 2,
              "rotary": 2, "embedding": 2, "cross_entropy": 3}
# the kinds whose vector operations an element are measured (the bandwidth kinds fit the memory curve)
VECTOR_MEASURED = tuple(k for kind in ("layer_norm", "rms_norm", "gelu", "swiglu", "dropout", "rotary", "embedding",
                                       "cross_entropy") for k in (kind, f"{kind}_backward"))
MEMORY_WIDTH = 256  # a memory-bound kernel's tensor is (rows, width): MEMORY_WIDTH, the loss's logits LOGITS_WIDTH
LOGITS_WIDTH = 2048
EMBEDDING_ROWS = 4096  # the lookup's table (its backward's: 64 rows, so that filling it stays a small part)
DROPOUT_P = 0.1
# optimizers as harness.models.make_optimizer builds them: OPTIMIZER_KINDS -> (name, momentum)
OPTIMIZERS = {"adam": ("adam", 0.0), "sgd": ("sgd", 0.0), "sgd_momentum": ("sgd", 0.9)}
OPTIMIZER_COUNT_TENSORS = 8  # a step's dispatched operations are counted over 1 and this many tensors
OPTIMIZER_SMALL = (64, 256)  # (tensors, elements each): the step a kernel's seconds beyond its bytes is taken from
# (a step over a few large tensors, the bandwidth's, and Scale.optimizer_check between them: not fitted on)


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
    kind_elements: tuple[int, int] = (1 << 14, 1 << 20)  # the vector kinds' kernels' elements
    multiple: int = 1  # GEMM dimensions and attention lengths are drawn as multiples of this
    optimizer_large: tuple[int, int] = (4, 1 << 18)  # (tensors, elements each): the step the bandwidth is taken from
    optimizer_check: tuple[int, int] = (16, 1 << 14)  # a step between it and OPTIMIZER_SMALL, not fitted on
    # the fused attentions, causal and not, that the causal kernel's key block is read from: their sequence lengths
    # and (batch, heads, head_dim)
    causal_seqs: tuple[int, ...] = (256, 512, 1024, 2048)
    causal_shape: tuple[int, int, int] = (1, 2, 32)


SCALES = {
    "cpu": Scale(gemm_m=(16, 1024), gemm_nk=(32, 4096), gemm_max_flops=1.5e9,
                 peak_gemms=((256, 256, 256), (512, 512, 512)),
                 attention_batch=(1, 4), attention_heads=(1, 8), attention_seq=(32, 512), head_dims=(16, 32, 64),
                 attention_max_flops=6e8, memory_rows=(4, 32768), vector_elements=1 << 14,
                 kind_elements=(1 << 14, 1 << 20)),
    "cuda": Scale(gemm_m=(128, 16384), gemm_nk=(128, 16384), gemm_max_flops=2e12,
                  peak_gemms=((4096, 4096, 4096), (8192, 8192, 8192)),
                  attention_batch=(1, 8), attention_heads=(8, 32), attention_seq=(256, 8192), head_dims=(64, 128),
                  attention_max_flops=5e12, memory_rows=(256, 1 << 20), vector_elements=1 << 26,
                  kind_elements=(1 << 16, 1 << 26), multiple=64, optimizer_large=(4, 1 << 24),
                  optimizer_check=(16, 1 << 20), causal_seqs=(512, 1024, 2048, 4096), causal_shape=(4, 16, 128)),
}


@dataclass(frozen=True)
class Counts:
    """How many shapes of each kind a set draws: GEMMs, fused attentions (each forward and backward),
    materialised attentions (each forward and backward), memory-bound kernels of the bandwidth kinds (in turn),
    and of each vector kind (VECTOR_MEASURED)."""

    gemm: int
    sdpa: int
    materialized: int
    memory: int
    vector: int = 0


FULL = Counts(gemm=24, sdpa=8, materialized=5, memory=12, vector=3)
QUICK = Counts(gemm=6, sdpa=2, materialized=1, memory=6, vector=2)


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
    # family -> seconds a kernel of its tiny block: the framework's time (CPU), the host's issue time (GPU)
    framework_blocks: dict[str, float] = field(default_factory=dict)
    bare_issue_s: float = 0.0  # a bare operator's issue on the host (GPU); kernel_issue_s beside it
    optimizer_counts: dict[str, dict[str, float]] = field(default_factory=dict)  # count_optimizer's, by kind
    collectives: list[dict[str, Any]] = field(default_factory=list)  # collectives_in_context's rows (2+ ranks)
    unshards: list[dict[str, Any]] = field(default_factory=list)  # unshards_over_ranks' rows (a CPU's, 2+ ranks)
    reduces: list[dict[str, Any]] = field(default_factory=list)  # reduces_over_ranks' rows (a CPU's, 2+ ranks)
    inline: list[dict[str, Any]] = field(default_factory=list)  # inline_collectives_over_ranks' (a CPU's, 2+ ranks)
    p2p: list[dict[str, Any]] = field(default_factory=list)  # p2p_over_ranks' rows (a CPU's, 2+ ranks)
    ranks: int = 1
    causal: list[dict[str, Any]] = field(default_factory=list)  # causal_rows: what causal_tile was read from

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


def _log_uniform(rng: np.random.Generator, low: int, high: int, multiple: int = 1) -> int:
    drawn = math.exp(rng.uniform(math.log(low), math.log(high)))
    return max(multiple, int(round(drawn / multiple)) * multiple)


def draw_kernels(kind: str, dtype: str, counts: Counts, seed: int, exclude: Sequence[Kernel] = ()) -> list[Kernel]:
    """Kernels of `counts` shapes for a device kind (SCALES), drawn from `seed`, none of `exclude`: GEMMs, fused
    attention forward and backward (causal and full in turn), materialised attention forward and backward (causal;
    of GEMMs and each attention kind the first is the range's smallest, unless excluded, so that a fitted curve does not
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
        m, n, k = (_log_uniform(rng, *scale.gemm_m, scale.multiple), _log_uniform(rng, *scale.gemm_nk, scale.multiple),
                   _log_uniform(rng, *scale.gemm_nk, scale.multiple))
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
                seq = _log_uniform(rng, *scale.attention_seq, scale.multiple)
                head_dim = int(rng.choice(scale.head_dims))
            causal = kernel_kind == "materialized" or drawn % 2 == 0  # fused ones causal and full in turn
            forward = Attention("attention", kernel_kind, batch, heads, seq, seq, head_dim, dtype, causal=causal,
                                launches=3 if kernel_kind == "materialized" else 1)
            if forward.flops > scale.attention_max_flops or forward in left_out or forward in out:
                continue
            out += [forward, Attention("attention.grad", kernel_kind, batch, heads, seq, seq, head_dim, dtype,
                                       causal=causal, backward=True,
                                       launches=5 if kernel_kind == "materialized" else 1)]
            drawn += 1
    drawn = 0
    while drawn < counts.memory:
        op = BANDWIDTH_KINDS[drawn % len(BANDWIDTH_KINDS)]
        if take(kind_kernel(op, _log_uniform(rng, *scale.memory_rows), dtype)):
            drawn += 1
    for op in VECTOR_MEASURED:  # the range's ends first (a kind's slope is fitted between its sizes)
        drawn, width = 0, kind_width(op)
        low, high = (max(1, bound // width) for bound in scale.kind_elements)
        ends = [low, high]
        while drawn < counts.vector:
            rows = ends.pop(0) if ends else _log_uniform(rng, low, high)
            if take(kind_kernel(op, rows, dtype)):
                drawn += 1
    return out


def kind_width(op: str) -> int:
    """The width of a memory-bound kind's tensor: the loss's logits LOGITS_WIDTH, every other MEMORY_WIDTH."""
    return LOGITS_WIDTH if op.startswith("cross_entropy") else MEMORY_WIDTH


def kind_kernel(op: str, rows: int, dtype: str) -> MemoryBound:
    """A memory-bound kernel of kind `op` over (rows, its width) elements, its bytes as harness.plan.kernels
    counts its kind's (KIND_BYTES; a backward's 1.5 x; dropout's 1-byte mask). The loss runs on float32 logits
    whatever the model's dtype (their conversion is a copy of its own)."""
    forward = op.removesuffix("_backward")
    dtype = "float32" if forward == "cross_entropy" else dtype
    elements = rows * kind_width(op)
    per = KIND_BYTES[forward] * DTYPES[dtype] + (1 if forward == "dropout" else 0)
    scale = 1.5 if op.endswith("_backward") else 1.0
    return MemoryBound(op, float(scale * per * elements), dtype, op=op, elements=float(elements))


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
        return _kind_runner(kernel, device)
    raise TypeError(f"not a kernel: {kernel!r}")


def _kind_runner(kernel: MemoryBound, device: torch.device) -> Callable[[], object]:
    """A memory-bound kernel of its kind (kernel.op) as the models run it (harness.models.transformer): a
    backward kind by autograd over the forward (retain_graph), which is what a training pass runs."""
    from harness.models.transformer import RMSNorm, _rotary

    dtype = TORCH_DTYPES[kernel.dtype]
    op, width = kernel.op, kind_width(kernel.op)
    forward_op, backward = op.removesuffix("_backward"), op.endswith("_backward")
    rows = max(1, round(kernel.elements / width))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=backward)

    if forward_op in BANDWIDTH_KINDS:
        x, y = randn(rows, width), randn(rows, width)
        return {"copy": lambda: x.clone(), "add": lambda: x + y,
                "fill": lambda: torch.zeros(rows, width, dtype=dtype, device=device)}[forward_op]
    x = randn(rows, width)
    inputs = [x]
    if forward_op == "layer_norm":
        weight, bias = randn(width), randn(width)
        inputs += [weight, bias]

        def forward():
            return F.layer_norm(x, (width,), weight, bias)
    elif forward_op == "rms_norm":
        norm = RMSNorm(width, dtype=dtype).to(device)
        inputs += list(norm.parameters()) if backward else []

        def forward():
            return norm(x)
    elif forward_op == "gelu":
        def forward():
            return F.gelu(x)
    elif forward_op == "swiglu":
        up = randn(rows, width)
        inputs.append(up)

        def forward():
            return F.silu(x) * up
    elif forward_op == "dropout":
        def forward():
            return F.dropout(x, DROPOUT_P, training=True)
    elif forward_op == "rotary":
        x = randn(1, 4, rows * width // (4 * 64), 64)
        inputs = [x]

        def forward():
            return _rotary(x)
    elif forward_op == "embedding":
        table = randn(64 if backward else EMBEDDING_ROWS, width)
        ids = torch.randint(0, table.shape[0], (rows,), device=device)
        inputs = [table]

        def forward():
            return F.embedding(ids, table)
    elif forward_op == "cross_entropy":
        targets = torch.randint(0, width, (rows,), device=device)

        def forward():
            return F.cross_entropy(x.float(), targets)
    else:
        raise ValueError(f"no runner for memory-bound kind {op!r}")
    if not backward:
        return forward
    out = forward()
    grad = torch.randn_like(out) if out.dim() else torch.ones_like(out)
    return lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)



def causal_kernels(kind: str, dtype: str) -> list[Attention]:
    """The fused attentions causal_tile_of reads: at each of the kind's causal_seqs, forward and backward, full
    then causal."""
    scale = SCALES[kind]
    batch, heads, head_dim = scale.causal_shape
    return [Attention("attention.grad" if backward else "attention", "sdpa", batch, heads, seq, seq, head_dim, dtype,
                      causal=causal, backward=backward)
            for seq in scale.causal_seqs for backward in (False, True) for causal in (False, True)]


def causal_rows(kernels: Sequence[Attention], seconds: Sequence[float], launch_s: float = 0.0) -> list[dict[str, Any]]:
    """causal_kernels' measured (full, causal) pairs as rows: seq, pass, both times and the causal one's share of
    the full one's, each net of a bare launch (`launch_s`; a GPU's shortest pair is a few launches long)."""
    pairs = zip(kernels[0::2], seconds[0::2], seconds[1::2])
    return [{"seq": k.q_len, "pass": "backward" if k.backward else "forward", "full_s": full, "causal_s": causal,
             "ratio": max(causal - launch_s, 1e-12) / max(full - launch_s, 1e-12)} for k, full, causal in pairs]


def causal_tile_of(rows: Sequence[dict[str, Any]]) -> int:
    """The key block (a power of two from 16 to the longest sequence measured) whose causal_fraction best matches
    the measured causal / full times (least squares of their logarithms; among equals the smallest: a kernel that
    skipped nothing at any length measured reads as the longest). Compute bounds these kernels, so the time's
    share is the computed scores' share."""
    longest = max(row["seq"] for row in rows)
    candidates = [1 << p for p in range(4, longest.bit_length())]

    def misfit(tile: int) -> float:
        return sum((math.log(row["ratio"]) - math.log(causal_fraction(row["seq"], row["seq"], tile))) ** 2
                   for row in rows)
    scores = {tile: misfit(tile) for tile in candidates}
    best = min(scores.values())
    return min(tile for tile, score in scores.items() if score <= best * (1 + 1e-9))


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


def _optimizer_parameters(tensors: int, elements: int, device: torch.device) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(elements, device=device)) for _ in range(tensors)]
    for param in params:
        param.grad = torch.randn_like(param)
    return params


def _optimizer_runner(kind: str, tensors: int, elements: int, device: torch.device) -> Callable[[], object]:
    """A step of optimizer `kind` (OPTIMIZERS) as harness train makes it, over `tensors` float32 parameters of
    `elements` each with their gradients; one step taken first, so that its states exist."""
    from harness.models import make_optimizer

    name, momentum = OPTIMIZERS[kind]
    optimizer = make_optimizer(name, momentum, _optimizer_parameters(tensors, elements, device), 1e-6)
    optimizer.step()
    return optimizer.step


def _sharded_optimizer_runner(kind: str, tensors: int, elements: int,
                              device: torch.device) -> Callable[[], object]:
    """_optimizer_runner's step over the same parameters as FSDP2's shards over this rank alone (DTensors, their
    gradients too), as a ZeRO job's optimizer steps them (call within harness.profile.sharded.leaving_no_world)."""
    from harness.models import make_optimizer
    from harness.profile.sharded import sharded_alone

    params = []
    for plain in _optimizer_parameters(tensors, elements, device):
        param = torch.nn.Parameter(sharded_alone(plain.detach(), device))
        param.grad = sharded_alone(plain.grad, device)
        params.append(param)
    name, momentum = OPTIMIZERS[kind]
    optimizer = make_optimizer(name, momentum, params, 1e-6)
    optimizer.step()
    return optimizer.step


def count_dispatched(run: Callable[[], object], elements: int = 0,
                     leave_out: frozenset[str] = frozenset()) -> tuple[int, int]:
    """(the aten operations one call of `run` dispatches, but those named in `leave_out` (views, say), the bytes of
    those operands and results that hold `elements` elements: read and written), counted by a TorchDispatchMode,
    not timed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels, self.bytes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in leave_out:
                return out
            self.kernels += 1
            for value in (*args, *(kwargs or {}).values(), out):
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(tensor, torch.Tensor) and tensor.numel() == elements:
                        self.bytes += tensor.numel() * tensor.element_size()
            return out

    with Count() as count:
        run()
    return count.kernels, count.bytes


def count_kind_launches(dtype: str, device: torch.device) -> dict[str, float]:
    """Each measured memory-bound kind's operations a call ([launches]): what its runner (the models' code, a
    backward by autograd) dispatches, counted on a small instance."""
    return {op: float(count_dispatched(_kind_runner(kind_kernel(op, 64, dtype), device))[0])
            for op in VECTOR_MEASURED}


def count_optimizer(kind: str, device: torch.device, elements: int = 4096) -> dict[str, float]:
    """What a step of optimizer `kind` dispatches, counted (not timed) over 1 and OPTIMIZER_COUNT_TENSORS tensors
    of `elements` each: every aten operation is a kernel, and its bytes are those of its operands and results the
    size of a parameter (its states, gradient and temporaries; scalars left out). kernels = kernels_per_step +
    kernels_per_tensor x tensors solved on the two counts; bytes_per_parameter from the larger."""
    counted = {}
    for tensors in (1, OPTIMIZER_COUNT_TENSORS):
        step = _optimizer_runner(kind, tensors, elements, device)
        kernels, nbytes = count_dispatched(step, elements)
        counted[tensors] = (kernels, nbytes / (tensors * elements))
    (one, _), (many, per_parameter) = counted[1], counted[OPTIMIZER_COUNT_TENSORS]
    per_tensor = (many - one) / (OPTIMIZER_COUNT_TENSORS - 1)
    return {"kernels_per_tensor": float(per_tensor), "kernels_per_step": float(max(0.0, one - per_tensor)),
            "bytes_per_parameter": float(per_parameter)}


def optimizer_kernel(kind: str, tensors: int, elements: int) -> MemoryBound:
    """The optimizer step `_optimizer_runner` runs, as harness.plan.kernels.optimizer_kernels lists one."""
    from harness.plan.events import OPTIMIZER_BYTES_PER_PARAMETER

    params = tensors * elements
    return MemoryBound("optimizer.step", float(params * OPTIMIZER_BYTES_PER_PARAMETER), "float32",
                       flops=12.0 * params, launches=1, op=kind, elements=float(params),
                       tensors=((elements, tensors),))


def fit_optimizer(counted: dict[str, float], small_s: float, large_s: float,
                  large: tuple[int, int] = SCALES["cpu"].optimizer_large) -> OptimizerCost:
    """An optimizer's [optimizer.NAME]: the counted kernels and bytes, and the two figures that make the steps
    over OPTIMIZER_SMALL's and `large`'s (tensors, elements each) take `small_s` and `large_s`: each step's time
    is its kernels x kernel_s + its parameters x bytes_per_parameter / bandwidth, two equations solved for kernel_s
    (at least 0) and the bandwidth (where the two steps do not tell them apart, kernel_s 0 and the large step's
    bytes over its time)."""
    cost = OptimizerCost(kernels_per_tensor=counted["kernels_per_tensor"],
                         kernels_per_step=counted["kernels_per_step"],
                         bytes_per_parameter=counted["bytes_per_parameter"], kernel_s=0.0, bandwidth=1.0)
    steps = []
    for (tensors, elements), seconds in ((OPTIMIZER_SMALL, small_s), (large, large_s)):
        launches = cost.kernels_per_step + cost.kernels_per_tensor * tensors
        steps.append((launches, tensors * elements * cost.bytes_per_parameter, seconds))
    (l1, b1, t1), (l2, b2, t2) = steps
    determinant = l1 * b2 - l2 * b1
    kernel_s, per_byte = 0.0, t2 / b2
    if determinant:
        kernel_s = (t1 * b2 - t2 * b1) / determinant
        per_byte = (l1 * t2 - l2 * t1) / determinant
    if kernel_s < 0 or per_byte <= 0:  # the steps do not tell them apart: bytes alone, at the large step's rate
        kernel_s, per_byte = 0.0, t2 / b2
    return dataclasses.replace(cost, kernel_s=kernel_s, bandwidth=1.0 / per_byte)


def issued_medians(run: Callable[[], object], device: torch.device, repeats: int,
                   warmup: int) -> tuple[float, float]:
    """(device seconds, host seconds) of `run()` on a GPU issued while the GPU is held busy for LEAD_S
    (timer.time_issued), medians of the samples in which the host stayed ahead (all, if none did)."""
    samples = [time_issued(run, device, LEAD_S) for _ in range(warmup + repeats)][warmup:]
    ahead = [s for s in samples if s.ahead] or samples
    return float(np.median([s.device_s for s in ahead])), float(np.median([s.host_s for s in ahead]))


def measure_launch_on_gpu(device: torch.device, repeats: int, warmup: int) -> tuple[float, float]:
    """(device seconds, host seconds) of one launch on a GPU: LAUNCH_LOOP tiny kernels (issued_medians)."""
    device_s, host_s = issued_medians(_launch_runner(device), device, repeats, warmup)
    return device_s / LAUNCH_LOOP, host_s / LAUNCH_LOOP


def framework_issue_on_gpu(description: DeviceDescription, dtype: str, device: torch.device, repeats: int,
                           warmup: int) -> dict[str, float]:
    """Per family of FRAMEWORK_FAMILIES, the host's seconds a kernel of its tiny block's forward and backward as
    a training pass issues them (nn.Module calls, autograd's graph and engine, the views between kernels) on a
    GPU: the block's host time issued (issued_medians) over the launches harness.plan.kernels lists for it."""
    out = {}
    for family in FRAMEWORK_FAMILIES:
        run, kernels = framework_block(family, dtype, device)
        out[family] = (issued_medians(run, device, repeats, warmup)[1]
                       / sum(description.kernel_launches(k) for k in kernels))
    return out


def least_disturbed(seconds: Sequence[float], comm, deciding: Sequence[bool] | None = None) -> list[float]:
    """The measurements of the rank whose whole calibration ran fastest (the smallest sum over the `deciding`
    runners, default all, of log(its seconds / the ranks' mean)), on every rank; each passes its own runners'
    seconds, in one order. A core another tenant or the system slows for the minute slows every kernel it times,
    and the machine's description is of the cores undisturbed. A whole rank is taken, not each runner's fastest,
    so that no figure is the luckier of several samples."""
    everyone = np.array(comm.allgather([float(s) for s in seconds]), dtype=float)
    typical = everyone.mean(axis=0)
    # a runner every rank timed at 0 (below the clock's step) tells no rank apart
    timed = (typical > 0) & (np.ones(len(typical), bool) if deciding is None else np.asarray(deciding, bool))
    slowdown = np.log(np.maximum(everyone[:, timed] / typical[timed], 1e-12)).sum(axis=1)
    return [float(s) for s in everyone[int(np.argmin(slowdown))]]


def measure(runners: Sequence[Callable[[], object]], device: torch.device, repeats: int, warmup: int,
            progress: Progress | None = None) -> list[float]:
    """Each runner's median seconds over `repeats` interleaved rounds after `warmup` untimed ones (module
    docstring); `progress` advances once a round per runner.

    On a GPU (timer.can_time_issued) a sample is the device's time alone: the GPU is held busy while the host
    issues the runner (timer.time_issued), for twice the runner's longest warm-up (synchronized: the host's issue
    and the device's work; ISSUE_LEAD_S bounds it), doubled after a sample the host fell behind in; the median is
    of the samples the host stayed ahead in (all, if none did). A synchronized sample of a small kernel is its
    host's issue, which the device model adds itself ([host] kernel_issue_us)."""
    issued = can_time_issued(device)
    samples: list[list[float]] = [[] for _ in runners]
    behind: list[list[float]] = [[] for _ in runners]  # samples the host fell behind in (GPU)
    lead = [ISSUE_LEAD_S[0]] * len(runners)
    for round_index in range(warmup + repeats):
        for index, run in enumerate(runners):
            if not issued or round_index < warmup:
                seconds = time_region(run, device)
                lead[index] = min(ISSUE_LEAD_S[1], max(lead[index], 2 * seconds))
                if round_index >= warmup:
                    samples[index].append(seconds)
            else:
                sample = time_issued(run, device, lead[index])
                (samples if sample.ahead else behind)[index].append(sample.device_s)
                if not sample.ahead:
                    lead[index] = min(ISSUE_LEAD_S[1], 2 * max(lead[index], sample.host_s))
            if progress is not None:
                progress.advance()
    return [float(np.median(ahead or late)) for ahead, late in zip(samples, behind)]


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
              show_progress: bool = True, held_out: Sequence[Kernel] = (), comm=None) -> Calibration:
    """Measure `device` (module docstring) and fit a description of it named `name`, its curves in `dtype`.
    `held_out`: kernels measured in the same rounds (the same minutes of the machine) but not fitted on, returned
    as Calibration.held_out (bench/device_model.py sets them against the description). `comm`: an mpi4py
    communicator of 2 or more ranks, every one calling this: they calibrate at once, then time the collectives
    in context (Calibration.collectives); every rank fits the least disturbed rank's runners' measurements
    (least_disturbed) and returns that fit (rank 0 writes it)."""
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
    # the one-rank world of the FSDP2 units (a CPU's wrappers): ended once measured, or on an error before
    with contextlib.ExitStack() as world:
        wrapped: list[list[Callable[[], object]]] = []
        if blocks:
            from harness.profile.sharded import leaving_no_world

            world.enter_context(leaving_no_world())
            before = len(runners)
            try:
                wrapped = [wrapper_runners(family, dtype, device) for family in FRAMEWORK_FAMILIES]
                runners += [run for runs in wrapped for run in runs]
                runners.append(_sharded_optimizer_runner("adam", *OPTIMIZER_SMALL, device))
            except (ImportError, UserError):  # a torch without FSDP2's fully_shard or the split backward: none
                wrapped = []
                del runners[before:]
        # optimizers: a step over many small tensors (a kernel's time beyond its bytes) and over a few large ones
        optimizers = [(kind, size) for kind in OPTIMIZER_KINDS
                      for size in (OPTIMIZER_SMALL, scale.optimizer_large, scale.optimizer_check)]
        runners += [_optimizer_runner(kind, tensors, elements, device) for kind, (tensors, elements) in optimizers]
        causal_set = causal_kernels(kind, dtype)
        runners += [_runner(k, device) for k in [*fit_set, *peaks, *held_out, *causal_set]]
        held_out_at = len(runners) - len(causal_set) - len(held_out)
        progress = Progress(f"device {device}", len(runners) * (warmup + repeats), enabled=show_progress,
                            unit="sample")
        try:
            seconds = measure(runners, device, repeats, warmup, progress)
        finally:
            progress.close()
    if comm is not None and comm.Get_size() > 1:  # the held-out kernels take no part in the choice
        deciding = [not held_out_at <= i < held_out_at + len(held_out) for i in range(len(seconds))]
        seconds = least_disturbed(seconds, comm, deciding)
    launch_s, issue_s = seconds[0] / LAUNCH_LOOP, 0.0
    gpu_issued = device.type == "cuda" and can_time_issued(device)
    if gpu_issued:
        launch_s, issue_s = measure_launch_on_gpu(device, repeats, warmup)
    vector = {d: 2.0 * scale.vector_elements * VECTOR_LOOP / s for d, s in zip(runnable, seconds[1:1 + len(runnable)])}
    block_seconds = seconds[1 + len(runnable):1 + len(runnable) + len(blocks)]
    at = 1 + len(runnable) + len(blocks)
    per_family = 1 + 2 * (len(WRAPPER_PASSES) - 1)
    wrapped_seconds = [seconds[at + i * per_family:at + (i + 1) * per_family] for i in range(len(wrapped))]
    at += per_family * len(wrapped)
    sharded_step_s = seconds[at] if wrapped else 0.0
    at += 1 if wrapped else 0
    optimizer_seconds = dict(zip(optimizers, seconds[at:at + len(optimizers)]))
    timed = seconds[at + len(optimizers):]
    causal = causal_rows(causal_set, timed[len(fit_set) + len(peaks) + len(held_out):], launch_s)
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
                              fitted=True, fitted_on="", kernel_issue_s=issue_s,
                              launches=count_kind_launches(dtype, device),
                              processor="cpu" if device.type == "cpu" else "gpu", causal_tile=causal_tile_of(causal))
    fitted = fit_description(start, observations)
    counted = {kind: count_optimizer(kind, device) for kind in OPTIMIZER_KINDS}
    fitted = dataclasses.replace(fitted, optimizer={
        kind: fit_optimizer(counted[kind], optimizer_seconds[(kind, OPTIMIZER_SMALL)],
                            optimizer_seconds[(kind, scale.optimizer_large)], scale.optimizer_large)
        for kind in OPTIMIZER_KINDS})
    observations += [Observation("optimizer", optimizer_kernel(kind, *scale.optimizer_check), s)
                     for (kind, size), s in optimizer_seconds.items() if size == scale.optimizer_check]
    framework = {}
    if blocks:  # a CPU: a kernel in a pass costs the framework's time around it too (module docstring)
        per_launch = framework_launch(fitted, [(kernels, s) for (_, kernels), s in zip(blocks, block_seconds)])
        framework = dict(zip(FRAMEWORK_FAMILIES, per_launch))
        fitted = dataclasses.replace(fitted, launch_s=max(launch_s, float(np.median(per_launch))))
        split = [split_kernels(family, dtype) for family in FRAMEWORK_FAMILIES]
        wrappers = wrapper_costs(block_seconds, wrapped_seconds,
                                 [tuple(sum(kernel_seconds(fitted, k) for k in ks) for ks in halves)
                                  for halves in split])
        adam = counted["adam"]
        launches = adam["kernels_per_step"] + adam["kernels_per_tensor"] * OPTIMIZER_SMALL[0]
        dtensor_s = max(0.0, sharded_step_s - optimizer_seconds[("adam", OPTIMIZER_SMALL)]) / launches
        wrappers["fsdp2"] = dataclasses.replace(wrappers["fsdp2"], optimizer_kernel_s=dtensor_s)
        fitted = dataclasses.replace(fitted, wrappers=wrappers)
    elif gpu_issued:  # a GPU: the host issues a pass's kernels through the same framework (module docstring)
        framework = framework_issue_on_gpu(fitted, dtype, device, repeats, warmup)
        fitted = dataclasses.replace(fitted, kernel_issue_s=max(issue_s, float(np.median(list(framework.values())))))
    calibration = Calibration(fitted, observations, dtype, repeats, warmup, unsupported,
                              held_out=held_out_observations, bare_launch_s=launch_s, framework_blocks=framework,
                              bare_issue_s=issue_s, optimizer_counts=counted, causal=causal)
    if comm is not None and comm.Get_size() > 1:
        calibration.ranks = comm.Get_size()
        (calibration.collectives, calibration.unshards, calibration.reduces, calibration.inline,
         calibration.p2p) = measure_over_ranks(comm, device, fitted.matrix_peak["float32"], repeats, warmup, quick,
                                               dtype)
        calibration.description = describe_over_ranks(fitted, calibration.inline, calibration.p2p,
                                                      calibration.unshards, calibration.reduces)
    calibration.description = _with_note(calibration, kind, quick)
    calibration.seconds = time.monotonic() - started
    return calibration


def _with_note(calibration: Calibration, kind: str, quick: bool) -> DeviceDescription:
    """The description with `fitted_on`: what was measured (kernels and their ranges, repeats, date)."""
    scale, obs = SCALES[kind], calibration.observations
    count = {curve: sum(o.curve == curve for o in obs) for curve in
             ("gemm", "sdpa_forward", "sdpa_backward", "materialized_attention", "memory")}
    bandwidth = sum(o.curve == "memory" and o.kernel.op in BANDWIDTH_KINDS for o in obs)
    per_block = ", ".join(f"{v * 1e6:.1f}" for v in calibration.framework_blocks.values())
    note = (f"harness device {time.strftime('%Y-%m-%d %H:%M')}{' --quick' if quick else ''}, torch "
            f"{torch.__version__}: curves in {calibration.dtype} on {count['gemm']} GEMMs (m {scale.gemm_m[0]}-"
            f"{scale.gemm_m[1]}, n and k {scale.gemm_nk[0]}-{scale.gemm_nk[1]}), {count['sdpa_forward']} fused "
            f"attentions forward and backward and {count['materialized_attention']} materialised ones (seq "
            f"{scale.attention_seq[0]}-{scale.attention_seq[1]}), {bandwidth} memory-bound kernels of "
            f"{', '.join(BANDWIDTH_KINDS)} (the memory curve) and {count['memory'] - bandwidth} of "
            f"{len(calibration.description.vector_ops)} other kinds (vector_ops: elements {scale.kind_elements[0]}-"
            f"{scale.kind_elements[1]}); optimizers {', '.join(OPTIMIZER_KINDS)} by torch's default implementation "
            f"here, their kernels and bytes counted by dispatch, a kernel's time beyond its bytes from a step over "
            f"{OPTIMIZER_SMALL[0]} tensors of {OPTIMIZER_SMALL[1]}; medians of {calibration.repeats} interleaved "
            f"repeats after {calibration.warmup} warm-up"
            + (f", every one of {calibration.ranks} ranks at once (the fastest rank's measurements)"
               if calibration.ranks > 1 else "")
            + "; peaks the best measured"
            + (f"; causal_tile the key block whose share of the scores matches causal over full fused attentions "
               f"(seq {', '.join(str(r['seq']) for r in calibration.causal if r['pass'] == 'forward')}, forward and "
               "backward)" if calibration.causal else "")
            + (f"; launch_us the framework's time a kernel in tiny {', '.join(FRAMEWORK_FAMILIES)} blocks' "
               f"forward and backward ({per_block} us; their median), a bare operator's "
               f"{calibration.bare_launch_s * 1e6:.2f} us"
               if calibration.framework_blocks and kind == "cpu" else "")
            + ("; [wrappers] the same blocks under torch.utils.checkpoint, as FSDP2 units over one rank and through "
               "the split backward's halves against plain ones (their medians), fsdp2's optimizer_kernel_us an Adam "
               "step over DTensor shards against plain tensors" if calibration.description.wrappers else "")
            + (f"; fsdp2's unshard_us and unshard_tensor_us FSDP2's unshard() of {len(calibration.unshards)} units "
               f"({', '.join(sorted({str(r['tensors']) for r in calibration.unshards}, key=int))} tensors; "
               f"{', '.join(human_bytes(b) for b in sorted({r['bytes'] for r in calibration.unshards}))}) over the "
               f"{calibration.ranks} ranks beyond the bare all-gather and the copies modelled"
               if calibration.unshards else "")
            + ("; fsdp2's reduce_us and reduce_tensor_us FSDP2's post-backward reduce of the same units beyond "
               "their backward without FSDP2, the bare reduce-scatter and the copy-in modelled"
               if calibration.reduces else "")
            + (f"; inline_collective_us the tiny gpt2 block split over the {calibration.ranks} ranks (with and "
               f"without sp) over them beyond alone, over its {sum(r['calls'] for r in calibration.inline)} inline "
               "collectives" if calibration.inline else "")
            + (f"; p2p_post_us and p2p_sender_busy_us a send between 2 of the ranks "
               f"({', '.join(human_bytes(r['bytes']) for r in calibration.p2p)}) as a profile measures its P2P: the "
               "median post as a training step posts it, and the sender-busy samples' mean beyond the least half "
               "round trip, each a line in the bytes"
               + ("; p2p_late_us the run-queue wait a send received late adds to each end's compute, in a stream of "
                  f"{LATE_STEP_S * 1e3:g} ms steps sending both ways" if "late_s" in calibration.p2p[0] else "")
               if calibration.p2p else "")
            + (f"; kernel_issue_us the host's time a kernel in tiny {', '.join(FRAMEWORK_FAMILIES)} blocks' "
               f"forward and backward issued on the GPU ({per_block} us; their median), a bare operator's "
               f"{calibration.bare_issue_s * 1e6:.2f} us" if calibration.framework_blocks and kind != "cpu" else "")
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
