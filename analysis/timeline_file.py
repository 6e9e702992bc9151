"""The simulated timeline in HDF5 (layout in docs/timeline.md): one group per device with its events.

Replicas of a pipeline stage have identical timelines, so each stage's columns are written once under
/stages and every device group holds hard links to them (h5py sees ordinary datasets).
"""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from analysis.report import strategy_label
from analysis.simulate import Timeline
from harness.store.hdf5_io import (
    GROUP_CREATION,
    create,
    create_group,
    open_file,
    read_attrs,
    read_column,
    reading,
    write_dataset,
    write_text,
)
from harness.store.hdf5_schema import READ_VERSIONS, TIMELINE_KIND, TIMELINE_SCHEMA_VERSION

COLUMNS = ("start_s", "end_s", "track", "kind", "name", "event_id", "stage", "micro", "layer")
USAGE = ("compute_s", "comm_s", "overlapped_comm_s", "idle_s")


def write_timeline(path: str | Path, timeline: Timeline, ranks: Sequence[int],
                   report: dict[str, Any] | None = None) -> Path:
    """Write the timelines of `ranks` and the summary numbers atomically to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = {"written_at": time.time(), "spec_json": timeline.spec.to_json(), "model": timeline.spec.model.name,
            "strategy": strategy_label(timeline), "world": timeline.world, "dp_overlap": timeline.dp_overlap,
            "batch_time_s": timeline.batch_time_s, "throughput_samples_s": timeline.throughput_samples_s,
            "throughput_tokens_s": timeline.throughput_tokens_s, "bubble_fraction": timeline.bubble_fraction}
    if report is not None:
        root["report_json"] = json.dumps(report)
    with create(path, TIMELINE_KIND, TIMELINE_SCHEMA_VERSION, root) as f:
        stages = create_group(f, "stages")
        devices = create_group(f, "devices")
        summary = timeline.devices(ranks)
        for stage in sorted({d.stage for d in summary}):
            g = create_group(stages, f"stage-{stage:05d}")
            intervals = timeline.intervals(stage)
            write_dataset(g, "start_s", [iv.start_s for iv in intervals], np.float64)
            write_dataset(g, "end_s", [iv.end_s for iv in intervals], np.float64)
            for column, attr in (("track", "track"), ("kind", "category"), ("name", "name"), ("event_id", "event_id")):
                write_text(g, column, [getattr(iv, attr) for iv in intervals])
            for column, attr in (("stage", "virtual_stage"), ("micro", "micro"), ("layer", "layer")):
                write_dataset(g, column, [getattr(iv, attr) for iv in intervals], np.int32)
            device = timeline.pipeline[stage]
            g.attrs["stage"] = stage
            g.attrs["end_s"] = device.end_s
            for key, value in device.usage._asdict().items():
                g.attrs[key] = value
        for d in summary:
            # Low-level calls: h5py's high-level links and attributes cost ~0.3 ms each, too slow for 16k devices.
            gid = h5py.h5g.create(devices.id, f"rank-{d.rank:05d}".encode(), gcpl=GROUP_CREATION)
            source = stages[f"stage-{d.stage:05d}"].id
            for column in COLUMNS:
                gid.links.create_hard(column.encode(), source, column.encode())  # the replica's columns are its stage's
            _write_scalar_attrs(gid, d.to_dict())
        table = create_group(f, "summary")
        for key in ("rank", "stage", "dp", "tp"):
            write_dataset(table, key, [getattr(d, key) for d in summary], np.int64)
        for key in USAGE:
            write_dataset(table, key, [getattr(d, key) for d in summary], np.float64)
    return path


def _write_scalar_attrs(gid: h5py.h5g.GroupID, values: dict[str, int | float]) -> None:
    scalar = h5py.h5s.create(h5py.h5s.SCALAR)
    for key, value in values.items():
        data = np.array(value, dtype=np.int64 if isinstance(value, int) else np.float64)
        attr = h5py.h5a.create(gid, key.encode(), h5py.h5t.py_create(data.dtype), scalar)
        attr.write(data)


def read_timeline(path: str | Path) -> dict[str, Any]:
    """Read a timeline file: {"attrs": root attributes, "summary": columns, "devices": {rank: {"attrs", columns}}};
    checked and verified (harness.store.hdf5_io.open_file)."""
    with open_file(path, TIMELINE_KIND, READ_VERSIONS) as f, reading(Path(path), TIMELINE_KIND):
        attrs = read_attrs(f)
        summary = {k: f["summary"][k][()] for k in f["summary"]}
        devices = {}
        for g in f["devices"].values():
            device_attrs = read_attrs(g)
            devices[int(device_attrs["rank"])] = {"attrs": device_attrs, **{c: read_column(g[c]) for c in COLUMNS}}
        return {"attrs": attrs, "summary": summary, "devices": devices}
