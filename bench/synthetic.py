"""A synthetic profile.h5 for the scale benchmarks: what a 2-node (16-rank) profile of a large job would hold.

Compute times from FLOPs at a plausible bf16 rate (optimizer steps from their memory traffic), the bytes each
forward saves from Korthikanti et al.'s count for a transformer block (a few bytes per token for the
embedding and head), communication measured as 2 nodes of 8 would measure it (all-reduce sweeps over 2..16
ranks, P2P sweeps, intra and inter node), so that larger groups are extrapolated by the alpha-beta fit. The
file is written by harness.store.profile_store, as `harness profile` writes it; a spec with [search] gets the union
of its candidates' events.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from harness.plan.events import event_id, events_to_profile
from harness.plan.spec import JobSpec
from harness.store.hdf5_schema import ACTIVATION_BYTES_ATTR
from harness.store.profile_store import Measurement, write_profile

COMPUTE_FLOPS = 400e12  # sustained bf16 FLOP/s of one GPU
OPTIMIZER_BYTES_PER_PARAM, MEMORY_BW = 16, 2.5e12  # Adam reads and writes ~16 bytes per parameter
LINKS = {"intra": (8e-6, 1 / 300e9), "inter": (25e-6, 1 / 20e9)}  # (alpha s, beta s/byte) of a synthetic cluster
PROFILE_RANKS, RANKS_PER_NODE = 16, 8


def comm_seconds(kind: str, nbytes: int, group: int, placement: str) -> float:
    alpha, beta = LINKS[placement]
    if kind == "p2p":
        return alpha + nbytes * beta
    return 2 * (group - 1) * alpha + 2 * (group - 1) / group * nbytes * beta


def saved_bytes(spec: JobSpec, content: dict) -> int:
    """What a forward saves: Korthikanti et al.'s s*b*h*(10 + 24/t + 5*a*s/(h*t)) for a block (16-bit, tensor
    parallel), 2*s*b*h for the embedding and head."""
    signature = content["signature"]
    s, b, h = content["seq"], content["micro"], spec.model.hidden
    if content["layer"] == "block":
        t, a = int(signature.get("tp", 1)), spec.model.heads
        return int(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    return 2 * s * b * h


def write_synthetic_profile(path: Path, spec: JobSpec, rng: np.random.Generator, repeats: int = 20) -> int:
    """Write profile.h5 for `spec` (with [search]: the union of its candidates); returns the unique events."""
    unique, _ = events_to_profile(spec)
    measurements, unmeasured = [], {}
    noise = lambda t: t * rng.normal(1.0, 0.02, repeats).clip(0.9, 1.1)  # noqa: E731
    dtype = spec.model.dtype
    for event in unique.events.values():
        if event.kind == "compute":
            content = event.content
            if content["phase"] == "optimizer":
                seconds = content["params"] * OPTIMIZER_BYTES_PER_PARAM / MEMORY_BW
            else:
                seconds = event.cost / COMPUTE_FLOPS
            attrs = {ACTIVATION_BYTES_ATTR: saved_bytes(spec, content)} if content["phase"] == "fwd" else {}
            measurements.append(Measurement(event.id, "compute", content, noise(seconds), [0], "bench", attrs))
        elif event.group_size > PROFILE_RANKS:
            unmeasured[event.id] = (f"group of {event.group_size} ranks is larger than the profiling world "
                                    f"({PROFILE_RANKS})")
        else:
            seconds = comm_seconds(event.kind, event.bytes, event.group_size, event.placement)
            measurements.append(Measurement(event.id, event.kind, event.content, noise(seconds), [0, 8], "bench",
                                            {"bytes": event.bytes, "group_size": event.group_size,
                                             "placement": event.placement, "backend": "synthetic"}))
    measured = {m.id for m in measurements}
    for placement, groups in (("intra", (2, 4, 8)), ("inter", (2, 4, 8, 16))):
        for kind in ("allreduce", "p2p"):
            for group in (groups if kind == "allreduce" else (2,)):
                for nbytes in (2**20, 2**23, 2**26, 2**28):
                    content = {"kind": kind, "bytes": nbytes, "dtype": dtype, "placement": placement}
                    if kind == "allreduce":
                        content["group"] = group
                    eid = event_id(content)
                    if eid in measured:
                        continue
                    measured.add(eid)
                    measurements.append(Measurement(eid, kind, content,
                                                    noise(comm_seconds(kind, nbytes, group, placement)),
                                                    list(range(group)), "bench",
                                                    {"bytes": nbytes, "group_size": group, "placement": placement,
                                                     "backend": "synthetic"}))
    write_profile(path, spec_json=spec.to_json(), layers_json=json.dumps([layer.to_dict() for layer in unique.layers]),
                  events=unique.table(), measurements=measurements, unmeasured=unmeasured,
                  environment={"world_size": PROFILE_RANKS, "ranks_per_node": RANKS_PER_NODE, "device": "synthetic",
                               "backend": "synthetic", "hosts": ["node0", "node1"], "warmup": 5, "repeats": repeats,
                               # as if the ranks had measured side by side, with a quarter more for set-up and merge
                               "profiling_wall_s": sum(float(m.samples_s.sum()) for m in measurements) * 1.25
                               / PROFILE_RANKS},
                  placement={m.id: m.ranks for m in measurements})
    return len(unique)
