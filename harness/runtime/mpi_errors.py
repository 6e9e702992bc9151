"""MPI helpers of the front ends: bad input that every rank learns of (only rank 0 reports it, and MPI ends
quietly), and a barrier that leaves the cores to the ranks still working.

A rank that returns exit 2 alone would leave the others blocked in a collective; a non-zero exit under
`python -m mpi4py` calls MPI_Abort, whose one line per rank would bury the one message that matters.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence

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


PROJECT_PACKAGES = ("harness", "launcher", "analysis")


def _package(frame) -> str:
    return str(frame.f_globals.get("__name__", "")).split(".")[0]


def user_code_frame(exc: BaseException, user_packages: Sequence[str]) -> str | None:
    """Where the user's own model code (a factory's modules: their top-level packages, `user_packages`) raised
    `exc`, as "FILE:LINE, in FUNCTION": its deepest frame of those packages, provided no frame of this project lies
    below it (a hook of the harness's that failed under the model's forward is the harness's failure). Frames of
    other libraries below it (torch refusing the model's shapes) leave it the model's. Modules are told by name, not
    by path, so symlinked or installed checkouts read alike."""
    user = tuple(name for name in user_packages if name)
    where, tb = None, exc.__traceback__
    while tb is not None:
        package = _package(tb.tb_frame)
        if package in PROJECT_PACKAGES:
            where = None
        elif user and package in user:
            code = tb.tb_frame.f_code
            where = f"{code.co_filename}:{tb.tb_lineno}, in {code.co_name}"
        tb = tb.tb_next
    return where


def factory_packages(spec) -> tuple[str, ...]:
    """The top-level package of a spec's factory model (`module:function`), or none for a built-in model."""
    factory = getattr(spec.model, "factory", None)
    return (factory.split(":")[0].split(".")[0],) if factory else ()


ABORT_GRACE_S = 0.5  # after the failure's line, before MPI_Abort: the launcher forwards it before it ends the job


def abort_on_failure(comm, command: str, rank: int, host: str, phase: str, exc: BaseException,
                     user_packages: Sequence[str] = (), before_abort: Callable[[], object] | None = None) -> None:
    """A rank's failure that the others may not share: end every rank now. Bad input (a UserError, or an error
    raised in the user's model code, whose line the message names) prints one line and ends with its status (2);
    anything else is the harness's failure: its traceback, then the line, status 1. `before_abort` (keeping what the
    rank measured) runs after the line, and ABORT_GRACE_S passes before the abort: MPICH's launcher drops a rank's
    last output once the job is aborted. Never returns."""
    where = user_code_frame(exc, user_packages)
    if isinstance(exc, UserError):
        status, what = exc.exit_status, str(exc)
    else:
        status, what = (2 if where else 1), f"{type(exc).__name__}: {exc}"
        if not where:
            traceback.print_exception(exc, file=sys.stderr)
    print(f"{command}: rank {rank} ({host}) failed in {phase}: {what}"
          + (f" (raised in the model's code at {where})" if where else ""), file=sys.stderr, flush=True)
    sys.stdout.flush()
    if before_abort is not None:
        try:
            before_abort()
        except Exception as problem:  # noqa: BLE001 - the job ends either way; say what was not kept
            print(f"{command}: rank {rank} could not keep what it measured: {type(problem).__name__}: {problem}",
                  file=sys.stderr, flush=True)
    time.sleep(ABORT_GRACE_S)
    comm.Abort(status)
    os._exit(status)  # MPICH's MPI_Abort may return before the launcher ends this process: no traceback after it
