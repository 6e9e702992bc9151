"""The HDF5 store: one file per rank while profiling, merged into profile.h5 (layout in docs/hdf5.md).

Files are written to a temporary name and renamed, so a reader never sees half a file and a run stopped
half-way keeps every file that was finished. Needs h5py and numpy only (no MPI, no torch).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import h5py
import numpy as np

from harness.hdf5_schema import (MEASUREMENT_FIELD_ATTRS, PROFILE_KIND, PROFILE_SCHEMA_VERSION as SCHEMA_VERSION,
                                  RANK_PROFILE_KIND, RANK_SPEED_PROBE_ENV, SERIES, STATS)


@dataclass
class Measurement:
    """Every sample of one measured event (seconds). For collectives a sample is the max over the group's
    ranks for one repeat; for P2P one send+receive; for compute one run on one rank."""

    id: str
    kind: str
    content: dict[str, Any]
    samples_s: np.ndarray
    ranks: list[int]
    env_key: str
    attrs: dict[str, Any] = field(default_factory=dict)
    series: dict[str, np.ndarray] = field(default_factory=dict)  # further samples, one of SERIES each

    def stats(self) -> dict[str, float]:
        return summarize(self.samples_s)


def summarize(samples: np.ndarray) -> dict[str, float]:
    """median, mean, std, min, max, p5, p95 and count of a sample array."""
    x = np.asarray(samples, dtype=np.float64)
    if x.size == 0:
        return {**{k: float("nan") for k in STATS}, "count": 0}
    return {"median_s": float(np.median(x)), "mean_s": float(x.mean()), "std_s": float(x.std()),
            "min_s": float(x.min()), "max_s": float(x.max()), "p5_s": float(np.percentile(x, 5)),
            "p95_s": float(np.percentile(x, 95)), "count": int(x.size)}


def _atomic_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _write_measurement(group: h5py.Group, m: Measurement, stats: dict[str, float] | None = None) -> None:
    g = group.create_group(m.id)
    g.create_dataset("samples_s", data=np.asarray(m.samples_s, dtype=np.float64))
    for name, values in m.series.items():
        g.create_dataset(name, data=np.asarray(values, dtype=np.float64))
    g.attrs["kind"] = m.kind
    g.attrs["content_json"] = json.dumps(m.content, sort_keys=True)
    g.attrs["ranks"] = np.asarray(m.ranks, dtype=np.int64)
    g.attrs["env_key"] = m.env_key
    for key, value in (stats or m.stats()).items():
        g.attrs[key] = value
    for key, value in m.attrs.items():
        g.attrs[key] = value


def _read_measurement(eid: str, g: h5py.Group) -> Measurement:
    return Measurement(id=eid, kind=str(g.attrs["kind"]), content=json.loads(g.attrs["content_json"]),
                       samples_s=g["samples_s"][()], ranks=[int(r) for r in g.attrs["ranks"]],
                       env_key=str(g.attrs["env_key"]),
                       attrs={k: v for k, v in g.attrs.items() if k not in MEASUREMENT_FIELD_ATTRS},
                       series={name: g[name][()] for name in SERIES if name in g})


def write_rank_file(path: str | Path, rank: int, measurements: Iterable[Measurement],
                    unmeasured: dict[str, str] | None = None, meta: dict[str, Any] | None = None) -> Path:
    """Write one rank's measurements atomically to `path` (rank-NNNNN.h5)."""
    path = Path(path)
    tmp = _atomic_path(path)
    with h5py.File(tmp, "w") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["kind"] = RANK_PROFILE_KIND
        f.attrs["rank"] = rank
        f.attrs["written_at"] = time.time()
        for key, value in (meta or {}).items():
            f.attrs[key] = value
        group = f.create_group("measurements")
        for m in measurements:
            _write_measurement(group, m)
        _write_unmeasured(f, unmeasured or {})
    os.replace(tmp, path)
    return path


