"""The kernels a built-in layer runs in a pass: GEMMs with their m, n, k, attention with its shape and kind, and
memory-bound kernels (norms, activations, residual adds, copies, dropout, the loss) with their bytes.

What analysis.device_model costs a compute event from when no profile measured it. Sizes are one tensor-parallel
shard's for one micro-batch of `micro` samples of `seq` local tokens (seq_len / cp), as the plan's compute events
(harness.plan.events) and the layer's signature (its family, sizes, dtype, tp, sp, cp) say. Rules (docs/devices.md,
"Kernels"):

- FLOPs are counted as the layers count them (LayerDesc.fwd_flops): a GEMM's 2 m n k, attention's QK^T and
  attention x V over the whole square (4 b heads s_q s_kv d), the embedding's h per token and the loss's 5 per
  logit; a block's memory-bound kernels carry no FLOPs (they are a few per element, far below every device's
  ridge). A backward runs each GEMM twice (input gradient: m, k, n; weight gradient: k, n, m) and counts attention
  and the counted memory-bound kernels twice: 2 x the forward's FLOPs, as the plan's events count it.
- bytes are what a kernel reads and writes once in HBM: a GEMM its two operands and its result; fused attention
  q, k, v and the output (backward also their gradients and the output's); materialised attention adds its
  scores' matrix, written and read by each of its steps; a memory-bound kernel its inputs and outputs.
- with sequence parallelism (sp) the norms, residual adds and dropout between the tensor-parallel regions hold
  seq / tp tokens; with context parallelism the all-gather variant's attention spans seq x cp keys, and a ring's
  attention is the kernels the ring runs (ring_attention_kernels: its blocks a step, their merges).
  Each sequence-parallel exchange also copies the whole sequence's activations once in the layer (harness.models.tp
  keeps them batch-first, (micro, seq, h)): an all-gather's buffer out into the sequence's order, a reduce-scatter's
  partial sums into the buffer's (sequence_exchange: every gather and scatter of the layer's pass, its backward's
  too).
- recompute = "full" re-runs the forward (the plan's R step: the forward event again), so the backward's kernels
  do not change; "selective" (Megatron-LM's) runs the attention core's forward again inside the backward.
- attention is fused (sdpa) unless the block's signature says ("attention", "materialized"): the spec's
  `[model] attention`.
- a job's layer backward also adds its parameters' gradients into the step's earlier micro-batches' (an add a
  tensor, job_event_kernels), unless the spec says Megatron-LM's gradient accumulation fusion.
- a split backward (torch.distributed.pipelining's stage_backward_input, then stage_backward_weight) computes the
  weights' side in its second half: the weight GEMMs, and each norm's weight gradient again (autograd runs the
  norm's backward node once a half: a read of its input and the output's gradient; two launches for RMSNorm's
  multiply and sum); the first half computes everything else.
- a bias's gradient (its output's gradient reduced over the tokens) is not listed, in a whole backward as in a
  split one: its time is in the fitted framework time a launch (a CPU's tiny blocks run it) or a GPU's fitted
  figures (why: docs/devices.md, "Kernels").
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from harness.common.errors import UserError
from harness.plan.device import MEMORY_KINDS, OPTIMIZER_KINDS  # noqa: F401 (the kinds named here)
from harness.plan.events import optimizer_bytes, optimizer_dtype
from harness.plan.layers import LayerDesc, fused_softmax, megatron_loss
from harness.plan.ring import DIAGONAL, ring_blocks
from harness.plan.spec import ATTENTION_KINDS, DTYPES, JobSpec

PHASES = ("fwd", "bwd", "bwd_input", "bwd_weight")
RECOMPUTES = ("none", "full", "selective")
MASK_BYTES = 1  # a dropout mask's element (torch keeps a bool)
NORM_KINDS = frozenset({"layer_norm", "rms_norm"})  # every listed norm has weights (LayerNorm's and RMSNorm's)
# a vocabulary shard's embedding moves its token ids into the shard and masks those outside it: a subtraction,
# two comparisons, their or and an out-of-place masked_fill of the ids (five dispatched operations)
VOCAB_MASK, VOCAB_MASK_LAUNCHES = "embedding.vocab_mask", 5
VOCAB_MASK_BYTES = 8 * 8 + 6 * 1  # a token's: the subtraction 8 + 8, each comparison 8 + 1, the or 1 + 1 + 1, the
# fill's copy 8 + 8 and its fill 8 + 1 + 8 (int64 ids, bool masks): 70
NO_GRADIENT = frozenset({VOCAB_MASK})  # listed forward kernels whose backward runs nothing (integer ids)
LOSS_BYTES = 4  # the loss's logits: float32
ID_BYTES = 8  # a token id (int64)


@dataclass(frozen=True)
class Gemm:
    """`batch` matrix multiplies of (m x k) by (k x n) in `dtype`; `weight_gradient`: a backward's weight GEMM (the
    bwd_weight step of a split backward)."""

    name: str
    m: int
    n: int
    k: int
    dtype: str
    batch: int = 1
    weight_gradient: bool = False
    launches: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def bytes(self) -> float:
        return float(self.batch * (self.m * self.k + self.k * self.n + self.m * self.n) * DTYPES[self.dtype])


@dataclass(frozen=True)
class Attention:
    """Attention over `batch` samples x `heads` heads, `q_len` queries against `kv_len` keys of `head_dim`: `kind`
    sdpa (fused: the scores never leave the chip) or materialized (baddbmm, softmax, bmm: the scores in HBM);
    `causal`: the upper triangle masked (a fused kernel skips its blocks wholly above the diagonal:
    causal_fraction); `backward`: its gradient."""

    name: str
    kind: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    causal: bool = True
    backward: bool = False
    launches: int = 1
    # a ring step's (ring_attention_kernels): the share of its scores in the chunk pairs it computes whole, and in
    # those on the diagonal (a causal chunk: causal_fraction of a chunk's square); both 0: the rule below
    computed: float = 0.0
    diagonal: float = 0.0

    @property
    def flops(self) -> float:
        forward = 4.0 * self.batch * self.heads * self.q_len * self.kv_len * self.head_dim
        return 2.0 * forward if self.backward else forward

    def executed_flops(self, causal_tile: int = 0) -> float:
        """The FLOPs the kernel executes: a ring step's its counted FLOPs x (`computed` + `diagonal` x a chunk's
        causal_fraction; a materialised one computes its diagonal chunks whole), any other's x causal_fraction (a
        fused causal kernel's), all of them for a materialised or non-causal one."""
        if self.computed or self.diagonal:
            chunk = self.q_len // 2
            causal = 1.0 if self.kind == "materialized" else causal_fraction(chunk, chunk, causal_tile)
            return self.flops * (self.computed + self.diagonal * causal)
        if self.kind == "materialized" or not self.causal:
            return self.flops
        return self.flops * causal_fraction(self.q_len, self.kv_len, causal_tile)

    @property
    def bytes(self) -> float:
        rows = self.batch * self.heads * self.head_dim
        # forward: q, k, v read and the output written; backward: q, k, v, output and its gradient read, q, k, v's
        # gradients written
        tensors = rows * (4 * self.q_len + 4 * self.kv_len) if self.backward else rows * 2 * (self.q_len + self.kv_len)
        scores = 0
        if self.kind == "materialized":
            # forward: scores written, read and probabilities written by the softmax, read by the bmm; backward:
            # probabilities read twice, their gradient written and read, the scores' gradient written and read twice
            scores = self.batch * self.heads * self.q_len * self.kv_len * (7 if self.backward else 4)
        return float((tensors + scores * ((self.computed + self.diagonal) or 1.0)) * DTYPES[self.dtype])


