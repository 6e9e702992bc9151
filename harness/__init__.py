"""distsim-harness: a job's plan, its profiling on real ranks, real training runs and the HDF5 store
(`python -m harness`).

Sub-packages by stage (docs/architecture.md): common <- plan <- store; runtime, models <- profile, train <-
commands. Importing `harness`, `harness.plan` or `harness.store` loads no torch or MPI, so the analysis can
use them offline.
"""
__version__ = "0.1.0"
