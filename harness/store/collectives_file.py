"""The results of `harness collectives` in HDF5 (layout: docs/hdf5.md, "Collective benchmarks"): written
by the benchmark, read by the analysis (h5py and numpy only).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.plan.collectives import OPS, SizeResult, bus_factor
from harness.store.hdf5_io import (
    create,
    create_group,
    open_file,
    read_attrs,
    read_environment,
    reading,
    set_attrs,
    write_dataset,
)
from harness.store.hdf5_schema import COLLECTIVES_KIND, COLLECTIVES_READ_VERSIONS, COLLECTIVES_SCHEMA_VERSION


@dataclass
class CollectivesRun:
    """One benchmark run: who took part, how, and every operation's sizes in the order measured."""

    path: Path
    backend: str  # torch-gloo | torch-nccl | torch-mpi | mpi4py
    group: str  # all | intra | inter: which ranks were asked for
    placement: str  # intra | inter: where the group's ranks are
    ranks: list[int]
    dtype: str
    iters: int
    warmup: int
    results: dict[str, list[SizeResult]] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """How a run is named beside others: backend, rank count and placement."""
        return f"{self.backend} x{len(self.ranks)} {self.placement}"

    def summary(self) -> dict[str, Any]:
        return {"file": str(self.path), "backend": self.backend, "group": self.group, "placement": self.placement,
                "ranks": self.ranks, "dtype": self.dtype, "iters": self.iters, "warmup": self.warmup}


def write_collectives(path: str | Path, run: CollectivesRun) -> Path:
    """Write a benchmark run atomically (harness.store.hdf5_io): run attributes at the root, /environment, and one
    group per operation with its sizes, wrong counts and every iteration's time."""
    path = Path(path)
    attrs = {"written_at": time.time(), **{k: v for k, v in run.summary().items() if k != "file"}}
    with create(path, COLLECTIVES_KIND, COLLECTIVES_SCHEMA_VERSION, attrs) as f:
        set_attrs(create_group(f, "environment"), run.environment)
        ops = create_group(f, "ops")
        for op, results in run.results.items():
            g = create_group(ops, op)
            set_attrs(g, {"bus_factor": bus_factor(op, len(run.ranks))})
            write_dataset(g, "bytes", [r.nbytes for r in results], np.int64)
            write_dataset(g, "wrong", [r.wrong for r in results], np.int64)
            write_dataset(g, "samples_s", np.stack([r.samples_s for r in results]), np.float64)
    return path


def read_collectives(path: str | Path) -> CollectivesRun:
    """A benchmark file, checked and verified (harness.store.hdf5_io.open_file); operations in OPS order."""
    path = Path(path)
    with open_file(path, COLLECTIVES_KIND, COLLECTIVES_READ_VERSIONS) as f, reading(path, COLLECTIVES_KIND):
        attrs = read_attrs(f, decode_json=True)
        run = CollectivesRun(path=path, backend=attrs["backend"], group=attrs["group"], placement=attrs["placement"],
                             ranks=[int(r) for r in attrs["ranks"]], dtype=attrs["dtype"], iters=int(attrs["iters"]),
                             warmup=int(attrs["warmup"]), environment=read_environment(f))
        for op in sorted(f["ops"], key=lambda name: (OPS.index(name) if name in OPS else len(OPS), name)):
            g = f["ops"][op]
            samples = g["samples_s"][()]
            run.results[op] = [SizeResult(op, int(nbytes), run.dtype, len(run.ranks), samples[i], int(wrong))
                               for i, (nbytes, wrong) in enumerate(zip(g["bytes"][()], g["wrong"][()]))]
    return run
