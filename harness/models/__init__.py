"""Torch models: the built-in transformer zoo (Megatron-style tensor parallel) and users' factory models, and
the optimizer a job trains them with."""
from __future__ import annotations

import torch

from harness.models.transformer import TORCH_DTYPES, build_layer

__all__ = ["TORCH_DTYPES", "build_layer", "make_optimizer"]


def make_optimizer(name: str, momentum: float, params: list, lr: float) -> torch.optim.Optimizer:
    """The optimizer of a spec's [optimizer] over `params`: Adam, or SGD with `momentum`."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    return torch.optim.Adam(params, lr=lr)
