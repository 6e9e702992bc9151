"""`harness device` on 2 or more ranks (pytest-mpi): the collectives a training step runs, timed in context after a
compute burst and back to back, every operation and size, the same rows on every rank; a tensor-parallel block's
inline collectives over the ranks; the measurements every rank fits, the least disturbed rank's."""
from __future__ import annotations

import numpy as np
import pytest


def over_the_world(measure):
    """`measure(comm, cpu)` with torch.distributed started on every rank of MPI's world (gloo), ended after:
    harness device's measurements over the ranks."""
    import torch
    from mpi4py import MPI

    from harness.runtime.distributed import destroy_process_group, init_process_group
    from launcher.topology import discover

    comm = MPI.COMM_WORLD
    cpu = torch.device("cpu")
    init_process_group(comm, discover(comm), cpu)
    try:
        return measure(comm, cpu)
    finally:
        destroy_process_group()


@pytest.mark.mpi(min_size=2)
def test_collectives_in_context_on_every_rank():
    from mpi4py import MPI

    from harness.profile.device_ranks import CONTEXT_OPS, collectives_in_context

    rows = over_the_world(lambda comm, cpu: collectives_in_context(comm, cpu, 1e9, repeats=2, warmup=1, quick=True))
    comm = MPI.COMM_WORLD
    assert {r["op"] for r in rows} == set(CONTEXT_OPS)
    assert len({r["bytes"] for r in rows}) >= 3  # sizes over the range, every operation at each
    assert all(r["in_context_s"] > 0 and r["back_to_back_s"] > 0 and r["ranks"] == comm.Get_size() for r in rows)
    assert all(other == rows for other in comm.allgather(rows))  # reduced over the ranks: the same everywhere


@pytest.mark.mpi(min_size=2)
def test_fsdp2_unshards_are_timed_over_every_rank():
    """FSDP2's unshard() of each unit over all the ranks beside the bare all-gather of its bytes: a row per unit
    with both medians and their rounds' median difference, the same rows on every rank."""
    from mpi4py import MPI

    from harness.profile.device_ranks import UNSHARD_UNITS, unshards_over_ranks

    rows = over_the_world(lambda comm, cpu: unshards_over_ranks(comm, cpu, repeats=2, warmup=1))
    comm = MPI.COMM_WORLD
    assert [r["tensors"] for r in rows] == [tensors for tensors, _ in UNSHARD_UNITS]
    size = comm.Get_size()
    for row, (tensors, nbytes) in zip(rows, UNSHARD_UNITS):  # at least a row of 64 a rank in each tensor
        assert row["ranks"] == size and 0 < row["bytes"] <= max(nbytes, size * 64 * 4 * tensors)
        assert row["bytes"] % (size * 4 * 64 * tensors) == 0
        assert row["unshard_s"] > 0 and row["bare_s"] > 0 and np.isfinite(row["extra_s"])
    assert all(other == rows for other in comm.allgather(rows))


@pytest.mark.mpi(min_size=2)
def test_fsdp2_reduces_are_timed_over_every_rank():
    """FSDP2's post-backward reduce of each unit over all the ranks beside the same backward without FSDP2 and the
    bare reduce-scatter of its bytes: a row per unit with the three medians and their rounds' median difference,
    the same rows on every rank."""
    from mpi4py import MPI

    from harness.profile.device_ranks import UNSHARD_UNITS, reduces_over_ranks

    rows = over_the_world(lambda comm, cpu: reduces_over_ranks(comm, cpu, repeats=2, warmup=1))
    comm = MPI.COMM_WORLD
    assert [r["tensors"] for r in rows] == [tensors for tensors, _ in UNSHARD_UNITS]
    size = comm.Get_size()
    for row in rows:
        assert row["ranks"] == size and row["bytes"] % (size * 4 * 64 * row["tensors"]) == 0
        assert row["reduce_s"] > 0 and row["plain_s"] > 0 and row["bare_s"] > 0 and np.isfinite(row["extra_s"])
    assert all(other == rows for other in comm.allgather(rows))