def causal_fraction(q_len: int, kv_len: int, causal_tile: int = 0) -> float:
    """The share of a causal attention's scores a fused kernel computes: each query its keys up to its own,
    rounded up to a whole block of `causal_tile` keys (the kernel computes a block of keys whole, masked, and skips
    the blocks wholly above the diagonal; torch's CPU kernel's block is 512 keys, so up to 512 keys it computes
    the whole square). `causal_tile` 0: no block, half the square (the masked half skipped). Queries and keys of
    different lengths (a context-parallel ring's chunks): half."""
    if causal_tile <= 0 or q_len != kv_len or q_len <= 0:
        return 0.5
    full_blocks = (q_len - 1) // causal_tile  # the blocks before the one holding the last key
    # block j (from 1) of those: causal_tile queries computing j x causal_tile keys; the rest compute every key
    computed = causal_tile * causal_tile * full_blocks * (full_blocks + 1) // 2
    computed += (q_len - full_blocks * causal_tile) * q_len
    return computed / (q_len * q_len)


@dataclass(frozen=True)
class MemoryBound:
    """An elementwise, normalisation, copy or reduction kernel: `bytes` read and written, `flops` as the layer
    counts them (0 for a block's). `op`: its kind (MEMORY_KINDS; a backward's is the forward's + "_backward"),
    `elements` the elements it computes (what a kind's measured vector operations an element multiply: a
    description's [vector_ops], docs/devices.md); an optimizer step's `op` is its optimizer (OPTIMIZER_KINDS),
    `elements` its parameters and `tensors` its parameter tensors as (elements, count) runs (a description's
    [optimizer.NAME] costs it tensor by tensor). Left empty: costed by bytes and `flops` alone, as before."""

    name: str
    bytes: float
    dtype: str
    flops: float = 0.0
    launches: float = 1  # a share where the kernel runs in some of the passes an event stands for
    op: str = ""
    elements: float = 0.0
    tensors: tuple[tuple[int, int], ...] = ()
    # its backward's bytes and launches where they are not the rule's (1.5 x its bytes, its launches): 0 = the rule
    grad_bytes: float = 0.0
    grad_launches: int = 0
    weight_gradient: bool = False  # a backward's kernel on the weights' side (the bwd_weight step of a split backward)


Kernel = Gemm | Attention | MemoryBound


@dataclass(frozen=True)
class PassShape:
    """What the kernels of a layer's pass depend on beyond its signature: the micro-batch, the local sequence
    (seq_len / cp), the recompute mode, the attention kind and the dropout probability."""

    micro: int
    seq: int
    recompute: str = "none"
    attention: str = "sdpa"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTES:
            raise ValueError(f"unknown recompute {self.recompute!r}; known: {', '.join(RECOMPUTES)}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention kind {self.attention!r}; known: {', '.join(ATTENTION_KINDS)}")

    @classmethod
    def of_spec(cls, spec: JobSpec) -> PassShape:
        """A job's: its micro-batch, seq_len / cp, recompute mode and attention kind."""
        return cls(micro=spec.batch.micro, seq=spec.model.seq_len // spec.strategy.cp,
                   recompute=spec.strategy.recompute, attention=spec.model.attention)


