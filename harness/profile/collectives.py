"""Collective operations timed the nccl-tests way, through torch.distributed or mpi4py (definitions:
harness.plan.collectives).

Every member of the benchmark's group calls `measure` for every (operation, size) in the same order. A size
is first run once on known inputs and its output checked (the wrong elements, summed over the ranks, are
nccl-tests' #wrong); then the buffers are zeroed (sums of zeros stay finite however many iterations run)
and each iteration is a barrier of the group (the backend's own) followed by the operation, timed on every rank; an
iteration's time is its slowest rank's.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from harness.plan.collectives import (
    ELEMENT_BYTES,
    SizeResult,
    element_count,
    expected_output,
    input_elements,
    input_values,
)

# mpi4py's buffers are numpy arrays; numpy has no bfloat16 and MPI no standard half type
MPI4PY_DTYPES = ("float32", "float64", "int32")
_HALF = ("float16", "bfloat16")


class CollectiveBench:
    """One group's operations on one backend; `comm` is the group's own mpi4py communicator (its barriers,
    the max of the times and the sum of the wrong counts), `ranks` its world ranks in order."""

    def __init__(self, comm, ranks: tuple[int, ...], backend: str, dtype: str, device=None, torch_group=None):
        self.comm, self.ranks, self.backend, self.dtype = comm, ranks, backend, dtype
        self.size, self.index = comm.Get_size(), comm.Get_rank()
        self.device, self.torch_group = device, torch_group

    def measure(self, op: str, nbytes: int, warmup: int, iters: int) -> SizeResult:
        """`op` at `nbytes` (a size of whole elements, harness.plan.collectives.round_size): checked once, then
        timed; the same result on every member."""
        inp_n, out_n = input_elements(op, nbytes, self.dtype, self.size)
        inp, out, run, to_numpy = (self._torch if self.backend != "mpi4py" else self._mpi)(op, inp_n, out_n)
        self._fill(inp, input_values(self.index, inp_n))
        run()
        self._sync()
        expected = expected_output(op, self.index, self.size, element_count(nbytes, self.dtype))
        wrong = self._count_wrong(to_numpy(), expected)
        self._fill(inp, np.zeros(inp_n))
        local = np.empty(iters, dtype=np.float64)
        # the backend's own barrier, as the profiler's (MPICH's spinning one leaves gloo's threads a core short)
        barrier = self.comm.Barrier if self.backend == "mpi4py" else self._torch_barrier
        for i in range(warmup + iters):
            barrier()
            t0 = time.perf_counter_ns()
            run()
            self._sync()
            if i >= warmup:
                local[i - warmup] = (time.perf_counter_ns() - t0) / 1e9
        from mpi4py import MPI

        slowest = np.empty_like(local)
        self.comm.Allreduce(local, slowest, op=MPI.MAX)
        return SizeResult(op, nbytes, self.dtype, self.size, slowest, int(self.comm.allreduce(wrong, op=MPI.SUM)))

    def _torch_barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.torch_group)
        self._sync()

    def _count_wrong(self, got: np.ndarray, expected: np.ndarray) -> int:
        got = np.asarray(got, dtype=np.float64)
        tolerance = 1e-2 * np.abs(expected) if self.dtype in _HALF else 0.0
        return int(np.count_nonzero(np.abs(got - expected) > tolerance))

    def _fill(self, buffer, values: np.ndarray) -> None:
        if self.backend == "mpi4py":
            buffer[...] = values
        else:
            import torch

            buffer.copy_(torch.from_numpy(values).to(buffer.dtype))

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def _torch(self, op: str, inp_n: int, out_n: int) -> tuple[object, object, Callable[[], None], Callable]:
        import torch
        import torch.distributed as dist

        from harness.models import TORCH_DTYPES
        from harness.models.flat_collectives import all_gather_single, reduce_scatter_single

        dtype = TORCH_DTYPES.get(self.dtype, torch.int32 if self.dtype == "int32" else None)
        group = self.torch_group
        all_gather, reduce_scatter = all_gather_single, reduce_scatter_single
        inp = torch.zeros(inp_n, dtype=dtype, device=self.device)
        out = inp if op in ("allreduce", "broadcast") else torch.zeros(out_n, dtype=dtype, device=self.device)
        peer_next = self.ranks[(self.index + 1) % self.size]
        peer_prev = self.ranks[(self.index - 1) % self.size]
        runs: dict[str, Callable[[], object]] = {
            "allreduce": lambda: dist.all_reduce(inp, group=group),
            "allgather": lambda: all_gather(out, inp, group=group),
            "reducescatter": lambda: reduce_scatter(out, inp, group=group),
            "broadcast": lambda: dist.broadcast(inp, src=self.ranks[0], group=group),
            "alltoall": lambda: dist.all_to_all_single(out, inp, group=group),
            "sendrecv": lambda: [work.wait() for work in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, inp, peer_next, group), dist.P2POp(dist.irecv, out, peer_prev, group)])],
        }
        return inp, out, runs[op], lambda: out.cpu().double().numpy()

    def _mpi(self, op: str, inp_n: int, out_n: int) -> tuple[object, object, Callable[[], None], Callable]:
        from mpi4py import MPI

        comm = self.comm
        dtype = np.dtype(self.dtype)
        assert dtype.itemsize == ELEMENT_BYTES[self.dtype]
        inp = np.zeros(inp_n, dtype=dtype)
        out = inp if op in ("allreduce", "broadcast") else np.zeros(out_n, dtype=dtype)
        peer_next, peer_prev = (self.index + 1) % self.size, (self.index - 1) % self.size
        runs: dict[str, Callable[[], object]] = {
            "allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, inp, op=MPI.SUM),
            "allgather": lambda: comm.Allgather(inp, out),
            "reducescatter": lambda: comm.Reduce_scatter_block(inp, out, op=MPI.SUM),
            "broadcast": lambda: comm.Bcast(inp, root=0),
            "alltoall": lambda: comm.Alltoall(inp, out),
            "sendrecv": lambda: comm.Sendrecv(inp, dest=peer_next, recvbuf=out, source=peer_prev),
        }
        return inp, out, runs[op], lambda: out
