"""Load a merged profile.h5 (layout in docs/hdf5.md) into a typed Profile, with h5py and numpy only.

`harness show` and the analysis (analysis.profile_reader) read profiles through this module. It never imports
torch, MPI or the profilers, nor a user model's factory module (only its "module:function" form is checked).
The file is opened, checked and verified by harness.store.hdf5_io and read whole while it is open.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from harness.common.errors import UserError
from harness.plan.events import CommunicationFields
from harness.plan.layers import LayerDesc
from harness.plan.spec import JobSpec, parse_spec
from harness.store.hdf5_io import open_file, read_attrs, read_environment, read_text, reading
from harness.store.hdf5_schema import (
    DIVIDE_SERIES,
    HOST_ISSUE_SERIES,
    IN_CONTEXT_SERIES,
    LATE_SERIES,
    PROFILE_KIND,
    READ_VERSIONS,
    REMEDIES,
    SAMPLE_END_SERIES,
    SEND_POST_SERIES,
    SENDER_BUSY_SERIES,
    SERIES,
    ZERO_SERIES,
)
from harness.store.profile_store import read_measurement


@dataclass
class MeasuredEvent(CommunicationFields):
    """One measured event: its content, raw samples (seconds), the optional sample series (SERIES by name,
    empty where the profile has none), the ranks that measured it and its other attributes; the statistics
    are derived from the samples once, on first use."""

    id: str
    kind: str  # compute | p2p | allreduce
    content: dict[str, Any]
    samples_s: np.ndarray
    series: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    ranks: list[int] = field(default_factory=list)
    env_key: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.samples_s = np.asarray(self.samples_s, dtype=np.float64)
        self.series = {name: np.asarray(self.series.get(name, []), dtype=np.float64) for name in SERIES}

    @property
    def count(self) -> int:
        return int(self.samples_s.size)

    @cached_property
    def median_s(self) -> float:
        return float(np.median(self.samples_s)) if self.count else float("nan")

    @cached_property
    def mean_s(self) -> float:
        return float(self.samples_s.mean()) if self.count else float("nan")

    @cached_property
    def min_s(self) -> float:
        return float(self.samples_s.min()) if self.count else float("nan")

    @property
    def sender_busy_samples_s(self) -> np.ndarray:
        """P2P only: the receive timed while the sender computes (empty where the profile has none)."""
        return self.series[SENDER_BUSY_SERIES]

    @property
    def send_post_samples_s(self) -> np.ndarray:
        """P2P only: the sender's time in the call that posted its send (empty where the profile has none)."""
        return self.series[SEND_POST_SERIES]

    @property
    def late_cpu_samples_s(self) -> np.ndarray:
        """A CPU's P2P of the job: per round, the compute a send received late took from each end (empty where the
        profile has none)."""
        return self.series[LATE_SERIES]

    @property
    def host_issue_samples_s(self) -> np.ndarray:
        """GPU forwards and backwards: the host's time to issue each sample (empty where the profile has none)."""
        return self.series[HOST_ISSUE_SERIES]

    @property
    def divide_samples_s(self) -> np.ndarray:
        """All-reduces: the in-place division of the buffer by the group size timed before each all-reduce
        (a data-parallel replica averaging its gradient bucket); empty where the profile has none."""
        return self.series[DIVIDE_SERIES]

    @property
    def zero_samples_s(self) -> np.ndarray:
        """All-reduces: the buffer's zeroing timed after each all-reduce (a data-parallel replica clearing its
        gradient bucket for the next iteration); empty where the profile has none."""
        return self.series[ZERO_SERIES]

    @property
    def in_context_samples_s(self) -> np.ndarray:
        """Compute: the event timed inside its stages' chains run as one (harness.profile.in_context); empty
        where the profile has none (older profiles, split backwards, chains that could not run)."""
        return self.series[IN_CONTEXT_SERIES]

    @property
    def sample_end_s(self) -> np.ndarray:
        """Compute: when each sample ended, seconds after its profiling run's compute phase began (attribute
        `compute_phase` names that run); empty where the profile has none."""
        return self.series[SAMPLE_END_SERIES]


@dataclass
class Profile:
    """A merged profile: the spec it was taken for, the layer descriptions, what was measured and what not."""

    path: Path
    schema_version: int
    spec: JobSpec
    spec_json: str
    layers: list[LayerDesc]
    events: dict[str, dict[str, Any]]  # the profiled spec's unique events: id -> {kind, name, content, ...}
    measurements: dict[str, MeasuredEvent]
    unmeasured: dict[str, str]  # id -> reason
    environment: dict[str, Any]
    placement: dict[str, list[int]]

    @property
    def world_size(self) -> int:
        """How many ranks took the profile (from /environment, else the ranks seen in measurements)."""
        if "world_size" in self.environment:
            return int(self.environment["world_size"])
        ranks = {r for assigned in self.placement.values() for r in assigned}
        return max(ranks) + 1 if ranks else 1

    def event_name(self, eid: str) -> str:
        return str(self.events.get(eid, {}).get("name", eid))