@pytest.mark.mpi(min_size=2)
def test_a_tensor_parallel_blocks_inline_collectives_are_timed_over_every_rank():
    """The framework block split over all the ranks, without and with sequence parallelism, over the world group
    and alone: its inline collectives counted (2 all-reduces a forward and 2 a backward; sp 4 exchanges forward, 6
    backward), both passes timed, the same rows on every rank (or none, where the block does not split)."""
    from mpi4py import MPI

    from harness.profile.device_blocks import FRAMEWORK_SIZES
    from harness.profile.device_ranks import fit_inline_collective, inline_collectives_over_ranks

    rows = over_the_world(lambda comm, cpu: inline_collectives_over_ranks(comm, cpu, "float32", repeats=2, warmup=1))
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    splits = all(FRAMEWORK_SIZES[key] % size == 0 for key in ("hidden", "seq_len", "ffn"))
    if not splits:
        assert rows == []
        return
    assert [(r["sp"], r["calls"]) for r in rows] == [(False, 4), (True, 10)]
    assert all(r["ranks"] == size and r["grouped_s"] > 0 and r["alone_s"] > 0 for r in rows)
    assert all(r["bytes"] == FRAMEWORK_SIZES["micro"] * FRAMEWORK_SIZES["seq_len"] * FRAMEWORK_SIZES["hidden"] * 4
               for r in rows)
    assert fit_inline_collective(rows) > 0.0  # the group's passes wait on the other ranks: longer than alone
    assert all(other == rows for other in comm.allgather(rows))


@pytest.mark.mpi(min_size=2)
def test_a_pipeline_send_is_measured_between_two_ranks_as_a_profile_measures_it(monkeypatch):
    """p2p_over_ranks on the first two ranks (the others wait): a row per size, the same on every rank, with the
    least half round trip, the posts and the sender-busy samples of harness.profile.comm and, on Linux, the compute
    a send received late takes (run-queue waits: 0 or more); fit_p2p reads them into the description's fields."""
    import sys

    from mpi4py import MPI

    from harness.profile import comm as comm_module
    from harness.profile import device_ranks

    monkeypatch.setattr(device_ranks, "P2P_SIZES", (1 << 12,))
    monkeypatch.setattr(device_ranks, "P2P_MIN_ROUNDS", 2)
    monkeypatch.setattr(comm_module, "LATE_STREAM_STEPS", 4)
    monkeypatch.setattr(comm_module, "LATE_ROUNDS", 1)
    comm = MPI.COMM_WORLD
    switch = sys.getswitchinterval()
    rows = over_the_world(lambda comm, cpu: device_ranks.p2p_over_ranks(comm, cpu, repeats=2, warmup=1))
    assert sys.getswitchinterval() == switch  # the stream's interval is put back
    (row,) = rows
    assert row["bytes"] == 4096 and row["ranks"] == comm.Get_size()
    assert row["least_s"] > 0 and row["sender_busy_s"] > 0 and row["post_s"] > 0
    assert row["extra_s"] == pytest.approx(max(0.0, row["sender_busy_s"] - row["least_s"]))
    if sys.platform.startswith("linux"):
        assert row["late_s"] >= 0.0
    fields = device_ranks.fit_p2p(rows)
    assert fields["p2p_post_s"] == pytest.approx(row["post_s"]) and fields["p2p_post_s_per_mib"] == 0.0
    assert all(other == rows for other in comm.allgather(rows))


@pytest.mark.mpi(min_size=2)
def test_the_least_disturbed_rank_is_taken_whole_on_every_rank():
    from mpi4py import MPI

    from harness.profile.device_curves import least_disturbed

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    base = [1e-3, 2e-3, 5e-4, 4e-3]
    slower = 1.0 + 0.3 * (size - 1 - rank)  # the last rank's core ran fastest overall...
    mine = [s * slower for s in base]
    if rank == 0:
        mine[0] = base[0] * 0.5  # ...though rank 0 was the fastest at one kernel
    taken = least_disturbed(mine, comm)
    assert taken == pytest.approx(base)  # the last rank's, whole: not each kernel's fastest
    assert all(other == taken for other in comm.allgather(taken))
    # only the deciding runners choose (the calibration leaves its held-out kernels out): on kernel 0 alone, rank 0's
    only_first = least_disturbed(mine, comm, [True, False, False, False])
    assert only_first == pytest.approx(comm.bcast(mine, root=0))
