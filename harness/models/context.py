"""Context parallelism: attention over a sequence split across the cp ranks of a group (ring attention).

Layout (zigzag): the sequence is cut into 2 * cp equal chunks and rank r holds chunks r and 2 * cp - 1 - r,
concatenated in that order, so that under a causal mask every rank does the same work. cp = 1 holds the whole
sequence (of any length).

`ring_attention` runs cp steps. At step i rank r holds the keys and values that started on rank (r - i) mod cp;
it posts their exchange (send to r + 1, receive from r - 1, over torch.distributed P2P), computes its queries'
attention against them, merging the partial results by their log-sum-exp, then waits for the exchange. Per pair
of (query chunk, key chunk) a causal mask makes the pair "full" (every query sees every key), "diagonal" (a
lower-triangular mask: the same chunk) or "skip" (no query sees any key); a step computes the blocks that
harness.plan.ring.step_blocks gives, each with torch's fused CPU kernel that also returns its rows' log-sum-exp
(fused_blocks), or with its scores materialised in float32 (materialized, or off a CPU). The backward passes the
keys and values round the ring again, each with its travelling gradient (dk, dv), and one last hop brings every
gradient home to the rank owning those keys and values; a fused block's gradients come from the fused kernel's
backward given the whole ring's output and log-sum-exp. Softmax statistics, the merges and the travelling
gradients are float32 (float64 inputs stay float64); forward messages keep the inputs' dtype.

`allgather_attention` (cp_comm = "allgather") gathers every rank's keys and values first (the backward
reduce-scatters their gradients back) and computes the local queries against the whole sequence.

`LocalRing(cp, rank)` stands in for the group when one rank's share is profiled alone (harness.profile
.compute): the same steps, pairs, shapes and copies, each "received" block a copy of the rank's own.

With a hook, every exchange is run through hook(name, run) (as `set_collective_hook` in harness.models.tp):
"cp.kv" (keys and values, forward and backward), "cp.kv_grad" (the travelling gradients), "cp.allgather" and
"cp.reduce_scatter". A ring exchange is posted before the step's compute and `run` is only its wait, so the
hook times the part of the transfer the compute did not hide; the two collectives are timed whole.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from harness.models.flat_collectives import all_gather_single, reduce_scatter_single
from harness.plan.ring import (  # noqa: F401 (the ring's geometry, kept importable from here)
    DIAGONAL,
    FULL,
    SKIP,
    RingStep,
    check_rank,
    pair_kind,
    rank_work,
    ring_steps,
    step_blocks,
    step_pairs,
    zigzag_chunks,
)

Hook = Callable[[str, Callable[[], None]], None]

KV, KV_GRAD, ALLGATHER, REDUCE_SCATTER = "cp.kv", "cp.kv_grad", "cp.allgather", "cp.reduce_scatter"
_KV_TAG, _GRAD_TAG = 0, 1  # both exchanges of the backward can be in flight to the same peer at once


def _chunk_len(seq_len: int, cp: int) -> int:
    if seq_len < 0 or seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 * cp = {2 * cp} equal chunks")
    return seq_len // (2 * cp)


def local_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions (int64) of the tokens rank holds, its first chunk's then its second's."""
    check_rank(cp, rank)
    if cp == 1:
        return torch.arange(seq_len)
    chunk = _chunk_len(seq_len, cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in zigzag_chunks(cp, rank)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """Rank's share of a full-sequence tensor: its two chunks along dim, concatenated."""
    check_rank(cp, rank)
    if cp == 1:
        return x
    chunk = _chunk_len(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, c * chunk, chunk) for c in zigzag_chunks(cp, rank)], dim=dim)


