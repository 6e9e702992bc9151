"""Writing traces of real runs: one file per rank, merged into trace.h5 (layout in docs/train.md).

h5py and numpy only. Files are written to a temporary name and renamed, as in harness.profile_store.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import h5py
import numpy as np

from harness.hdf5_schema import (TRACE_COLUMNS as COLUMNS, TRACE_INT_COLUMNS as INT_COLUMNS, TRACE_KIND,
                                  TRACE_LAYER_COLUMNS, TRACE_LAYER_GROUP, TRACE_LAYER_INT_COLUMNS,
                                  TRACE_LAYER_STRING_COLUMNS, TRACE_RANK_KIND as RANK_KIND,
                                  TRACE_SCHEMA_VERSION as SCHEMA_VERSION, TRACE_STRING_COLUMNS as STRING_COLUMNS)


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.trace.h5"


def device_group_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _attr(value: Any) -> Any:
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, str):
        return str(value)  # not numpy's fixed-width str_, which h5py cannot store
    if isinstance(value, (int, float, np.integer, np.floating)):
        return value
    return json.dumps(value)


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
    string = h5py.string_dtype()
    for name in names:
        data = columns[name]
        if name in strings:
            group.create_dataset(name, data=data, dtype=string)
        else:
            group.create_dataset(name, data=data)


def write_rank_trace(path: str | Path, *, rank: int, columns: dict[str, np.ndarray], attrs: dict[str, Any],
                     iterations: dict[str, np.ndarray], layers: dict[str, np.ndarray] | None = None) -> Path:
    """One rank's intervals (common timebase), its own iteration bounds and losses, and (with
    --layer-times) its layer intervals."""
    path = Path(path)
    tmp = _tmp(path)
    with h5py.File(tmp, "w") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["kind"] = RANK_KIND
        f.attrs["rank"] = rank
        f.attrs["written_at"] = time.time()
        for key, value in attrs.items():
            f.attrs[key] = _attr(value)
        intervals = f.create_group("intervals")
        _write_columns(intervals, columns)
        if layers is not None:
            _write_columns(intervals.create_group(TRACE_LAYER_GROUP), layers, TRACE_LAYER_COLUMNS,
                           TRACE_LAYER_STRING_COLUMNS)
        it = f.create_group("iterations")
        for key, value in iterations.items():
            it.create_dataset(key, data=value)
    os.replace(tmp, path)
    return path


def merge_traces(out: str | Path, rank_files: Iterable[str | Path], *, root_attrs: dict[str, Any],
                 environment: dict[str, Any], clock: dict[str, np.ndarray], warmup: int,
                 loss_ranks: Sequence[int]) -> Path:
    """Merge the rank files into trace.h5: devices, iterations (start = first rank's start, end = last rank's
    end), the mean loss over `loss_ranks` (one rank per data-parallel replica's last stage), clocks."""
    out = Path(out)
    tmp = _tmp(out)
    rank_files = [Path(p) for p in rank_files]
    starts, ends, losses = [], [], []
    with h5py.File(tmp, "w") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["kind"] = TRACE_KIND
        for key, value in root_attrs.items():
            f.attrs[key] = _attr(value)
        f.attrs["written_at"] = time.time()
        env = f.create_group("environment")
        for key, value in environment.items():
            env.attrs[key] = _attr(value)
        cg = f.create_group("clock")
        string = h5py.string_dtype()
        for key, value in clock.items():
            value = np.asarray(value)
            if value.dtype.kind in "OUS":
                cg.create_dataset(key, data=value.astype(object), dtype=string)
            else:
                cg.create_dataset(key, data=value)
        devices = f.create_group("devices")
        for index, path in enumerate(rank_files):
            with h5py.File(path, "r") as src:
                rank = int(src.attrs["rank"])
                if rank != index:
                    raise ValueError(f"{path} holds rank {rank}; expected rank {index} (give the files in rank order)")
                name = device_group_name(rank)
                src.copy(src["intervals"], devices, name=name)
                for key, value in src.attrs.items():
                    if key not in ("schema_version", "kind", "written_at"):
                        devices[name].attrs[key] = value
                starts.append(src["iterations/start_s"][()])
                ends.append(src["iterations/end_s"][()])
                losses.append(src["iterations/loss"][()])
        rank_start = np.stack(starts, axis=1) if starts else np.zeros((0, 0))
        rank_end = np.stack(ends, axis=1) if ends else np.zeros((0, 0))
        n = rank_start.shape[0]
        it = f.create_group("iterations")
        it.create_dataset("index", data=np.arange(n, dtype=np.int64))
        it.create_dataset("start_s", data=rank_start.min(axis=1) if n else np.zeros(0))
        it.create_dataset("end_s", data=rank_end.max(axis=1) if n else np.zeros(0))
        it.create_dataset("warmup", data=(np.arange(n) < warmup).astype(np.uint8))
        loss = np.stack(losses, axis=1)[:, list(loss_ranks)].mean(axis=1) if n and loss_ranks else np.full(n, np.nan)
        it.create_dataset("loss", data=loss.astype(np.float64))
        it.create_dataset("rank_start_s", data=rank_start.astype(np.float64))
        it.create_dataset("rank_end_s", data=rank_end.astype(np.float64))
    os.replace(tmp, out)
    return out
