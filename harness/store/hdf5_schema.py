"""Names and versions in the project's HDF5 files, written down once (layouts: docs/hdf5.md, docs/train.md,
docs/timeline.md).

Constants and one key format, importing nothing: the writers (harness.store.profile_store, harness.train.trace_writer,
analysis.timeline_file) and the readers (harness.store.profile_reader, analysis.trace_reader, analysis.timeline_file)
take the same names from here; harness.store.hdf5_io writes and reads them.
"""

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"  # the first bytes of every HDF5 file

# Version 2: every dataset checksummed (fletcher32), text fixed-length UTF-8, HDF5's newest format
# (harness.store.hdf5_io); version 1 files hold the same layout without checksums and are still read.
READ_VERSIONS = (1, 2)

# ---- profile.h5 and the rank files of `harness profile` (docs/hdf5.md)
PROFILE_SCHEMA_VERSION = 2
PROFILE_KIND = "distsim-profile"
RANK_PROFILE_KIND = "distsim-rank"
# a measurement's summary attributes, beside `count`
STATS = ("median_s", "mean_s", "std_s", "min_s", "max_s", "p5_s", "p95_s")
# a measurement's attributes that are its own fields; the rest are free-form (name, warmup, bytes, ...)
MEASUREMENT_FIELD_ATTRS = frozenset({"kind", "content_json", "ranks", "env_key", "count", *STATS})
# A measurement's optional sample series, next to samples_s:
# P2P only: the receive timed while the sender computes (harness.profile.comm)
SENDER_BUSY_SERIES = "sender_busy_samples_s"
# P2P only: the sender's time in the call that posted its send (the receiver waiting), per ping-pong sample
SEND_POST_SERIES = "send_post_samples_s"
# a CPU's P2P events of the job only: per round of harness.profile.comm's stream of late receives, the compute a
# send received late took from each end (run-queue wait over the sends, the two ranks' mean)
LATE_SERIES = "late_cpu_samples_s"
# GPU forwards and backwards only: the host's time to issue each sample (harness.profile.timer.time_issued)
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
# compute forwards, whole backwards and optimizer steps only: the event timed inside each distinct stage's chain
# run as one (harness.profile.in_context), every position of every chain holding it; where present the costs use
# it instead of samples_s (the layer alone)
IN_CONTEXT_SERIES = "in_context_samples_s"
SERIES = (SENDER_BUSY_SERIES, SEND_POST_SERIES, LATE_SERIES, HOST_ISSUE_SERIES, SAMPLE_END_SERIES, DIVIDE_SERIES,
          ZERO_SERIES, IN_CONTEXT_SERIES)
# /environment: the wall seconds the in-context chains took (what they added to the profile), and how many
# distinct stage chains ran
IN_CONTEXT_WALL_ENV = "in_context_wall_s"
IN_CONTEXT_CHAINS_ENV = "in_context_chains"
# compute backwards only, an attribute: what each further backward() call cost the measuring rank's host
# (harness.profile.compute.measure_backward_call); every sample paid it, a training step pays it once
BACKWARD_CALL_ATTR = "backward_call_s"
# compute forwards only, an attribute: the bytes one forward saves for its backward (harness.profile.memory),
# what a micro-batch in flight holds on its stage (analysis.memory)
ACTIVATION_BYTES_ATTR = "activation_bytes"
# a split backward's bwd_input: the saved activations its input gradient lets go of when its layer is a stage's last
RELEASED_BYTES_ATTR = "released_bytes"
# compute whole backwards (bwd) only, attributes: the temporaries its backward holds at its worst moment and the
# saved activations it has let go of by then, and the same in its loss's backward before (a model's last layer; 0
# elsewhere) (harness.profile.memory.backward_temporaries); absent in older profiles
TEMPORARY_BYTES_ATTR = "temporary_bytes"
TEMPORARY_FREED_BYTES_ATTR = "temporary_freed_bytes"
LOSS_TEMPORARY_BYTES_ATTR = "loss_temporary_bytes"
LOSS_TEMPORARY_FREED_BYTES_ATTR = "loss_temporary_freed_bytes"
TEMPORARY_ATTRS = (TEMPORARY_BYTES_ATTR, TEMPORARY_FREED_BYTES_ATTR, LOSS_TEMPORARY_BYTES_ATTR,
                   LOSS_TEMPORARY_FREED_BYTES_ATTR)  # in harness.plan.activations.BackwardTemporaries' order
# compute only, attributes: the precision asked for (`[profile] precision`, a fraction) and the one reached, the
# 95% interval's half-width of the samples' mean over the mean (harness.plan.precision; inf with too few samples)
PRECISION_GOAL_ATTR = "precision_goal"
PRECISION_ATTR = "precision"
PRECISION_BUDGET_ATTR = "precision_budget_s"  # compute only: the budget the samples were taken with
# compute only, an attribute: the compute phase that took the samples (its start, Unix time, the same on every
# rank of one profiling run)
COMPUTE_PHASE_ATTR = "compute_phase"
# a measurement's attributes that must be numbers where present (the reader refuses a file whose are not)
NUMBER_ATTRS = (BACKWARD_CALL_ATTR, ACTIVATION_BYTES_ATTR, RELEASED_BYTES_ATTR, *TEMPORARY_ATTRS, PRECISION_GOAL_ATTR,
                PRECISION_ATTR, PRECISION_BUDGET_ATTR, COMPUTE_PHASE_ATTR)
