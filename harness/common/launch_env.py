"""What the launcher's environment says about this job, read without MPI (pure: the analysis reads it too)."""
from __future__ import annotations

import os


def launched_rank(environ: dict[str, str] | None = None) -> int | None:
    """This process's rank as the launcher says (None if no launcher says)."""
    env = os.environ if environ is None else environ
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if name in env:
            return int(env[name])
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    return None


def promised_world_size(environ: dict[str, str] | None = None) -> tuple[int, str] | None:
    """The world size the launcher promised, and the variable that says so (None if no launcher says)."""
    env = os.environ if environ is None else environ
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        if name in env:
            return int(env[name]), name
    if "SLURM_STEP_ID" in env or "SLURM_PROCID" in env:
        for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
            if name in env:
                return int(env[name]), name
    return None
