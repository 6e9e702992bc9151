"""What the launcher's environment says about this job, read without MPI (pure: the analysis reads it too)."""
from __future__ import annotations

import os


def launched_rank(environ: dict[str, str] | None = None) -> int | None:
    """This process's rank as the launcher says (None if no launcher says)."""
    env = os.environ if environ is None else environ
    names = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK") + (("SLURM_PROCID",) if "SLURM_STEP_ID" in env else ())
    for name in names:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
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
