"""The simulated timeline in HDF5 (layout in docs/timeline.md): one group per device with its events.

Replicas of a pipeline stage have identical timelines, so each stage's columns are written once under
/stages and every device group holds hard links to them (h5py sees ordinary datasets).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np

from harness.errors import UserError

from analysis.report import strategy_label
from analysis.simulate import Timeline

TIMELINE_SCHEMA_VERSION = 1
TIMELINE_KIND = "distsim-timeline"
COLUMNS = ("start_s", "end_s", "track", "kind", "name", "event_id", "stage", "micro", "layer")
USAGE = ("compute_s", "comm_s", "overlapped_comm_s", "idle_s")


def write_timeline(path: str | Path, timeline: Timeline, ranks: Sequence[int],
                   report: dict[str, Any] | None = None) -> Path:
    """Write the timelines of `ranks` and the summary numbers atomically to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    string = h5py.string_dtype()
    with h5py.File(tmp, "w") as f:
        f.attrs["schema_version"] = TIMELINE_SCHEMA_VERSION
        f.attrs["kind"] = TIMELINE_KIND
        f.attrs["written_at"] = time.time()
        f.attrs["spec_json"] = timeline.spec.to_json()
        f.attrs["model"] = timeline.spec.model.name
        f.attrs["strategy"] = strategy_label(timeline)
        f.attrs["world"] = timeline.world
        f.attrs["dp_overlap"] = timeline.dp_overlap
        f.attrs["batch_time_s"] = timeline.batch_time_s
        f.attrs["throughput_samples_s"] = timeline.throughput_samples_s
        f.attrs["throughput_tokens_s"] = timeline.throughput_tokens_s
        f.attrs["bubble_fraction"] = timeline.bubble_fraction
        if report is not None:
            f.attrs["report_json"] = json.dumps(report)
        stages = f.create_group("stages")
        devices = f.create_group("devices")
        summary = timeline.devices(ranks)
        for stage in sorted({d.stage for d in summary}):
            g = stages.create_group(f"stage-{stage:05d}")
            intervals = timeline.intervals(stage)
            g.create_dataset("start_s", data=np.array([iv.start_s for iv in intervals], dtype=np.float64))
            g.create_dataset("end_s", data=np.array([iv.end_s for iv in intervals], dtype=np.float64))
            for column, attr in (("track", "track"), ("kind", "category"), ("name", "name"), ("event_id", "event_id")):
                g.create_dataset(column, data=np.array([getattr(iv, attr) for iv in intervals], dtype=object),
                                 dtype=string)
            for column, attr in (("stage", "virtual_stage"), ("micro", "micro"), ("layer", "layer")):
                g.create_dataset(column, data=np.array([getattr(iv, attr) for iv in intervals], dtype=np.int32))
            device = timeline.pipeline[stage]
            g.attrs["stage"] = stage
            g.attrs["end_s"] = device.end_s
            for key, value in device.usage._asdict().items():
                g.attrs[key] = value
        for d in summary:
            # Low-level calls: h5py's high-level links and attributes cost ~0.3 ms each, too slow for 16k devices.
            gid = h5py.h5g.create(devices.id, f"rank-{d.rank:05d}".encode())
            source = stages[f"stage-{d.stage:05d}"].id
            for column in COLUMNS:
                gid.links.create_hard(column.encode(), source, column.encode())  # the replica's columns are its stage's
            _write_scalar_attrs(gid, d.to_dict())
        table = f.create_group("summary")
        for key in ("rank", "stage", "dp", "tp"):
            table.create_dataset(key, data=np.array([getattr(d, key) for d in summary], dtype=np.int64))
        for key in USAGE:
            table.create_dataset(key, data=np.array([getattr(d, key) for d in summary], dtype=np.float64))
    os.replace(tmp, path)
    return path


def _write_scalar_attrs(gid: h5py.h5g.GroupID, values: dict[str, int | float]) -> None:
    scalar = h5py.h5s.create(h5py.h5s.SCALAR)
    for key, value in values.items():
        data = np.array(value, dtype=np.int64 if isinstance(value, int) else np.float64)
        attr = h5py.h5a.create(gid, key.encode(), h5py.h5t.py_create(data.dtype), scalar)
        attr.write(data)


def read_timeline(path: str | Path) -> dict[str, Any]:
    """Read a timeline file: {"attrs": root attributes, "summary": columns, "devices": {rank: {"attrs", columns}}}."""
    path = Path(path)
    try:
        f = h5py.File(path, "r")
    except (FileNotFoundError, OSError) as exc:
        raise UserError(f"{path}: cannot read timeline file ({exc})")
    with f:
        version = f.attrs.get("schema_version")
        if version is None or int(version) != TIMELINE_SCHEMA_VERSION or f.attrs.get("kind") != TIMELINE_KIND:
            raise UserError(f"{path}: not a {TIMELINE_KIND} file of schema_version {TIMELINE_SCHEMA_VERSION}")
        attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
        summary = {k: f["summary"][k][()] for k in f["summary"]}
        devices = {}
        for name, g in f["devices"].items():
            columns = {c: (g[c].asstr()[()] if g[c].dtype.kind == "O" else g[c][()]) for c in COLUMNS}
            devices[int(g.attrs["rank"])] = {"attrs": {k: v.item() if isinstance(v, np.generic) else v
                                                       for k, v in g.attrs.items()}, **columns}
        return {"attrs": attrs, "summary": summary, "devices": devices}
