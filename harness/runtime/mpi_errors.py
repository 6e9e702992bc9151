"""MPI helpers of the front ends: bad input that every rank learns of (only rank 0 reports it, and MPI ends
quietly), and a barrier that leaves the cores to the ranks still working.

A rank that returns exit 2 alone would leave the others blocked in a collective; a non-zero exit under
`python -m mpi4py` calls MPI_Abort, whose one line per rank would bury the one message that matters.
"""
from __future__ import annotations

import os
import sys
import time

from harness.common.errors import UserError


def yielding_barrier(comm, sleep_s: float = 0.0) -> None:
    """A barrier that gives the core away while it waits (MPICH's Barrier busy-polls, which takes a core from
    the ranks still computing when there are more ranks than cores): yields, or with `sleep_s` sleeps that
    long between polls, so that a rank waiting does not slow the work of the others it waits for."""
    request = comm.Ibarrier()
    while not request.Test():
        if sleep_s:
            time.sleep(sleep_s)
        else:
            os.sched_yield()


def agree_on_error(comm, error: UserError | None) -> UserError | None:
    """Collective: the first rank's error (named by rank when it is not rank 0), or None if no rank has one."""
    errors = comm.allgather(None if error is None else str(error))
    for rank, message in enumerate(errors):
        if message is not None:
            return UserError(message if rank == 0 else f"rank {rank}: {message}")
    return None


def finalize_quietly() -> None:
    """End MPI now (all ranks), so the non-zero exit that follows does not make mpi4py call MPI_Abort."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Barrier()
        MPI.Finalize()


class AgreedError(UserError):
    """A UserError that every rank of the job holds (agreed collectively by `raise_if_any`): the front end ends MPI
    quietly (`stop_agreed`) and only rank 0 reports it."""


def raise_if_any(comm, error: UserError | None) -> None:
    """Collective: if any rank has an error, raise it (the first rank's, as agree_on_error names it) on every rank
    as an AgreedError."""
    agreed = agree_on_error(comm, error)
    if agreed is not None:
        raise AgreedError(str(agreed))


def stop_agreed(comm, error: AgreedError) -> int:
    """End MPI quietly; rank 0 raises the error (the CLI prints it and exits 2), other ranks get the status."""
    rank = comm.Get_rank()
    finalize_quietly()
    if rank == 0:
        raise UserError(str(error))
    return error.exit_status


def stop_on_error(comm, error: UserError | None) -> int | None:
    """Collective: if any rank has an error, end MPI quietly and raise it on rank 0 (the CLI prints it and
    exits 2); other ranks get the exit status to return. None when every rank is fine."""
    try:
        raise_if_any(comm, error)
    except AgreedError as agreed:
        return stop_agreed(comm, agreed)
    return None
