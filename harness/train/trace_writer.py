"""Writing traces of real runs: one file per rank, merged into trace.h5 (layout in docs/train.md).

h5py and numpy only, through harness.store.hdf5_io (atomic, checksummed files).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from harness.store.hdf5_io import (
    create,
    create_group,
    open_file,
    read_attrs,
    read_column,
    reading,
    set_attrs,
    write_dataset,
    write_text,
)
from harness.store.hdf5_schema import (
    READ_VERSIONS,
    TRACE_KIND,
    TRACE_LAYER_COLUMNS,
    TRACE_LAYER_GROUP,
    TRACE_LAYER_INT_COLUMNS,
    TRACE_LAYER_STRING_COLUMNS,
)
from harness.store.hdf5_schema import TRACE_COLUMNS as COLUMNS
from harness.store.hdf5_schema import TRACE_INT_COLUMNS as INT_COLUMNS
from harness.store.hdf5_schema import TRACE_RANK_KIND as RANK_KIND
from harness.store.hdf5_schema import TRACE_SCHEMA_VERSION as SCHEMA_VERSION
from harness.store.hdf5_schema import TRACE_STRING_COLUMNS as STRING_COLUMNS


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.trace.h5"


def device_group_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _columns(rows: Sequence[tuple], to_seconds, names: Sequence[str], strings: Sequence[str],
             ints: Sequence[str]) -> dict[str, np.ndarray]:
    """Rows whose fields are `names` in order, sorted by start then end, into columns: `start_s` and `end_s`
    (ns on this rank's clock) through `to_seconds` onto the common timebase, other `_s` fields from ns to
    seconds, `strings` as str, `ints` as int."""
    rows = sorted(rows, key=lambda r: (r[0], r[1]))
    n = len(rows)
    cols: dict[str, np.ndarray] = {}
    for i, name in enumerate(names):
        values = [r[i] for r in rows]
        if name in ("start_s", "end_s"):
            cols[name] = np.asarray(to_seconds(np.array(values, dtype=np.int64).reshape(n)),
                                    dtype=np.float64).reshape(n)
        elif name in strings:
            cols[name] = np.array([str(v) for v in values], dtype=object).reshape(n)
        elif name in ints:
            cols[name] = np.array([int(v) for v in values], dtype=np.int64).reshape(n)
        else:
            cols[name] = np.array(values, dtype=np.float64).reshape(n) / 1e9
    return cols


def columns_from_rows(rows: Sequence[tuple], to_seconds) -> dict[str, np.ndarray]:
    """Rows (start_ns, end_ns, wait_ns, kind, name, phase, event_id, virtual_stage, micro, iteration, peer),
    times on this rank's clock, into columns on the common timebase (`to_seconds` maps ns arrays)."""
    return _columns(rows, to_seconds, COLUMNS, STRING_COLUMNS, INT_COLUMNS)


def layer_columns_from_rows(rows: Sequence[tuple], to_seconds) -> dict[str, np.ndarray]:
    """Layer rows (start_ns, end_ns, phase, event_id, layer, virtual_stage, micro, iteration), times on this
    rank's clock, into the columns of the device's `layers` group on the common timebase."""
    return _columns(rows, to_seconds, TRACE_LAYER_COLUMNS, TRACE_LAYER_STRING_COLUMNS, TRACE_LAYER_INT_COLUMNS)


def _write_columns(group: h5py.Group, columns: dict[str, np.ndarray], names: Sequence[str] = COLUMNS,
                   strings: Sequence[str] = STRING_COLUMNS) -> None:
    for name in names:
        if name in strings:
            write_text(group, name, columns[name])
        else:
            write_dataset(group, name, columns[name])


def write_rank_trace(path: str | Path, *, rank: int, columns: dict[str, np.ndarray], attrs: dict[str, Any],
                     iterations: dict[str, np.ndarray], layers: dict[str, np.ndarray] | None = None) -> Path:
    """One rank's intervals (common timebase), its own iteration bounds and losses, and (with
    --layer-times) its layer intervals."""
    path = Path(path)
    with create(path, RANK_KIND, SCHEMA_VERSION, {"rank": rank, "written_at": time.time(), **attrs}) as f:
        intervals = create_group(f, "intervals")
        _write_columns(intervals, columns)
        if layers is not None:
            _write_columns(create_group(intervals, TRACE_LAYER_GROUP), layers, TRACE_LAYER_COLUMNS,
                           TRACE_LAYER_STRING_COLUMNS)
        it = create_group(f, "iterations")
        for key, value in iterations.items():
            write_dataset(it, key, value)
    return path


def _read_group(group: h5py.Group) -> dict[str, Any]:
    """Every dataset of a group (subgroups as nested dicts), text as str arrays."""
    return {name: _read_group(obj) if isinstance(obj, h5py.Group) else read_column(obj) for name, obj in group.items()}


def _write_group(group: h5py.Group, data: dict[str, Any]) -> None:
    """What _read_group read, written with the checksums of harness.store.hdf5_io."""
    for name, values in data.items():
        if isinstance(values, dict):
            _write_group(create_group(group, name), values)
        elif np.asarray(values).dtype.kind in "OUS":
            write_text(group, name, values)
        else:
            write_dataset(group, name, values)


def read_rank_trace(path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray]]:
    """A rank file's attributes, its intervals (nested by group) and its iterations."""
    with open_file(path, RANK_KIND, READ_VERSIONS) as src, reading(path, RANK_KIND):
        return read_attrs(src), _read_group(src["intervals"]), _read_group(src["iterations"])


