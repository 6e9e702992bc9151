"""Reading trace.h5 of `harness train` (layout in docs/train.md): h5py and numpy only, no torch, no MPI.

The analysis owns reading real-run traces, as it owns reading profiles; `harness train` only writes them.

    trace = read_trace("run/trace.h5")
    trace.iteration_times()                       # seconds, warm-up excluded
    trace.device(3).select(kind="compute", phase="F", iteration=2)
    trace.timeline(3, iteration=2)                # that device's intervals, relative to the iteration start
    trace.step_times(2)                           # (rank, F|B, stage, micro) -> (start, end), relative
    trace.event_durations()                       # event id -> durations of every interval of that plan event
    trace.p2p_transfers()                         # every send matched with its receive
    trace.layer_durations()                       # (stage, F|B, event id) -> each layer's own time (--layer-times)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.common.errors import UserError
from harness.plan.spec import TABLES
from harness.store.hdf5_io import open_file, plain, read_attrs, read_column, read_environment, reading
from harness.store.hdf5_schema import (
    READ_VERSIONS,
    TRACE_FLOAT_COLUMNS,
    TRACE_KIND,
    TRACE_LAYER_COLUMNS,
    TRACE_LAYER_FLOAT_COLUMNS,
    TRACE_LAYER_GROUP,
)
from harness.store.hdf5_schema import TRACE_COLUMNS as COLUMNS


class TraceError(ValueError):
    """A trace whose contents do not hold together (a send without its receive)."""


@dataclass
class DeviceTrace:
    """Every interval of one device (rank), as equal-length column arrays (strings as numpy object arrays)."""

    rank: int
    dp: int
    tp: int
    pp: int
    columns: dict[str, np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, np.ndarray] | None = None  # every layer of every step, where traced with --layer-times

    @property
    def cp(self) -> int:
        """The context-parallel index (0 in traces without context parallelism, or written before it)."""
        return int(self.attrs.get("cp", 0))

    def __len__(self) -> int:
        return len(self.columns["start_s"])

    def mask(self, **where: Any) -> np.ndarray:
        """Boolean mask of rows whose columns equal the given values (a list/tuple/set value: any of them)."""
        keep = np.ones(len(self), dtype=bool)
        for key, value in where.items():
            if value is None:
                continue
            column = self.columns[key]
            if isinstance(value, (list, tuple, set, frozenset)):
                keep &= np.isin(column, list(value))
            else:
                keep &= column == value
        return keep

    def select(self, **where: Any) -> dict[str, np.ndarray]:
        """The rows matching `where` (see mask), as columns, in start order."""
        keep = self.mask(**where)
        return {key: column[keep] for key, column in self.columns.items()}

    def rows(self, **where: Any) -> list[dict[str, Any]]:
        cols = self.select(**where)
        return [{key: plain(cols[key][i]) for key in cols} for i in range(len(cols["start_s"]))]


@dataclass
class Trace:
    path: Path
    spec: dict[str, Any]
    spec_json: str
    layers: list[dict[str, Any]]
    attrs: dict[str, Any]
    environment: dict[str, Any]
    clock: dict[str, np.ndarray]
    iterations: dict[str, np.ndarray]
    devices: dict[int, DeviceTrace]

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def warmup(self) -> np.ndarray:
        return self.iterations["warmup"].astype(bool)

    def measured(self) -> np.ndarray:
        """Indexes of the iterations that are not warm-up."""
        return self.iterations["index"][~self.warmup]

    def iteration_times(self, include_warmup: bool = False) -> np.ndarray:
        """end - start of each iteration (start: the first rank to start it; end: the last rank to finish)."""
        t = self.iterations["end_s"] - self.iterations["start_s"]
        return t if include_warmup else t[~self.warmup]

    def device(self, rank: int) -> DeviceTrace:
        return self.devices[rank]

    def timeline(self, rank: int, iteration: int, **where: Any) -> dict[str, np.ndarray]:
        """One device's intervals of one iteration with start_s/end_s relative to the iteration's start
        (the common start of all devices), i.e. the timeline the simulator predicts."""
        cols = self.devices[rank].select(iteration=iteration, **where)
        zero = float(self.iterations["start_s"][iteration])
        cols["start_s"] = cols["start_s"] - zero
        cols["end_s"] = cols["end_s"] - zero
        return cols

    def step_times(self, iteration: int) -> dict[tuple[int, str, int, int], tuple[float, float]]:
        """(rank, "F"|"B"|"W", virtual stage, micro-batch) -> (start, end) of that compute step, relative to the
        iteration's start: what the simulator's StepRecords predict."""
        zero = float(self.iterations["start_s"][iteration])
        out = {}
        for rank, device in self.devices.items():
            cols = device.select(iteration=iteration, kind="compute")
            for phase, vs, micro, a, b in zip(cols["phase"], cols["virtual_stage"], cols["micro"], cols["start_s"],
                                              cols["end_s"]):
                out[(rank, str(phase), int(vs), int(micro))] = (float(a) - zero, float(b) - zero)
        return out

    def event_durations(self, include_warmup: bool = False, **where: Any) -> dict[str, np.ndarray]:
        """Plan event id -> the durations of every interval that is that one event (TP and DP all-reduces,
        P2P sends and receives, optimizer steps), over all devices and the measured iterations."""
        out: dict[str, list[np.ndarray]] = {}
        keep_iterations = self.iterations["index"] if include_warmup else self.measured()
        for device in self.devices.values():
            cols = device.select(**where)
            ok = (cols["event_id"] != "") & np.isin(cols["iteration"], keep_iterations)
            ids = cols["event_id"][ok]
            dur = (cols["end_s"] - cols["start_s"])[ok]
            for eid in np.unique(ids):
                out.setdefault(str(eid), []).append(dur[ids == eid])
        return {eid: np.concatenate(parts) for eid, parts in out.items()}

    def stage_compute(self, include_warmup: bool = False) -> dict[tuple[int, str], np.ndarray]:
        """(virtual stage, "F"|"B"|"W") -> durations of every compute interval (one stage, one micro-batch)."""
        out: dict[tuple[int, str], list[np.ndarray]] = {}
        keep_iterations = self.iterations["index"] if include_warmup else self.measured()
        for device in self.devices.values():
            cols = device.select(kind="compute")
            ok = np.isin(cols["iteration"], keep_iterations)
            for vs, phase, dur in zip(cols["virtual_stage"][ok], cols["phase"][ok],
                                      (cols["end_s"] - cols["start_s"])[ok]):
                out.setdefault((int(vs), str(phase)), []).append(np.array([dur]))
        return {key: np.concatenate(parts) for key, parts in sorted(out.items())}

    def p2p_transfers(self, include_warmup: bool = False) -> dict[str, np.ndarray]:
        """Every P2P send matched with its receive: columns iteration, what (activation|gradient), event_id,
        micro, src/dst rank and virtual stage, send_start_s, send_end_s, recv_start_s, recv_end_s.
        Raises TraceError if a send has no receive or the other way round."""
        keep = set(int(i) for i in (self.iterations["index"] if include_warmup else self.measured()))
        recvs: dict[tuple, tuple[float, float]] = {}
        sends: list[tuple] = []
        for rank, device in self.devices.items():
            cols = device.select(kind="p2p", phase=("send", "recv"))  # not context parallelism's ring
            for i in range(len(cols["start_s"])):
                iteration = int(cols["iteration"][i])
                if iteration not in keep:
                    continue
                what = str(cols["name"][i]).split(".", 1)[1]
                vs, micro, peer = int(cols["virtual_stage"][i]), int(cols["micro"][i]), int(cols["peer"][i])
                span = (float(cols["start_s"][i]), float(cols["end_s"][i]))
                if cols["phase"][i] == "recv":
                    recvs[(iteration, what, rank, vs, micro)] = span
                else:
                    dst_vs = vs + 1 if what == "activation" else vs - 1
                    sends.append((iteration, what, str(cols["event_id"][i]), micro, rank, peer, vs, dst_vs, span))
        rows = []
        for iteration, what, eid, micro, src, dst, src_vs, dst_vs, span in sends:
            recv = recvs.pop((iteration, what, dst, dst_vs, micro), None)
            if recv is None:
                raise TraceError(f"send of {what} {src_vs}->{dst_vs} micro-batch {micro} (iteration {iteration}, "
                                 f"rank {src}->{dst}) has no receive")
            rows.append((iteration, what, eid, micro, src, dst, src_vs, dst_vs, *span, *recv))
        if recvs:
            raise TraceError(f"{len(recvs)} receives without a send, e.g. {next(iter(recvs))}")
        names = ("iteration", "what", "event_id", "micro", "src_rank", "dst_rank", "src_vs", "dst_vs",
                 "send_start_s", "send_end_s", "recv_start_s", "recv_end_s")
        rows.sort(key=lambda r: (r[0], r[8]))
        out: dict[str, np.ndarray] = {}
        for j, name in enumerate(names):
            values = [r[j] for r in rows]
            out[name] = np.array(values, dtype=object if name in ("what", "event_id") else
                                 (np.float64 if name.endswith("_s") else np.int64))
        return out

    def layer_durations(self, include_warmup: bool = False) -> dict[tuple[int, str, str], np.ndarray]:
        """(virtual stage, "F"|"B", plan event id) -> the time of every traced layer that is that event, over all
        devices and the measured iterations; tensor-parallel all-reduces and FSDP2's collectives (zero > 0) inside a
        layer are taken off it, as they are events of their own. Empty for a trace without --layer-times."""
        out: dict[tuple[int, str, str], list[float]] = {}
        keep_iterations = self.iterations["index"] if include_warmup else self.measured()
        for device in self.devices.values():
            if device.layers is None:
                continue
            layers = device.layers
            collectives = device.select(phase=("tp", "zero", "cp", "ep"))  # they block the main thread
            by_start = np.argsort(collectives["start_s"], kind="stable")
            starts, ends = collectives["start_s"][by_start], collectives["end_s"][by_start]
            for i in np.flatnonzero(np.isin(layers["iteration"], keep_iterations)):
                start, end = float(layers["start_s"][i]), float(layers["end_s"][i])
                # only the collectives that end after the layer starts and start before it ends can overlap it
                lo, hi = np.searchsorted(ends, start, "right"), np.searchsorted(starts, end, "left")
                inside = float(np.clip(np.minimum(ends[lo:hi], end) - np.maximum(starts[lo:hi], start), 0.0,
                                       None).sum())
                key = (int(layers["virtual_stage"][i]), str(layers["phase"][i]), str(layers["event_id"][i]))
                out.setdefault(key, []).append(end - start - inside)
        return {key: np.array(values) for key, values in sorted(out.items())}

    def busy_time(self, rank: int, iteration: int, kind: str | tuple[str, ...] = ("compute", "optimizer")) -> float:
        """Seconds device `rank` spent in intervals of `kind` during `iteration` (intervals of one kind on
        one device do not overlap for compute and optimizer; communication may overlap compute)."""
        cols = self.devices[rank].select(iteration=iteration, kind=kind)
        return float(np.sum(cols["end_s"] - cols["start_s"]))


TIMES = ("start_s", "end_s", "rank_start_s", "rank_end_s")  # an iteration's times (its loss may be NaN)


def read_trace(path: str | Path) -> Trace:
    """Load a whole trace.h5 into memory (a few MB for realistic runs), checked and verified
    (harness.store.hdf5_io.open_file); UserError if it is missing, damaged or not a merged trace."""
    path = Path(path)
    if path.is_dir():  # a RUNDIR of `harness train`
        path = path / "trace.h5"
    with open_file(path, TRACE_KIND, READ_VERSIONS) as f, reading(path, TRACE_KIND):
        attrs = read_attrs(f)
        environment = read_environment(f)
        clock = {key: read_column(ds) for key, ds in f["clock"].items()}
        iterations = {key: ds[()] for key, ds in f["iterations"].items()}
        devices = {}
        groups = {}  # rank -> its group's name, for messages
        for group in f["devices"].values():
            cols = {key: read_column(group[key]) for key in COLUMNS}
            layers = None
            if TRACE_LAYER_GROUP in group:
                layers = {key: read_column(group[TRACE_LAYER_GROUP][key]) for key in TRACE_LAYER_COLUMNS}
            dattrs = read_attrs(group)
            rank = int(dattrs["rank"])
            devices[rank] = DeviceTrace(rank, int(dattrs["dp"]), int(dattrs["tp"]), int(dattrs["pp"]), cols, dattrs,
                                        layers)
            groups[rank] = group.name.lstrip("/")
    times = {f"iterations/{key}": iterations[key] for key in TIMES if key in iterations}
    for rank, device in devices.items():
        times.update({f"{groups[rank]}/{key}": device.columns[key] for key in TRACE_FLOAT_COLUMNS})
        if device.layers is not None:
            times.update({f"{groups[rank]}/{TRACE_LAYER_GROUP}/{key}": device.layers[key]
                          for key in TRACE_LAYER_FLOAT_COLUMNS})
    for name, values in times.items():
        bad = ~np.isfinite(np.asarray(values, dtype=float))
        if bad.any():
            raise UserError(f"{path}: {name} holds {int(bad.sum())} time(s) that are not finite numbers; harness "
                            "train writes none: the file was edited or written by another tool, take the trace again")
    try:
        spec_json = str(attrs.pop("spec_json"))
        spec = json.loads(spec_json)
        layers = json.loads(str(attrs.pop("layers_json")))
        if not isinstance(spec, dict) or not all(isinstance(spec.get(key, {}), dict) for key in TABLES):
            raise ValueError("spec_json is not a table of the spec's sections")
        if not isinstance(layers, list):
            raise ValueError("layers_json is not a list")
    except (ValueError, KeyError) as exc:
        raise UserError(f"{path}: spec_json or layers_json is missing or not what docs/hdf5.md describes ({exc}); "
                        "a harness train run writes them: take the trace again") from None
    return Trace(path=path, spec=spec, spec_json=spec_json, layers=layers, attrs=attrs,
                 environment=environment, clock=clock, iterations=iterations, devices=dict(sorted(devices.items())))
