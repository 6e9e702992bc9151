"""Shared test set-up: under mpirun every rank gets its own --basetemp and only rank 0 reports."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def launcher_rank() -> int | None:
    for name in _RANK_VARS:
        if name in os.environ:
            return int(os.environ[name])
    return None


@pytest.hookimpl(trylast=True)  # after the terminal reporter has registered itself
def pytest_configure(config: pytest.Config) -> None:
    rank = launcher_rank()
    if rank is None or not config.getoption("with_mpi", default=False):
        return
    # Ranks would race on pytest's numbered temp folders: give each its own.
    if config.option.basetemp is None:
        config.option.basetemp = tempfile.mkdtemp(prefix=f"pytest-rank{rank}-")
    if rank != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


@pytest.fixture
def python_exe() -> str:
    return sys.executable


@pytest.fixture
def project_env() -> dict[str, str]:
    """Environment for subprocesses: the project importable, one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


_failures: list[str] = []  # this rank's failed reports, for rank 0 to print: only rank 0 reports


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and launcher_rank():
        _failures.append(f"{report.nodeid} ({report.when}):\n{report.longreprtext}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Under mpirun rank 0 prints what failed on the other ranks, and no rank leaves before every rank has
    finished: a rank that exits with failures makes `python -m mpi4py` abort the job, which would cut rank 0's
    report (the only one printed) short."""
    if launcher_rank() is None or not config.getoption("with_mpi", default=False) or "mpi4py.MPI" not in sys.modules:
        return
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        return
    gathered = MPI.COMM_WORLD.gather(_failures, root=0)
    if gathered is not None:
        for rank, failures in enumerate(gathered):
            for failure in failures:
                print(f"\nFAILED on rank {rank}: {failure}")
    sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
