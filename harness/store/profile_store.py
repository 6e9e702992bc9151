"""profile.h5 and the rank files of `harness profile` (layout in docs/hdf5.md), written and read through
harness.store.hdf5_io. h5py and numpy only: the analysis reads measurements with the same functions.

Each rank writes its measurements to its own file, rewritten whole now and then; rank 0 merges them into
profile.h5. A file is renamed into place only when complete (harness.store.hdf5_io.create).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from harness.common.errors import UserError
from harness.store.hdf5_io import (
    create,
    create_group,
    open_file,
    read_attrs,
    read_text,
    reading,
    set_attrs,
    write_dataset,
    write_text,
)
from harness.store.hdf5_schema import (
    MEASUREMENT_FIELD_ATTRS,
    NUMBER_ATTRS,
    PROFILE_KIND,
    PROFILE_SCHEMA_VERSION,
    RANK_PROFILE_KIND,
    RANK_SPEED_PROBE_ENV,
    READ_VERSIONS,
    SERIES,
    STATS,
)


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


def _write_measurement(group: h5py.Group, m: Measurement, stats: dict[str, float] | None = None) -> None:
    g = create_group(group, m.id)
    write_dataset(g, "samples_s", m.samples_s, np.float64)
    for name, values in m.series.items():
        write_dataset(g, name, values, np.float64)
    set_attrs(g, {"kind": m.kind, "content_json": json.dumps(m.content, sort_keys=True),
                  "ranks": np.asarray(m.ranks, dtype=np.int64), "env_key": m.env_key, **(stats or m.stats()),
                  **m.attrs})


def read_measurement(eid: str, g: h5py.Group) -> Measurement:
    """A measurement group as written (the analysis reads it so too): samples, the series it has, attributes."""
    attrs = read_attrs(g)
    for name in NUMBER_ATTRS:
        value = attrs.get(name)
        if value is not None and (isinstance(value, (bool, np.bool_))
                                  or not isinstance(value, (int, float, np.number))):
            raise ValueError(f"measurement {eid}'s attribute {name} is {value!r}, not a number")
    return Measurement(id=eid, kind=str(attrs["kind"]), content=json.loads(attrs["content_json"]),
                       samples_s=np.asarray(g["samples_s"][()], dtype=np.float64),
                       ranks=[int(r) for r in np.atleast_1d(attrs.get("ranks", []))],
                       env_key=str(attrs.get("env_key", "")),
                       attrs={k: v for k, v in attrs.items() if k not in MEASUREMENT_FIELD_ATTRS},
                       series={name: np.asarray(g[name][()], dtype=np.float64) for name in SERIES if name in g})


def _write_unmeasured(f: h5py.File, unmeasured: dict[str, str]) -> None:
    g = create_group(f, "unmeasured")
    ids = sorted(unmeasured)
    write_text(g, "id", ids)
    write_text(g, "reason", [unmeasured[i] for i in ids])


def write_rank_file(path: str | Path, rank: int, measurements: Iterable[Measurement],
                    unmeasured: dict[str, str] | None = None, meta: dict[str, Any] | None = None) -> Path:
    """Write one rank's measurements atomically to `path` (rank-NNNNN.h5)."""
    path = Path(path)
    with create(path, RANK_PROFILE_KIND, PROFILE_SCHEMA_VERSION,
                {"rank": rank, "written_at": time.time(), **(meta or {})}) as f:
        group = create_group(f, "measurements")
        for m in measurements:
            _write_measurement(group, m)
        _write_unmeasured(f, unmeasured or {})
    return path


@contextmanager
def _open(path: str | Path) -> Iterator[h5py.File]:
    """A rank file or merged profile, checked (harness.store.hdf5_io.open_file), its reads' errors the file's."""
    with open_file(path, (PROFILE_KIND, RANK_PROFILE_KIND), READ_VERSIONS) as f, reading(Path(path), PROFILE_KIND):
        yield f


def read_measurements(path: str | Path) -> dict[str, Measurement]:
    """All measurements in a rank file or a merged profile (UserError if it is damaged or foreign)."""
    with _open(path) as f:
        try:
            return {eid: read_measurement(eid, g) for eid, g in f["measurements"].items()} \
                if "measurements" in f else {}
        except (ValueError, KeyError, TypeError) as exc:  # an edited file: said so, as load_profile says it
            raise UserError(f"{path}: a measurement is not what docs/hdf5.md describes ({exc})") from None


def read_rank_probes(path: str | Path) -> dict[str, float | None]:
    """A rank file's own speed-probe medians, per compute phase (compute_phase_key); {} in files without."""
    with _open(path) as f:
        text = read_attrs(f).get(RANK_SPEED_PROBE_ENV)
    if text is None:
        return {}
    probes = json.loads(text)
    return {str(key): value for key, value in probes.items()} if isinstance(probes, dict) else {}


def read_unmeasured(path: str | Path) -> dict[str, str]:
    with _open(path) as f:
        if "unmeasured" not in f:
            return {}
        g = f["unmeasured"]
        return dict(zip(read_text(g["id"]), read_text(g["reason"])))


def write_profile(path: str | Path, *, spec_json: str, layers_json: str, events: list[dict[str, Any]],
                  measurements: Iterable[Measurement], unmeasured: dict[str, str], environment: dict[str, Any],
                  placement: dict[str, list[int]]) -> Path:
    """Write the merged profile.h5 atomically: spec, layers, event table, environment, placement,
    measurements with raw samples and summaries, and what stayed unmeasured with the reason."""
    path = Path(path)
    measurements = sorted(measurements, key=lambda m: m.id)
    with create(path, PROFILE_KIND, PROFILE_SCHEMA_VERSION,
                {"spec_json": spec_json, "layers_json": layers_json, "written_at": time.time()}) as f:
        set_attrs(create_group(f, "environment"), environment)
        ev = create_group(f, "events")
        write_text(ev, "id", [e["id"] for e in events])
        write_text(ev, "kind", [e["kind"] for e in events])
        write_text(ev, "name", [e["name"] for e in events])
        write_text(ev, "content_json", [json.dumps(e["content"], sort_keys=True) for e in events])
        write_dataset(ev, "multiplicity", [e["multiplicity"] for e in events], np.int64)
        write_dataset(ev, "cost", [e["cost"] for e in events], np.float64)
        stats = [m.stats() for m in measurements]
        group = create_group(f, "measurements")
        for m, m_stats in zip(measurements, stats):
            _write_measurement(group, m, m_stats)
        summary = create_group(f, "summary")
        write_text(summary, "id", [m.id for m in measurements])
        for key in (*STATS, "count"):
            write_dataset(summary, key, [s[key] for s in stats], np.int64 if key == "count" else np.float64)
        _write_unmeasured(f, unmeasured)
        pl = create_group(f, "placement")
        ids = sorted(placement)
        write_text(pl, "id", ids)
        write_text(pl, "ranks", [",".join(map(str, placement[i])) for i in ids])
    return path
