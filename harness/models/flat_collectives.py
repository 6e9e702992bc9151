"""torch.distributed's collectives of flat tensors under either of their names: torch 2.13 renamed
all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and reduce_scatter_single, and an older torch
has only the first names."""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, **kwargs):
    """An all-gather of flat tensors: torch 2.13's all_gather_single, all_gather_into_tensor on a torch without it."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, tensor, **kwargs)


def reduce_scatter_single(output: torch.Tensor, tensor: torch.Tensor, **kwargs):
    """A reduce-scatter of flat tensors: torch 2.13's reduce_scatter_single, reduce_scatter_tensor before it."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, tensor, **kwargs)
