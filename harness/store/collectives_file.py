"""The results of `harness collectives` in HDF5 (layout: docs/hdf5.md, "Collective benchmarks"): written
by the benchmark, read by the analysis (h5py and numpy only).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.common.errors import UserError
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
from harness.store.hdf5_schema import (
    COLLECTIVES_KIND,
    COLLECTIVES_READ_VERSIONS,
    COLLECTIVES_SCHEMA_VERSION,
    REMEDIES,
)


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
    """A benchmark file, checked and verified (harness.store.hdf5_io.open_file); operations in OPS order. A part
    that is not what docs/hdf5.md describes (an edited or foreign file: an unknown operation, ranks that are not
    integers, sizes below 1 byte, negative counts of wrong elements, samples that are not finite seconds above 0)
    is a UserError naming it."""
    path = Path(path)
    with open_file(path, COLLECTIVES_KIND, COLLECTIVES_READ_VERSIONS) as f, reading(path, COLLECTIVES_KIND):
        try:
            return _read_run(f, path)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise UserError(f"{path}: a part is not what docs/hdf5.md describes ({type(exc).__name__}: {exc}); "
                            f"{REMEDIES[COLLECTIVES_KIND]}") from None


def _read_run(f, path: Path) -> CollectivesRun:
    attrs = read_attrs(f, decode_json=True)
    ranks = attrs["ranks"]
    if isinstance(ranks, (str, bytes)) or not len(ranks):
        raise ValueError(f"ranks must be a list of rank numbers, got {ranks!r}")
    run = CollectivesRun(path=path, backend=attrs["backend"], group=attrs["group"], placement=attrs["placement"],
                         ranks=[int(r) for r in ranks], dtype=attrs["dtype"], iters=int(attrs["iters"]),
                         warmup=int(attrs["warmup"]), environment=read_environment(f))
    for op in f["ops"]:
        if op not in OPS:
            raise ValueError(f"ops/{op}: not one of {', '.join(OPS)}")
    for op in sorted(f["ops"], key=OPS.index):
        g = f["ops"][op]
        samples, sizes = np.asarray(g["samples_s"][()], dtype=float), np.asarray(g["bytes"][()])
        if samples.ndim != 2 or samples.shape[0] != len(sizes) or not samples.shape[1]:
            raise ValueError(f"ops/{op}/samples_s must hold a row of samples for each of its {len(sizes)} sizes, "
                             f"got shape {samples.shape}")
        if not np.isfinite(samples).all() or (samples <= 0).any():
            bad, none = int(np.sum(~np.isfinite(samples))), int(np.sum(samples <= 0))
            raise ValueError(f"ops/{op}/samples_s must be finite seconds above 0 (a call never takes none): "
                             f"{bad} not finite, {none} not above 0")
        wrong = np.asarray(g["wrong"][()])
        if (sizes < 1).any() or wrong.shape != sizes.shape or (wrong < 0).any():
            raise ValueError(f"ops/{op}: bytes must be 1 or more and wrong a count of 0 or more for each size, got "
                             f"bytes from {int(sizes.min())} and wrong {wrong.tolist()}")
        run.results[op] = [SizeResult(op, int(nbytes), run.dtype, len(run.ranks), samples[i], int(bad))
                           for i, (nbytes, bad) in enumerate(zip(sizes, wrong))]
    return run
