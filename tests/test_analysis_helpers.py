"""Hand-made profiles for the analysis tests: a plan's events with chosen durations, written with
harness.store.profile_store.write_profile exactly as the harness writes a merged profile.h5."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from harness.plan.events import Event, UniqueEvents, build_plan, event_id
from harness.plan.layers import LayerDesc
from harness.plan.spec import JobSpec, parse_spec
from harness.store.hdf5_schema import (
    ACTIVATION_BYTES_ATTR,
    BACKWARD_CALL_ATTR,
    COMPUTE_PHASE_ATTR,
    DIVIDE_SERIES,
    HOST_ISSUE_SERIES,
    RANK_SPEED_PROBE_ENV,
    SEND_POST_SERIES,
    SENDER_BUSY_SERIES,
    ZERO_SERIES,
    compute_phase_key,
)
from harness.store.profile_store import Measurement, write_profile

REPO = Path(__file__).resolve().parents[1]


def make_spec(*, pp: int = 1, dp: int = 1, tp: int = 1, micro_batches: int = 4, micro: int = 1,
              layers: int | None = None, schedule: str = "1f1b", chunks: int = 1, dp_overlap: bool = True,
              nodes: int = 1, bucket_mb: float = 25.0, hidden: int = 64, seq: int = 16,
              recompute: str = "none", zero: int = 0) -> JobSpec:
    """A small GPT-2-like job; `layers` defaults to one block per virtual stage."""
    layers = layers or pp * chunks
    world = dp * tp * pp
    data = {"model": {"name": "gpt2-small", "layers": layers, "hidden": hidden, "heads": 4, "ffn": 2 * hidden,
                      "seq_len": seq, "vocab": 128},
            "batch": {"global": micro_batches * dp * micro, "micro": micro},
            "strategy": {"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "chunks": chunks,
                         "dp_overlap": dp_overlap, "bucket_mb": bucket_mb, "recompute": recompute,
                         "zero": zero},
            "cluster": {"nodes": nodes, "gpus_per_node": world // nodes}}
    return parse_spec(data, source="test")


def by_name(seconds: Mapping[str, float], default: float | None = 0.0) -> Callable[[Event], float | None]:
    """Durations by event name ('gpt2.block.fwd'), or by kind ('p2p', 'allreduce'); else `default`."""
    return lambda event: seconds.get(event.name, seconds.get(event.kind, default))


def comm_point(kind: str, nbytes: int, placement: str, seconds: float, group: int = 2,
               dtype: str = "float32") -> Measurement:
    """A communication measurement that is not an event of the spec (a point of a size sweep)."""
    content = {"kind": kind, "bytes": nbytes, "dtype": dtype, "placement": placement}
    if kind != "p2p":
        content["group"] = group
    return Measurement(event_id(content), kind, content, np.array([seconds] * 3), [0, 1], "test",
                       {"bytes": nbytes, "group_size": group, "placement": placement, "backend": "test"})


def write_handmade_profile(path: str | Path, spec: JobSpec,
                           durations: Callable[[Event], float | None] | Mapping[str, float],
                           extra: Iterable[Measurement] = (), world_size: int = 2, samples: int = 3,
                           layers: list[LayerDesc] | None = None, sender_busy: Sequence[float] = (),
                           host_issue: Mapping[str, Sequence[float]] | None = None,
                           backward_call_s: float | None = None, divide: Sequence[float] = (),
                           zero: Sequence[float] = (), measuring_rank: Mapping[str, int] | None = None,
                           speed_probe: Sequence[float] | None = None, send_post: Sequence[float] = (),
                           activations: Callable[[Event], int | None] | None = None,
                           also: Sequence[JobSpec] = (), environment: Mapping | None = None) -> Path:
    """profile.h5 for `spec` where each event takes `durations(event)` seconds in every sample; events for
    which it returns None are left unmeasured (and listed so). A user model needs its `layers`. P2P events
    get `sender_busy` as their samples timed with the sender computing and `send_post` as their sender's
    post times (none when empty); compute events
    named in `host_issue` get those samples as the host's issue times (as a GPU profile has them); backward
    compute events get `backward_call_s` as the cost of one backward() call (as profiles measure it);
    all-reduces get `divide` as their samples of the buffer's division by the group size and `zero` as those
    of its zeroing (none when empty). Compute events named in `measuring_rank` were measured by that rank
    (else rank 0). All compute events come from one compute phase; with `speed_probe` (the profiling ranks'
    speed-probe medians, None for a rank without a share) the environment records its probe, as harness
    profile writes it; without, the profile is one from before the probe existed. `activations(event)`: the
    bytes a forward event saves (as harness profile measures them; none where it returns None). `also`: further
    specs whose events are measured too (a search's union); `environment`: more /environment entries."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = build_plan(spec, layers)
    unique = UniqueEvents.union([plan] + [build_plan(other, layers) for other in also])
    events = unique.events
    if isinstance(durations, Mapping):
        table = dict(durations)
        durations = lambda event: table.get(event.id)  # noqa: E731
    measurements, unmeasured = [], {}
    phase = 1.7e9  # a compute phase's start, Unix time
    for event in events.values():
        seconds = durations(event)
        if seconds is None:
            unmeasured[event.id] = "left out of this hand-made profile"
            continue
        attrs = {} if event.kind == "compute" else {"bytes": event.bytes, "group_size": event.group_size,
                                                    "placement": event.placement, "backend": "test"}
        series = {SENDER_BUSY_SERIES: np.asarray(sender_busy, dtype=float)} if event.kind == "p2p" and len(
            sender_busy) else {}
        if event.kind == "p2p" and len(send_post):
            series[SEND_POST_SERIES] = np.asarray(send_post, dtype=float)
        if event.kind == "allreduce" and len(divide):
            series[DIVIDE_SERIES] = np.asarray(divide, dtype=float)
        if event.kind == "allreduce" and len(zero):
            series[ZERO_SERIES] = np.asarray(zero, dtype=float)
        if backward_call_s is not None and event.kind == "compute" and event.content.get("phase") == "bwd":
            attrs[BACKWARD_CALL_ATTR] = backward_call_s
        if host_issue and event.name in host_issue:
            series[HOST_ISSUE_SERIES] = np.asarray(host_issue[event.name], dtype=float)
        if event.kind == "compute":  # harness profile names the compute phase of every compute measurement
            attrs[COMPUTE_PHASE_ATTR] = phase
        saved = activations(event) if activations is not None and event.content.get("phase") == "fwd" else None
        if saved is not None:
            attrs[ACTIVATION_BYTES_ATTR] = saved
        rank = (measuring_rank or {}).get(event.name, 0) if event.kind == "compute" else 0
        measurements.append(Measurement(event.id, event.kind, event.content, np.full(samples, float(seconds)),
                                        [rank], "test", attrs, series))
    measurements += list(extra)
    return write_profile(path, spec_json=spec.to_json(),
                         layers_json=json.dumps([layer.to_dict() for layer in plan.layers]),
                         events=unique.table(), measurements=measurements, unmeasured=unmeasured,
                         environment={"world_size": world_size, "device": "cpu", "backend": "test",
                                      "hosts": ["test"], **(environment or {}),
                                      **({RANK_SPEED_PROBE_ENV: {compute_phase_key(phase): list(speed_probe)}}
                                         if speed_probe is not None else {})},
                         placement={m.id: m.ranks for m in measurements})


def run_analysis(*args: str, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`python -m analysis ARGS` in a fresh interpreter from the repository (or `cwd`)."""
    return subprocess.run([sys.executable, "-m", "analysis", *args], capture_output=True, text=True, cwd=cwd or REPO,
                          timeout=120)


def run_python(script: str, cwd: str | Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run a Python script in a fresh interpreter with the project importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_handmade_profile_round_trips(tmp_path):
    from analysis.profile_reader import load_profile

    spec = make_spec(pp=2, dp=2, micro_batches=2)
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({"gpt2.block.fwd": 1.5}, default=0.5))
    profile = load_profile(path)
    plan = build_plan(spec)
    assert profile.spec == spec
    assert set(profile.measurements) == set(plan.events)
    block = next(e for e in plan.events.values() if e.name == "gpt2.block.fwd")
    assert profile.measurements[block.id].median_s == 1.5
    assert profile.world_size == 2
