"""Saved activations from formulas: the bytes each built-in layer's forward saves for its backward, what a split
backward's input step keeps for its weight step, and what it lets go of as a stage's last layer, from the layer's
description and the job's spec alone (no profile, no torch), so that a model nobody ran is sized (docs/analysis.md,
"Memory", "Activations from formulas").

The figures are Korthikanti et al. (2022)'s per-layer accounting specialised to what harness.models' torch layers
save, term by term (`layer_terms`), as harness.profile.memory meters them (every distinct storage once; weights
not counted): per tensor-parallel shard, micro-batch b, a context-parallel rank's s tokens (seq / cp), T = b s,
T' = T / tp with sequence parallelism (else T), hidden h, dtype bytes d, a = heads / tp and kv = kv_heads / tp of
head size hd, F = ffn / tp, V = vocab / tp split by vocabulary (else vocab), acc = 4 (float32 accumulation):
- transformer block: its two norms' inputs (LayerNorm: T' h d each and mean and rstd, 2 T' d; LLaMA's RMSNorm:
  its input cast to float32 twice, once where d = 4, its normalised output in d and its rsqrt, T' x 4), the
  attention's and the MLP's inputs (T' h d each: a sequence-parallel column linear saves the shard), q, k and v
  as the attention kernel holds them (GPT-2 and BERT: views of the fused QKV output, T (a + 2 kv) hd d; LLaMA: the
  rotated queries and keys and, with grouped-query attention, the keys and values repeated to a heads, 3 T a hd d,
  else the rotated pair and the QKV output; its rotary cos and sin, 2 s hd d), a logsumexp per query row
  (b a s x acc: torch's scaled_dot_product_attention keeps no s x s matrix on a CPU nor with the flash or
  memory-efficient kernels), the attention's output (T a hd d), copied again for the projection where the kernel
  returns it head-major (LLaMA's contiguous rotated queries; the ring's output), the MLP's hidden (GELU: its input
  and output, 2 T F d; SwiGLU: the fused gate-and-up output, the SiLU and the product, 4 T F d); context parallelism
  by all-gather adds the gathered keys and values (2 cp T a hd d in place of k and v) and, causal, the
  float mask (s x cp s x d);
- Mixture-of-Experts block (tp = 1): the attention as above, and in place of the MLP the gate's float32 input
  (T h acc; with d < acc also the gate weight's float32 copy, E h acc, and with shared experts the norm's output
  in d), the router's probabilities (T E acc), for the A routed (token, expert) pairs of a rank's tokens their
  indices (2 A x 8) and weights (3 A acc), the R rows its experts compute (R h d and per row 2 or 4 x expert_ffn d
  as the MLP's), the combine's float32 rows and their weighted product (2 A h acc), and the shared experts'
  MLP; with ep > 1 the rows' regrouping indices (2 R x 8);
- embedding: the token ids (T x 8; split by vocabulary, the shard's masked ids and the mask, T x 9), GPT-2's and
  BERT's position indices (s x 8), BERT's LayerNorm's input and statistics;
- head with the loss: the norm's input and statistics (BERT: its transform's input, output and GELU output
  before them) on T' tokens, the projection's input on T (gathered), the loss's float32 log-probabilities (split
  by vocabulary: its softmax shard) T V x 4, its int64 targets T x 8, and a float32 scalar (split: a T-byte mask).
Dropout (the layer's signature's, Megatron-LM's, or the `dropout` option) adds the hidden dropouts' masks (2 T' h
per block, T' h after the embedding) of `mask_bytes` each (1: torch's bool mask on CUDA; a CPU's dropout saves its
mask in the dtype, d); with `attention = "math"` (torch's scaled_dot_product_attention falling back to its math
path, as on a CPU with dropout; float32: in 16 bits it computes in float32, not modelled) the attention keeps,
in place of the logsumexp and its own output, its scaled queries and keys (2 T a hd d: GPT-2's, BERT's and
grouped-query LLaMA's beside what the fused kernel keeps, LLaMA's in place of the rotated pair) and two b a s s_k d
matrices (the probabilities and their dropped-out copy), the projection's input copied once. A block
under selective recompute (its signature's "recompute") saves of its attention core only the inputs
(torch.utils.checkpoint's), the output once as the projection's input: no logsumexp, no s x s_k matrix
(`attention_core_bytes`: what its backward makes again).
Korthikanti's older Megatron: `attention = "materialized"` keeps the softmax output (b a s s_k d, s_k the keys' cp
s) in place of the logsumexp, its output saved once, and with dropout the attention dropout's mask and output
(b a s s_k (mask_bytes + d)).
LayerNorm statistics are counted in d, as on a CPU (CUDA keeps them in float32: 2 T' (4 - d) bytes more a norm).
A factory model's layers have no formula: they are left to the profile.
"""
from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from harness.common.errors import UserError
from harness.plan.events import EventPlan
from harness.plan.layers import (
    LayerDesc,
    fused_softmax,
    input_bytes,
    moe_load,
    recompute_group,
    recompute_groups,
    selective,
)
from harness.plan.spec import JobSpec