def layer_kernels(layer: LayerDesc, shape: PassShape, phase: str) -> list[Kernel]:
    """The kernels of `layer`'s pass `phase` (fwd, bwd, or a split backward's bwd_input and bwd_weight) in order."""
    return _kernels(layer.kind, dict(layer.signature), shape, phase)


def event_kernels(content: Mapping[str, Any], recompute: str = "none") -> list[Kernel]:
    """The kernels of a plan's compute event from its content (harness.plan.events: layer, signature, micro, seq,
    phase; or an optimizer step's params and layers); the attention kind is the signature's."""
    if content.get("phase") == "optimizer":
        return optimizer_kernels(content)
    shape = PassShape(micro=int(content["micro"]), seq=int(content["seq"]), recompute=recompute)
    return _kernels(content["layer"], dict(content["signature"]), shape, content["phase"])


def job_event_kernels(content: Mapping[str, Any], spec: JobSpec) -> list[Kernel]:
    """A compute event's kernels as `spec`'s job runs it: event_kernels with the spec's recompute, and after a
    layer's backward its gradient accumulation (accumulation_kernels at accumulation_share(spec)), into the ZeRO
    shard's gradients where ZeRO 2 and 3 shard them."""
    shard = spec.strategy.dp if spec.strategy.zero >= 2 else 1
    return event_kernels(content, spec.strategy.recompute) + accumulation_kernels(
        content, accumulation_share(spec), shard, main_gradients_dtype(spec))


def main_gradients_dtype(spec: JobSpec) -> str | None:
    """With master weights, the dtype of Megatron-LM's main gradients, the reductions' (JobSpec.reduce_dtype: fp32
    with bf16 weights); None without them (the gradients are the weights')."""
    return spec.reduce_dtype if spec.optimizer.master_weights else None


def accumulation_share(spec: JobSpec) -> float:
    """The share of a step's micro-batches whose layer backwards add their gradients into accumulated ones: (m - 1)
    / m of a replica's m micro-batches as PyTorch accumulates (the first's backward makes them); all of them with
    `master_weights` (Megatron-LM's main gradients, zeroed at each step's start, take every micro-batch's add); 0
    with Megatron-LM's gradient accumulation fusion (`grad_accumulation_fusion`: the weight-gradient GEMM adds into
    the main gradient)."""
    if spec.strategy.grad_accumulation_fusion:
        return 0.0
    if spec.optimizer.master_weights:
        return 1.0
    micro_batches = max(1, spec.micro_batches)
    return (micro_batches - 1) / micro_batches


def accumulation_kernels(content: Mapping[str, Any], share: float, shard: int = 1,
                         main_gradients: str | None = None) -> list[Kernel]:
    """A layer's backward (bwd, or a split backward's bwd_weight) adding its parameters' new gradients into the
    accumulated ones (PyTorch's AccumulateGrad; Megatron-LM's main_grad.add_ without the fusion): an add a
    parameter tensor (its first dimension split over `shard` where the gradients are sharded), reading the new
    gradient (the weights' dtype) and the accumulated one and writing it (in `main_gradients`' dtype where given:
    Megatron's main gradients, main_gradients_dtype), spread over every backward the plan lists as `share` of it
    (accumulation_share). None for another phase, no share, or a layer whose tensors the plan does not know."""
    if share <= 0 or content.get("phase") not in ("bwd", "bwd_weight"):
        return []
    sig = dict(content["signature"])
    shapes = parameter_tensor_shapes(content["layer"], sig)
    if not shapes:
        return []
    elements = sum(shard_elements(shape, shard) for shape in shapes)
    dtype = sig.get("dtype", "float32")
    accumulated = DTYPES[main_gradients or dtype]
    return [MemoryBound("grad_accumulate", share * elements * (DTYPES[dtype] + 2 * accumulated), dtype, op="add",
                        elements=share * elements, launches=share * len(shapes))]


