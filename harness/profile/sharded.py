"""ZeRO's layers as a run holds them: a compute event of a `zero > 0` job's layer with weights (content `fsdp2`)
runs its layer as an FSDP2 unit, as harness train wraps it (harness.train.grad_sync.ShardedReplicas), so that its
samples hold FSDP2's hooks around every forward and backward.

The unit is sharded over a process group of this rank alone and kept whole: it gathers its weights once, before
the first sample, and never reduce-scatters. What a run's FSDP2 does around its collectives (the shards copied in
and out of the gathered buffers, the gradients copied in, averaged and accumulated) is in the collectives' own
events, which time them through FSDP2 (harness.profile.comm, `_fsdp`); the samples here hold the rest, the same
at every zero level.

In context (harness.profile.in_context), a stage chain's units can instead be sharded over a real group of ranks
(`shard_over`), which run the chain together: the gradients reduce-scattered and the weights resharded as the
run's zero level and micro-batches do it, FSDP2's post-backward (all of that work) timed: where it reduce-scatters,
the chain's backward samples leave it to the collective's event, of which it is an in-context sample. Run so, a
stage's forwards and backwards took longer than over a one-rank group (docs/profiling.md, "ZeRO's layers").
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from harness.models.flat_collectives import reduce_scatter_single

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


def alone_mesh(device: torch.device):
    """A DeviceMesh of this rank alone (its set_up_alone_group group; in one process, started here)."""
    from torch.distributed.device_mesh import DeviceMesh

    if _alone_group() is None:  # one process: nothing else to agree with
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("a ZeRO layer needs set_up_alone_group() on every rank first")
        set_up_alone_group()
    return DeviceMesh.from_group(_alone_group(), device_type=device.type)


def sharded_alone(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` as one rank's shard of an FSDP2 parameter (a DTensor split along its first dimension) over this
    rank alone: what a ZeRO run's optimizer steps, each of its operations through DTensor's dispatch."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(tensor, alone_mesh(device), [Shard(0)], run_check=False)


def shard_alone(layer: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`layer` made an FSDP2 unit over this rank alone, kept whole (the module docstring); a layer without
    parameters is left as it is."""
    if not any(True for _ in layer.parameters()):
        return layer
    from torch.distributed.fsdp import fully_shard

    mesh = alone_mesh(device)
    # FSDP2 warns of a unit returning a view (an in-place op on it would skip its hooks): the profile never
    # writes into a layer's output
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    layer.set_requires_gradient_sync(False)
    layer.set_reshard_after_backward(False)
    return layer


def shard_over(layer: torch.nn.Module, device: torch.device, group, post_backward: Callable[[float, float], None],
               mark: Callable[[], object]) -> torch.nn.Module:
    """`layer` made an FSDP2 unit over `group` (every member makes its copy of the same layer, in the same order),
    weights kept whole after the forward, its reduce-scatter waited for inside FSDP2's post-backward; each
    post-backward (gradients copied in, reduce-scattered, averaged, accumulated, and any reshard) reported as
    `post_backward(start, end)` of `mark()`s. Which backwards reduce-scatter and reshard is the caller's
    (set_requires_gradient_sync, set_reshard_after_backward). Raises RuntimeError where this torch's FSDP2 lacks
    custom collectives or its parameter groups (measure_chains then leaves the chain out: its events keep their
    isolated samples)."""
    if not any(True for _ in layer.parameters()):
        return layer
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    waited = _waited_reduce_scatter()  # imported here: torch's FSDP2 takes half a second to import
    if waited is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError("this torch's FSDP2 has no custom reduce-scatter")
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    fully_shard(layer, mesh=DeviceMesh.from_group(group, device_type=device.type), reshard_after_forward=False)
    layer.set_custom_reduce_scatter(waited())
    state = layer._get_fsdp_state()  # FSDP2 calls its parameter groups' post_backward by attribute: time it there
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    if not groups or any(g is None or not hasattr(g, "post_backward") for g in groups):
        raise RuntimeError("this torch's FSDP2 keeps its parameter groups elsewhere")
    for param_group in groups:
        def timed(*args, _inner=param_group.post_backward, **kwargs):
            start = mark()
            try:
                return _inner(*args, **kwargs)
            finally:
                post_backward(start, mark())
        param_group.post_backward = timed
    return layer


@functools.cache
def _waited_reduce_scatter() -> type | None:
    """FSDP2's reduce-scatter, waited for in the call (as harness train's is), so that it ends inside the
    post-backward that issued it; buffers allocated as FSDP2's default does. None where this torch has no custom
    collectives (before 2.8)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        return None

    class WaitedReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            work = reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
            if work is not None:
                work.wait()
            return work

    return WaitedReduceScatter
