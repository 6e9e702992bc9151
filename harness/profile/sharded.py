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

import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist

# this rank's one-rank process group ("group") and the world it was made in ("world"): a profile's end destroys its
# world, and a later profile in the same process makes a new one
_ALONE: dict[str, object] = {}


def _alone_group():
    """This rank's one-rank group of the current world; None before set_up_alone_group in it."""
    if dist.is_initialized() and _ALONE.get("world") is dist.group.WORLD:
        return _ALONE["group"]
    return None


def set_up_alone_group() -> None:
    """Make every rank's one-rank group: collective, every rank of torch.distributed's world calls it once, before
    any ZeRO layer is measured. Without torch.distributed (one process), a one-rank gloo world is started."""
    if _alone_group() is not None:
        return
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD if dist.get_world_size() == 1 else dist.new_subgroups(group_size=1)[0]
    _ALONE.update(group=group, world=dist.group.WORLD, started=started)


@contextmanager
def leaving_no_world():
    """Within: ZeRO layers may start a one-rank world where there is none (set_up_alone_group); on leaving, a world
    started so is destroyed, so the process is left as it was (a training run may start its own after)."""
    before = dist.is_initialized()
    try:
        yield
    finally:
        if not before and dist.is_initialized() and _ALONE.get("started") and _alone_group() is not None:
            dist.destroy_process_group()
            _ALONE.clear()


def shard_alone(layer: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`layer` made an FSDP2 unit over this rank alone, kept whole (the module docstring); a layer without
    parameters is left as it is."""
    if not any(True for _ in layer.parameters()):
        return layer
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if _alone_group() is None:  # one process: nothing else to agree with
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("a ZeRO layer needs set_up_alone_group() on every rank first")
        set_up_alone_group()
    # FSDP2 warns of a unit returning a view (an in-place op on it would skip its hooks): the profile never
    # writes into a layer's output
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = DeviceMesh.from_group(_alone_group(), device_type=device.type)
    fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    layer.set_requires_gradient_sync(False)
    layer.set_reshard_after_backward(False)
    return layer
