"""Analytic descriptions of a model's layers: what each computes, its parameters and its output.

The event generator works from these, so generating events needs neither torch nor a model instance.
Built-in families are described here, at the spec's padded vocabulary (harness.plan.spec.pad_vocab: the padded rows
cost as the others do); a user's factory model is described by instantiating it (harness.models.user.factory_layers,
with torch, outside the plan), and the result is stored in the profile for the analysis.
"""
from __future__ import annotations

import ast
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from harness.common.errors import UserError
from harness.plan.routing import expert_counts, expert_shares, moe_tag, rank_tokens
from harness.plan.spec import DTYPES, JobSpec, ModelSpec

# bytes per element of what a factory model's layer may take as input (its signature's in_dtype)
INPUT_DTYPE_BYTES = {**DTYPES, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class LayerDesc:
    """One layer of the model as the events see it; sizes are per tensor-parallel shard.

    `signature` holds everything that decides the layer's cost (family, sizes, tp); layers with the same
    signature are identical events. `params` counts this shard's parameters; `fwd_flops_per_token`
    the forward FLOPs for one token of one sample; `attn_flops_per_token_per_seq` the part that grows
    with the sequence; `tp_allreduces` how many hidden-sized all-reduces the layer does per pass (a block's);
    `tp_forward` and `tp_backward` the other collectives over the tp group it runs in its forward and its
    backward, in order, each (name, bytes per token of the whole array, dtype): a vocabulary-parallel embedding's
    and head's, and with sequence parallelism a block's all-gathers and reduce-scatters; the name is the one
    harness.models.tp gives it (what harness train records) and says its kind (collective_kind); `cp_forward`
    and `cp_backward` a context-parallel block's exchanges over its cp ranks, each (name, bytes per local token,
    dtype, how many a pass): the ring's key-and-value sends and their gradients' (harness.models.context), or
    the all-gather and its reduce-scatter.
    """

    kind: str  # embedding | block | head | user
    signature: tuple[tuple[str, Any], ...]
    params: int
    fwd_flops_per_token: float
    attn_flops_per_token_per_seq: float = 0.0
    tp_allreduces: int = 0
    out_features: tuple[int, ...] = ()  # output shape after (micro, seq)
    tp_forward: tuple[tuple[str, int, str], ...] = ()
    tp_backward: tuple[tuple[str, int, str], ...] = ()
    cp_forward: tuple[tuple[str, int, str, int], ...] = ()
    cp_backward: tuple[tuple[str, int, str, int], ...] = ()
    # a Mixture-of-Experts block's all-to-alls over its ep ranks, forward and backward, each (name, bytes of one
    # micro-batch, dtype), and how many of its parameters are its experts' (not in the data-parallel buckets)
    ep_forward: tuple[tuple[str, int, str], ...] = ()
    ep_backward: tuple[tuple[str, int, str], ...] = ()
    expert_params: int = 0
    index: int = 0  # position in the model; the first of identical layers for user models
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def fwd_flops(self, micro: int, seq: int) -> float:
        tokens = micro * seq
        return tokens * (self.fwd_flops_per_token + self.attn_flops_per_token_per_seq * seq)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "signature": [list(item) for item in self.signature], "params": self.params,
                "fwd_flops_per_token": self.fwd_flops_per_token,
                "attn_flops_per_token_per_seq": self.attn_flops_per_token_per_seq,
                "tp_allreduces": self.tp_allreduces, "out_features": list(self.out_features), "index": self.index,
                **{key: [list(c) for c in getattr(self, key)]
                   for key in ("tp_forward", "tp_backward", "cp_forward", "cp_backward", "ep_forward", "ep_backward")
                   if getattr(self, key)},
                **({"expert_params": self.expert_params} if self.expert_params else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerDesc:
        return cls(kind=data["kind"], signature=tuple(tuple(item) for item in data["signature"]),
                   params=int(data["params"]), fwd_flops_per_token=float(data["fwd_flops_per_token"]),
                   attn_flops_per_token_per_seq=float(data["attn_flops_per_token_per_seq"]),
                   tp_allreduces=int(data["tp_allreduces"]), out_features=tuple(data["out_features"]),
                   tp_forward=tuple(tuple(c) for c in data.get("tp_forward", ())),
                   tp_backward=tuple(tuple(c) for c in data.get("tp_backward", ())),
                   cp_forward=tuple(tuple(c) for c in data.get("cp_forward", ())),
                   cp_backward=tuple(tuple(c) for c in data.get("cp_backward", ())),
                   ep_forward=tuple(tuple(c) for c in data.get("ep_forward", ())),
                   ep_backward=tuple(tuple(c) for c in data.get("ep_backward", ())),
                   expert_params=int(data.get("expert_params", 0)), index=int(data["index"]))


def block_params(model: ModelSpec, tp: int) -> int:
    """Parameters of one transformer block's tensor-parallel shard (matches harness.models)."""
    h, ffn = model.hidden, model.ffn
    head_dim = h // model.heads
    if model.family == "llama":
        qkv_out = (model.heads + 2 * model.kv_heads) * head_dim
        sharded = h * qkv_out + h * h + 3 * h * ffn  # no biases
        replicated = 2 * h  # two RMSNorm weights
        return sharded // tp + replicated
    sharded = h * 3 * h + 3 * h + h * h + h * ffn + ffn + ffn * h  # weights and column-parallel biases
    replicated = h + h + 4 * h  # row-parallel biases (attention, MLP) and two LayerNorms
    return sharded // tp + replicated


def embedding_params(model: ModelSpec, shards: int = 1) -> int:
    """An embedding's parameters, its token table split by vocabulary over `shards` (the rest replicated)."""
    h, v = model.hidden, model.vocab // shards
    if model.family == "llama":
        return v * h
    if model.family == "bert":
        return v * h + model.seq_len * h + 2 * h + 2 * h  # tokens, positions, token types, LayerNorm
    return v * h + model.seq_len * h


def head_params(model: ModelSpec, shards: int = 1, tied: bool = False) -> int:
    """A head's parameters, its projection (and BERT's decoder bias) split by vocabulary over `shards`; `tied`:
    its projection is the embedding's token table, counted there."""
    h, v = model.hidden, model.vocab // shards
    projection = 0 if tied else v * h
    if model.family == "llama":
        return h + projection  # RMSNorm, lm head without bias
    if model.family == "bert":
        return h * h + h + 2 * h + projection + v  # transform, LayerNorm, decoder
    return 2 * h + projection  # final LayerNorm, lm head without bias


def replicated_params(model: ModelSpec, kind: str) -> int:
    """The parameters every tensor-parallel rank of a built-in layer holds whole (norms, row-parallel biases,
    position and token-type tables, BERT's head transform): with sequence parallelism each rank's gradient of them
    covers its seq / tp tokens alone, and the tp group all-reduces them after the backward (Megatron-LM)."""
    h = model.hidden
    if kind == "block":
        return 2 * h if model.family == "llama" else 6 * h
    if kind == "embedding":
        return embedding_params(model) - model.vocab * h
    if kind == "head":
        return head_params(model, tied=True) - (model.vocab if model.family == "bert" else 0)
    return 0


# A vocabulary-parallel layer's all-reduces (LayerDesc.tp_forward, tp_backward): hidden-sized ones (the
# embedding's sum of its shards' lookups, the head's input gradient) and the cross-entropy's two per token in
# float32, its logits' maximum and (its exponentials' sum, its target's logit) together
HIDDEN_ALLREDUCE = "tp.allreduce"
LOSS_MAX, LOSS_SUMS = "tp.loss_max", "tp.loss_sums"
# sequence parallelism's (Megatron-LM, Korthikanti et al. 2022): hidden-sized, the whole array's bytes
SEQ_ALLGATHER, SEQ_REDUCESCATTER = "tp.allgather", "tp.reducescatter"


# context parallelism's (harness.models.context): the ring's sends of keys and values and of their gradients, or
# the keys and values all-gathered and their gradients reduce-scattered
CP_KV, CP_KV_GRAD, CP_ALLGATHER, CP_REDUCESCATTER = "cp.kv", "cp.kv_grad", "cp.allgather", "cp.reduce_scatter"
_KINDS = {SEQ_ALLGATHER: "allgather", SEQ_REDUCESCATTER: "reducescatter", CP_KV: "p2p", CP_KV_GRAD: "p2p",
          CP_ALLGATHER: "allgather", CP_REDUCESCATTER: "reducescatter", "ep.dispatch": "alltoall",
          "ep.combine": "alltoall", "ep.combine_grad": "alltoall", "ep.dispatch_grad": "alltoall"}


def collective_kind(name: str) -> str:
    """The communication kind of a tensor- or context-parallel collective by its name (events.COMM_KINDS)."""
    return _KINDS.get(name.split("#", 1)[0], "allreduce")


def context_parallel_block(model: ModelSpec, tp: int, cp: int, cp_comm: str) -> tuple[tuple, tuple]:
    """A block's exchanges under context parallelism, forward and backward, per local token (harness.models
    .context): the keys and values travel repeated to the query heads (this shard's heads / tp x head size
    each), in the model's dtype, their gradients in float32. The ring sends them cp - 1 times a forward, and a
    backward sends them cp - 1 times and the gradients cp times (the last hop brings them home); the all-gather
    moves the whole sequence's (cp x the local bytes) once each way."""
    per_token = 2 * model.hidden // tp * model.dtype_bytes
    if cp_comm == "allgather":
        return ((CP_ALLGATHER, cp * per_token, model.dtype, 1),), ((CP_REDUCESCATTER, cp * per_token, model.dtype, 1),)
    grads = 2 * model.hidden // tp * max(4, model.dtype_bytes)
    kv = (CP_KV, per_token, model.dtype, cp - 1)
    return (kv,), (kv, (CP_KV_GRAD, grads, "float32" if model.dtype_bytes <= 4 else model.dtype, cp))


def sequence_parallel_block(hidden_bytes: int, dtype: str) -> tuple[tuple, tuple]:
    """A block's collectives under sequence parallelism, forward and backward, in order (harness.models.tp):
    forward, the attention's and the MLP's all-gather before their column-parallel linear and reduce-scatter
    after their row-parallel one; backward, per half in reverse, the reduce-scatter's backward (an all-gather
    of the output's gradient), the column-parallel linear's input gradient reduce-scattered and its input
    gathered again for its weight's gradient (Megatron-LM saves the sequence shard, not the gathered input)."""
    gather, scatter = (SEQ_ALLGATHER, hidden_bytes, dtype), (SEQ_REDUCESCATTER, hidden_bytes, dtype)
    return (gather, scatter) * 2, (gather, scatter, gather) * 2


def fused_softmax(dtype_bytes: int, batch_heads: int, q_len: int, kv_len: int, causal: bool = True) -> bool:
    """Whether Megatron-LM's materialised attention runs its fused scale-mask-softmax kernel on these scores
    (FusedScaleMaskSoftmax.is_kernel_available, megatron/model/fused_softmax.py): 16-bit scores, 16 < keys <= 4096,
    queries and keys multiples of 4, micro-batch x local heads a multiple of 4, and (causal) that product, or (a
    padding mask: BERT's) the queries, a multiple of the kernel's batches a block (4 from 128 keys on, else 8);
    else it falls back to PyTorch in float32. A 32-bit job runs no fused kernel and no fallback: its softmax is
    the materialised attention's own."""
    if dtype_bytes == 4:
        return True
    per_block = 4 if kv_len > 128 else 8  # 128 threads a block: one row a warp from 128 keys on, else two
    return (16 < kv_len <= 4096 and q_len % 4 == 0 and kv_len % 4 == 0 and batch_heads % 4 == 0
            and (batch_heads if causal else q_len) % per_block == 0)


def megatron_loss(head_signature: dict) -> bool:
    """Whether a built-in head runs Megatron-LM's vocab_parallel_cross_entropy: split by vocabulary (its
    signature's tp), or whole with the model's cross_entropy = "megatron"; else torch's cross_entropy."""
    return int(head_signature.get("tp", 1)) > 1 or head_signature.get("cross_entropy") == "megatron"


def describe_builtin(model: ModelSpec, tp: int, vocab_parallel: bool = False, pp: int = 1,
                     sp: bool = False, cp: int = 1, cp_comm: str = "ring", ep: int = 1,
                     tokens: int = 0, selective: bool = False) -> list[LayerDesc]:
    """_described_builtin's layers as a new list (the descriptions, frozen, are shared)."""
    return list(_described_builtin(model, tp, vocab_parallel, pp, sp, cp, cp_comm, ep, tokens, selective))


@functools.lru_cache(maxsize=256)  # a search describes the same model under each strategy many times
def _described_builtin(model: ModelSpec, tp: int, vocab_parallel: bool, pp: int, sp: bool, cp: int, cp_comm: str,
                       ep: int, tokens: int, selective: bool) -> tuple[LayerDesc, ...]:
    """The layers of a built-in model: embedding, `layers` identical blocks, head with loss.

    Blocks are Megatron-sharded over the tensor-parallel group; with `vocab_parallel` (and tp > 1) the
    embedding and the head are split by vocabulary as Megatron-LM's VocabParallelEmbedding, its
    column-parallel output layer and vocab_parallel_cross_entropy (their all-reduces in tp_forward and
    tp_backward), else replicated. With tie_embeddings on one pipeline stage (pp = 1) the head's projection is
    the embedding's token table (the head "tied", its parameters without it); on several each keeps a copy.
    With `sp` (sequence parallelism, vocab_parallel and tp > 1) the activations between the layers hold seq / tp
    tokens: the embedding reduce-scatters its shards' lookups (its gradient all-gathered), each block all-gathers
    and reduce-scatters (sequence_parallel_block) instead of all-reducing, and the head all-gathers its input
    (its gradient reduce-scattered); their signatures say ("sp", True).
    With experts (Mixture-of-Experts) every moe_every-th block is a moe_block for `tokens` tokens a micro-batch.
    With `cp` > 1 (context parallelism) a rank holds seq / cp tokens (the plan's events say so): each block's
    queries attend to the whole sequence (its attention FLOPs per local token x cp) through the exchanges of
    context_parallel_block; the block's and the embedding's signatures say ("cp", cp) (the embedding adds its
    tokens' positions), the block's also a cp_comm other than the ring.
    With dropout (the model's, Megatron-LM's hidden and attention dropout) the block's and the embedding's
    signatures say ("dropout", P); with materialized attention (the model's `attention`) the block's says
    ("attention", "materialized"); with `selective` (recompute = "selective") the block's says ("recompute",
    "selective"): its backward runs its attention core's forward again (attention_core_flops). A whole head whose
    loss is Megatron-LM's (the model's cross_entropy = "megatron") says ("cross_entropy", "megatron"); a split one
    always runs it.
    """
    h, ffn = model.hidden, model.ffn
    shards = tp if vocab_parallel and tp > 1 else 1
    v = model.vocab // shards
    head_dim = h // model.heads
    base = (("family", model.family), ("hidden", h), ("dtype", model.dtype))
    dropped = (("dropout", model.dropout),) if model.dropout else ()
    if model.family == "llama":
        proj = h * (model.heads + 2 * model.kv_heads) * head_dim + h * h + 3 * h * ffn
    else:
        proj = 4 * h * h + 2 * h * ffn
    sp = sp and shards > 1
    hidden_bytes = h * model.dtype_bytes
    sequence = (("sp", True),) if sp else ()
    block_fwd, block_bwd = sequence_parallel_block(hidden_bytes, model.dtype) if sp else ((), ())
    context = (("cp", cp),) + ((("cp_comm", cp_comm),) if cp_comm != "ring" else ()) if cp > 1 else ()
    ring_fwd, ring_bwd = context_parallel_block(model, tp, cp, cp_comm) if cp > 1 else ((), ())
    block = LayerDesc(
        kind="block",
        signature=base + (("heads", model.heads), ("kv_heads", model.kv_heads), ("ffn", ffn), ("tp", tp)) + sequence
        + context + dropped + ((("attention", model.attention),) if model.attention != "sdpa" else ())
        + ((("recompute", "selective"),) if selective else ()),
        params=block_params(model, tp),
        fwd_flops_per_token=2.0 * proj / tp,
        attn_flops_per_token_per_seq=4.0 * h / tp * cp,  # QK^T and attention x V, over the whole sequence's keys
        tp_allreduces=2 if tp > 1 and not sp else 0,
        out_features=(h,),
        tp_forward=block_fwd, tp_backward=block_bwd, cp_forward=ring_fwd, cp_backward=ring_bwd,
    )
    sharded = (("tp", shards),) if shards > 1 else ()
    gathered = (SEQ_REDUCESCATTER if sp else HIDDEN_ALLREDUCE, hidden_bytes, model.dtype)
    embedding = LayerDesc(kind="embedding", signature=base + (("vocab", model.vocab), ("max_seq", model.seq_len))
                          + sharded + sequence + context[:1] + dropped, params=embedding_params(model, shards),
                          fwd_flops_per_token=float(h),
                          out_features=(h,), tp_forward=(gathered,) * bool(sharded),
                          tp_backward=((SEQ_ALLGATHER, hidden_bytes, model.dtype),) if sp else ())
    tied = model.tie_embeddings and pp == 1
    loss = ((LOSS_MAX, 4, "float32"), (LOSS_SUMS, 8, "float32"))
    megatron_loss = (("cross_entropy", "megatron"),) if model.cross_entropy == "megatron" and shards == 1 else ()
    head = LayerDesc(kind="head", signature=base + (("vocab", model.vocab),) + sharded + (("tied", True),) * tied
                     + sequence + megatron_loss, params=head_params(model, shards, tied),
                     fwd_flops_per_token=2.0 * h * v + 5.0 * v
                     # BERT's transform: with sp on its sequence shard (harness.models' Head gathers after it)
                     + (2.0 * h * h / (shards if sp else 1) if model.family == "bert" else 0.0),
                     out_features=(),
                     tp_forward=(((SEQ_ALLGATHER, hidden_bytes, model.dtype),) if sp else ()) + loss * bool(sharded),
                     tp_backward=(gathered,) * bool(sharded))
    layers = [embedding]
    moe_index = 0
    for i in range(model.layers):
        if model.is_moe_block(i + 1):
            layers.append(moe_block(model, block, ep, tokens, moe_index, i + 1))
            moe_index += 1
        else:
            layers.append(LayerDesc(**{**block.__dict__, "index": i + 1}))
    layers.append(LayerDesc(**{**head.__dict__, "index": model.layers + 1}))
    return tuple(layers)


# the all-to-alls of a Mixture-of-Experts block (harness.models.moe): forward, the tokens dispatched to their
# experts' ranks and the experts' outputs combined back; backward, the combine's and the dispatch's gradients
EP_DISPATCH, EP_COMBINE = "ep.dispatch", "ep.combine"
EP_COMBINE_GRAD, EP_DISPATCH_GRAD = "ep.combine_grad", "ep.dispatch_grad"


def expert_ffn_params(model: ModelSpec, width: int) -> int:
    """One expert FFN of `width` (GPT-2 and BERT: two linears with biases; LLaMA: SwiGLU, no biases)."""
    h = model.hidden
    return 3 * h * width if model.family == "llama" else 2 * h * width + width + h


def moe_load(model: ModelSpec, ep: int, tokens: int, moe_index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tokens each expert gets of one rank's `tokens`, tokens each ep rank's experts get of them) in MoE
    layer `moe_index` (harness.plan.routing; every rank routes alike)."""
    shares = expert_shares(model.routing, model.experts, model.expert_histogram, moe_index)
    counts = expert_counts(shares, tokens, model.top_k, model.capacity_factor)
    return counts, rank_tokens(counts, ep)


def moe_block(model: ModelSpec, dense: LayerDesc, ep: int, tokens: int, moe_index: int, index: int) -> LayerDesc:
    """A Mixture-of-Experts block (tp = 1): the dense block's attention, a router, this rank's experts / ep
    experts and the shared ones. Its costs are the slowest ep rank's (the all-to-alls hold the ranks together):
    its experts' token counts (each count x ep: every rank sends alike) are in the signature, and each
    all-to-all moves, as an even all-to-all of the same largest pair message, ep x that message (the tokens
    a rank sends its busiest peer x hidden x dtype)."""
    h, d = model.hidden, model.dtype_bytes
    counts, per_rank = moe_load(model, ep, tokens, moe_index)
    slowest = max(range(ep), key=lambda j: (per_rank[j], -j))
    local = model.experts // ep
    received = tuple(ep * c for c in counts[slowest * local:(slowest + 1) * local])
    dense_mlp = 3 * h * model.ffn if model.family == "llama" else 2 * h * model.ffn + model.ffn + h
    expert = expert_ffn_params(model, model.expert_ffn)
    shared = expert_ffn_params(model, model.shared_experts * model.expert_ffn) if model.shared_experts else 0
    params = dense.params - dense_mlp + h * model.experts + local * expert + shared
    mlp_flops = 2.0 * (expert * sum(received) / max(1, tokens) + shared) if tokens else 0.0
    attention = dense.fwd_flops_per_token - 2.0 * dense_mlp
    signature = dict(dense.signature)
    signature.update(experts=model.experts, top_k=model.top_k, expert_ffn=model.expert_ffn,
                     shared_experts=model.shared_experts, ep=ep, ep_rank=slowest, received=str(received))
    if len(model.expert_histogram) > 1:  # a measured histogram per layer: which one this block routes by
        signature["moe_layer"] = moe_index
    message = ep * max(per_rank) * h * d if ep > 1 else 0
    tag = moe_tag(model, moe_index)  # the layer's own names where layers' messages differ (tp_events by name)
    forward = ((EP_DISPATCH + tag, message, model.dtype), (EP_COMBINE + tag, message, model.dtype)) if message else ()
    backward = ((EP_COMBINE_GRAD + tag, message, model.dtype), (EP_DISPATCH_GRAD + tag, message, model.dtype)) \
        if message else ()
    return LayerDesc(kind="block", signature=tuple(signature.items()), params=params,
                     fwd_flops_per_token=attention + 2.0 * h * model.experts + mlp_flops,
                     attn_flops_per_token_per_seq=dense.attn_flops_per_token_per_seq, out_features=(h,),
                     ep_forward=forward, ep_backward=backward, expert_params=local * expert, index=index)


def describe(spec: JobSpec, user_layers: list[LayerDesc] | None = None) -> list[LayerDesc]:
    """The model's layers in order; user models need their description (from the profile or the factory)."""
    if spec.model.family == "user":
        if user_layers is None:
            raise UserError(f"model {spec.model.factory!r} is a factory model: its layers are described by "
                            "tracing it with torch (harness.models.user.factory_layers) or read from its "
                            "profile; the plan cannot describe it alone")
        return user_layers
    s = spec.strategy
    return describe_builtin(spec.model, s.tp, s.vocab_parallel, s.pp, s.sp, s.cp, s.cp_comm, s.ep,
                            spec.batch.micro * spec.model.seq_len // s.cp, selective=s.recompute == "selective")


def recomputed(layer: LayerDesc) -> bool:
    """Whether full recompute may run this layer's forward again before its backward: the transformer blocks
    (as Megatron-LM's full recompute: the embedding and the head with the loss keep what they save), and every
    layer of a factory model (recompute_groups says which do)."""
    return layer.kind in ("block", "user")


def recompute_groups(spec: JobSpec, stage: list[LayerDesc]) -> list[list[int]]:
    """With recompute = "full", the layers (positions in `stage`, one virtual stage's layers in forward order) that
    torch.utils.checkpoint runs again together before their backward, in forward order, as Megatron-LM's
    --recompute-method: of the stage's `recomputed` layers, "uniform" cuts them into chunks of recompute_layers
    (each chunk keeps its input alone and runs again whole), "block" takes the first recompute_layers, each alone
    (the others keep what they save). None with another recompute mode."""
    s = spec.strategy
    if s.recompute != "full":
        return []
    positions = [p for p, layer in enumerate(stage) if recomputed(layer)]
    n = s.recompute_layers
    if s.recompute_method == "block":
        return [[p] for p in positions[:n]]
    return [positions[i:i + n] for i in range(0, len(positions), n)]


def recompute_group(spec: JobSpec, layers: list[LayerDesc], index: int) -> list[int]:
    """The recompute group (recompute_groups) of layer `index` of the model's `layers`, as indexes into them; empty
    where full recompute does not run it again."""
    start = 0
    for stage in split_into_stages(layers, spec.model, spec.strategy.virtual_stages):
        if start <= index < start + len(stage):
            return next(([start + p for p in group] for group in recompute_groups(spec, stage)
                         if index - start in group), [])
        start += len(stage)
    return []


def selective(layer: LayerDesc) -> bool:
    """Whether this block's backward runs its attention core again (recompute = "selective")."""
    return dict(layer.signature).get("recompute") == "selective"


def attention_core_flops(layer: LayerDesc, micro: int, seq: int) -> float:
    """The attention core's forward FLOPs (QK^T and attention x V over the whole sequence's keys) in one
    micro-batch: what selective recompute runs again in the backward."""
    return micro * seq * layer.attn_flops_per_token_per_seq * seq


def user_input(layer: LayerDesc, model_dtype: str) -> tuple[tuple[int, ...], str]:
    """A factory model's layer input after (micro, seq): its features and dtype name, as described."""
    signature = dict(layer.signature)
    return tuple(ast.literal_eval(signature.get("in_features", "()"))), signature.get("in_dtype", model_dtype)


def input_bytes(spec: JobSpec, layers: list[LayerDesc], index: int) -> int:
    """Bytes of one micro-batch's input to layer `index`, which a recomputed layer keeps for its backward: the
    previous layer's output (a built-in model's hidden states), or the first layer's token ids (int64)."""
    micro, seq = spec.batch.micro, spec.model.seq_len // spec.strategy.cp
    if spec.model.family != "user":
        return micro * seq * (8 if index == 0 else spec.model.hidden * spec.model.dtype_bytes // sequence_shards(spec))
    features, dtype = user_input(layers[index], spec.model.dtype)
    return micro * seq * math.prod(features) * INPUT_DTYPE_BYTES.get(dtype, spec.model.dtype_bytes)


def sequence_shards(spec: JobSpec) -> int:
    """Over how many ranks the activations between a built-in model's layers split a context-parallel rank's
    seq / cp tokens: tp with sequence parallelism, else 1."""
    return spec.strategy.tp if spec.strategy.sp else 1


def split_into_stages(layers: list[LayerDesc], model: ModelSpec, virtual_stages: int) -> list[list[LayerDesc]]:
    """Split layers over virtual pipeline stages: blocks evenly; the embedding joins the first stage and the
    head the last. A user model's layers are split evenly by count (its first and last layers included)."""
    if model.family == "user":
        per = len(layers) // virtual_stages
        extra = len(layers) % virtual_stages
        out, start = [], 0
        for stage in range(virtual_stages):
            size = per + (1 if stage < extra else 0)
            out.append(layers[start:start + size])
            start += size
        return out
    blocks = layers[1:-1]
    per = len(blocks) // virtual_stages
    out = [blocks[i * per:(i + 1) * per] for i in range(virtual_stages)]
    out[0] = [layers[0]] + out[0]
    out[-1] = out[-1] + [layers[-1]]
    return out
