"""What a device's ranks cost together, measured by `harness device` under an MPI launcher with 2 or more ranks
(every rank calling), and the description's figures fitted on it.

Rules:
- over torch.distributed started on the communicator (gloo on a CPU, NCCL on a GPU; measure_over_ranks), ended
  after; each measurement interleaves its variants in rounds (`repeats`, at least its own minimum: a call's wait is
  a long-tailed distribution);
- the collectives a training step runs are timed in context (collectives_in_context): each all-reduce, all-gather
  and reduce-scatter right after a compute burst on every rank (a layer's GEMMs), as a tensor-parallel layer runs
  them, each rank's time in the call: the transfer and the wait for the other ranks' burst (their compute's jitter,
  a loaded machine's time slices), which back-to-back collectives after a barrier do not see;
- on a CPU only: FSDP2's unshard() of small units over the ranks beside the bare all-gather (unshards_over_ranks):
  its time a call and a parameter tensor beyond the collective and its modelled copies ([wrappers.fsdp2] unshard_us,
  unshard_tensor_us; fit_unshard); FSDP2's post-backward reduce of the same units beside the bare reduce-scatter and
  their backward without FSDP2 (reduces_over_ranks; reduce_us, reduce_tensor_us; fit_reduce); the framework block
  of GPT-2 (harness.profile.device_blocks) split over the ranks by tensor parallelism, with and without sequence
  parallelism, its forward and backward over the world group against the same shard with no group
  (inline_collectives_over_ranks): what its inline collectives cost a call in a layer's pass (`[host]
  inline_collective_us`; fit_inline_collective), which a bare collective after a burst under-reads (why:
  docs/benchmarks-log/device-model.md, 2026-12-06 (s)); and a pipeline send between the first two ranks as a
  profile measures its P2P (p2p_over_ranks; `[host] p2p_*`; fit_p2p);
- describe_over_ranks writes the fitted figures into a description; no job's run or profile enters them.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from harness.models.transformer import TORCH_DTYPES
from harness.plan.device import MIB, DeviceDescription, WrapperCost
from harness.plan.device_fit import kernel_seconds
from harness.plan.kernels import reduce_copies, unshard_copies
from harness.plan.spec import DTYPES
from harness.profile.device_blocks import FRAMEWORK_SIZES, framework_model
from harness.profile.timer import synchronize

# collectives in context (2 or more ranks): the operations a tensor-parallel layer runs, the sizes (bytes, as
# harness collectives counts them), and the compute burst each follows: a GEMM of about BURST_S on this device
CONTEXT_OPS = ("allreduce", "allgather", "reducescatter")
CONTEXT_SIZES = {"cpu": (1 << 10, 1 << 24), "cuda": (1 << 16, 1 << 30)}
CONTEXT_FACTOR = 4  # between sizes (--quick: 16)
CONTEXT_MIN_ROUNDS = 30  # rounds at least, whatever --repeats: a collective's wait is a wide distribution
BURST_S = 0.002
# on a CPU with 2 or more ranks, FSDP2's unshard() over them: units of (parameter tensors, bytes), float32; small,
# where gloo's all-gather is steady and the copies short (from 1 MiB up it took 0.7 ms in one run, 3-4 in the next)
UNSHARD_UNITS = tuple((tensors, nbytes) for nbytes in (1 << 16, 1 << 18) for tensors in (1, 8, 32))
UNSHARD_MIN_ROUNDS = 60  # a unit's difference of two calls of 0.3-1 ms, each with a wait of its own
INLINE_MIN_ROUNDS = 40  # a pass's difference of 4-10 calls of about 1 ms, each wait from a long-tailed distribution
# a pipeline send between two ranks, as a profile measures its P2P events: a stage's activations on this project's
# CPU jobs (tens of KiB to a few MiB)
P2P_SIZES = (1 << 14, 1 << 18, 1 << 20, 1 << 22)
P2P_MIN_ROUNDS = 20  # the sender-busy samples: a scheduler's slice won or not, each


def collectives_in_context(comm, device: torch.device, matrix_peak: float, repeats: int, warmup: int,
                           quick: bool, group=None) -> list[dict[str, Any]]:
    """The collectives of CONTEXT_OPS over CONTEXT_SIZES, timed in context on every rank of `comm` (mpi4py; torch's
    process group started): each right after a compute burst (a square GEMM of about BURST_S at
    `matrix_peak`), each rank's time in the call; and beside it back to back, after a barrier, as harness
    collectives times it (the slowest rank's). Rounds (`repeats`, at least CONTEXT_MIN_ROUNDS) interleave every
    operation and size. A row per operation and size: bytes, `in_context_s` (the mean over rounds of the ranks'
    mean time in the call: what a step loses to it on average, the transfer and the wait for the other ranks'
    burst; a mean, since a step's time is the sum of its collectives' and the wait's distribution has a long
    tail of lost time slices) and `back_to_back_s` (the median, as harness collectives reports)."""
    import torch.distributed as dist
    from mpi4py import MPI

    from harness.plan.collectives import input_elements, round_size
    from harness.profile.collectives import CollectiveBench

    ranks = comm.Get_size()
    kind = device.type if device.type in CONTEXT_SIZES else "cpu"
    low, high = CONTEXT_SIZES[kind]
    factor = CONTEXT_FACTOR ** 2 if quick else CONTEXT_FACTOR
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= factor
    bench = CollectiveBench(comm, tuple(range(ranks)), "torch", "float32", device, group)
    tasks = []
    for op in CONTEXT_OPS:
        for nbytes in sizes:
            nbytes = round_size(op, nbytes, "float32", ranks)
            _, _, run, _ = bench._torch(op, *input_elements(op, nbytes, "float32", ranks))
            tasks.append((op, nbytes, run))
    side = max(16, round((BURST_S * matrix_peak / 2) ** (1 / 3)))
    a, b = torch.randn(side, side, device=device), torch.randn(side, side, device=device)
    repeats = max(repeats, CONTEXT_MIN_ROUNDS)
    in_context = np.zeros((len(tasks), repeats))
    back_to_back = np.zeros((len(tasks), repeats))
    for round_index in range(warmup + repeats):
        for index, (_, _, run) in enumerate(tasks):
            torch.mm(a, b)
            synchronize(device)
            started = time.perf_counter_ns()
            run()
            synchronize(device)
            took = (time.perf_counter_ns() - started) / 1e9
            dist.barrier(group=group)
            synchronize(device)
            started = time.perf_counter_ns()
            run()
            synchronize(device)
            alone = (time.perf_counter_ns() - started) / 1e9
            if round_index >= warmup:
                in_context[index, round_index - warmup] = took
                back_to_back[index, round_index - warmup] = alone
    mean = np.empty_like(in_context)
    comm.Allreduce(in_context, mean, op=MPI.SUM)
    slowest = np.empty_like(back_to_back)
    comm.Allreduce(back_to_back, slowest, op=MPI.MAX)
    return [{"op": op, "bytes": nbytes, "ranks": ranks, "in_context_s": float(np.mean(mean[i] / ranks)),
             "back_to_back_s": float(np.median(slowest[i])), "burst_s": BURST_S}
            for i, (op, nbytes, _) in enumerate(tasks)]


def measure_over_ranks(comm, device: torch.device, matrix_peak: float, repeats: int, warmup: int, quick: bool,
                 dtype: str = "float32") -> tuple[list[dict[str, Any]], ...]:
    """collectives_in_context and, on a CPU, unshards_over_ranks, reduces_over_ranks,
    inline_collectives_over_ranks and p2p_over_ranks, over torch.distributed started on `comm` (gloo on a CPU, NCCL
    on a GPU), ended after."""
    from harness.runtime.distributed import destroy_process_group, init_process_group
    from launcher.topology import discover

    comm.Barrier()
    init_process_group(comm, discover(comm), device)
    try:
        rows = collectives_in_context(comm, device, matrix_peak, repeats, warmup, quick)
        cpu = device.type == "cpu"
        unshards = unshards_over_ranks(comm, device, repeats, warmup) if cpu else []
        reduces = reduces_over_ranks(comm, device, repeats, warmup) if cpu else []
        inline = inline_collectives_over_ranks(comm, device, dtype, repeats, warmup) if cpu else []
        p2p = p2p_over_ranks(comm, device, repeats, warmup) if cpu else []
        return rows, unshards, reduces, inline, p2p
    finally:
        destroy_process_group()


def inline_collectives_over_ranks(comm, device: torch.device, dtype: str, repeats: int,
                                  warmup: int) -> list[dict[str, Any]]:
    """The framework block of GPT-2 (FRAMEWORK_SIZES) split over every rank of `comm` by tensor parallelism,
    without and with sequence parallelism (torch's process group started: its world group), forward and backward as
    a pass runs them, against the same shard with no group (harness.models.tp: its exchanges stay on the rank), both
    after a barrier, interleaved in rounds (`repeats`, at least INLINE_MIN_ROUNDS). A row per variant: `sp`, `calls`
    (the inline collectives a pass runs, counted through the models' collective hook), `ranks`, `bytes` (one call's
    activations), `grouped_s` and `alone_s` (the mean over rounds and ranks: a step pays every wait of the long
    tail). None where the block does not split over the ranks (its heads, sequence and MLP by the rank count)."""
    import torch.distributed as dist
    from mpi4py import MPI

    from harness.models import tp as tensor_parallel
    from harness.models.transformer import build_layer

    ranks, rank = comm.Get_size(), comm.Get_rank()
    sizes = FRAMEWORK_SIZES
    heads = max(sizes["heads"], ranks)
    if sizes["hidden"] % heads or sizes["seq_len"] % ranks or sizes["ffn"] % ranks:
        return []
    model = dataclasses.replace(framework_model("gpt2", dtype), heads=heads, kv_heads=heads)
    calls = [0]

    def counted(name: str, run: Callable[[], None]) -> None:
        calls[0] += 1
        run()

    variants = []
    for sp in (False, True):
        torch.manual_seed(0)
        grouped = build_layer(model, "block", tp=ranks, group=dist.group.WORLD, tp_index=rank, sp=sp).to(device)
        alone = build_layer(model, "block", tp=ranks, group=None, tp_index=rank, sp=sp).to(device)
        shape = (sizes["micro"], sizes["seq_len"] // (ranks if sp else 1), sizes["hidden"])
        x = torch.randn(*shape, dtype=TORCH_DTYPES[dtype], device=device, requires_grad=True)
        variants.append((sp, grouped, alone, x))
    repeats = max(repeats, INLINE_MIN_ROUNDS)
    times = np.zeros((len(variants), 2, repeats))
    counts = [0] * len(variants)
    tensor_parallel.set_collective_hook(counted)
    try:
        for round_index in range(warmup + repeats):
            for index, (_, grouped, alone, x) in enumerate(variants):
                for which, layer in enumerate((grouped, alone)):
                    calls[0] = 0
                    comm.Barrier()
                    synchronize(device)
                    started = time.perf_counter_ns()
                    out = layer(x)
                    out.backward(torch.ones_like(out))
                    synchronize(device)
                    took = (time.perf_counter_ns() - started) / 1e9
                    layer.zero_grad(set_to_none=True)
                    x.grad = None
                    if which == 0:
                        counts[index] = calls[0]
                    if round_index >= warmup:
                        times[index, which, round_index - warmup] = took
    finally:
        tensor_parallel.set_collective_hook(None)
    total = np.empty_like(times)
    comm.Allreduce(times, total, op=MPI.SUM)
    mean = total.mean(axis=2) / ranks
    nbytes = sizes["micro"] * sizes["seq_len"] * sizes["hidden"] * DTYPES[dtype]
    return [{"sp": sp, "calls": counts[i], "ranks": ranks, "bytes": nbytes, "grouped_s": float(mean[i, 0]),
             "alone_s": float(mean[i, 1])} for i, (sp, _, _, _) in enumerate(variants)]


def fit_inline_collective(rows: Sequence[Mapping[str, Any]]) -> float:
    """`[host] inline_collective_us` (in seconds) from inline_collectives_over_ranks' rows: the passes' time over
    the world group beyond the same shards alone, over all their inline collectives (a call's wait and hand-off at
    the framework block's few KiB, its bytes' time negligible there); not below 0."""
    calls = sum(row["calls"] for row in rows)
    if not calls:
        return 0.0
    return max(0.0, sum(row["grouped_s"] - row["alone_s"] for row in rows) / calls)


def p2p_over_ranks(comm, device: torch.device, repeats: int, warmup: int) -> list[dict[str, Any]]:
    """A send from the first rank of `comm` to the second at each of P2P_SIZES (float32), measured by the profile's
    own P2P measurement (harness.profile.comm.CommProfiler: the ping-pong, the send posted as a training step
    posts it, the sender computing when its receiver posts late, the stream of late receives) with `repeats` rounds
    (at least P2P_MIN_ROUNDS).
    A row per size on every rank: `bytes`, `ranks`, `least_s` (the least half round trip, what stands for a P2P),
    `sender_busy_s` (the mean of the sender-busy samples), `extra_s` (that beyond least_s, not below 0: what
    analysis.costs.corrections reads from a profile), `post_s` (the median post) and, where the stream's run-queue
    waits can be read, `late_s` (the median over its rounds, not below 0)."""
    from harness.profile.comm import CommProfiler
    from launcher.placement import CommTask

    profiler = CommProfiler(comm, "torch", device)
    rows = []
    for nbytes in P2P_SIZES:
        task = CommTask(f"calibration-p2p-{nbytes}", "p2p", {"dtype": "float32", "bytes": nbytes}, (0, 1))
        samples = profiler.measure(task, warmup, max(repeats, P2P_MIN_ROUNDS))
        row = None
        if samples is not None:  # the task's first rank
            least, busy = float(samples.samples_s.min()), float(samples.sender_busy_s.mean())
            row = {"bytes": nbytes, "ranks": comm.Get_size(), "least_s": least, "sender_busy_s": busy,
                   "extra_s": max(0.0, busy - least), "post_s": float(np.nanmedian(samples.send_post_s))}
            if samples.late_s.size:
                row["late_s"] = max(0.0, float(np.median(samples.late_s)))
        rows.append(comm.bcast(row, root=0))
    return rows


def fit_p2p(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """`[host] p2p_post_us`, `p2p_sender_busy_us` and (where the rows have it) `p2p_late_us`, each with its
    `_per_mib`, from p2p_over_ranks' rows (the description's attributes, in seconds): each a line in the sizes'
    bytes by least squares (the isend's call writes the bytes the socket takes; the library's threads move the rest
    in the slices they win), its slope and intercept not below 0."""
    mib = np.array([row["bytes"] for row in rows], dtype=float) / MIB
    out = {}
    for column, name in (("post_s", "p2p_post_s"), ("extra_s", "p2p_sender_busy_s"), ("late_s", "p2p_late_s")):
        if any(column not in row for row in rows):
            continue
        seconds = np.array([row[column] for row in rows], dtype=float)
        spread = float(((mib - mib.mean()) ** 2).sum())
        slope = max(0.0, float(((mib - mib.mean()) * (seconds - seconds.mean())).sum()) / spread) if spread else 0.0
        out[name], out[f"{name}_per_mib"] = max(0.0, float(seconds.mean()) - slope * float(mib.mean())), slope
    return out


def unshards_over_ranks(comm, device: torch.device, repeats: int, warmup: int) -> list[dict[str, Any]]:
    """FSDP2's unshard() of units of UNSHARD_UNITS (float32 tensors of equal size, fully_shard over every rank of
    `comm`; torch's process group started), each beside the bare all-gather of the unit's bytes, each after a
    barrier, every unit and both calls interleaved in rounds (`repeats`, at least UNSHARD_MIN_ROUNDS); a sample is
    the slowest rank's. A row per unit: tensors, bytes, ranks, `unshard_s` and `bare_s` (medians) and `extra_s`
    (the median over rounds of the unshard less the bare all-gather beside it)."""
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from harness.models.flat_collectives import all_gather_single
    from harness.profile.comm import TrivialUnit

    ranks = comm.Get_size()
    mesh = DeviceMesh.from_group(dist.group.WORLD, device_type=device.type)
    units = []
    for shapes in _unit_shapes(ranks):
        unit = TrivialUnit(shapes, device)
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
        whole = torch.empty(sum(shape.numel() for shape, _ in shapes), device=device)
        units.append((unit, whole, whole[:whole.numel() // ranks].clone()))
    repeats = max(repeats, UNSHARD_MIN_ROUNDS)
    times = np.zeros((2, len(units), repeats))
    for round_index in range(warmup + repeats):
        for index, (unit, whole, shard) in enumerate(units):
            for call, run in enumerate((unit.unshard, functools.partial(all_gather_single, whole, shard))):
                comm.Barrier()
                synchronize(device)
                started = time.perf_counter_ns()
                run()
                synchronize(device)
                if round_index >= warmup:
                    times[call, index, round_index - warmup] = (time.perf_counter_ns() - started) / 1e9
            unit.reshard()
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return [{"tensors": len(list(unit.parameters())), "bytes": whole.numel() * 4, "ranks": ranks,
             "unshard_s": float(np.median(slowest[0, i])), "bare_s": float(np.median(slowest[1, i])),
             "extra_s": float(np.median(slowest[0, i] - slowest[1, i]))}
            for i, (unit, whole, _) in enumerate(units)]


def _unit_shapes(ranks: int) -> list[list[tuple[torch.Size, torch.dtype]]]:
    """UNSHARD_UNITS as parameter shapes: each unit's tensors of rows of 64 float32, split evenly over `ranks`."""
    out = []
    for tensors, nbytes in UNSHARD_UNITS:
        rows = max(ranks, nbytes // 4 // tensors // 64 // ranks * ranks)
        out.append([(torch.Size((rows, 64)), torch.float32)] * tensors)
    return out


def reduces_over_ranks(comm, device: torch.device, repeats: int, warmup: int) -> list[dict[str, Any]]:
    """FSDP2's post-backward reduce of units of UNSHARD_UNITS (fully_shard over every rank of `comm`, its weights
    kept whole after the forward: the backward then only reduces), as a profile times a ZeRO reduce-scatter
    (harness.profile.comm: the backward of a trivial use of the weights), beside the same backward without FSDP2
    and the bare reduce-scatter of the unit's bytes, each after a barrier, every unit and the three interleaved
    in rounds (`repeats`, at least UNSHARD_MIN_ROUNDS); a sample is the slowest rank's. A row per unit: tensors,
    bytes, ranks, `reduce_s`, `plain_s` and `bare_s` (medians) and `extra_s` (the median over rounds of the
    reduce less the plain backward and the bare reduce-scatter beside it)."""
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from harness.models.flat_collectives import reduce_scatter_single
    from harness.profile.comm import TrivialUnit

    ranks = comm.Get_size()
    mesh = DeviceMesh.from_group(dist.group.WORLD, device_type=device.type)
    one = torch.ones((), device=device)
    units = []
    for shapes in _unit_shapes(ranks):
        sharded, plain = TrivialUnit(shapes, device), TrivialUnit(shapes, device)
        fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
        whole = torch.empty(sum(shape.numel() for shape, _ in shapes), device=device)
        units.append((sharded, plain, whole, torch.empty(whole.numel() // ranks, device=device)))

    def timed(run: Callable[[], Any]) -> float:
        comm.Barrier()
        synchronize(device)
        started = time.perf_counter_ns()
        run()
        synchronize(device)
        return (time.perf_counter_ns() - started) / 1e9

    repeats = max(repeats, UNSHARD_MIN_ROUNDS)
    times = np.zeros((3, len(units), repeats))
    for round_index in range(warmup + repeats):
        for index, (sharded, plain, whole, shard) in enumerate(units):
            took = []
            for unit in (sharded, plain):
                loss = unit(one)  # FSDP2's gathers (untimed): its backward then finds whole weights
                took.append(timed(loss.backward))
                unit.zero_grad(set_to_none=True)
            sharded.reshard()
            took.append(timed(functools.partial(reduce_scatter_single, shard, whole)))
            if round_index >= warmup:
                times[:, index, round_index - warmup] = took
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return [{"tensors": len(list(sharded.parameters())), "bytes": whole.numel() * 4, "ranks": ranks,
             "reduce_s": float(np.median(slowest[0, i])), "plain_s": float(np.median(slowest[1, i])),
             "bare_s": float(np.median(slowest[2, i])),
             "extra_s": float(np.median(slowest[0, i] - slowest[1, i] - slowest[2, i]))}
            for i, (sharded, _, whole, _) in enumerate(units)]


def _per_call_and_tensor(extra: Sequence[float], tensors: Sequence[float]) -> tuple[float, float]:
    """(a time a call, a time a parameter tensor) through units' extra times by Theil-Sen: the median of the slopes
    between units of different tensor counts, then the median of what is left (one unit's wait that ran long moves
    neither); neither below 0."""
    slopes = [(extra[j] - extra[i]) / (tensors[j] - tensors[i])
              for i in range(len(extra)) for j in range(i + 1, len(extra)) if tensors[j] != tensors[i]]
    per_tensor = max(0.0, float(np.median(slopes))) if slopes else 0.0
    call = float(np.median([y - per_tensor * k for y, k in zip(extra, tensors)]))
    return max(0.0, call), per_tensor


def fit_reduce(description: DeviceDescription, rows: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """[wrappers.fsdp2] (reduce_s, reduce_tensor_s) from reduces_over_ranks' rows: each unit's reduce beyond its
    plain backward and bare reduce-scatter (`extra_s`), less its copy-in on `description`
    (harness.plan.kernels.reduce_copies), as a time a call plus a time a parameter tensor (_per_call_and_tensor)."""
    extra = [row["extra_s"] - sum(kernel_seconds(description, kernel)
                                  for kernel in reduce_copies(row["bytes"], "float32")) for row in rows]
    return _per_call_and_tensor(extra, [float(row["tensors"]) for row in rows])


def fit_unshard(description: DeviceDescription, rows: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """[wrappers.fsdp2] (unshard_s, unshard_tensor_s) from unshards_over_ranks' rows: each unit's unshard beyond
    its bare all-gather (`extra_s`), less its copies on `description` (harness.plan.kernels.unshard_copies), as a
    time a call plus a time a parameter tensor, by Theil-Sen (the median of the slopes between units of different
    tensor counts, then the median of what is left: one unit's wait that ran long moves neither); neither below 0."""
    extra = [row["extra_s"] - sum(kernel_seconds(description, kernel)
                                  for kernel in unshard_copies(row["bytes"], row["ranks"], "float32", row["tensors"]))
             for row in rows]
    return _per_call_and_tensor(extra, [float(row["tensors"]) for row in rows])



def describe_over_ranks(description: DeviceDescription, inline: Sequence[Mapping[str, Any]] = (),
                        p2p: Sequence[Mapping[str, Any]] = (), unshards: Sequence[Mapping[str, Any]] = (),
                        reduces: Sequence[Mapping[str, Any]] = ()) -> DeviceDescription:
    """`description` with the figures fitted on measure_over_ranks' rows: `[host] inline_collective_us`, the
    `[host] p2p_*` fields and [wrappers.fsdp2]'s unshard and reduce, each where its rows were measured (the FSDP2
    entry's others kept, or 0)."""
    if inline:
        description = dataclasses.replace(description, inline_collective_s=fit_inline_collective(inline))
    if p2p:
        description = dataclasses.replace(description, **fit_p2p(p2p))
    if not (unshards or reduces):
        return description
    fsdp2 = description.wrappers.get("fsdp2", WrapperCost(0.0, 0.0))
    if unshards:
        unshard_s, tensor_s = fit_unshard(description, unshards)
        fsdp2 = dataclasses.replace(fsdp2, unshard_s=unshard_s, unshard_tensor_s=tensor_s)
    if reduces:
        reduce_s, tensor_s = fit_reduce(description, reduces)
        fsdp2 = dataclasses.replace(fsdp2, reduce_s=reduce_s, reduce_tensor_s=tensor_s)
    return dataclasses.replace(description, wrappers={**description.wrappers, "fsdp2": fsdp2})
