"""Bad input under MPI: every rank learns of any rank's error, only rank 0 reports it, and MPI ends quietly.

A rank that returns exit 2 alone would leave the others blocked in a collective; a non-zero exit under
`python -m mpi4py` calls MPI_Abort, whose one line per rank would bury the one message that matters.
"""
from __future__ import annotations

import sys

from harness.errors import UserError


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


def stop_on_error(comm, error: UserError | None) -> int | None:
    """Collective: if any rank has an error, end MPI quietly and raise it on rank 0 (the CLI prints it and
    exits 2); other ranks get the exit status to return. None when every rank is fine."""
    error = agree_on_error(comm, error)
    if error is None:
        return None
    rank = comm.Get_rank()
    finalize_quietly()
    if rank == 0:
        raise error
    return error.exit_status
