"""Megatron-style tensor parallelism: column- and row-parallel linears and the two conjugate operators.

`copy_to_tp` (Megatron's f) is the identity forward and all-reduces the gradient backward;
`reduce_from_tp` (g) all-reduces forward and is the identity backward. With no group (profiling one
shard alone, or tp = 1) both are the identity: the harness then times the collectives as separate events.
`vocab_parallel_cross_entropy` is Megatron-LM's loss over logits split by vocabulary: two small all-reduces
forward (the maximum; the exponentials' sum with the target's logit), none backward.
Sequence parallelism (Megatron-LM, Korthikanti et al. 2022) keeps the activations between the tensor-parallel
regions split by sequence, (micro, seq / tp, hidden): `gather_sequence` all-gathers them (its gradient
reduce-scattered), `scatter_sequence` reduce-scatters a row-parallel linear's partial sums (its gradient
all-gathered), and a column-parallel linear built with `sequence_parallel` all-gathers its input itself, saves
the shard, not the gathered input, and gathers it again in its backward for its weight's gradient. With no
group (one shard profiled alone) each stands in with the same shapes and copies: tp copies of the shard, or the
first shard of the sum, so that the shard's compute is timed at its real sizes.
A hook (`set_collective_hook`) lets real runs time every tensor-parallel collective, by the names
harness.plan.layers gives them.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from harness.models.flat_collectives import all_gather_single, reduce_scatter_single
from harness.plan.layers import SEQ_ALLGATHER, SEQ_REDUCESCATTER

_collective_hook: Callable[[str, Callable[[], None]], None] | None = None


def set_collective_hook(hook: Callable[[str, Callable[[], None]], None] | None) -> None:
    """Route every tensor-parallel collective through hook(name, run) (used by `harness train` to time them)."""
    global _collective_hook
    _collective_hook = hook


def _all_reduce(tensor: torch.Tensor, group, name: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    hooked(name, lambda: dist.all_reduce(tensor, op=op, group=group))
    return tensor


def hooked(name: str, run: Callable[[], None]) -> None:
    """Run a collective of the given name through the hook set by set_collective_hook (if any)."""
    if _collective_hook is None:
        run()
    else:
        _collective_hook(name, run)


def _gather(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """(micro, seq / tp, ...) shards of the group, in rank order, as (micro, seq, ...); no group: tp copies of x."""
    x = x.contiguous()
    shards = torch.empty((tp,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    if group is None:
        shards.copy_(x.unsqueeze(0).expand_as(shards))
    else:
        hooked(SEQ_ALLGATHER, lambda: all_gather_single(shards.flatten(0, 1), x, group=group))
    return shards.transpose(0, 1).flatten(1, 2)


def _scatter(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """The sum over the group of (micro, seq, ...) partial sums, this rank's seq / tp tokens of it; no group: the
    first shard of x."""
    staged = x.unflatten(1, (tp, x.shape[1] // tp)).transpose(0, 1).contiguous()
    if group is None:
        return staged[0].clone()
    out = torch.empty_like(staged[0])
    hooked(SEQ_REDUCESCATTER, lambda: reduce_scatter_single(out, staged.flatten(0, 1), group=group))
    return out


class _SequenceExchange(torch.autograd.Function):
    """All-gather by sequence (`gather`) or reduce-scatter, its backward the other one."""

    @staticmethod
    def forward(ctx, x, group, tp, gather):
        ctx.group, ctx.tp, ctx.gather = group, tp, gather
        return (_gather if gather else _scatter)(x, group, tp)

    @staticmethod
    def backward(ctx, grad):
        return (_scatter if ctx.gather else _gather)(grad, ctx.group, ctx.tp), None, None, None


class _GatheredLinear(torch.autograd.Function):
    """y = gather(x) A^T + b for a sequence shard x, saving x (seq / tp tokens) and gathering it again in the
    backward for A's gradient, as Megatron-LM's sequence-parallel column linear does."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, tp):
        ctx.group, ctx.tp, ctx.has_bias = group, tp, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, group, tp), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = _scatter(grad.matmul(weight), ctx.group, ctx.tp)
        whole = _gather(x, ctx.group, ctx.tp)
        grad_weight = grad.flatten(0, -2).t().matmul(whole.flatten(0, -2))
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None


def gather_sequence(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """Sequence shards -> the whole sequence (all-gather; the gradient reduce-scattered)."""
    return _SequenceExchange.apply(x, group, tp, True)


def scatter_sequence(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """Partial sums over the whole sequence -> this rank's shard of their sum (reduce-scatter; the gradient
    all-gathered)."""
    return _SequenceExchange.apply(x, group, tp, False)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.group, "tp.allreduce"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous(), group, "tp.allreduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of (tokens, vocab / tp) float32 logits, this shard's vocabulary from `vocab_start`.
    Saves its softmax shard alone and turns it into the logits' gradient in place, as Megatron-LM does."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        maximum = logits.max(dim=-1).values
        if group is not None:
            _all_reduce(maximum, group, "tp.loss_max", dist.ReduceOp.MAX)
        exp = (logits - maximum.unsqueeze(-1)).exp_()  # its shifted logits first
        local = targets - vocab_start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        picked = (logits.gather(-1, local.unsqueeze(-1)).squeeze(-1) - maximum) * inside
        sums = torch.stack((exp.sum(dim=-1), picked))
        if group is not None:
            _all_reduce(sums, group, "tp.loss_sums")
        exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(exp, local, inside)
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        softmax[rows, local] -= inside.to(softmax.dtype)
        softmax.mul_(grad / softmax.shape[0])
        return softmax, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group) -> torch.Tensor:
    """Next-token cross-entropy (float32, the mean over tokens) of logits (micro, seq, vocab / tp) holding
    vocabulary entries vocab_start.. of targets (micro, seq); with no group this shard's part alone (what a
    profile of the head times, its all-reduces measured as their own events)."""
    return _VocabParallelCrossEntropy.apply(logits.float().flatten(0, 1), targets.flatten(), vocab_start, group)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows of the output: each shard computes out_features / tp outputs. With
    `sequence_parallel` its input is a sequence shard, all-gathered over `group` first (_GatheredLinear)."""

    def __init__(self, in_features: int, out_features: int, tp: int, bias: bool = True, dtype=None,
                 sequence_parallel: bool = False, group=None):
        super().__init__()
        if out_features % tp:
            raise ValueError(f"out_features {out_features} not divisible by tp {tp}")
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // tp, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.tp, self.sequence_parallel, self.group = tp, sequence_parallel, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _GatheredLinear.apply(x, self.weight, self.bias, self.group, self.tp)
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """The matching row-parallel linear: each shard takes in_features / tp inputs; the partial outputs are
    summed by reduce_from_tp (with `sequence_parallel` reduce-scattered by sequence), and the (replicated)
    bias is added after the sum."""

    def __init__(self, in_features: int, out_features: int, tp: int, bias: bool = True, dtype=None,
                 sequence_parallel: bool = False):
        super().__init__()
        if in_features % tp:
            raise ValueError(f"in_features {in_features} not divisible by tp {tp}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=0.02 / math.sqrt(2))
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        partial = nn.functional.linear(x, self.weight)
        out = scatter_sequence(partial, group, self.tp) if self.sequence_parallel else reduce_from_tp(partial, group)
        return out + self.bias if self.bias is not None else out