def merge_sequence(parts: list[torch.Tensor], cp: int, dim: int) -> torch.Tensor:
    """The full sequence from every rank's share (parts[r] is rank r's): the inverse of `split_sequence`."""
    if len(parts) != cp:
        raise ValueError(f"merge_sequence needs one part per rank: {len(parts)} parts for cp = {cp}")
    if cp == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        if part.shape[dim] % 2:
            raise ValueError(f"rank {rank}'s part has {part.shape[dim]} tokens along dim {dim}: not two chunks")
        first, second = part.chunk(2, dim=dim)
        a, b = zigzag_chunks(cp, rank)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


# ---- the ring -------------------------------------------------------------------------------------------------

class LocalRing(NamedTuple):
    """A stand-in for a cp group of `cp` ranks seen from `rank`, with no communication (module docstring)."""
    cp: int
    rank: int = 0


def _group_layout(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    if isinstance(group, LocalRing):
        return group.cp, group.rank
    return dist.get_world_size(group), dist.get_rank(group)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError("q, k and v must share one shape (batch, heads, s_local, head_dim) (repeat grouped keys "
                         f"and values first), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if cp > 1 and q.shape[2] % 2:
        raise ValueError(f"s_local = {q.shape[2]} is not this rank's two equal chunks (cp = {cp})")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _run(hook: Hook | None, name: str, run: Callable[[], None]) -> None:
    run() if hook is None else hook(name, run)


class _Exchange:
    """One posted ring exchange: `send` goes to the next rank while `received` fills from the previous one."""

    def __init__(self, send: torch.Tensor, group, cp: int, rank: int, tag: int):
        if isinstance(group, LocalRing):  # what arrives has the shape, and takes the copy, of what is sent
            self.received, self.works = send.clone(), []
            return
        self.received = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % cp), group, tag),
               dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (rank - 1) % cp), group, tag)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self, hook: Hook | None, name: str) -> torch.Tensor:
        def run() -> None:
            for work in self.works:
                work.wait()

        _run(hook, name, run)
        return self.received


# the CPU's fused attention that also returns each row's log-sum-exp (what a ring merges blocks by), and its
# backward from the whole ring's output and log-sum-exp; None where this torch has none
_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def fused_blocks(q: torch.Tensor, materialized: bool) -> bool:
    """Whether a ring computes its blocks with the fused kernel: not asked for materialised attention, on a CPU
    whose torch has one (elsewhere each block's scores are materialised, in float32)."""
    return not materialized and q.device.type == "cpu" and _FUSED is not None and _FUSED_BACKWARD is not None


class _Masks:
    """A pass's block masks, built once a kind: True hides a key (materialised blocks), or 0 and -inf added to the
    scores in the inputs' dtype (the fused kernel's)."""

    def __init__(self, device, dtype: torch.dtype, fused: bool):
        self.device, self.dtype, self.fused, self.made = device, dtype, fused, {}

    def get(self, kinds: tuple[str, ...], size: int) -> torch.Tensor:
        if kinds not in self.made:
            tri = torch.ones(size, size, dtype=torch.bool, device=self.device).triu(1)
            hidden = tri if len(kinds) == 1 else torch.cat(
                [tri if kind == DIAGONAL else torch.zeros_like(tri) for kind in kinds], dim=1)
            if self.fused:
                hidden = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(
                    hidden, float("-inf"))
            self.made[kinds] = hidden
        return self.made[kinds]


def _blocks(cp: int, rank: int, step: int, causal: bool, s_local: int,
            masks: _Masks) -> list[tuple[slice, slice, torch.Tensor | None]]:
    """(query slice, key slice, mask) of the local tensors to compute at step (harness.plan.ring.step_blocks);
    the mask is None where every query sees every key."""
    if cp == 1 or not causal:
        return [(slice(None), slice(None), masks.get((DIAGONAL,), s_local) if causal else None)]
    chunk = s_local // 2
    return [(slice(b.q_chunk * chunk, (b.q_chunk + b.q_chunks) * chunk),
             slice(b.kv_chunk * chunk, (b.kv_chunk + b.kv_chunks) * chunk),
             masks.get(b.kinds, chunk) if b.masked else None) for b in step_blocks(cp, rank, step, causal)]


