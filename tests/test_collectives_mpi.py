"""The collective benchmark's operations on the whole world (pytest-mpi): every output right at any world
size of 2 or more, on torch.distributed and on mpi4py, and the same result on every rank."""
from __future__ import annotations

import numpy as np
import pytest

from harness.plan.collectives import OPS, round_size


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _measure_all(bench, size: int) -> list:
    results = []
    for op in OPS:
        for nbytes in (4, 1000, 64 << 10):  # one element, an odd count, a few pages
            results.append(bench.measure(op, round_size(op, nbytes, bench.dtype, size), warmup=1, iters=2))
    return results


def _check(results, comm) -> None:
    assert all(r.wrong == 0 for r in results), [(r.op, r.nbytes, r.wrong) for r in results if r.wrong]
    assert all(r.samples_s.size == 2 and (r.samples_s > 0).all() for r in results)
    # an iteration's time is its slowest rank's: the same on every rank
    times = np.concatenate([r.samples_s for r in results])
    assert all(np.array_equal(times, other) for other in comm.allgather(times))


@pytest.mark.mpi(min_size=2)
def test_every_operation_right_through_mpi4py():
    from harness.profile.collectives import CollectiveBench

    comm = _world()
    sub = comm.Dup()
    bench = CollectiveBench(sub, tuple(range(comm.size)), "mpi4py", "float64")
    _check(_measure_all(bench, comm.size), comm)
    sub.Free()


@pytest.mark.mpi(min_size=2)
def test_every_operation_right_through_torch_on_a_subgroup():
    """On the world's first two ranks only (a torch group that is not the world), while the others wait."""
    import torch
    import torch.distributed as dist

    from harness.profile.collectives import CollectiveBench
    from harness.runtime.distributed import destroy_process_group, init_process_group
    from harness.runtime.mpi_errors import yielding_barrier
    from launcher.topology import discover

    comm = _world()
    init_process_group(comm, discover(comm), torch.device("cpu"), timeout_s=120)
    try:
        ranks = (0, 1)
        group = dist.new_group(list(ranks))
        member = comm.rank in ranks
        from mpi4py import MPI

        sub = comm.Split(0 if member else MPI.UNDEFINED, key=comm.rank)
        if member:
            bench = CollectiveBench(sub, ranks, "gloo", "bfloat16", torch.device("cpu"), group)
            results = _measure_all(bench, 2)
            assert all(r.wrong == 0 for r in results), [(r.op, r.nbytes, r.wrong) for r in results if r.wrong]
            assert all(r.ranks == 2 for r in results)
            sub.Free()
        yielding_barrier(comm, 0.001)
    finally:
        destroy_process_group()
