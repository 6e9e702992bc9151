"""Names and versions in the project's HDF5 files, written down once (layouts: docs/hdf5.md, docs/train.md).

Constants, one key format and the /environment decoding, importing only json: the harness writes its files
with them (harness.profile_store, harness.train.trace) and the analysis reads them with the same names and the same
decoding (analysis.profile, analysis.trace_reader) without importing the writers.
"""
import json
from typing import Any


# ---- profile.h5 and the rank files of `harness profile` (docs/hdf5.md)
PROFILE_SCHEMA_VERSION = 1
PROFILE_KIND = "distsim-profile"
RANK_PROFILE_KIND = "distsim-rank"
# a measurement's summary attributes, beside `count`
STATS = ("median_s", "mean_s", "std_s", "min_s", "max_s", "p5_s", "p95_s")
# a measurement's attributes that are its own fields; the rest are free-form (name, warmup, bytes, ...)
MEASUREMENT_FIELD_ATTRS = frozenset({"kind", "content_json", "ranks", "env_key", "count", *STATS})
# A measurement's optional sample series, next to samples_s:
# P2P only: the receive timed while the sender computes (harness.profilers.comm)
SENDER_BUSY_SERIES = "sender_busy_samples_s"
# P2P only: the sender's time in the call that posted its send (the receiver waiting), per ping-pong sample
SEND_POST_SERIES = "send_post_samples_s"
# GPU forwards and backwards only: the host's time to issue each sample (harness.profilers.timer.time_issued)
HOST_ISSUE_SERIES = "host_issue_samples_s"
# compute only: when each sample ended, seconds after the compute phase's start barrier (attribute
# `compute_phase`: that phase's start, Unix time, the same on every rank of one profiling run)
SAMPLE_END_SERIES = "sample_end_s"
# all-reduces only: the in-place division of the buffer by the group size that came before each all-reduce
# (how a data-parallel replica averages its gradient bucket)
DIVIDE_SERIES = "divide_samples_s"
# all-reduces only: the buffer's zeroing that came after each all-reduce (how a replica clears its gradient
# bucket for the next iteration)
ZERO_SERIES = "zero_samples_s"
SERIES = (SENDER_BUSY_SERIES, SEND_POST_SERIES, HOST_ISSUE_SERIES, SAMPLE_END_SERIES, DIVIDE_SERIES, ZERO_SERIES)
# compute backwards only, an attribute: what each further backward() call cost the measuring rank's host
# (harness.profilers.compute.measure_backward_call); every sample paid it, a training step pays it once
BACKWARD_CALL_ATTR = "backward_call_s"
# compute only, an attribute: the compute phase that took the samples (its start, Unix time, the same on every
# rank of one profiling run)
COMPUTE_PHASE_ATTR = "compute_phase"
# /environment, JSON: per compute phase (compute_phase_key), every rank's median speed-probe time
# (harness.profilers.probe), so that the analysis can refer each rank's samples to the ranks' mean speed
RANK_SPEED_PROBE_ENV = "rank_speed_probe_s"
SPEED_PROBE_ENV = "speed_probe"  # /environment: what the probe is


def compute_phase_key(compute_phase: float) -> str:
    """The key of a compute phase in RANK_SPEED_PROBE_ENV: its attribute's value, written exactly."""
    return repr(float(compute_phase))


def read_environment(f: Any) -> dict[str, Any]:
    """An open profile's or trace's /environment attributes (an h5py File) as plain data: numpy scalars
    unwrapped, bytes decoded, the values the writers stored as JSON (lists, objects) decoded; {} without it."""
    environment: dict[str, Any] = {}
    if "environment" not in f:
        return environment
    for key, value in f["environment"].attrs.items():
        value = value.item() if hasattr(value, "item") else value
        if isinstance(value, bytes):
            value = value.decode()
        if isinstance(value, str) and value[:1] in "[{":
            try:
                value = json.loads(value)
            except ValueError:
                pass
        environment[key] = value
    return environment


# ---- trace.h5 and the rank files of `harness train` (docs/train.md)
TRACE_SCHEMA_VERSION = 1
TRACE_KIND = "distsim-trace"
TRACE_RANK_KIND = "distsim-trace-rank"
# the interval columns of every device, in this order
TRACE_FLOAT_COLUMNS = ("start_s", "end_s", "wait_s")
TRACE_STRING_COLUMNS = ("kind", "name", "phase", "event_id")
TRACE_INT_COLUMNS = ("virtual_stage", "micro", "iteration", "peer")
TRACE_COLUMNS = TRACE_FLOAT_COLUMNS + TRACE_STRING_COLUMNS + TRACE_INT_COLUMNS
# optional (harness train --layer-times): every layer of every compute step, in a subgroup of the device's group
TRACE_LAYER_GROUP = "layers"
TRACE_LAYER_FLOAT_COLUMNS = ("start_s", "end_s")
TRACE_LAYER_STRING_COLUMNS = ("phase", "event_id")
TRACE_LAYER_INT_COLUMNS = ("layer", "virtual_stage", "micro", "iteration")
TRACE_LAYER_COLUMNS = TRACE_LAYER_FLOAT_COLUMNS + TRACE_LAYER_STRING_COLUMNS + TRACE_LAYER_INT_COLUMNS