def _scores(q: torch.Tensor, k: torch.Tensor, mask, scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    return scores if mask is None else scores.masked_fill_(mask, float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, hook, fused):
        cp, rank = _group_layout(group)
        acc = _compute_dtype(q.dtype)
        scale = 1.0 / math.sqrt(q.shape[-1])
        qc = q if fused else q.to(acc)
        masks = _Masks(q.device, q.dtype, fused)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        for step in range(cp):
            exchange = _Exchange(kv, group, cp, rank, _KV_TAG) if step + 1 < cp else None
            held_k, held_v = (kv if fused else kv.to(acc)).unbind(0)
            for qs, ks, mask in _blocks(cp, rank, step, causal, q.shape[2], masks):
                if fused:
                    block_out, block_lse = _FUSED(qc[:, :, qs], held_k[:, :, ks], held_v[:, :, ks], 0.0, False,
                                                  attn_mask=mask, scale=scale)
                    block_out, block_lse = block_out.to(acc), block_lse.to(acc)
                else:
                    scores = _scores(qc[:, :, qs], held_k[:, :, ks], mask, scale)
                    block_lse = torch.logsumexp(scores, dim=-1)
                    block_out = torch.matmul(torch.exp(scores - block_lse.unsqueeze(-1)), held_v[:, :, ks])
                old = lse[:, :, qs]
                new = torch.logaddexp(old, block_lse)
                out[:, :, qs] = (out[:, :, qs] * torch.exp(old - new).unsqueeze(-1)
                                 + block_out * torch.exp(block_lse - new).unsqueeze(-1))
                lse[:, :, qs] = new
            if exchange is not None:
                kv = exchange.wait(hook, KV)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.hook, ctx.fused = group, causal, hook, fused
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, hook, fused = ctx.group, ctx.causal, ctx.hook, ctx.fused
        cp, rank = _group_layout(group)
        acc = _compute_dtype(q.dtype)
        scale = 1.0 / math.sqrt(q.shape[-1])
        masks = _Masks(q.device, q.dtype, fused)
        if fused:  # the kernel takes the inputs' dtype and the whole ring's output and log-sum-exp
            qc, dout, delta = q, grad_out.contiguous(), None
        else:
            qc, dout = q.to(acc), grad_out.to(acc)
            delta = (dout * out.to(acc)).sum(dim=-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        grads = None  # (dk, dv) of the keys and values held now, once this step's share is added
        grad_exchange = None
        for step in range(cp):
            exchange = _Exchange(kv, group, cp, rank, _KV_TAG) if step + 1 < cp else None
            held_k, held_v = (kv if fused else kv.to(acc)).unbind(0)
            block_grads = torch.zeros(kv.shape, dtype=acc, device=q.device)
            dk, dv = block_grads.unbind(0)
            for qs, ks, mask in _blocks(cp, rank, step, causal, q.shape[2], masks):
                if fused:
                    dq_block, dk_block, dv_block = _FUSED_BACKWARD(
                        dout[:, :, qs], qc[:, :, qs], held_k[:, :, ks], held_v[:, :, ks], out[:, :, qs],
                        lse[:, :, qs], 0.0, False, attn_mask=mask, scale=scale)
                    dq[:, :, qs].add_(dq_block)
                    dk[:, :, ks].add_(dk_block)
                    dv[:, :, ks].add_(dv_block)
                    continue
                probs = torch.exp(_scores(qc[:, :, qs], held_k[:, :, ks], mask, scale) - lse[:, :, qs].unsqueeze(-1))
                dv[:, :, ks].add_(torch.matmul(probs.transpose(-1, -2), dout[:, :, qs]))
                dprobs = torch.matmul(dout[:, :, qs], held_v[:, :, ks].transpose(-1, -2))
                dscores = probs.mul_(dprobs - delta[:, :, qs].unsqueeze(-1)).mul_(scale)
                dq[:, :, qs].add_(torch.matmul(dscores, held_k[:, :, ks]))
                dk[:, :, ks].add_(torch.matmul(dscores.transpose(-1, -2), qc[:, :, qs]))
            if grad_exchange is not None:
                block_grads += grad_exchange.wait(hook, KV_GRAD)
            grads = block_grads
            if cp > 1:
                # the gradients of the keys just used go on with them; after the last step this hop takes
                # every gradient to the rank owning its keys and values
                grad_exchange = _Exchange(grads, group, cp, rank, _GRAD_TAG)
            if exchange is not None:
                kv = exchange.wait(hook, KV)
        if grad_exchange is not None:
            grads = grad_exchange.wait(hook, KV_GRAD)
        dk, dv = grads.unbind(0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool,
                   hook: Hook | None = None, materialized: bool = False) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, keys and values passed round the group's ring.

    q, k, v: (batch, heads, s_local, head_dim), s_local this rank's two zigzag chunks (k and v already repeated
    to q's heads). Scaled by 1 / sqrt(head_dim). With no group (or cp = 1) plain attention, equal to
    F.scaled_dot_product_attention(q, k, v, is_causal=causal). Each block fused (fused_blocks) or with its scores
    materialised (`materialized`, or no fused kernel here). Saves q, k, v, the output and a float32 (float64 for
    float64 inputs) log-sum-exp per row for the backward, none of the other ranks' keys and values."""
    _check_qkv(q, k, v, _group_layout(group)[0])
    return _RingAttention.apply(q, k, v, group, causal, hook, fused_blocks(q, materialized))


# ---- all-gather -----------------------------------------------------------------------------------------------

class _GatherSequence(torch.autograd.Function):
    """Every rank's (.., s_local, head_dim) share gathered into the full sequence in order; the backward
    reduce-scatters the full gradient back to the shares' owners."""

    @staticmethod
    def forward(ctx, local, group, hook):
        cp, _ = _group_layout(group)
        local = local.contiguous()
        gathered = torch.empty(cp * local.numel(), dtype=local.dtype, device=local.device)
        if isinstance(group, LocalRing):
            gathered.view(cp, -1).copy_(local.flatten().expand(cp, -1))
        else:
            _run(hook, ALLGATHER, lambda: all_gather_single(gathered, local.flatten(), group=group))
        ctx.group, ctx.hook, ctx.shape = group, hook, local.shape
        return merge_sequence(list(gathered.view(cp, *local.shape).unbind(0)), cp, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        cp, _ = _group_layout(ctx.group)
        shares = torch.cat([split_sequence(grad, cp, r, dim=-2).flatten() for r in range(cp)])
        mine = torch.empty(ctx.shape.numel(), dtype=grad.dtype, device=grad.device)
        if isinstance(ctx.group, LocalRing):
            mine.copy_(shares[:mine.numel()])
        else:
            _run(ctx.hook, REDUCE_SCATTER, lambda: reduce_scatter_single(mine, shares, group=ctx.group))
        return mine.view(ctx.shape), None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool,
                        hook: Hook | None = None) -> torch.Tensor:
    """cp_comm = "allgather": the same result as `ring_attention`, computed against the gathered sequence's
    keys and values with the mask of the zigzag positions (a query sees the keys at or before its position)."""
    cp, rank = _group_layout(group)
    _check_qkv(q, k, v, cp)
    if cp == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    full_k, full_v = _GatherSequence.apply(torch.stack((k, v)), group, hook).unbind(0)
    mask = None
    if causal:
        seq_len = full_k.shape[2]
        positions = local_positions(seq_len, cp, rank).to(q.device)
        mask = positions.unsqueeze(1) >= torch.arange(seq_len, device=q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, full_k, full_v, attn_mask=mask)
