"""Torch models: the built-in transformer zoo (Megatron-style tensor parallel) and users' factory models, and
the optimizer a job trains them with."""
from __future__ import annotations

import torch

from harness.common.errors import UserError
from harness.models.transformer import TORCH_DTYPES, build_layer

__all__ = ["TORCH_DTYPES", "build_layer", "make_optimizer", "split_backward"]


def make_optimizer(name: str, momentum: float, params: list, lr: float) -> torch.optim.Optimizer:
    """The optimizer of a spec's [optimizer] over `params`: Adam, or SGD with `momentum`."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    return torch.optim.Adam(params, lr=lr)


def checkpointed(function, *args):
    """`function(*args)` as recompute = "full" runs it (harness train and the profile alike): under
    torch.utils.checkpoint, non-reentrant, its forward run again whole before its backward. Torch's default
    early stop would skip a pre-LN block's last projection and all-reduce, which nothing saves; Megatron-LM and
    the plan run the whole forward again."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        return checkpoint(function, *args, use_reentrant=False)


def split_backward():
    """(stage_backward_input, stage_backward_weight): torch.distributed.pipelining's two halves of a backward,
    which its zero-bubble schedules run (a private module; UserError on a torch without it)."""
    try:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    except ImportError as exc:
        raise UserError(f"the zero-bubble schedules need torch.distributed.pipelining's split backward "
                        f"(stage_backward_input, stage_backward_weight), which torch {torch.__version__} does "
                        f"not have ({exc}); use schedule = '1f1b' or a newer torch") from None
    return stage_backward_input, stage_backward_weight