ATTENTION_KINDS = ("flash", "materialized", "math")
INDEX_BYTES = 8  # int64 token ids, targets, positions and routing indices
MASK_BYTES = 1  # a bool or uint8 mask element
ACC_BYTES = 4  # float32: the norms' and the router's accumulation, the loss, the attention's logsumexp
# the terms a split backward's input step lets go of as a stage's last layer (kept_for_weights' `released`)
LOSS_TERMS = ("loss log-probabilities", "loss targets", "loss scalar")
COMBINE_TERMS = ("routing indices", "routing weights", "combine rows")


class BackwardTemporaries(NamedTuple):
    """A layer's backward at its worst moments, as a profile measures them (harness.profile.memory.
    backward_temporaries) and the memory model reads them: the temporaries then and the saved bytes let go of by
    then, once its output's gradient has reached it (`made`, `freed`) and, for a model's last layer, whose
    forward ends in the loss, in the loss's backward before that (`loss_made`, `loss_freed`)."""

    made: int
    freed: int
    loss_made: int = 0
    loss_freed: int = 0


@dataclass(frozen=True)
class Sizes:
    """What one layer's formulas read: its description's signature and the event's micro-batch and tokens."""

    kind: str
    family: str
    micro: int
    seq: int  # a context-parallel rank's tokens of a sample
    hidden: int
    dtype_bytes: int
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_comm: str = "ring"
    heads: int = 0  # this shard's
    kv_heads: int = 0
    head_dim: int = 0
    ffn: int = 0  # this shard's
    vocab: int = 0  # this shard's (split by vocabulary) or the whole padded vocabulary

    @property
    def tokens(self) -> int:
        return self.micro * self.seq

    @property
    def shard_tokens(self) -> int:
        """The tokens between the tensor-parallel regions: a sequence shard with sp."""
        return self.tokens // self.tp if self.sp else self.tokens