def merge_traces(out: str | Path, rank_files: Iterable[str | Path], *, root_attrs: dict[str, Any],
                 environment: dict[str, Any], clock: dict[str, np.ndarray], warmup: int,
                 loss_ranks: Sequence[int]) -> Path:
    """Merge the rank files into trace.h5: devices, iterations (start = first rank's start, end = last rank's
    end), the mean loss over `loss_ranks` (one rank per data-parallel replica's last stage), clocks. Each rank
    file is read whole before anything is written, so that a problem writing trace.h5 is not blamed on it."""
    out = Path(out)
    paths = [Path(p) for p in rank_files]
    ranks = [read_rank_trace(p) for p in paths]
    for index, (attrs, _, _) in enumerate(ranks):
        if int(attrs["rank"]) != index:
            raise ValueError(f"{paths[index]} holds rank {attrs['rank']}; expected rank {index} (give the files in "
                             "rank order)")
    with create(out, TRACE_KIND, SCHEMA_VERSION, {**root_attrs, "written_at": time.time()}) as f:
        set_attrs(create_group(f, "environment"), environment)
        cg = create_group(f, "clock")
        for key, value in clock.items():
            value = np.asarray(value)
            if value.dtype.kind in "OUS":
                write_text(cg, key, value)
            else:
                write_dataset(cg, key, value)
        devices = create_group(f, "devices")
        for rank, (attrs, intervals, _) in enumerate(ranks):
            device = create_group(devices, device_group_name(rank))
            _write_group(device, intervals)
            set_attrs(device, {k: v for k, v in attrs.items() if k not in ("schema_version", "kind", "written_at")})
        starts = [its["start_s"] for _, _, its in ranks]
        ends = [its["end_s"] for _, _, its in ranks]
        losses = [its["loss"] for _, _, its in ranks]
        rank_start = np.stack(starts, axis=1) if starts else np.zeros((0, 0))
        rank_end = np.stack(ends, axis=1) if ends else np.zeros((0, 0))
        n = rank_start.shape[0]
        it = create_group(f, "iterations")
        write_dataset(it, "index", np.arange(n, dtype=np.int64))
        write_dataset(it, "start_s", rank_start.min(axis=1) if n else np.zeros(0))
        write_dataset(it, "end_s", rank_end.max(axis=1) if n else np.zeros(0))
        write_dataset(it, "warmup", (np.arange(n) < warmup).astype(np.uint8))
        loss = np.stack(losses, axis=1)[:, list(loss_ranks)].mean(axis=1) if n and loss_ranks else np.full(n, np.nan)
        write_dataset(it, "loss", loss.astype(np.float64))
        write_dataset(it, "rank_start_s", rank_start.astype(np.float64))
        write_dataset(it, "rank_end_s", rank_end.astype(np.float64))
    return out