def load_profile(path: str | Path) -> Profile:
    """Read profile.h5 (or the profile.h5 of an OUTDIR), checked and verified (harness.store.hdf5_io.open_file);
    UserError if it is missing, damaged, not a merged profile, or of a schema this version does not read."""
    path = Path(path)
    if path.is_dir():  # an OUTDIR of `harness profile`
        path = path / "profile.h5"
    with open_file(path, PROFILE_KIND, READ_VERSIONS) as f, reading(path, PROFILE_KIND):
        attrs = read_attrs(f)
        if "spec_json" not in attrs:
            raise UserError(f"{path}: no spec_json attribute; the profile is incomplete; {REMEDIES[PROFILE_KIND]}")
        spec_json = str(attrs["spec_json"])
        try:
            spec_data = json.loads(spec_json)
            layers = [LayerDesc.from_dict(d) for d in json.loads(str(attrs.get("layers_json", "[]")))]
            if not isinstance(spec_data, dict):
                raise TypeError("spec_json is not a table")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{path}: spec_json or layers_json is not what docs/hdf5.md describes ({exc})") from None
        spec = parse_spec_offline(spec_data, source=f"{path}:spec_json")
        try:  # the rest as docs/hdf5.md lays it out; an edited or foreign file is said so, not a traceback
            return Profile(path=path, schema_version=int(attrs["schema_version"]), spec=spec, spec_json=spec_json,
                           layers=layers, events=_read_events(f), measurements=_read_measurements(f),
                           unmeasured=_read_pairs(f, "unmeasured", "id", "reason"),
                           environment=read_environment(f),
                           placement={eid: [int(r) for r in ranks.split(",") if r]
                                      for eid, ranks in _read_pairs(f, "placement", "id", "ranks").items()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{path}: a part is not what docs/hdf5.md describes ({type(exc).__name__}: {exc}); "
                            f"{REMEDIES[PROFILE_KIND]}") from None


def parse_spec_offline(data: dict, source: str) -> JobSpec:
    """parse_spec of a stored spec (a profile's, a run's) without importing a user model's factory module (it
    may need torch, or be absent here). A stored strategy without `vocab_parallel` was written before the
    field existed, when the embedding and the head were always replicated: it reads as false."""
    strategy = data.get("strategy")
    if isinstance(strategy, dict) and "vocab_parallel" not in strategy:
        data = {**data, "strategy": {**strategy, "vocab_parallel": False}}
    return parse_spec(data, source=source, import_factory=False)


def _read_events(f: h5py.File) -> dict[str, dict[str, Any]]:
    if "events" not in f or "id" not in f["events"]:
        return {}
    g = f["events"]
    ids, kinds, names = read_text(g["id"]), read_text(g["kind"]), read_text(g["name"])
    contents = [json.loads(s) for s in read_text(g["content_json"])]
    multiplicity = g["multiplicity"][()] if "multiplicity" in g else np.zeros(len(ids), dtype=np.int64)
    cost = g["cost"][()] if "cost" in g else np.zeros(len(ids))
    return {eid: {"id": eid, "kind": kind, "name": name, "content": content, "multiplicity": int(mult),
                  "cost": float(c)}
            for eid, kind, name, content, mult, c in zip(ids, kinds, names, contents, multiplicity, cost)}


def _read_measurements(f: h5py.File) -> dict[str, MeasuredEvent]:
    """Every measurement, whole (the file is open and verified: its samples are read once, here)."""
    out: dict[str, MeasuredEvent] = {}
    for eid, g in f.get("measurements", {}).items():
        m = read_measurement(eid, g)
        finite = np.isfinite(m.samples_s)
        if not m.samples_s.size or not finite.all() or (m.samples_s[finite] < 0).any():
            raise ValueError(f"measurement {eid}'s samples_s must be one or more finite seconds of 0 or more, got "
                             f"{m.samples_s.size}: {int(np.sum(~finite))} not finite, "
                             f"{int(np.sum(m.samples_s[finite] < 0))} negative")
        out[eid] = MeasuredEvent(eid, m.kind, m.content, m.samples_s, m.series, m.ranks, m.env_key, m.attrs)
    return out


def _read_pairs(f: h5py.File, group: str, key: str, value: str) -> dict[str, str]:
    if group not in f or key not in f[group]:
        return {}
    return dict(zip(read_text(f[group][key]), read_text(f[group][value])))
