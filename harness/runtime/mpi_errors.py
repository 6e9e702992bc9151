"""MPI helpers of the front ends: bad input that every rank learns of (only rank 0 reports it, and MPI ends
quietly), and a barrier that leaves the cores to the ranks still working.

A rank that returns exit 2 alone would leave the others blocked in a collective; a non-zero exit under
`python -m mpi4py` calls MPI_Abort, whose one line per rank would bury the one message that matters.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import time
from pathlib import Path

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


_PROJECT_PACKAGES = tuple(os.path.join(Path(__file__).resolve().parents[2], name, "")
                          for name in ("harness", "launcher", "analysis"))
_LIBRARIES = tuple({os.path.join(sysconfig.get_paths()[key], "")
                    for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def user_code_frame(exc: BaseException) -> str | None:
    """Where in the user's own code (a factory model: not this project's packages, not Python's library, not an
    installed package) `exc` was raised, as "FILE:LINE, in FUNCTION": the deepest such frame of its traceback."""
    where = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = code.co_filename
        if not path.startswith("<") and not os.path.abspath(path).startswith(_PROJECT_PACKAGES + _LIBRARIES):
            where = f"{path}:{tb.tb_lineno}, in {code.co_name}"
        tb = tb.tb_next
    return where


def abort_on_failure(comm, command: str, rank: int, host: str, phase: str, exc: BaseException) -> None:
    """A rank's failure that the others may not share: print one line (the rank, its host, the phase, the error and,
    where the user's model raised it, the line of its code) and end every rank. Bad input (a UserError, or an error
    raised in the user's model code) ends with status 2, anything else with 1."""
    where = user_code_frame(exc)
    print(f"{command}: rank {rank} ({host}) failed in {phase}: {type(exc).__name__}: {exc}"
          + (f" (raised in the model's code at {where})" if where else ""), file=sys.stderr, flush=True)
    status = exc.exit_status if isinstance(exc, UserError) else 2 if where else 1
    comm.Abort(status)
    os._exit(status)  # MPICH's MPI_Abort may return before the launcher ends this process: no traceback after it
