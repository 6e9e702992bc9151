"""Megatron-style tensor parallelism: column- and row-parallel linears and the two conjugate operators.

`copy_to_tp` (Megatron's f) is the identity forward and all-reduces the gradient backward;
`reduce_from_tp` (g) all-reduces forward and is the identity backward. With no group (profiling one
shard alone, or tp = 1) both are the identity: the harness then times the collectives as separate events.
A hook (`set_collective_hook`) lets real runs time every tensor-parallel all-reduce.
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


def _all_reduce(tensor: torch.Tensor, group, name: str) -> torch.Tensor:
    def run() -> None:
        dist.all_reduce(tensor, group=group)

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