# /environment, JSON: per compute phase (compute_phase_key), every rank's median speed-probe time
# (harness.profile.probe), so that the analysis can refer each rank's samples to the ranks' mean speed
RANK_SPEED_PROBE_ENV = "rank_speed_probe_s"
SPEED_PROBE_ENV = "speed_probe"  # /environment: what the probe is
# /environment, JSON: the training engine's host seconds between steps by transition (ENGINE_GAPS), the median over
# the ranks of a copy of the job trained alone (harness.train.engine_gaps); absent in older profiles
ENGINE_GAPS_ENV = "engine_gaps_s"
STEP_GAPS = ("F->B", "B->F", "F->F", "B->B")  # between two steps of a device
ENGINE_GAPS = (*STEP_GAPS, "B->opt", "start", "end")  # and before the optimizer, the iteration's start and end


def compute_phase_key(compute_phase: float) -> str:
    """The key of a compute phase in RANK_SPEED_PROBE_ENV: its attribute's value, written exactly."""
    return repr(float(compute_phase))


# ---- trace.h5 and the rank files of `harness train` (docs/train.md)
TRACE_SCHEMA_VERSION = 2
TRACE_KIND = "distsim-trace"
TRACE_RANK_KIND = "distsim-trace-rank"
# the interval columns of every device, in this order
TRACE_FLOAT_COLUMNS = ("start_s", "end_s", "wait_s")
TRACE_STRING_COLUMNS = ("kind", "name", "phase", "event_id")
TRACE_INT_COLUMNS = ("virtual_stage", "micro", "iteration", "peer")
TRACE_COLUMNS = TRACE_FLOAT_COLUMNS + TRACE_STRING_COLUMNS + TRACE_INT_COLUMNS
# a device's attributes: the most bytes it held over the measured iterations, counted as the memory model counts
# (harness.profile.memory), and each part's bytes at that peak (JSON); on a GPU also CUDA's own peak
PEAK_MEMORY_ATTR = "peak_memory_bytes"
MEMORY_PARTS_ATTR = "memory_at_peak_json"
CUDA_PEAK_MEMORY_ATTR = "cuda_max_allocated_bytes"
# optional (harness train --layer-times): every layer of every compute step, in a subgroup of the device's group
TRACE_LAYER_GROUP = "layers"
TRACE_LAYER_FLOAT_COLUMNS = ("start_s", "end_s")
TRACE_LAYER_STRING_COLUMNS = ("phase", "event_id")
TRACE_LAYER_INT_COLUMNS = ("layer", "virtual_stage", "micro", "iteration")
TRACE_LAYER_COLUMNS = TRACE_LAYER_FLOAT_COLUMNS + TRACE_LAYER_STRING_COLUMNS + TRACE_LAYER_INT_COLUMNS

# ---- timeline.h5 of `analysis simulate --out` (docs/timeline.md)
TIMELINE_SCHEMA_VERSION = 2
TIMELINE_KIND = "distsim-timeline"

# ---- the results of `harness collectives` (docs/hdf5.md, "Collective benchmarks")
COLLECTIVES_SCHEMA_VERSION = 2
COLLECTIVES_KIND = "distsim-collectives"
COLLECTIVES_READ_VERSIONS = (2,)

# what each kind is, in the words of error messages
KIND_DESCRIPTIONS = {
    PROFILE_KIND: "a merged profile (profile.h5 of `harness profile`)",
    RANK_PROFILE_KIND: "a per-rank file of `harness profile` (rank-NNNNN.h5)",
    TRACE_KIND: "a real run's trace (trace.h5 of `harness train`)",
    TRACE_RANK_KIND: "a per-rank file of `harness train` (rank-NNNNN.trace.h5)",
    TIMELINE_KIND: "a simulated timeline (timeline.h5 of `analysis simulate --out`)",
    COLLECTIVES_KIND: "a collective benchmark (FILE.h5 of `harness collectives -o`)",
}

# what to do about a missing or damaged file of each kind, in the words of error messages
_PROFILE = "profile again: mpirun -n N python -m mpi4py -m harness profile SPEC -o OUTDIR"
_TRACE = "run the training again: mpirun -n N python -m mpi4py -m harness train SPEC -o RUNDIR"
REMEDIES = {
    PROFILE_KIND: _PROFILE,
    RANK_PROFILE_KIND: _PROFILE,
    TRACE_KIND: _TRACE,
    TRACE_RANK_KIND: _TRACE,
    TIMELINE_KIND: "write it again: python -m analysis simulate PROFILE.h5 --out TIMELINE.h5",
    COLLECTIVES_KIND: "run the benchmark again: mpirun -n N python -m mpi4py -m harness collectives -o FILE.h5",
}
# what to say to a user who gave a per-rank file where the merged one belongs
MERGED_FILE_HINTS = {RANK_PROFILE_KIND: "give the merged profile.h5 of its folder",
                     TRACE_RANK_KIND: "give the merged trace.h5 of its folder"}
MERGED_KINDS = {RANK_PROFILE_KIND: PROFILE_KIND, TRACE_RANK_KIND: TRACE_KIND}  # a rank's file -> its folder's merged
