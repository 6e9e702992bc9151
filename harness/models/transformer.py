"""The built-in transformer families as torch modules, one module per layer (embedding, block, head).

GPT-2 (pre-LayerNorm, GELU), BERT (post-LayerNorm, GELU, token types, MLM-style head) and a LLaMA-like
block (RMSNorm, SwiGLU, grouped-query attention, rotary positions). Blocks are Megatron-sharded over
`tp` ranks (heads and FFN columns split); embedding and head built with tp > 1 are split by vocabulary
(Megatron-LM's VocabParallelEmbedding and column-parallel output layer, the loss vocabulary-parallel),
built with tp = 1 whole (replicated on a tensor-parallel group). Built with `sp` (sequence parallelism), the
layers pass (micro, seq / tp, hidden) between them: the embedding reduce-scatters, a block's norms and residuals
run on the shard and its column-parallel linears gather it, the head gathers its input (harness.models.tp).
Built with `cp` > 1 (context parallelism) a rank holds its seq / cp tokens in the zigzag order: the embedding
adds their positions, a block's attention runs over the whole sequence through `cp_group` (ring or all-gather,
harness.models.context; no group: a LocalRing stand-in of rank `cp_rank`), LLaMA's rotary positions are theirs.
With the model's dropout P > 0 (Megatron-LM's hidden and attention dropout), in training: the attention
probabilities (scaled_dot_product_attention's dropout_p), each sub-layer's output before its residual add and the
embedding's output are dropped with probability P, from torch's global generator (harness train seeds it); P = 0
runs no dropout at all. With the model's attention = "materialized" the attention core writes its scores out
(q k^T / sqrt(d) by baddbmm, the causal mask, softmax, dropout, bmm with v: Megatron-LM's local attention without
flash attention) instead of calling scaled_dot_product_attention; 16-bit scores whose shape Megatron-LM's fused
softmax kernel does not take (harness.plan.layers.fused_softmax) are masked and softmaxed in float32, as its
fallback does. A head's loss is Megatron-LM's vocabulary-parallel cross-entropy where it is split by vocabulary or
the model's cross_entropy says "megatron", else torch's; both on float32 logits. A block built `selective` runs its
attention core (scaled_dot_product_attention or the materialised one, its dropout included) under
torch.utils.checkpoint: its inputs kept, the core run again in the backward with the same random state
(Megatron-LM's selective recompute).
Parameter counts match harness.plan.layers, which the event generator uses.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from harness.models.context import LocalRing, allgather_attention, local_positions, ring_attention
from harness.models.moe import LocalExperts, MoEMLP
from harness.models.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tp,
    gather_sequence,
    hooked,
    reduce_from_tp,
    scatter_sequence,
    vocab_parallel_cross_entropy,
)
from harness.plan.layers import fused_softmax
from harness.plan.routing import moe_tag, router
from harness.plan.spec import ModelSpec

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def _rotary(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding over the last dimension of (batch, heads, seq, head_dim), at `positions` (the
    tokens' places in the sequence; default 0..seq - 1)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    if positions is None:
        positions = torch.arange(seq, device=x.device)
    angles = torch.outer(positions.to(device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class TransformerBlock(nn.Module):
    """One transformer layer's tensor-parallel shard. `group` is the tp process group (None: no collectives);
    `sp`: its input and output are sequence shards (Megatron-LM's sequence parallelism); `cp` > 1: its tokens are
    context-parallel rank `cp_rank`'s, its attention over `cp_group` (module docstring); `moe_layer` (not None):
    its MLP is that MoE layer's experts (harness.models.moe), ep rank `ep_rank`'s experts / ep of them over
    `ep_group` (no group: a LocalExperts stand-in); `selective`: its attention core recomputed in the backward
    (module docstring)."""

    def __init__(self, model: ModelSpec, tp: int = 1, group=None, sp: bool = False, cp: int = 1, cp_group=None,
                 cp_rank: int = 0, cp_comm: str = "ring", moe_layer: int | None = None, ep: int = 1, ep_group=None,
                 ep_rank: int = 0, selective: bool = False):
        super().__init__()
        self.family = model.family
        self.dropout, self.selective = model.dropout, selective
        self.materialized = model.attention == "materialized"
        self.group = group
        self.sp = sp
        self.cp, self.cp_comm = cp, cp_comm
        self.cp_group = (cp_group or LocalRing(cp, cp_rank)) if cp > 1 else None
        self.positions = local_positions(model.seq_len, cp, cp_rank) if cp > 1 else None
        column = {"sequence_parallel": sp, "group": group}
        dtype = TORCH_DTYPES[model.dtype]
        h = model.hidden
        self.head_dim = h // model.heads
        self.local_heads = model.heads // tp
        self.local_kv = model.kv_heads // tp
        causal = model.family != "bert"
        self.causal = causal
        if model.family == "llama":
            self.norm1, self.norm2 = RMSNorm(h, dtype=dtype), RMSNorm(h, dtype=dtype)
            qkv_out = (model.heads + 2 * model.kv_heads) * self.head_dim
            self.qkv = ColumnParallelLinear(h, qkv_out, tp, bias=False, dtype=dtype, **column)
            self.proj = RowParallelLinear(h, h, tp, bias=False, dtype=dtype, sequence_parallel=sp)
        else:
            self.norm1 = nn.LayerNorm(h, dtype=dtype)
            self.norm2 = nn.LayerNorm(h, dtype=dtype)
            self.qkv = ColumnParallelLinear(h, 3 * h, tp, dtype=dtype, **column)
            self.proj = RowParallelLinear(h, h, tp, dtype=dtype, sequence_parallel=sp)
        self.moe = None
        if moe_layer is not None:
            group_or_stand_in = ep_group if ep_group is not None else LocalExperts(ep, ep_rank) if ep > 1 else None
            self.moe = MoEMLP(h, model.expert_ffn, model.experts, model.top_k, router(model, moe_layer),
                              shared_experts=model.shared_experts,
                              activation="swiglu" if model.family == "llama" else "gelu", ep=ep,
                              ep_group=group_or_stand_in, ep_rank=ep_rank, dtype=dtype, tag=moe_tag(model, moe_layer))
        elif model.family == "llama":
            self.gate_up = ColumnParallelLinear(h, 2 * model.ffn, tp, bias=False, dtype=dtype, **column)
            self.down = RowParallelLinear(model.ffn, h, tp, bias=False, dtype=dtype, sequence_parallel=sp)
        else:
            self.fc1 = ColumnParallelLinear(h, model.ffn, tp, dtype=dtype, **column)
            self.fc2 = RowParallelLinear(model.ffn, h, tp, dtype=dtype, sequence_parallel=sp)

    def attention_context(self, x: torch.Tensor) -> torch.Tensor:
        """This shard's attention output before the row-parallel projection: (micro, seq, local heads x head_dim)."""
        qkv = self.qkv(self._into_tp(x))
        b, s, _ = qkv.shape
        q_size, kv_size = self.local_heads * self.head_dim, self.local_kv * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.local_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.local_kv, self.head_dim).transpose(1, 2)
        if self.family == "llama":
            q, k = _rotary(q, self.positions), _rotary(k, self.positions)
        if self.local_kv != self.local_heads:
            repeat = self.local_heads // self.local_kv
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if self.cp > 1:
            if self.cp_comm == "allgather":
                out = allgather_attention(q, k, v, self.cp_group, self.causal, hook=hooked)
            else:
                out = ring_attention(q, k, v, self.cp_group, self.causal, hook=hooked, materialized=self.materialized)
        elif self.selective:
            out = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            out = self._core(q, k, v)
        return out.transpose(1, 2).reshape(b, s, q_size)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core: softmax(q k^T / sqrt(d)) v, its probabilities dropped out in training; fused, or
        with its scores materialised (module docstring)."""
        p = self.dropout if self.training else 0.0
        if not self.materialized:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        b, heads, s, d = q.shape
        scores = torch.baddbmm(torch.empty(b * heads, s, k.shape[2], dtype=q.dtype, device=q.device),
                               q.reshape(b * heads, s, d), k.reshape(b * heads, -1, d).transpose(1, 2),
                               beta=0.0, alpha=d ** -0.5)
        if not fused_softmax(q.element_size(), b * heads, s, k.shape[2], self.causal):
            scores = scores.float()  # Megatron-LM's fallback: the softmax in float32, made 16-bit again after it
        if self.causal:
            mask = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        probabilities = torch.softmax(scores, dim=-1).to(q.dtype)
        probabilities = F.dropout(probabilities, p) if p else probabilities
        return torch.bmm(probabilities, v.reshape(b * heads, -1, d)).view(b, heads, s, d)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """A sub-layer's output dropped out before its residual add (none at all with dropout 0)."""
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        return self._drop(self.proj(self.attention_context(x), self.group))

    def _into_tp(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel region's input: its gradient all-reduced, or with sp gathered by the linear itself."""
        return x if self.sp else copy_to_tp(x, self.group)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:  # tp = 1 (harness.plan.spec)
            return self._drop(self.moe(x))
        x = self._into_tp(x)
        if self.family == "llama":
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self._drop(self.down(F.silu(gate) * up, self.group))
        return self._drop(self.fc2(F.gelu(self.fc1(x)), self.group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.family == "bert":  # post-LayerNorm
            x = self.norm1(x + self._attention(x))
            return self.norm2(x + self._mlp(x))
        x = x + self._attention(self.norm1(x))
        return x + self._mlp(self.norm2(x))


class Embedding(nn.Module):
    """Token (and for GPT-2/BERT position, for BERT token-type) embeddings: ids (micro, seq) -> hidden. With
    tp > 1 the token table holds shard `tp_index`'s vocab / tp rows: ids outside it look up zeros, and the
    shards' lookups are summed over `group` before the (replicated) positions are added; with `sp` reduce-scattered
    by sequence instead, each rank adding its own tokens' positions."""

    def __init__(self, model: ModelSpec, tp: int = 1, group=None, tp_index: int = 0, sp: bool = False, cp: int = 1,
                 cp_rank: int = 0):
        super().__init__()
        dtype = TORCH_DTYPES[model.dtype]
        self.family = model.family
        self.dropout = model.dropout
        self.group = group
        self.tp, self.tp_index, self.sp = tp, tp_index, sp
        # the positions of the tokens this rank holds (context parallelism: its zigzag chunks)
        self.register_buffer("token_positions", local_positions(model.seq_len, cp, cp_rank), persistent=False)
        self.shard_vocab = model.vocab // tp
        self.vocab_start = tp_index * self.shard_vocab
        self.sharded = tp > 1
        self.tokens = nn.Embedding(self.shard_vocab, model.hidden, dtype=dtype)
        if model.family != "llama":
            self.positions = nn.Embedding(model.seq_len, model.hidden, dtype=dtype)
        if model.family == "bert":
            self.token_types = nn.Embedding(2, model.hidden, dtype=dtype)
            self.norm = nn.LayerNorm(model.hidden, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.sharded:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.shard_vocab)
            x = self.tokens(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
            x = scatter_sequence(x, self.group, self.tp) if self.sp else reduce_from_tp(x, self.group)
        else:
            x = self.tokens(ids)
        if self.family != "llama":
            first = self.tp_index * x.shape[1] if self.sp else 0
            x = x + self.positions(self.token_positions[first:first + x.shape[1]])
        if self.family == "bert":
            x = self.norm(x + self.token_types.weight[0])
        return F.dropout(x, self.dropout, self.training) if self.dropout else x


class Head(nn.Module):
    """Final norm (BERT: transform) and the vocabulary projection; `loss` adds cross-entropy. With tp > 1 the
    projection holds shard `tp_index`'s vocab / tp outputs, its input's gradient is all-reduced over `group`
    (copy_to_tp) and the loss is vocabulary-parallel, Megatron-LM's; a whole head runs Megatron-LM's loss too where
    the model's cross_entropy says "megatron", else torch's. `tied`: the projection's weight is not the head's own
    parameter but a buffer (a stand-in of its shape until `tie` makes it the embedding's token table). With `sp`
    its input is a sequence shard, all-gathered after the norm (its gradient reduce-scattered)."""

    def __init__(self, model: ModelSpec, tp: int = 1, group=None, tp_index: int = 0, tied: bool = False,
                 sp: bool = False):
        super().__init__()
        dtype = TORCH_DTYPES[model.dtype]
        h = model.hidden
        self.family = model.family
        self.group = group
        self.tp, self.sp = tp, sp
        self.sharded = tp > 1
        self.megatron_loss = self.sharded or model.cross_entropy == "megatron"
        vocab = model.vocab // tp
        self.vocab_start = tp_index * vocab
        if model.family == "llama":
            self.norm = RMSNorm(h, dtype=dtype)
            self.out = nn.Linear(h, vocab, bias=False, dtype=dtype)
        elif model.family == "bert":
            self.transform = nn.Linear(h, h, dtype=dtype)
            self.norm = nn.LayerNorm(h, dtype=dtype)
            self.out = nn.Linear(h, vocab, dtype=dtype)
        else:
            self.norm = nn.LayerNorm(h, dtype=dtype)
            self.out = nn.Linear(h, vocab, bias=False, dtype=dtype)
        if tied:
            self.tie(self.out.weight.detach().requires_grad_())

    def tie(self, weight: torch.Tensor) -> None:
        """Make `weight` (the embedding's token table, or its shard) the projection's, held but not owned."""
        self.out._parameters.pop("weight", None)
        self.out._buffers["weight"] = weight
        self.out._non_persistent_buffers_set.add("weight")

    def _apply(self, fn, recurse=True):
        """Moved or cast, a tied head's stand-in weight stays a leaf of its own (a copy made by `.to()` would
        send its gradient back to where it was); the embedding's own weight, once tied, is left as it is."""
        out = super()._apply(fn, recurse)
        weight = self.out.weight
        if "weight" in self.out._buffers and not isinstance(weight, nn.Parameter) and weight.grad_fn is not None:
            self.out._buffers["weight"] = weight.detach().requires_grad_()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.family == "bert":
            x = F.gelu(self.transform(x))
        x = self.norm(x)
        if self.sp:
            return self.out(gather_sequence(x, self.group, self.tp))
        return self.out(copy_to_tp(x, self.group) if self.sharded else x)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy (float32) of this head's logits, the mean over the micro-batch's tokens."""
        if self.megatron_loss:
            return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.group if self.sharded else None)
        return cross_entropy(logits, targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (float32) of whole logits (micro, seq, vocab), averaged over the tokens."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_layer(model: ModelSpec, kind: str, tp: int = 1, group=None, tp_index: int = 0,
                tied: bool = False, sp: bool = False, cp: int = 1, cp_group=None, cp_rank: int = 0,
                cp_comm: str = "ring", moe_layer: int | None = None, ep: int = 1, ep_group=None,
                ep_rank: int = 0, selective: bool = False) -> nn.Module:
    """A fresh layer of a built-in model: kind is embedding, block or head; tp > 1 its shard `tp_index` (an
    embedding's or head's by vocabulary); `tied`, a head whose projection is the embedding's (Head.tie); `sp`,
    sequence-parallel (tp > 1); `cp` > 1, context-parallel rank `cp_rank` of `cp_group` (module docstring);
    `moe_layer`, a block whose MLP is that MoE layer's experts, ep rank `ep_rank`'s of `ep_group`; `selective`, a
    block whose attention core is recomputed in the backward."""
    if kind == "embedding":
        return Embedding(model, tp, group, tp_index, sp, cp, cp_rank)
    if kind == "block":
        return TransformerBlock(model, tp, group, sp, cp, cp_group, cp_rank, cp_comm, moe_layer, ep, ep_group, ep_rank,
                                selective)
    if kind == "head":
        return Head(model, tp, group, tp_index, tied, sp)
    raise ValueError(f"unknown layer kind {kind!r}")
