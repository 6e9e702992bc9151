"""ZeRO's layers as a run holds them: a compute event of a `zero > 0` job (content `zero`) runs its layer as an FSDP2
unit, as harness train wraps every layer with parameters (harness.train.grad_sync.ShardedReplicas), so that its
samples hold FSDP2's hooks around every forward and backward and its copies in and out of the gathered weights.

The unit is sharded over a process group of this rank alone: its all-gather and reduce-scatter are local copies,
while the collectives themselves are events of their own (harness.profile.comm, `_fsdp`). zero 1 and 2 keep the
weights whole after the first forward; zero 3 reshards after every forward and backward; zero 2 and 3
reduce-scatter every backward's gradients, zero 1 only the last micro-batch's (its samples take the others' way).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_ALONE: dict[str, object] = {}  # "group": this rank's one-rank process group, once made


def set_up_alone_group() -> None:
    """Make every rank's one-rank group: collective, every rank of torch.distributed's world calls it once, before
    any ZeRO event is measured. Without torch.distributed (one process), a one-rank gloo world is started."""
    if "group" in _ALONE:
        return
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() == 1:
        _ALONE["group"] = dist.group.WORLD
        return
    mine, _ = dist.new_subgroups(group_size=1)
    _ALONE["group"] = mine


def shard_alone(layer: torch.nn.Module, zero: int, device: torch.device) -> torch.nn.Module:
    """`layer` made an FSDP2 unit over this rank alone, as a `zero` job's run holds it (the module docstring);
    a layer without parameters is left as it is."""
    if zero <= 0 or not any(True for _ in layer.parameters()):
        return layer
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if "group" not in _ALONE:  # one process: nothing else to agree with
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("a ZeRO event's layer needs set_up_alone_group() on every rank first")
        set_up_alone_group()
    mesh = DeviceMesh.from_group(_ALONE["group"], device_type=device.type)
    fully_shard(layer, mesh=mesh, reshard_after_forward=zero == 3)
    layer.set_requires_gradient_sync(zero >= 2)
    layer.set_reshard_after_backward(zero == 3)
    return layer