def _write_unmeasured(f: h5py.File, unmeasured: dict[str, str]) -> None:
    string = h5py.string_dtype()
    g = f.create_group("unmeasured")
    ids = sorted(unmeasured)
    g.create_dataset("id", data=np.array(ids, dtype=object), dtype=string)
    g.create_dataset("reason", data=np.array([unmeasured[i] for i in ids], dtype=object), dtype=string)


def read_measurements(path: str | Path) -> dict[str, Measurement]:
    """All measurements in a rank file or a merged profile."""
    with h5py.File(path, "r") as f:
        return {eid: _read_measurement(eid, g) for eid, g in f.get("measurements", {}).items()}


def read_rank_probes(path: str | Path) -> dict[str, float | None]:
    """A rank file's own speed-probe medians, per compute phase (compute_phase_key); {} in files without."""
    with h5py.File(path, "r") as f:
        text = f.attrs.get(RANK_SPEED_PROBE_ENV)
    if text is None:
        return {}
    probes = json.loads(text)
    return {str(key): value for key, value in probes.items()} if isinstance(probes, dict) else {}


def read_unmeasured(path: str | Path) -> dict[str, str]:
    with h5py.File(path, "r") as f:
        if "unmeasured" not in f:
            return {}
        g = f["unmeasured"]
        return dict(zip(g["id"].asstr()[()], g["reason"].asstr()[()]))


def write_profile(path: str | Path, *, spec_json: str, layers_json: str, events: list[dict[str, Any]],
                  measurements: Iterable[Measurement], unmeasured: dict[str, str], environment: dict[str, Any],
                  placement: dict[str, list[int]]) -> Path:
    """Write the merged profile.h5 atomically: spec, layers, event table, environment, placement,
    measurements with raw samples and summaries, and what stayed unmeasured with the reason."""
    path = Path(path)
    tmp = _atomic_path(path)
    string = h5py.string_dtype()
    measurements = sorted(measurements, key=lambda m: m.id)
    with h5py.File(tmp, "w") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["kind"] = PROFILE_KIND
        f.attrs["spec_json"] = spec_json
        f.attrs["layers_json"] = layers_json
        f.attrs["written_at"] = time.time()
        env = f.create_group("environment")
        for key, value in environment.items():
            if isinstance(value, str):
                value = str(value)  # str subclasses (torch's version string) have no HDF5 type
            elif not isinstance(value, (int, float)):
                value = json.dumps(value)
            env.attrs[key] = value
        ev = f.create_group("events")
        ev.create_dataset("id", data=np.array([e["id"] for e in events], dtype=object), dtype=string)
        ev.create_dataset("kind", data=np.array([e["kind"] for e in events], dtype=object), dtype=string)
        ev.create_dataset("name", data=np.array([e["name"] for e in events], dtype=object), dtype=string)
        ev.create_dataset("content_json", data=np.array([json.dumps(e["content"], sort_keys=True) for e in events],
                                                        dtype=object), dtype=string)
        ev.create_dataset("multiplicity", data=np.array([e["multiplicity"] for e in events], dtype=np.int64))
        ev.create_dataset("cost", data=np.array([e["cost"] for e in events], dtype=np.float64))
        stats = [m.stats() for m in measurements]
        group = f.create_group("measurements")
        for m, m_stats in zip(measurements, stats):
            _write_measurement(group, m, m_stats)
        summary = f.create_group("summary")
        summary.create_dataset("id", data=np.array([m.id for m in measurements], dtype=object), dtype=string)
        for key in (*STATS, "count"):
            summary.create_dataset(key, data=np.array([s[key] for s in stats],
                                                      dtype=np.int64 if key == "count" else np.float64))
        _write_unmeasured(f, unmeasured)
        pl = f.create_group("placement")
        ids = sorted(placement)
        pl.create_dataset("id", data=np.array(ids, dtype=object), dtype=string)
        pl.create_dataset("ranks", data=np.array([",".join(map(str, placement[i])) for i in ids], dtype=object),
                          dtype=string)
    os.replace(tmp, path)
    return path
