"""ZeRO's layers as a run holds them: a compute event of a `zero > 0` job's layer with weights (content `fsdp2`)
runs its layer as an FSDP2 unit, as harness train wraps it (harness.train.grad_sync.ShardedReplicas), so that its
samples hold FSDP2's hooks around every forward and backward.

The unit is sharded over a process group of this rank alone and kept whole: it gathers its weights once, before
the first sample, and never reduce-scatters. What a run's FSDP2 does around its collectives (the shards copied in
and out of the gathered buffers, the gradients copied in, averaged and accumulated) is in the collectives' own
events, which time them through FSDP2 (harness.profile.comm, `_fsdp`); the samples here hold the rest, the same
at every zero level.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_ALONE: dict[str, object] = {}  # "group": this rank's one-rank process group, once made


def set_up_alone_group() -> None:
    """Make every rank's one-rank group: collective, every rank of torch.distributed's world calls it once, before
    any ZeRO layer is measured. Without torch.distributed (one process), a one-rank gloo world is started."""
    if "group" in _ALONE:
        return
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() == 1:
        _ALONE["group"] = dist.group.WORLD
        return
    mine, _ = dist.new_subgroups(group_size=1)
    _ALONE["group"] = mine


def shard_alone(layer: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`layer` made an FSDP2 unit over this rank alone, kept whole (the module docstring); a layer without
    parameters is left as it is."""
    if not any(True for _ in layer.parameters()):
        return layer
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if "group" not in _ALONE:  # one process: nothing else to agree with
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("a ZeRO layer needs set_up_alone_group() on every rank first")
        set_up_alone_group()
    mesh = DeviceMesh.from_group(_ALONE["group"], device_type=device.type)
    fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    layer.set_requires_gradient_sync(False)
    layer.set_reshard_after_backward(False)
    return layer