def sizes(spec: JobSpec, layer: LayerDesc, micro: int, seq: int) -> Sizes:
    """The sizes of built-in `layer` for `micro` samples of `seq` tokens (a context-parallel rank's)."""
    if layer.kind not in ("embedding", "block", "head"):
        raise UserError(f"layer {layer.index} is a factory model's ({layer.kind!r}): its saved activations have no "
                        "formula; profile the model (harness profile) to measure them")
    model, sig = spec.model, dict(layer.signature)
    tp = int(sig.get("tp", 1))
    common = dict(kind=layer.kind, family=model.family, micro=micro, seq=seq, hidden=model.hidden,
                  dtype_bytes=model.dtype_bytes, tp=tp, sp=bool(sig.get("sp", False)), cp=int(sig.get("cp", 1)),
                  cp_comm=str(sig.get("cp_comm", "ring")))
    if layer.kind == "block":
        return Sizes(**common, heads=model.heads // tp, kv_heads=model.kv_heads // tp,
                     head_dim=model.hidden // model.heads, ffn=model.ffn // tp)
    return Sizes(**common, vocab=model.vocab // tp)


def _norm(family: str, tokens: int, hidden: int, d: int) -> tuple[int, int]:
    """(what a norm saves beside its statistics, its statistics) on `tokens` tokens: LayerNorm its input and its
    mean and rstd; RMSNorm (harness.models.transformer) its input cast to float32 for the square and again for the
    product (the input itself where d = 4), the normalised product in d before the weight, and its float32 rsqrt."""
    if family != "llama":
        return tokens * hidden * d, 2 * tokens * d
    casts = 1 if d == ACC_BYTES else 2
    return tokens * hidden * (casts * ACC_BYTES + d), tokens * ACC_BYTES


def _attention(z: Sizes, attention: str, dropout: float, mask_bytes: int = MASK_BYTES,
               core_recomputed: bool = False) -> dict[str, int]:
    """The attention's terms from its QKV output to its projection's input (`core_recomputed`: selective
    recompute's)."""
    b, s, t, d, a, kv, hd = z.micro, z.seq, z.tokens, z.dtype_bytes, z.heads, z.kv_heads, z.head_dim
    keys = s * z.cp  # every query attends to the whole sequence's keys
    gathered = z.cp > 1 and z.cp_comm == "allgather"
    out: dict[str, int] = {}
    if z.family == "llama":
        out["rotary"] = 2 * s * hd * d  # cos and sin (s x hd / 2 each) for the queries and again for the keys
        queries = t * a * hd * d  # rotated: a tensor of its own
        if gathered:
            kv_bytes = 0  # the keys and values are saved gathered
        elif kv != a:  # grouped-query: the keys and values repeated to the query heads
            kv_bytes = 2 * t * a * hd * d
        else:  # the rotated keys, and the values as a view of the QKV output
            kv_bytes = t * kv * hd * d + t * (a + 2 * kv) * hd * d
        out["qkv"] = queries + kv_bytes
    else:  # q, k and v are views of the fused QKV output
        out["qkv"] = t * (a + 2 * kv) * hd * d
    if gathered:
        out["gathered keys and values"] = 2 * z.cp * t * a * hd * d
    if core_recomputed:  # the core's inputs alone; its output once, as the projection's input
        out["attention output"] = t * a * hd * d
        return out
    if attention == "materialized":
        scores = b * a * s * keys
        if fused_softmax(d, b * a, s, keys, causal=z.family != "bert"):
            out["attention softmax"] = scores * d
        else:  # Megatron-LM's float32 fallback: the softmax keeps its float32 output, the bmm the 16-bit copy
            out["attention softmax"] = scores * ACC_BYTES + (0 if dropout > 0 else scores * d)
        if dropout > 0:
            out["attention dropout"] = scores * (mask_bytes + d)
        out["attention output"] = t * a * hd * d
        return out
    if attention == "math":
        if z.family != "llama" or kv != a:  # LLaMA's scaled pair takes the place of its rotated one
            out["scaled queries and keys"] = 2 * t * a * hd * d
        out["attention probabilities"] = 2 * b * a * s * keys * d
        out["attention output"] = t * a * hd * d
        return out
    out["attention logsumexp"] = b * a * s * ACC_BYTES
    if gathered and z.family != "bert":  # causal: the zigzag positions' mask, as the attention's dtype
        out["attention mask"] = s * keys * d
    # the kernel's output follows the queries' layout: head-major (contiguous rotated queries, the ring's
    # output) it is copied into the projection's token-major input
    copied = (z.cp > 1 and not gathered) or z.family == "llama"
    out["attention output"] = t * a * hd * d * (2 if copied else 1)
    return out


def _moe(spec: JobSpec, layer: LayerDesc, z: Sizes) -> tuple[dict[str, int], dict[str, int]]:
    """A Mixture-of-Experts MLP's (harness.models.moe) saved terms and the gradients its input step keeps."""
    model, sig = spec.model, dict(layer.signature)
    t, h, d, acc = z.tokens, z.hidden, z.dtype_bytes, max(ACC_BYTES, z.dtype_bytes)
    ep, experts = int(sig.get("ep", 1)), model.experts
    counts, _ = moe_load(model, ep, t, int(sig.get("moe_layer", 0)))
    routed = sum(counts)  # (token, expert) pairs of this rank's tokens
    rows = sum(ast.literal_eval(str(sig["received"])))  # the rows its experts compute (every ep rank's)
    per_row = 4 if model.family == "llama" else 2  # SwiGLU: gate-and-up, SiLU, product; GELU: input, output
    shared_ffn = model.shared_experts * model.expert_ffn
    saved = {"mlp input": t * h * acc + (experts * h * acc if d < acc else 0)
             + (t * h * d if shared_ffn and d < acc else 0),
             "router probabilities": t * experts * acc,
             "routing indices": 2 * routed * INDEX_BYTES,
             "routing weights": 3 * routed * acc,
             "expert rows": rows * h * d,
             "mlp": per_row * rows * model.expert_ffn * d + per_row * t * shared_ffn * d,
             "combine rows": 2 * routed * h * acc}
    if ep > 1:  # the received rows' regrouping by expert and its inverse
        saved["regroup indices"] = 2 * rows * INDEX_BYTES
    hidden_grads = 2 if model.family == "llama" else 1
    kept = {"router gradient": t * experts * acc,
            "mlp gradients": rows * (hidden_grads * model.expert_ffn + h) * d
            + (t * (hidden_grads * shared_ffn + h) * d if shared_ffn else 0)}
    return saved, kept


def _block(spec: JobSpec, layer: LayerDesc, z: Sizes, attention: str, dropout: float,
           mask_bytes: int = MASK_BYTES) -> tuple[dict, dict]:
    t, ts, h, d = z.tokens, z.shard_tokens, z.hidden, z.dtype_bytes
    inputs, statistics = _norm(z.family, ts, h, d)
    saved = {"norm inputs": 2 * inputs, "norm statistics": 2 * statistics, "attention input": ts * h * d,
             **_attention(z, attention, dropout, mask_bytes, selective(layer))}
    qkv_out = t * (z.heads + 2 * z.kv_heads) * z.head_dim * d
    kept = {"norm gradients": 2 * ts * h * d, "qkv gradient": qkv_out, "projection gradient": t * h * d}
    if "experts" in dict(layer.signature):
        moe_saved, moe_kept = _moe(spec, layer, z)
        saved.update(moe_saved)
        kept.update(moe_kept)
    else:
        saved["mlp input"] = ts * h * d
        saved["mlp"] = (4 if z.family == "llama" else 2) * t * z.ffn * d
        kept["mlp gradients"] = ((2 if z.family == "llama" else 1) * z.ffn + h) * t * d
    if z.sp and z.family != "llama":  # the row-parallel biases' gradients on the shard, beside the partial sums'
        kept["bias gradients"] = 2 * ts * h * d
    if dropout > 0:
        saved["dropout masks"] = 2 * ts * h * mask_bytes
    return saved, kept


def _embedding(z: Sizes, dropout: float, mask_bytes: int = MASK_BYTES) -> dict[str, int]:
    t, ts, h, d = z.tokens, z.shard_tokens, z.hidden, z.dtype_bytes
    split = z.tp > 1
    out = {"token ids": t * (INDEX_BYTES + (MASK_BYTES if split else 0))}
    if z.family != "llama":
        out["position ids"] = z.seq * INDEX_BYTES  # the rank's positions buffer, whole
    if z.family == "bert":
        out["norm inputs"], out["norm statistics"] = _norm(z.family, ts, h, d)
    if dropout > 0:
        out["dropout masks"] = ts * h * mask_bytes
    return out


def _head(z: Sizes) -> tuple[dict[str, int], dict[str, int]]:
    t, ts, h, d = z.tokens, z.shard_tokens, z.hidden, z.dtype_bytes
    inputs, statistics = _norm(z.family, ts, h, d)
    saved = {"norm inputs": inputs, "norm statistics": statistics}
    kept = {"norm gradients": ts * h * d, "logits gradient": t * z.vocab * d}
    if z.family == "bert":  # the transform's input, its output and its GELU's (the norm's input, counted above)
        saved["transform"] = 2 * ts * h * d
        kept["norm gradients"] += ts * h * d
    split = z.tp > 1
    saved.update({"projection input": t * h * d, "loss log-probabilities": t * z.vocab * ACC_BYTES,
                  "loss targets": t * INDEX_BYTES,
                  # split: which targets fall in the shard's vocabulary; whole: nll_loss's total weight
                  "loss scalar": t * MASK_BYTES if split else ACC_BYTES})
    return saved, kept


def layer_terms(spec: JobSpec, layer: LayerDesc, micro: int, seq: int, *, attention: str = "flash",
                dropout: float | None = None, mask_bytes: int = MASK_BYTES) -> dict[str, int]:
    """What one forward of built-in `layer` saves for its backward (module docstring), by term, for `micro`
    samples of `seq` tokens (a context-parallel rank's); a head's with its loss. `dropout`: the layer's own
    (its signature's) when None; `mask_bytes`: a dropout mask's element."""
    return _terms(spec, layer, micro, seq, attention, dropout, mask_bytes)[0]


def _terms(spec: JobSpec, layer: LayerDesc, micro: int, seq: int, attention: str, dropout: float | None,
           mask_bytes: int = MASK_BYTES) -> tuple[dict[str, int], dict[str, int]]:
    if attention not in ATTENTION_KINDS:
        raise UserError(f"attention = {attention!r} is not one of {ATTENTION_KINDS}")
    if dropout is None:
        dropout = float(dict(layer.signature).get("dropout", 0.0))
    if not 0.0 <= dropout < 1.0:
        raise UserError(f"dropout = {dropout!r} is not a probability in [0, 1)")
    if attention == "math" and not dropout:  # without dropout torch runs its fused kernel
        attention = "flash"
    z = sizes(spec, layer, micro, seq)
    if z.kind == "embedding":
        return _embedding(z, dropout, mask_bytes), {}
    if z.kind == "head":
        return _head(z)
    return _block(spec, layer, z, attention, dropout, mask_bytes)


def attention_core_bytes(spec: JobSpec, layer: LayerDesc, micro: int, seq: int, **options) -> int:
    """What a block's attention core saves beyond its inputs and the projection's input (its logsumexp, or its
    s x s_k matrices, and its own output): what selective recompute leaves unsaved and its backward makes again."""
    if layer.kind != "block":
        return 0
    whole = dataclasses.replace(layer, signature=tuple(item for item in layer.signature if item[0] != "recompute"))
    core_recomputed = dataclasses.replace(whole, signature=whole.signature + (("recompute", "selective"),))
    return saved_bytes(spec, whole, micro, seq, **options) - saved_bytes(spec, core_recomputed, micro, seq, **options)


def saved_bytes(spec: JobSpec, layer: LayerDesc, micro: int, seq: int, **options) -> int:
    """The sum of `layer_terms`: the bytes one forward saves (what harness.profile.memory.activation_bytes
    measures)."""
    return sum(layer_terms(spec, layer, micro, seq, **options).values())


def kept_bytes(spec: JobSpec, layer: LayerDesc, micro: int, seq: int) -> int:
    """What a split backward's input step keeps for the weight step: the gradients at the outputs of the
    operations that hold weights (the norms', the linears', the router's; an embedding's: none)."""
    return sum(_terms(spec, layer, micro, seq, "flash", 0.0)[1].values())


def released_bytes(spec: JobSpec, layer: LayerDesc, micro: int, seq: int, **options) -> int:
    """What a split backward's input step lets go of as a stage's last layer: all an embedding saved, a head's
    loss's, a Mixture-of-Experts block's combine's (its routing pairs' indices, weights and rows), a dense
    block's nothing."""
    terms = layer_terms(spec, layer, micro, seq, **options)
    if layer.kind == "embedding":
        return sum(terms.values())
    return sum(terms.get(name, 0) for name in LOSS_TERMS + COMBINE_TERMS)


def held_bytes(spec: JobSpec, layers: list[LayerDesc], index: int, micro: int, seq: int, **options) -> int:
    """What layer `index` holds from its forward to its backward: with recompute = "full" a layer its stage runs
    again (harness.plan.layers.recompute_group) the input of its group (harness.plan.layers.input_bytes) if it is
    the group's first, else nothing; any other what its forward saves for `micro` samples of `seq` tokens (a
    context-parallel rank's)."""
    group = recompute_group(spec, layers, index)
    if group:
        return input_bytes(spec, layers, index) if index == group[0] else 0
    return saved_bytes(spec, layers[index], micro, seq, **options)


def stage_held_bytes(spec: JobSpec, layers: list[LayerDesc], first: int, count: int, micro: int, seq: int,
                     **options) -> int:
    """held_bytes summed over one virtual stage: the `count` layers of the model's `layers` from index `first`
    (harness.plan.layers.split_into_stages), its recompute groups found once and each distinct layer's saves
    worked out once."""
    stage = layers[first:first + count]
    group_of = {p: group for group in recompute_groups(spec, stage) for p in group}
    saves: dict[LayerDesc, int] = {}
    total = 0
    for p, layer in enumerate(stage):
        if p in group_of:
            total += input_bytes(spec, layers, first + p) if p == group_of[p][0] else 0
        else:
            if layer not in saves:
                saves[layer] = saved_bytes(spec, layer, micro, seq, **options)
            total += saves[layer]
    return total


def _compute_events(plan: EventPlan, phase: str) -> Iterator[tuple[str, LayerDesc, dict]]:
    """(event id, layer, content) of every built-in layer's compute event of `phase` in the plan, once each."""
    seen = set()
    for program in plan.stages:
        pairs = list(zip(program.forward, program.forward_layers)) + list(zip(program.backward,
                                                                                program.backward_layers))
        for eid, index in pairs:
            content = plan.events[eid].content
            if index < 0 or eid in seen or content.get("phase") != phase or plan.layers[index].kind == "user":
                continue
            seen.add(eid)
            yield eid, plan.layers[index], content


def formula_activation_bytes(plan: EventPlan, *, attention: str = "flash", dropout: float | None = None,
                             mask_bytes: int = MASK_BYTES) -> dict[str, int]:
    """Forward event id -> the bytes its forward saves (`saved_bytes`; a recomputed layer's whole, as a profile
    measures it: analysis.memory applies recompute itself), and input-gradient event id (bwd_input) -> what it
    keeps for the weight step (`kept_bytes`), keyed as analysis.memory.activation_bytes(profile); a factory
    model's events are absent."""
    out = {eid: saved_bytes(plan.spec, layer, content["micro"], content["seq"], attention=attention,
                            dropout=dropout, mask_bytes=mask_bytes)
           for eid, layer, content in _compute_events(plan, "fwd")}
    out.update({eid: kept_bytes(plan.spec, layer, content["micro"], content["seq"])
                for eid, layer, content in _compute_events(plan, "bwd_input")})
    return out


def formula_released_bytes(plan: EventPlan, *, attention: str = "flash", dropout: float | None = None,
                           mask_bytes: int = MASK_BYTES) -> dict[str, int]:
    """Input-gradient event id (bwd_input) -> `released_bytes`, keyed as analysis.memory.released_bytes(profile)."""
    return {eid: released_bytes(plan.spec, layer, content["micro"], content["seq"], attention=attention,
                                dropout=dropout, mask_bytes=mask_bytes)
            for eid, layer, content in _compute_events(plan, "bwd_input")}
