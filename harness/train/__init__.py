"""`harness train`: real hybrid-parallel training iterations, traced per device (layout in docs/train.md).

The package imports nothing heavy at import time: `harness.train.trace_writer` (pure h5py/numpy)
can be used without torch or MPI; `run_training` (torch, mpi4py) is loaded lazily. Traces are read by
`analysis.trace_reader`.
"""
from __future__ import annotations

from typing import Any

__all__ = ["run_training", "check_run", "TrainResult", "reference_losses"]

_LAZY = {
    "run_training": "harness.train.runner",
    "check_run": "harness.train.runner",
    "TrainResult": "harness.train.runner",
    "reference_losses": "harness.train.model",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'harness.train' has no attribute {name!r}")
