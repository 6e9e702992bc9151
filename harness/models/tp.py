"""Megatron-style tensor parallelism: column- and row-parallel linears and the two conjugate operators.

`copy_to_tp` (Megatron's f) is the identity forward and all-reduces the gradient backward;
`reduce_from_tp` (g) all-reduces forward and is the identity backward. With no group (profiling one
shard alone, or tp = 1) both are the identity: the harness then times the collectives as separate events.
`vocab_parallel_cross_entropy` is Megatron-LM's loss over logits split by vocabulary: two small all-reduces
forward (the maximum; the exponentials' sum with the target's logit), none backward.
A hook (`set_collective_hook`) lets real runs time every tensor-parallel all-reduce, by the names
harness.layers gives them.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

_collective_hook: Callable[[str, Callable[[], None]], None] | None = None


def set_collective_hook(hook: Callable[[str, Callable[[], None]], None] | None) -> None:
    """Route every tensor-parallel all-reduce through hook(name, run) (used by `harness train` to time them)."""
    global _collective_hook
    _collective_hook = hook


def _all_reduce(tensor: torch.Tensor, group, name: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    def run() -> None:
        dist.all_reduce(tensor, op=op, group=group)

    if _collective_hook is None:
        run()
    else:
        _collective_hook(name, run)
    return tensor


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
    """y = x A^T + b with A split by rows of the output: each shard computes out_features / tp outputs."""

    def __init__(self, in_features: int, out_features: int, tp: int, bias: bool = True, dtype=None):
        super().__init__()
        if out_features % tp:
            raise ValueError(f"out_features {out_features} not divisible by tp {tp}")
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // tp, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """The matching row-parallel linear: each shard takes in_features / tp inputs; the partial outputs are
    summed by reduce_from_tp, and the (replicated) bias is added after the sum."""

    def __init__(self, in_features: int, out_features: int, tp: int, bias: bool = True, dtype=None):
        super().__init__()
        if in_features % tp:
            raise ValueError(f"in_features {in_features} not divisible by tp {tp}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.normal_(self.weight, std=0.02 / math.sqrt(2))

    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        out = reduce_from_tp(nn.functional.linear(x, self.weight), group)
        return out + self.bias if self.bias is not None else out