def optimizer_kernels(content: Mapping[str, Any]) -> list[Kernel]:
    """An optimizer step (harness.plan.events._optimizer_event): reads and writes each parameter, its gradient and
    its states (events.optimizer_bytes, in the weights' dtype, float32 with master weights: its layers'
    signatures and the content's `master_weights`) with 12 FLOPs a parameter, one launch per layer (foreach
    kernels over a layer's tensors). It also carries its optimizer (`op`: OPTIMIZER_KINDS), its parameters
    (`elements`) and its parameter tensors as (elements, count) runs, each tensor's ZeRO shard (its first
    dimension split over `shard`), for a description that measured the optimizer tensor by tensor
    ([optimizer.NAME]); no tensors where a layer's are not known (a factory model's, a Mixture-of-Experts
    block's)."""
    shard = int(content.get("shard", 1))
    params = -(-int(content["params"]) // shard)
    layers = sum(count for _, count in content.get("layers", ())) or 1
    name = content.get("optimizer", "adam")
    op = "adam" if name == "adam" else "sgd_momentum" if float(content.get("momentum", 0.0)) else "sgd"
    runs: dict[int, int] = {}
    for layer, count in content.get("layers", ()):
        shapes = parameter_tensor_shapes(layer["layer"], dict(layer["signature"]))
        if shapes is None:
            runs = {}
            break
        for shape in shapes:
            elements = shard_elements(shape, shard)
            runs[elements] = runs.get(elements, 0) + int(count)
    signatures = [dict(layer["signature"]) for layer, _ in content.get("layers", ())]
    dtype = optimizer_dtype(signatures[0].get("dtype", "float32") if signatures else "float32",
                            bool(content.get("master_weights", False)))
    return [MemoryBound("optimizer.step", optimizer_bytes(params, dtype), dtype, flops=12.0 * params,
                        launches=layers, op=op, elements=float(params), tensors=tuple(sorted(runs.items())))]


def shard_shape(shape: tuple[int, ...], shard: int) -> tuple[int, ...]:
    """One ZeRO shard of a parameter tensor of `shape`: its first dimension split over `shard`, rounded up, as
    FSDP2 splits it (the first replica's shard)."""
    return (-(-shape[0] // shard), *shape[1:])


def shard_elements(shape: tuple[int, ...], shard: int) -> int:
    """The elements of shard_shape's shard."""
    return math.prod(shard_shape(shape, shard))


def parameter_tensor_shapes(kind: str, sig: Mapping[str, Any]) -> list[tuple[int, ...]] | None:
    """The shapes of a built-in layer's trainable parameter tensors (this tensor-parallel shard's, as
    harness.models builds them; LayerDesc.params is their elements' sum), None for a layer whose tensors the plan
    does not know (a factory model's, a Mixture-of-Experts block's)."""
    if kind not in ("embedding", "block", "head") or "experts" in sig:
        return None
    family, h, tp = sig["family"], int(sig["hidden"]), int(sig.get("tp", 1))
    layer_norm = [(h,), (h,)]  # weight and bias
    if kind == "block":
        heads, kv_heads, ffn = int(sig["heads"]), int(sig["kv_heads"]), int(sig["ffn"])
        head_dim = h // heads
        if family == "llama":
            qkv = (heads + 2 * kv_heads) * head_dim // tp
            return [(h,), (qkv, h), (h, h // tp), (h,), (2 * ffn // tp, h), (h, ffn // tp)]
        return [*layer_norm, (3 * h // tp, h), (3 * h // tp,), (h, h // tp), (h,), *layer_norm,
                (ffn // tp, h), (ffn // tp,), (h, ffn // tp), (h,)]
    vocab = int(sig["vocab"]) // tp
    if kind == "embedding":
        if family == "llama":
            return [(vocab, h)]
        positions = [(int(sig["max_seq"]), h)]
        return [(vocab, h), *positions] + ([(2, h), *layer_norm] if family == "bert" else [])
    projection = [] if sig.get("tied") else [(vocab, h)]
    if family == "llama":
        return [(h,), *projection]
    if family == "bert":
        return [(h, h), (h,), *layer_norm, *projection, (vocab,)]
    return [*layer_norm, *projection]


def unshard_tensors(content: Mapping[str, Any]) -> int:
    """The parameter tensors of the FSDP2 unit a ZeRO collective's content names (`fsdp`: its layer and
    signature); 1 where the plan does not know them (parameter_tensor_shapes)."""
    unit = content["fsdp"]
    shapes = parameter_tensor_shapes(unit["layer"], dict(unit["signature"]))
    return len(shapes) if shapes else 1


def unshard_kernels(content: Mapping[str, Any]) -> list[MemoryBound]:
    """FSDP2's copies around a ZeRO all-gather (content: the event's; `bytes` the whole unit's, `group` its ranks):
    this rank's shards copied into the all-gather's input, then the gathered buffer copied out into each whole
    parameter, each read and written, a copy a parameter tensor (unshard_tensors)."""
    return unshard_copies(float(content["bytes"]), int(content["group"]), content["dtype"], unshard_tensors(content))


def unshard_copies(nbytes: float, group: int, dtype: str, tensors: int) -> list[MemoryBound]:
    """unshard_kernels' copies of a unit of `nbytes` in `tensors` parameter tensors all-gathered over `group`."""
    size = DTYPES[dtype]
    return [MemoryBound("fsdp.copy_in", 2.0 * nbytes / group, dtype, launches=tensors, op="copy",
                        elements=nbytes / group / size),
            MemoryBound("fsdp.copy_out", 2.0 * nbytes, dtype, launches=tensors, op="copy", elements=nbytes / size)]


def reduce_kernels(content: Mapping[str, Any]) -> list[MemoryBound]:
    """FSDP2's copy around a ZeRO reduce-scatter (content: the event's; `bytes` the whole unit's gradients): the
    whole gradients copied into the reduce-scatter's input, read and written, by one op (its chunk_cat). The
    shards it writes are views, not copies; an averaging reduce-scatter divides inside the collective."""
    return reduce_copies(float(content["bytes"]), content["dtype"])


def reduce_copies(nbytes: float, dtype: str) -> list[MemoryBound]:
    """reduce_kernels' copy of a unit's `nbytes` of gradients."""
    return [MemoryBound("fsdp.grad_copy_in", 2.0 * nbytes, dtype, op="copy", elements=nbytes / DTYPES[dtype])]


def kernels_flops(kernels: Iterable[Kernel]) -> float:
    return sum(kernel.flops for kernel in kernels)


def _kernels(kind: str, sig: dict[str, Any], shape: PassShape, phase: str) -> list[Kernel]:
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
    if kind == "user":
        raise UserError("a factory model's layers are its own code, whose kernels the plan cannot list; profile the "
                        "job (python -m harness profile) to cost them")
    if "experts" in sig:
        raise UserError("a Mixture-of-Experts block's kernels are not listed yet (its experts' token counts differ "
                        "by rank); profile the job (python -m harness profile) to cost it")
    if sig.get("recompute") == "selective" or sig.get("dropout") or sig.get("attention"):  # the layer's own
        shape = dataclasses.replace(shape, recompute=sig.get("recompute", shape.recompute),  # (harness.plan.layers)
                                    dropout=float(sig.get("dropout", shape.dropout)),
                                    attention=sig.get("attention", shape.attention))
    forward = {"embedding": _embedding, "block": _block, "head": _head}[kind](sig, shape)
    if phase == "fwd":
        return forward
    backward = [grad for kernel in reversed(forward) if kernel.name not in NO_GRADIENT for grad in _gradients(kernel)]
    if kind == "embedding":  # PyTorch's dense gradient of each table looked up: zeroed, then rows added
        h, dtype = int(sig["hidden"]), sig["dtype"]
        rows = {"embedding.table_grad_fill": int(sig["vocab"]) // int(sig.get("tp", 1))}
        if sig["family"] != "llama":
            rows["embedding.positions_grad_fill"] = int(sig["max_seq"])
        backward += [MemoryBound(name, float(n * h * DTYPES[dtype]), dtype, op="fill", elements=float(n * h))
                     for name, n in rows.items()]
    if kind == "block" and shape.recompute == "selective":
        backward = [k for k in forward if isinstance(k, Attention)] + backward
    if phase == "bwd":
        return backward
    weights = [k for k in backward if isinstance(k, Gemm) and k.weight_gradient]
    if phase == "bwd_weight":
        return weights + [_norm_weight_gradient(k) for k in reversed(forward)
                          if isinstance(k, MemoryBound) and k.op in NORM_KINDS]
    return [k for k in backward if k not in weights]


def _norm_weight_gradient(norm: MemoryBound) -> MemoryBound:
    """A norm's weight gradient as a split backward's second half computes it again (module docstring): its input
    and the output's gradient read (as many bytes as its forward's read and write), the weights' gradient written
    (negligible); RMSNorm's (harness.models' x_hat * weight) a multiply and a sum, its product written and read
    too."""
    rms = norm.op == "rms_norm"
    return MemoryBound(f"{norm.name}.grad_weight", norm.bytes * (2.0 if rms else 1.0), norm.dtype,
                       launches=2 if rms else 1, elements=norm.elements, weight_gradient=True)


def _gradients(kernel: Kernel) -> list[Kernel]:
    """A forward kernel's backward: a GEMM's input and weight gradients (none for a weight-less batched one's
    weight), attention's gradient, a memory-bound kernel's (its output's gradient and its input read, the input's
    gradient written: 1.5 x its bytes unless it says its own, grad_bytes; its counted FLOPs twice). Materialised
    attention's backward is 5 launches for its forward's 3 (two bmm for the probabilities' and the values'
    gradients, the softmax's, two for q's and k's)."""
    if isinstance(kernel, Gemm):
        return [Gemm(f"{kernel.name}.grad_input", kernel.m, kernel.k, kernel.n, kernel.dtype, kernel.batch),
                Gemm(f"{kernel.name}.grad_weight", kernel.k, kernel.n, kernel.m, kernel.dtype, kernel.batch,
                     weight_gradient=True)]
    if isinstance(kernel, Attention):
        return [Attention(f"{kernel.name}.grad", kernel.kind, kernel.batch, kernel.heads, kernel.q_len, kernel.kv_len,
                          kernel.head_dim, kernel.dtype, kernel.causal, backward=True,
                          launches=kernel.launches // 3 * 5 if kernel.kind == "materialized" else kernel.launches,
                          computed=kernel.computed, diagonal=kernel.diagonal)]
    return [MemoryBound(f"{kernel.name}.grad", kernel.grad_bytes or 1.5 * kernel.bytes, kernel.dtype,
                        2.0 * kernel.flops, kernel.grad_launches or kernel.launches,
                        op=f"{kernel.op}_backward" if kernel.op else "", elements=kernel.elements)]


def _block(sig: dict[str, Any], shape: PassShape) -> list[Kernel]:
    """A transformer block's forward (harness.models.transformer): norm, QKV, (rotary, grouped keys repeated),
    attention, its output reshaped, projection, (dropout), residual add; norm, MLP in, activation, MLP out,
    (dropout), residual add."""
    family, h, dtype, tp = sig["family"], int(sig["hidden"]), sig["dtype"], int(sig.get("tp", 1))
    heads, kv_heads, ffn = int(sig["heads"]), int(sig["kv_heads"]), int(sig["ffn"])
    cp, ring = int(sig.get("cp", 1)), sig.get("cp_comm", "ring") == "ring"
    d = DTYPES[dtype]
    tokens = shape.micro * shape.seq
    sp = bool(sig.get("sp"))
    between = tokens // tp if sp else tokens  # the tokens between the tensor-parallel regions
    head_dim, local, local_kv = h // heads, heads // tp, kv_heads // tp
    norm = "rms_norm" if family == "llama" else "layer_norm"
    out: list[Kernel] = [MemoryBound("norm1", 2.0 * between * h * d, dtype, op=norm, elements=float(between * h)),
                         *sequence_exchange("qkv.gathered", "linear", tokens, h, dtype, sp),
                         Gemm("qkv", tokens, (local + 2 * local_kv) * head_dim, h, dtype)]
    if family == "llama":
        out.append(MemoryBound("rotary", 2.0 * tokens * (local + local_kv) * head_dim * d, dtype, op="rotary",
                               elements=float(tokens * (local + local_kv) * head_dim)))
    if local_kv != local:
        out.append(MemoryBound("repeat_kv", 2.0 * tokens * (local + local_kv) * head_dim * d, dtype, op="copy",
                               elements=float(tokens * (local + local_kv) * head_dim)))
    ring_core = cp > 1 and ring
    if ring_core:
        out += ring_attention_kernels(shape.micro, local, head_dim, shape.seq, cp, family != "bert", dtype,
                                      shape.attention == "materialized")
    else:
        # the all-gather variant's causal mask is the zigzag positions', given as a tensor: every score computed
        out.append(Attention("attention", shape.attention, shape.micro, local, shape.seq, shape.seq * cp, head_dim,
                             dtype, causal=family != "bert", launches=3 if shape.attention == "materialized" else 1,
                             computed=1.0 if cp > 1 and family != "bert" else 0.0))
    if shape.attention == "materialized" and not ring_core and not fused_softmax(
            d, shape.micro * local, shape.seq, shape.seq * cp, causal=family != "bert"):
        out.append(_unfused_softmax(shape.micro * local * shape.seq * shape.seq * cp, dtype))
    if shape.dropout and shape.attention == "materialized":  # a fused kernel draws its own mask
        scores = shape.micro * local * shape.seq * shape.seq * cp
        out.append(MemoryBound("attention_dropout", scores * (2.0 * d + MASK_BYTES), dtype, op="dropout",
                               elements=float(scores)))
    out += [MemoryBound("context_copy", 2.0 * tokens * local * head_dim * d, dtype, op="copy",
                        elements=float(tokens * local * head_dim)),
            Gemm("proj", tokens, h, local * head_dim, dtype),
            *sequence_exchange("proj.scattered", "scatter", tokens, h, dtype, sp)]
    out += _residual("1", between, h, d, dtype, shape.dropout)
    out.append(MemoryBound("norm2", 2.0 * between * h * d, dtype, op=norm, elements=float(between * h)))
    out += sequence_exchange("mlp.gathered", "linear", tokens, h, dtype, sp)
    if family == "llama":
        out += [Gemm("gate_up", tokens, 2 * ffn // tp, h, dtype),
                MemoryBound("swiglu", 3.0 * tokens * ffn // tp * d, dtype, op="swiglu",
                            elements=float(tokens * ffn // tp)),
                Gemm("down", tokens, h, ffn // tp, dtype)]
    else:
        out += [Gemm("fc1", tokens, ffn // tp, h, dtype),
                MemoryBound("gelu", 2.0 * tokens * ffn // tp * d, dtype, op="gelu", elements=float(tokens * ffn // tp)),
                Gemm("fc2", tokens, h, ffn // tp, dtype)]
    out += sequence_exchange("mlp.scattered", "scatter", tokens, h, dtype, sp)
    return out + _residual("2", between, h, d, dtype, shape.dropout)


# a sequence-parallel exchange's copies of the whole sequence (harness.models.tp), forward and backward: an
# all-gather into a column-parallel linear (_GatheredLinear: its buffer copied out; the backward copies the input's
# gradient into a reduce-scatter's buffer and gathers the input again for the weights' gradient, copied out too),
# a bare all-gather (gather_sequence; its gradient reduce-scattered) and a reduce-scatter (scatter_sequence; its
# gradient all-gathered)
EXCHANGE_COPIES = {"linear": (1, 2), "gather": (1, 1), "scatter": (1, 1)}


def sequence_exchange(name: str, how: str, tokens: int, h: int, dtype: str, sp: bool) -> list[MemoryBound]:
    """The copies of the whole sequence's (tokens x h) activations a sequence-parallel exchange `how`
    (EXCHANGE_COPIES) makes in its layer's forward, with its backward's as the kernel's gradient: each copy reads and
    writes the tensor once. None without sp."""
    if not sp:
        return []
    forward, backward = EXCHANGE_COPIES[how]
    copy = 2.0 * tokens * h * DTYPES[dtype]
    return [MemoryBound(name, forward * copy, dtype, launches=forward, op="copy", elements=float(forward * tokens * h),
                        grad_bytes=backward * copy, grad_launches=backward)]


def ring_attention_kernels(micro: int, heads: int, head_dim: int, seq: int, cp: int, causal: bool, dtype: str,
                           materialized: bool) -> list[Kernel]:
    """A context-parallel ring's attention (harness.models.context.ring_attention) over `seq` local tokens of
    `heads` local heads, as the rank running the most blocks runs it (harness.plan.ring.ring_blocks), forward, each
    kernel carrying its backward:
    - "ring.setup": the output and log-sum-exp started (zeros, full) and the keys and values stacked; backward, the
      queries' gradient started and the stack again (materialised: each row's output . gradient, a multiply and a
      sum); in 16 bits the casts to and from float32;
    - "ring.masks" (causal): the pass's block masks, built once a kind in each direction (fused: added to the
      scores in the inputs' dtype);
    - a step's "ring.attention": its blocks fused (one launch each, over the step's keys) or materialised in
      float32 (3 launches each; backward 5, the harness's softmax and recomputed scores in "ring.scores"),
      counted over the step's whole square, computing its full chunk pairs whole (`computed`) and its diagonal
      ones as a causal kernel does (`diagonal`);
    - a step's "ring.merge": each block merged into the output by its log-sum-exp (10 launches: 6 on a row's
      statistics, 4 on the output's rows); backward, each block's query, key and value gradients added in
      place (3) and the step's gradients started (and, after the first, the travelling ones added).
    FLOPs only in ring.attention, as the layers count them (4 b heads s (s x cp) d a pass)."""
    acc = "float32"
    a, d = DTYPES[acc], DTYPES[dtype]
    cast = d != a  # a 16-bit ring computes and merges in float32
    _, steps = ring_blocks(cp, causal)
    chunk = seq // 2
    rows = micro * heads  # (sample, head) rows
    out_elements = rows * seq * head_dim
    setup = out_elements * a + rows * seq * a + 4.0 * out_elements * d
    grad_setup = out_elements * a + 4.0 * out_elements * d
    setup_launches, grad_setup_launches = 3, 2
    if materialized:  # delta = (dout * out).sum(-1)
        grad_setup += 3.0 * out_elements * a + out_elements * a
        grad_setup_launches += 2
    if cast:  # out to the inputs' dtype; the gradients (q, k, v) back to it; materialised: q (and backward q, dout,
        # out) to float32
        setup += out_elements * (a + d) * (2 if materialized else 1)
        setup_launches += 2 if materialized else 1
        grad_setup += 3.0 * out_elements * (a + d) + (3.0 * out_elements * (a + d) if materialized else 0.0)
        grad_setup_launches += 3 + (3 if materialized else 0)
    kernels: list[Kernel] = [MemoryBound("ring.setup", setup, dtype, launches=setup_launches, op="copy",
                                         elements=float(3 * out_elements), grad_bytes=grad_setup,
                                         grad_launches=grad_setup_launches)]
    kinds = {block.kinds for blocks in steps for block in blocks if block.masked}
    if kinds:  # ones, triu (, zeros_like, cat for a two-chunk mask) (, fused: zeros, masked_fill_ into the dtype)
        launches = sum(2 + (2 if len(k) > 1 else 0) + (0 if materialized else 2) for k in kinds)
        mask_bytes = float(sum(chunk * chunk * len(k) * (1 + (0 if materialized else d)) for k in kinds))
        kernels.append(MemoryBound("ring.masks", launches * mask_bytes, dtype, launches=launches, op="fill",
                                   elements=mask_bytes, grad_bytes=launches * mask_bytes, grad_launches=launches))
    for step, blocks in enumerate(steps):
        area = sum(b.q_chunks * b.kv_chunks for b in blocks) * chunk * chunk  # scores computed, masked ones whole
        diagonal = sum(b.kinds.count(DIAGONAL) for b in blocks if b.q_chunks == 1) * chunk * chunk
        masked = sum(1 for b in blocks if b.masked)
        kernels.append(Attention(f"ring.attention.{step}", "materialized" if materialized else "sdpa", micro, heads,
                                 seq, seq, head_dim, acc if materialized else dtype, causal,
                                 launches=(3 if materialized else 1) * len(blocks),
                                 computed=(area - diagonal) / (seq * seq), diagonal=diagonal / (seq * seq)))
        if materialized:  # beyond materialised attention's 4 (backward 7) passes over its scores and 3 (5) launches
            scores = rows * area * a
            kernels.append(MemoryBound(f"ring.scores.{step}", scores * 9 + rows * area * 2 * masked, acc,
                                       launches=3 * len(blocks) + masked, op="copy", elements=float(rows * area),
                                       grad_bytes=scores * 10 + rows * area * 2 * masked,
                                       grad_launches=6 * len(blocks) + masked))
        queries = sum(b.q_chunks for b in blocks) * chunk * rows * head_dim  # each block's query rows' outputs
        keys = sum(b.kv_chunks for b in blocks) * chunk * rows * head_dim
        statistics = queries // head_dim
        block_cast = cast and not materialized  # each fused block's output cast to float32
        step_cast = 2.0 * out_elements * (a + d) if cast and materialized else 0.0  # the held keys and values
        merge = 15.0 * statistics * a + 9.0 * queries * a + (queries * (a + d) if block_cast else 0.0) + step_cast
        gradients = 3.0 * (queries + 2 * keys) * a + 2.0 * out_elements * a + (6.0 * out_elements * a if step else 0.0)
        kernels.append(MemoryBound(f"ring.merge.{step}", merge, acc,
                                   launches=(10 + block_cast) * len(blocks) + bool(step_cast), op="copy",
                                   elements=float(queries), grad_bytes=gradients + step_cast,
                                   grad_launches=3 * len(blocks) + 1 + (step > 0) + bool(step_cast)))
    return kernels


def _unfused_softmax(scores: int, dtype: str) -> MemoryBound:
    """What Megatron-LM's float32 fallback (fused_softmax is False) adds to the fused kernel that materialised
    attention counts (its 16-bit scores read and probabilities written): the scores made float32, scaled, masked,
    softmaxed and made 16-bit again, 4 more launches and 36 - 4 bytes an element in d = 2; its backward, autograd
    over the same five steps, 40 bytes an element against the fused backward's 6."""
    d = DTYPES[dtype]
    forward = (d + 4) + 8 + 8 + 8 + (4 + d) - 2 * d
    backward = (d + 4) + 12 + 8 + 8 + (4 + d) - 3 * d
    return MemoryBound("attention_softmax_float32", float(scores * forward), dtype, launches=4, op="copy",
                       elements=float(scores), grad_bytes=float(scores * backward), grad_launches=4)


def _residual(which: str, tokens: int, h: int, d: int, dtype: str, dropout: float) -> list[Kernel]:
    """A sub-layer's output (dropped out with `dropout`: read, written and its mask) added to the residual stream."""
    dropped = [MemoryBound(f"dropout{which}", tokens * h * (2.0 * d + MASK_BYTES), dtype, op="dropout",
                           elements=float(tokens * h))] if dropout else []
    return dropped + [MemoryBound(f"residual{which}", 3.0 * tokens * h * d, dtype, op="add",
                                  elements=float(tokens * h))]


def _embedding(sig: dict[str, Any], shape: PassShape) -> list[Kernel]:
    """The operations harness.models' Embedding dispatches, one listed kernel each:
    - a vocabulary shard (tp > 1): the token ids moved into the shard and masked (VOCAB_MASK_LAUNCHES operations on
      the ids, no gradient), then the lookup, then the rows of tokens outside the shard zeroed (an out-of-place
      masked_fill: a copy and the fill);
    - without a shard, the lookup alone;
    - GPT-2's and BERT's positions: the lookup of this rank's sequence positions (with sequence parallelism a
      tensor-parallel rank's 1 / tp of them, after the shards' reduce-scatter) and their add, broadcast over the
      micro-batch; BERT's token type's add (one row, broadcast) and its LayerNorm;
    - with dropout, its dropout.
    The lookup carries the layer's h FLOPs a token (LayerDesc.fwd_flops: the tables' sum, as the layer counts it).
    Megatron-LM's VocabParallelEmbedding runs the like: six operations on the ids, the outside rows zeroed in place,
    the positions looked up for every token before the scatter; the launches differ by one, the bytes a little."""
    family, h, dtype, tp = sig["family"], int(sig["hidden"]), sig["dtype"], int(sig.get("tp", 1))
    d = DTYPES[dtype]
    tokens = shape.micro * shape.seq
    positions = shape.seq // tp if sig.get("sp") else shape.seq  # the sequence positions this rank adds
    local = shape.micro * positions  # the tokens it adds them to
    out: list[Kernel] = []
    if tp > 1:
        out.append(MemoryBound(VOCAB_MASK, float(tokens * VOCAB_MASK_BYTES), dtype,
                               launches=VOCAB_MASK_LAUNCHES, op="copy", elements=float(tokens)))
    out.append(MemoryBound("embedding.lookup", tokens * (ID_BYTES + 2.0 * h * d), dtype, flops=float(tokens * h),
                           op="embedding", elements=float(tokens * h)))
    if tp > 1:
        out.append(MemoryBound("embedding.outside_zeroed", tokens * (4.0 * h * d + MASK_BYTES), dtype, op="copy",
                               elements=float(tokens * h)))
        out += sequence_exchange("embedding.scattered", "scatter", tokens, h, dtype, bool(sig.get("sp")))

    def added(name: str, rows: int) -> MemoryBound:  # the tokens' rows read and written, `rows` rows added
        return MemoryBound(name, (2.0 * local + rows) * h * d, dtype, op="add", elements=float(local * h))
    if family != "llama":
        out += [MemoryBound("embedding.positions", positions * (ID_BYTES + 2.0 * h * d), dtype, op="embedding",
                            elements=float(positions * h)), added("embedding.add_positions", positions)]
    if family == "bert":
        out += [added("embedding.add_token_type", 1),
                MemoryBound("embedding.norm", 2.0 * local * h * d, dtype, op="layer_norm", elements=float(local * h))]
    if shape.dropout:
        out.append(MemoryBound("embedding.dropout", local * h * (2.0 * d + MASK_BYTES), dtype, op="dropout",
                               elements=float(local * h)))
    return out


def _head(sig: dict[str, Any], shape: PassShape) -> list[Kernel]:
    """The final norm (BERT: its transform, GELU and LayerNorm), the logits over this shard's vocabulary and the
    cross-entropy (5 FLOPs a logit: the maximum, the exponential, the sum, the log and the target's pick)."""
    family, h, dtype = sig["family"], int(sig["hidden"]), sig["dtype"]
    d = DTYPES[dtype]
    tp, sp = int(sig.get("tp", 1)), bool(sig.get("sp"))
    vocab = int(sig["vocab"]) // tp
    tokens = shape.micro * shape.seq
    shard = tokens // tp if sp else tokens  # the tokens before the logits: a sequence shard's with sp
    out: list[Kernel] = []
    if family == "bert":
        out += [Gemm("transform", shard, h, h, dtype),
                MemoryBound("transform_gelu", 2.0 * shard * h * d, dtype, op="gelu", elements=float(shard * h))]
    norm = "rms_norm" if family == "llama" else "layer_norm"
    logits = tokens * vocab
    out += [MemoryBound("final_norm", 2.0 * shard * h * d, dtype, op=norm, elements=float(shard * h)),
            *sequence_exchange("head.gathered", "gather", tokens, h, dtype, sp),
            Gemm("logits", tokens, vocab, h, dtype)]
    if d < LOSS_BYTES:  # the loss runs on float32 logits (harness.models.transformer, Megatron-LM)
        out.append(MemoryBound("logits_float32", float(logits * (d + LOSS_BYTES)), dtype, op="copy",
                               elements=float(logits)))
    if megatron_loss(sig):
        # Megatron-LM's vocab_parallel_cross_entropy: the maximum, the shifted logits, their exponential in place,
        # its sum and the division in place (8 float32 passes: a read, two, two, a read, two); its backward scales
        # the saved softmax in place
        out.append(MemoryBound("cross_entropy", 8.0 * logits * LOSS_BYTES, "float32", flops=5.0 * logits,
                               launches=5, op="cross_entropy", elements=float(logits),
                               grad_bytes=2.0 * logits * LOSS_BYTES, grad_launches=1))
    else:  # torch's cross_entropy: a log-softmax over the logits (its maximum, its sum, the result)
        out.append(MemoryBound("cross_entropy", 3.0 * logits * LOSS_BYTES, "float32", flops=5.0 * logits,
                               op="cross_entropy", elements=float(logits)))
    return out
