"""`harness profile`: every rank profiles its share of the unique events, then rank 0 merges profile.h5.

One function per phase over a ProfileRun, separated by barriers so that measurements do not disturb each other:
  1. set-up (`_set_up`): device, process group, what is already stored (resume), placement (rank 0, broadcast);
  2. compute (`_profile_compute`): every rank its own share at once;
  3. tensor-parallel composites (`_profile_composites`): one tp group at a time;
  4. communication (`_profile_communication`): one P2P pair or all-reduce group at a time, every rank in step;
  5. merge (`_merge`): the engine's gaps (every rank trains a stage's copy alone, where the caller gives the
     trainer's measure), rank files -> OUTDIR/profile.h5.
A watchdog ends the whole job if a phase outlives profile.timeout_s; an exception on any rank ends the
job at once with that rank's message (MPI_Abort), so nothing hangs.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.common.errors import UserError, WriteError
from harness.common.progress import Progress
from harness.models.user import factory_layers
from harness.plan.candidates import expand
from harness.plan.events import COMM_KINDS, INTER, INTRA, UniqueEvents, build_plan, composite_content, event_id
from harness.plan.precision import precision_statistic, relative_half_width
from harness.plan.spec import JobSpec
from harness.runtime.host_memory import prepare_host_memory
from harness.runtime.mpi_errors import (
    AgreedError,
    abort_on_failure,
    factory_packages,
    raise_if_any,
    yielding_barrier,
)
from harness.store.hdf5_io import open_file, read_environment, reading
from harness.store.hdf5_schema import (
    ACTIVATION_BYTES_ATTR,
    BACKWARD_CALL_ATTR,
    COMPUTE_PHASE_ATTR,
    DIVIDE_SERIES,
    ENGINE_GAPS_ENV,
    HOST_ISSUE_SERIES,
    IN_CONTEXT_CHAINS_ENV,
    IN_CONTEXT_SERIES,
    IN_CONTEXT_WALL_ENV,
    LATE_SERIES,
    PRECISION_ATTR,
    PRECISION_BUDGET_ATTR,
    PRECISION_GOAL_ATTR,
    PROFILE_KIND,
    RANK_SPEED_PROBE_ENV,
    READ_VERSIONS,
    RELEASED_BYTES_ATTR,
    SAMPLE_END_SERIES,
    SEND_POST_SERIES,
    SENDER_BUSY_SERIES,
    SPEED_PROBE_ENV,
    TEMPORARY_ATTRS,
    TEMPORARY_BYTES_ATTR,
    ZERO_SERIES,
    compute_phase_key,
)
from harness.store.profile_store import Measurement, read_measurements, read_rank_probes, write_profile, write_rank_file
from launcher.placement import Placement, place
from launcher.topology import Topology, discover, mpi_library_version

FAIL_RANK_VAR = "DISTSIM_FAIL_RANK"  # test-only: this rank raises at the start of a phase:
FAIL_PHASE_VAR = "DISTSIM_FAIL_PHASE"  # test-only: that phase ("compute" unless set)
FAIL_HOW_VAR = "DISTSIM_FAIL_HOW"  # test-only: "kill" for SIGKILL instead of an exception
FAILABLE_PHASES = ("compute", "in context", "tensor-parallel composites", "communication", "merge")
PROGRESS_TAG = 7701
FLUSH_EVERY_S = 10.0


@dataclass
class ProfileResult:
    """What rank 0 reports after the merge."""

    path: Path
    measured: int = 0
    skipped: int = 0
    unmeasured: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    device_seconds: float = 0.0
    binding_note: str | None = None  # CPU profiles: where the ranks ran (Topology.cpu_notes)
    # events of the profile whose samples miss the precision asked for: (name, precision reached)
    missed_precision: list[tuple[str, float]] = field(default_factory=list)
    precision: float = 0.0  # the precision asked for
    compute_wall_s: float = 0.0  # the compute phase's wall time (the layers alone)
    in_context_wall_s: float = 0.0  # what the in-context chains added to it
    in_context_chains: int = 0  # distinct stage chains run
    # chains that could not run here, with why (their events keep their isolated samples)
    in_context_skipped: list[str] = field(default_factory=list)


class Watchdog:
    """Aborts the whole MPI job if a phase is not over within `timeout_s`."""

    def __init__(self, comm, rank: int, timeout_s: float):
        self.comm, self.rank, self.timeout_s = comm, rank, timeout_s
        self._timer: threading.Timer | None = None

    def start(self, phase: str) -> None:
        self.stop()
        self._timer = threading.Timer(self.timeout_s, self._expire, args=(phase,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, phase: str) -> None:
        print(f"harness profile: rank {self.rank}: phase '{phase}' did not finish within "
              f"profile.timeout_s = {self.timeout_s:g} s; ending the job", file=sys.stderr, flush=True)
        self.comm.Abort(3)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def environment_key(device_name: str, backend: str) -> str:
    """What must match for a stored measurement to be reused: the device, the backend and torch."""
    import torch

    text = json.dumps([device_name, backend, torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}"


def rank_file(outdir: Path, rank: int) -> Path:
    return outdir / f"rank-{rank:05d}.h5"


def reached_precision(m: Measurement) -> float:
    """A measurement's precision: the half-width of the 95% interval of its mean (compute) or median
    (communication, whose statistics are the median and the minimum, harness.plan.precision) over it."""
    return relative_half_width(m.samples_s, precision_statistic(m.kind))


def _asks_more(m: Measurement, precision: float, budget_s: float) -> bool:
    """Whether a measurement misses `precision` and was taken with a coarser precision or a smaller
    budget than these (or before either was recorded): measuring it again may then reach it."""
    if reached_precision(m) <= precision:
        return False
    goal, budget = m.attrs.get(PRECISION_GOAL_ATTR), m.attrs.get(PRECISION_BUDGET_ATTR)
    return goal is None or budget is None or precision < float(goal) or budget_s > float(budget)


def _complete(m: Measurement, precision: tuple[float, float] | None = None) -> bool:
    """Whether a stored measurement has everything this version measures: a P2P its sender-busy and send-post
    samples, an all-reduce its division's and zeroing's samples, a forward its activation bytes, a GPU forward
    or backward the host's issue times; and, with a (precision, budget), a compute or communication event that
    this run does not ask more of (_asks_more)."""
    if precision is not None and m.kind in ("compute", *COMM_KINDS) and _asks_more(m, *precision):
        return False
    if m.kind == "p2p":
        return SENDER_BUSY_SERIES in m.series and SEND_POST_SERIES in m.series
    if m.kind == "allreduce":
        return DIVIDE_SERIES in m.series and ZERO_SERIES in m.series
    phase = m.content.get("phase") if m.kind == "compute" else None
    if phase in ("fwd", "bwd_input") and ACTIVATION_BYTES_ATTR not in m.attrs:
        return False
    if phase == "bwd_input" and RELEASED_BYTES_ATTR not in m.attrs:
        return False
    if phase == "bwd" and TEMPORARY_BYTES_ATTR not in m.attrs:
        return False
    if m.kind == "compute" and str(m.attrs.get("device", "")).startswith("cuda") \
            and m.content.get("phase") in ("fwd", "bwd", "bwd_input", "bwd_weight"):
        return HOST_ISSUE_SERIES in m.series
    return True


def _stored(outdir: Path, env_key: str, complete_only: bool = False,
            precision: tuple[float, float] | None = None) -> dict[str, Measurement]:
    """Measurements already in OUTDIR (profile.h5 and rank files) taken in the same environment; with
    `complete_only` those that need no measuring again (_complete, with this run's (precision, budget))."""
    found: dict[str, Measurement] = {}
    paths = sorted(outdir.glob("rank-*.h5"))
    if (outdir / "profile.h5").exists():
        paths.insert(0, outdir / "profile.h5")
    for path in paths:
        try:
            found.update({k: m for k, m in read_measurements(path).items() if m.env_key == env_key
                          and (not complete_only or _complete(m, precision))})
        except UserError as exc:  # damaged or foreign: what it held is measured again
            print(f"harness profile: not reading {path.name} ({exc}); what it held is measured again and the "
                  "file replaced", file=sys.stderr)
    return found


class RankRecorder:
    """This rank's measurements, rewritten to its rank file now and then and at every phase end, with its
    speed-probe median of every compute phase they came from: a run that stops before its merge keeps both."""

    def __init__(self, path: Path, rank: int, meta: dict, previous: dict[str, Measurement],
                 previous_probes: dict[str, float | None] | None = None):
        self.path, self.rank, self.meta = path, rank, meta
        self.measurements: dict[str, Measurement] = dict(previous)
        self.probes: dict[str, float | None] = dict(previous_probes or {})
        self._probe: tuple[str, Any] | None = None
        self._last_flush = time.monotonic()
        self.write_error: WriteError | None = None  # a periodic flush that failed, until a save succeeds

    def track_probe(self, phase_key: str, probe: Any) -> None:
        """Write `probe`'s median so far (SpeedProbe.median_s) as this rank's for that compute phase at every
        flush."""
        self._probe = (phase_key, probe)

    def add(self, m: Measurement) -> None:
        self.measurements[m.id] = m
        if self.write_error is None and time.monotonic() - self._last_flush > FLUSH_EVERY_S:
            try:
                self.flush()
            except WriteError as exc:  # reported by the phase's save, which every rank reaches
                self.write_error = exc

    def flush(self) -> None:
        if self._probe is not None:
            key, probe = self._probe
            self.probes[key] = probe.median_s()
        meta = {**self.meta, RANK_SPEED_PROBE_ENV: json.dumps(self.probes)} if self.probes else self.meta
        write_rank_file(self.path, self.rank, self.measurements.values(), meta=meta)
        self._last_flush = time.monotonic()

    def save(self, comm) -> None:
        """Collective, at a phase's end: every rank writes its file; if any could not, every rank stops with
        that rank's message (AgreedError) and the complete files already in the folder stay for a resume."""
        error = None
        try:
            self.flush()
            self.write_error = None
        except WriteError as exc:
            error = exc
        if error is not None:
            error = UserError(f"{error}. Every complete file in {self.path.parent} is kept: run the same command "
                              "again to resume")
        raise_if_any(comm, error)


def _report_progress(comm, rank: int, progress: Progress | None, count: int | None, requests: list) -> int:
    """Rank 0 counts its own progress; the others send theirs to rank 0 without waiting (see _drain_progress),
    and None once they are done. Returns how many other ranks' None rank 0 took meanwhile."""
    if rank == 0:
        if count is not None:
            progress.advance(count)
        return _poll_progress(comm, progress)
    requests.append(comm.isend(count, dest=0, tag=PROGRESS_TAG))
    return 0


def _drain_progress(comm, progress: Progress, ranks_done: int) -> None:
    """Rank 0: take the other ranks' progress reports until every one of them has said it is done."""
    while ranks_done < comm.Get_size() - 1:
        ranks_done += _poll_progress(comm, progress)
        time.sleep(0.01)


def _poll_progress(comm, progress: Progress) -> int:
    """Rank 0: take every progress report that has arrived, without waiting; returns how many said done."""
    from mpi4py import MPI

    status = MPI.Status()
    done = 0
    while comm.iprobe(source=MPI.ANY_SOURCE, tag=PROGRESS_TAG, status=status):
        count = comm.recv(source=status.Get_source(), tag=PROGRESS_TAG)
        if count is None:
            done += 1
        else:
            progress.advance(count)
    return done


@dataclass
class ProfileRun:
    """One profiling job as every rank holds it: what to measure, where, and what the phases found so far."""

    spec: JobSpec
    unique: UniqueEvents
    outdir: Path
    comm: Any
    topology: Topology
    watchdog: Watchdog
    force: bool = False
    show_progress: bool = True
    started: float = field(default_factory=time.time)
    phase: str = "set-up"
    device: Any = None
    host_memory: str = "default"
    backend_label: str = ""
    device_name: str = ""
    env_key: str = ""
    stored_ids: list[str] = field(default_factory=list)
    placement: Placement | None = None
    recorder: RankRecorder | None = None
    probe: Any = None  # harness.profile.probe.SpeedProbe, from the compute phase on
    compute_phase: float = 0.0  # rank 0's Unix time at the compute phase's start: names this run's phase
    profiler: Any = None  # harness.profile.comm.CommProfiler
    busy_s: float = 0.0  # this rank's time spent measuring
    compute_wall_s: float = 0.0
    # every distinct stage's chain of the events profiled (harness.profile.in_context.StageChain)
    chains: list = field(default_factory=list)
    in_context_wall_s: float = 0.0
    in_context_chains: int = 0
    in_context_skipped: list[str] = field(default_factory=list)
    # communication events timed inside the chains (ZeRO's reduce-scatters over the pairs), for their measurers
    in_context_comm: dict[str, np.ndarray] = field(default_factory=dict)
    # composites timed inside the pairs' chains (context-parallel blocks on the pair), by composite id
    in_context_composites: dict[str, np.ndarray] = field(default_factory=dict)
    comm_start: float = 0.0  # perf_counter at the communication phase's start
    engine_gaps: Any = None  # run_profile's `engine_gaps`

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def warmup(self) -> int:
        return self.spec.profile.warmup

    @property
    def repeats(self) -> int:
        return self.spec.profile.repeats

    def begin(self, phase: str) -> None:
        """Enter a phase: its watchdog, and (test-only) the failure asked for in it."""
        self.phase = phase
        self.watchdog.start(phase)
        _fail_if_asked(self.rank, phase)

    def progress(self, what: str, total: int, unit: str = "event") -> Progress | None:
        return Progress(what, total, enabled=self.show_progress, unit=unit) if self.rank == 0 else None


def run_profile(spec: JobSpec, outdir: Path, *, comm, force: bool = False, show_progress: bool = True,
                events: UniqueEvents | None = None,
                engine_gaps: Callable[[JobSpec, str], dict[str, float]] | None = None) -> ProfileResult | None:
    """Profile the unique `events` (default: those of `spec`'s plan) on the ranks of `comm` into `outdir`, one
    phase after another; rank 0 returns the result, others None. `engine_gaps(spec, device)`: this rank's gaps
    of the training engine between steps (harness.train.engine_gaps.measure_engine_gaps, which `harness profile`
    passes: the trainer is not the profiler's to import), run by every rank before the merge; None: none."""
    from harness.profile.in_context import stage_chains

    topology = discover(comm)
    layers = factory_layers(spec)
    if events is None:
        events = build_plan(spec, layers).unique()
    run = ProfileRun(spec, events, outdir, comm, topology, Watchdog(comm, topology.rank, spec.profile.timeout_s),
                     force=force, show_progress=show_progress, engine_gaps=engine_gaps)
    # the stages of every plan whose events these are (a search's candidates), as chains of those events
    run.chains = [chain for chain in stage_chains(build_plan(candidate, layers) for candidate in
                                                  (expand(spec).candidates if spec.search else [spec]))
                  if chain.events <= set(events.events)]
    try:
        run.begin("set-up")
        _set_up(run)
        run.begin("compute")
        _profile_compute(run)
        run.begin("in context")
        _profile_in_context(run)
        run.begin("tensor-parallel composites")
        _profile_composites(run)
        run.begin("communication")
        _profile_communication(run)
        run.begin("merge")
        result = _merge(run)
        run.watchdog.stop()
    except AgreedError:  # every rank holds it: the front end ends MPI quietly
        run.watchdog.stop()
        raise
    except Exception as exc:  # any failure ends every rank now, with this rank's message
        recorder = run.recorder  # what this rank finished is kept before the abort
        abort_on_failure(comm, "harness profile", run.rank, run.topology.hostnames[run.rank], f"phase '{run.phase}'",
                         exc, factory_packages(spec), before_abort=recorder.flush if recorder is not None else None)
        raise
    return result


def _set_up(run: ProfileRun) -> None:
    """Device, process group, what is stored already, placement (rank 0 decides, everyone gets its answer)."""
    import torch

    from harness.profile.comm import CommProfiler
    from harness.runtime.distributed import init_process_group, pick_device

    comm, topology = run.comm, run.topology
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    run.device = pick_device(topology, run.spec.profile.device, comm)
    run.host_memory = prepare_host_memory(run.device.type)
    run.outdir.mkdir(parents=True, exist_ok=True)
    if topology.size > 1:  # tensor-parallel composites need torch.distributed whatever the comm backend
        init_process_group(comm, topology, run.device, run.spec.profile.timeout_s)
    if any(event.content.get("fsdp2") for event in run.unique.events.values()):
        from harness.profile.sharded import set_up_alone_group

        set_up_alone_group()  # ZeRO's layers run as FSDP2 units, each rank's over a group of its own
    comm_backend = run.spec.profile.backend
    # the label names the backend that measured, whatever the world size (resume compares it)
    run.backend_label = (f"torch-{'nccl' if run.device.type == 'cuda' else 'gloo'}" if comm_backend == "torch"
                         else comm_backend)
    run.device_name = device_name(run.device)
    run.env_key = environment_key(run.device_name, run.backend_label)
    if run.rank == 0:
        stored = {} if run.force else _stored(run.outdir, run.env_key, complete_only=True,
                                              precision=(run.spec.profile.precision, run.spec.profile.budget_s))
        setup = (sorted(stored), place(run.unique, topology, skip=set(stored)))
    else:
        setup = None
    run.stored_ids, run.placement = comm.bcast(setup, root=0)
    previous = {} if run.force else {k: m for k, m in _own_previous(run.outdir, run.rank).items()
                                     if m.env_key == run.env_key}
    meta = {"env_key": run.env_key, "hostname": socket.gethostname(), "device": run.device_name}
    run.recorder = RankRecorder(rank_file(run.outdir, run.rank), run.rank, meta, previous,
                                {} if run.force else _own_previous_probes(run.outdir, run.rank))
    run.recorder.save(comm)  # a full disk or an unwritable folder shows now, before anything is measured
    run.profiler = CommProfiler(comm, comm_backend, run.device)
    # The first optimizer imports torch._dynamo (seconds on a small CPU): pay it before any phase is timed.
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def _profile_compute(run: ProfileRun) -> None:
    """Every rank its own share of the compute events, all at once, round-robin; the speed probe once a round."""
    from mpi4py import MPI

    from harness.profile.compute import Precision, measure_compute_share
    from harness.profile.probe import SpeedProbe

    comm, rank, placement = run.comm, run.rank, run.placement
    run.compute_phase = comm.bcast(time.time() if rank == 0 else None, root=0)
    run.probe = SpeedProbe(run.device)  # ranks with a share time it once per round: their speeds side by side
    run.recorder.track_probe(compute_phase_key(run.compute_phase), run.probe)
    comm.Barrier()
    phase_start = time.perf_counter()
    total = sum(len(ids) for ids in placement.compute.values())
    # progress counts timed samples: every rank samples its whole share once per round, the repeats at least
    progress = run.progress("compute", total * run.repeats, unit="sample")
    reports: list = []
    ranks_done = 0

    def round_done(count: int) -> None:
        nonlocal ranks_done
        run.probe.sample()
        ranks_done += _report_progress(comm, rank, progress, count, reports)

    share = {eid: run.unique.events[eid].content for eid in placement.compute.get(rank, [])}
    t0 = time.perf_counter()
    # every rank's timed rounds start together, so that the ranks' speeds compare at the same moments (replica
    # skew); a rank that waits sleeps, leaving its core to a rank still warming up
    measured = measure_compute_share(run.spec, share, run.device, run.warmup, run.repeats, on_round=round_done,
                                     origin_s=phase_start, warmed=lambda: yielding_barrier(comm, sleep_s=1e-3),
                                     precision=Precision(run.spec.profile.precision, run.spec.profile.budget_s))
    run.probe.top_up()
    run.busy_s += time.perf_counter() - t0
    for eid, taken in measured.items():
        event = run.unique.events[eid]
        series = {SAMPLE_END_SERIES: taken.end_s}
        if taken.host_issue_s is not None:
            series[HOST_ISSUE_SERIES] = taken.host_issue_s
        attrs = {"name": event.name, "warmup": run.warmup, "device": run.device_name,
                 COMPUTE_PHASE_ATTR: run.compute_phase}
        if taken.backward_call_s is not None:
            attrs[BACKWARD_CALL_ATTR] = taken.backward_call_s
        if taken.activation_bytes is not None:
            attrs[ACTIVATION_BYTES_ATTR] = taken.activation_bytes
        if taken.released_bytes is not None:
            attrs[RELEASED_BYTES_ATTR] = taken.released_bytes
        if taken.temporaries is not None:
            attrs.update(zip(TEMPORARY_ATTRS, map(int, taken.temporaries)))
        measurement = Measurement(eid, "compute", event.content, taken.samples_s, [rank], run.env_key, attrs, series)
        attrs[PRECISION_GOAL_ATTR] = run.spec.profile.precision
        attrs[PRECISION_BUDGET_ATTR] = run.spec.profile.budget_s
        attrs[PRECISION_ATTR] = reached_precision(measurement)
        run.recorder.add(measurement)
    if rank == 0:
        _drain_progress(comm, progress, ranks_done)
        progress.close()
    else:
        _report_progress(comm, rank, progress, None, reports)
    MPI.Request.Waitall(reports)
    yielding_barrier(comm, sleep_s=1e-3)  # ranks still sampling to the precision keep their cores
    run.recorder.save(run.comm)  # then every rank writes, together
    run.compute_wall_s = time.perf_counter() - phase_start


@dataclass
class ChainShare:
    """Which stage chains a rank times (chains_of_rank's `index` of `count` shares) and with whom: alone, or with its
    pair (`group`, torch.distributed's; `comm`, the pair's MPI communicator), whose members run the same chains."""

    index: int
    count: int
    group: Any = None
    comm: Any = None
    placement: str = INTRA  # the pair's: on one node (INTRA) or not

    @property
    def agree(self) -> Callable[[bool], bool] | None:
        """`agree(stop)`: whether either member of the pair wants to stop (None alone)."""
        if self.comm is None:
            return None
        from mpi4py import MPI

        return lambda stop: bool(self.comm.allreduce(bool(stop), op=MPI.LOR))

    def free(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def pair_up(comm, hostnames: list[str] | None = None) -> ChainShare:
    """Pairs of the ranks of `comm` (0 and 1, 2 and 3, ...; an odd last rank alone), each a torch.distributed group
    whose members run the same stage chains together, a share of the chains each pair. Collective over `comm` and
    torch.distributed's world (the same ranks); the caller frees the share. `hostnames` (per rank of `comm`): a
    pair on two hosts is an inter-node pair (ChainShare.placement)."""
    import torch.distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    pairs = [[r, r + 1] for r in range(0, size - 1, 2)] + ([[size - 1]] if size % 2 else [])
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    mine = comm.Split(color=rank // 2, key=rank)
    if mine.Get_size() < 2:
        mine.Free()
        return ChainShare(rank // 2, len(pairs))
    apart = hostnames is not None and hostnames[rank] != hostnames[rank ^ 1]
    return ChainShare(rank // 2, len(pairs), group, mine, INTER if apart else INTRA)


def chain_composites(run: ProfileRun) -> dict[str, str]:
    """The compute events whose composite a pair's chain times (ChainRunner's `composites`): a context-parallel
    block's over 2 ranks, its ring exchanged with the pair's other rank as the run's cp group exchanges it; by
    event id, its composite's id. Tensor-parallel and expert-parallel composites keep their samples alone."""
    tasks = {task.id for task in run.placement.composites if len(task.ranks) == 2}
    out = {}
    for eid, event in run.unique.events.items():
        signature = event.content.get("signature", {})
        if event.kind == "compute" and event.content.get("layer") == "block" and int(signature.get("cp", 1)) == 2:
            composite = event_id(composite_content(event.content))
            if composite in tasks:
                out[eid] = composite
    return out


def chain_pairs(run: ProfileRun, chains: list, composites: dict[str, str] | None = None) -> ChainShare:
    """Where a chain holds a ZeRO job's layers, or an event of `composites` (chain_composites), and there are
    several ranks: pair_up's pairs, which run the same chains together, their layers sharded over the pair as a
    run shards them over its data-parallel group, or their ring on it (harness.profile.in_context.ChainRunner);
    else each rank a share of its own. Collective over the world."""
    import torch.distributed as dist

    composites = composites or {}
    if run.comm.Get_size() < 2 or not dist.is_initialized() or not any(
            run.unique.events[eid].content.get("fsdp2") or eid in composites
            for chain in chains for eid in chain.events):
        return ChainShare(run.rank, run.comm.Get_size())
    return pair_up(run.comm, run.topology.hostnames)


def chains_of_rank(chains: list, rank: int, size: int) -> list:
    """The stage chains rank `rank` of `size` runs: its share of them, and one at least where there are fewer chains
    than ranks (rank r the r-th modulo their number), so that every rank computes while the chains are timed, as
    every device of a run computes at once: one rank timing a chain while the others waited ran it 2-4% faster on
    this project's 2-core CPUs (docs/profiling.md, "In context")."""
    if not chains:
        return []
    if len(chains) < size:
        return [chains[rank % len(chains)]]
    return chains[rank::size]


def _profile_in_context(run: ProfileRun) -> None:
    """Every rank its share of the distinct stage chains that hold an event measured in this run, each event
    timed inside them (harness.profile.in_context), within BUDGET_FRACTION of the compute phase's wall time;
    every rank's samples to every rank, each adding them to the compute measurements it took in this run."""
    from harness.profile.in_context import BUDGET_FRACTION, measure_chains

    comm, rank = run.comm, run.rank
    measured_now = {eid for ids in run.placement.compute.values() for eid in ids}
    chains = [chain for chain in run.chains if chain.events & measured_now]
    contents = {eid: event.content for eid, event in run.unique.events.items()}
    # the same budget on every rank, from the phase they shared
    budget_s = BUDGET_FRACTION * comm.bcast(run.compute_wall_s if rank == 0 else None, root=0)
    comm.Barrier()
    t0 = time.perf_counter()
    skipped: list[str] = []
    composites = chain_composites(run)
    share = chain_pairs(run, chains, composites)
    try:
        # one untimed run a chain: its layers are new, but the compute phase has warmed the code paths they take
        samples = measure_chains(run.spec, chains_of_rank(chains, share.index, share.count), contents, run.device, 1,
                                 run.repeats, budget_s, group=share.group, agree=share.agree,
                                 placement=share.placement, composites=composites,
                                 on_skip=lambda chain, why: skipped.append(
                                     f"{' > '.join(run.unique.events[e].name for e in chain.forward)}: {why}"))
    finally:
        share.free()
    run.busy_s += time.perf_counter() - t0
    gathered = comm.allgather(samples)
    # a chain two ranks ran fails on both: one line for it
    run.in_context_skipped = list(dict.fromkeys(item for part in comm.allgather(skipped) for item in part))
    by_event: dict[str, list[np.ndarray]] = {}
    for part in gathered:
        for eid, values in part.items():
            by_event.setdefault(eid, []).append(values)
    for eid in run.placement.compute.get(rank, []):
        measurement = run.recorder.measurements.get(eid)
        if measurement is not None and eid in by_event:
            measurement.series[IN_CONTEXT_SERIES] = np.concatenate(by_event[eid])
    # composites in their pairs' chains, for the ranks that measure them next (_profile_composites)
    timed_composites = set(composites.values())
    run.in_context_composites = {eid: np.concatenate(values) for eid, values in by_event.items()
                                 if eid in timed_composites}
    # ZeRO's reduce-scatters in their pairs' chains, for the ranks that measure them next (_profile_communication)
    run.in_context_comm = {eid: np.concatenate(values) for eid, values in by_event.items()
                           if eid not in timed_composites and run.unique.events[eid].kind != "compute"}
    run.recorder.save(comm)
    run.in_context_wall_s = time.perf_counter() - t0
    run.in_context_chains = len(chains)


def _to_precision(run: ProfileRun, task, measure_once, samples_of, statistic: str, deadline: float) -> list:
    """`measure_once()` (collective over the world; results on the task's first rank, None elsewhere), again
    while the statistic of all its samples so far is not known within the precision and `deadline` (a
    perf_counter time) has not passed: the task's first rank decides, every rank follows. Returns the parts."""
    parts = [measure_once()]
    while True:
        more = None
        if parts[0] is not None:
            more = (time.perf_counter() < deadline
                    and relative_half_width(samples_of(parts), statistic) > run.spec.profile.precision)
        if not run.comm.bcast(more, root=task.ranks[0]):
            return parts
        parts.append(measure_once())


def _profile_composites(run: ProfileRun) -> None:
    """Tensor-parallel layers with their all-reduces on real tp groups, one group at a time, each to the precision
    (on its mean) within its share of the phase's budget."""
    from harness.profile.comm import COMPOSITE_SAMPLE

    tasks = run.placement.composites
    progress = run.progress(run.phase, len(tasks))
    deadline = time.perf_counter() + run.spec.profile.budget_s
    for number, task in enumerate(tasks):
        t0 = time.perf_counter()
        parts = _to_precision(run, task, lambda task=task: run.profiler.measure_composite(task, run.spec, run.warmup,
                                                                                          run.repeats),
                              lambda parts: np.concatenate(parts), precision_statistic("composite"),
                              t0 + max(0.0, deadline - t0) / (len(tasks) - number))
        samples = None if parts[0] is None else np.concatenate(parts)
        if run.rank in task.ranks:
            run.busy_s += time.perf_counter() - t0
        if samples is not None:
            measurement = Measurement(task.id, "composite", task.content, samples, list(task.ranks), run.env_key,
                                      {"group_size": len(task.ranks), "placement": "intra",
                                       "backend": run.backend_label, "warmup": run.warmup,
                                       "composite_sample": COMPOSITE_SAMPLE})
            if task.id in run.in_context_composites:  # a context-parallel block, timed in its pairs' chains too
                measurement.series[IN_CONTEXT_SERIES] = run.in_context_composites[task.id]
            run.recorder.add(measurement)
        if progress is not None:
            progress.advance()
    if progress is not None:
        progress.close()
    run.recorder.save(run.comm)


def _profile_communication(run: ProfileRun) -> None:
    """P2P pairs and all-reduce groups, one at a time, every rank in step; each task's `repeats`, then more
    rounds of them while its median is not known within the precision and its share of the budget lasts (the
    task's first rank decides, every rank follows)."""
    from harness.profile.comm import CommSamples

    run.comm_start = time.perf_counter()
    tasks = run.placement.comm
    progress = run.progress("communication", len(tasks))
    deadline = run.comm_start + run.spec.profile.budget_s
    for number, task in enumerate(tasks):
        t0 = time.perf_counter()
        parts = _to_precision(run, task,
                              lambda task=task: run.profiler.measure(task, run.warmup, run.repeats, run.spec),
                              lambda parts: np.concatenate([p.samples_s for p in parts]),
                              precision_statistic(task.kind),
                              t0 + max(0.0, deadline - t0) / (len(tasks) - number))
        if run.rank in task.ranks:
            run.busy_s += time.perf_counter() - t0
        if parts[0] is not None:
            measured = CommSamples(*(np.concatenate(values) for values in zip(*parts)))
            content = task.content
            series = {name: values for name, values in ((SENDER_BUSY_SERIES, measured.sender_busy_s),
                                                        (SEND_POST_SERIES, measured.send_post_s),
                                                        (LATE_SERIES, measured.late_s),
                                                        (DIVIDE_SERIES, measured.divide_s),
                                                        (ZERO_SERIES, measured.zero_s)) if values.size}
            attrs = {"bytes": content["bytes"], "group_size": len(task.ranks), "placement": content["placement"],
                     "backend": run.backend_label, "needed": task.needed, "warmup": run.warmup,
                     PRECISION_GOAL_ATTR: run.spec.profile.precision,
                     PRECISION_BUDGET_ATTR: run.spec.profile.budget_s}
            if task.id in run.in_context_comm:  # a ZeRO reduce-scatter, timed in its pairs' chains too
                series[IN_CONTEXT_SERIES] = run.in_context_comm[task.id]
            measurement = Measurement(task.id, task.kind, content, measured.samples_s, list(task.ranks),
                                      run.env_key, attrs, series)
            attrs[PRECISION_ATTR] = reached_precision(measurement)
            run.recorder.add(measurement)
        if progress is not None:
            progress.advance()
    if progress is not None:
        progress.close()
    run.recorder.save(run.comm)


def _merge(run: ProfileRun) -> ProfileResult | None:
    """Every rank's time and probe to rank 0, which merges the rank files (and what was stored) into
    profile.h5; rank 0 returns the result. A profile.h5 that cannot be written stops every rank (AgreedError)."""
    from harness.runtime.distributed import destroy_process_group

    comm, outdir = run.comm, run.outdir
    busy = comm.gather(run.busy_s, root=0)
    probe_medians = comm.gather(run.probe.median_s(), root=0)
    comm.Barrier()
    comm_wall_s = time.perf_counter() - run.comm_start
    destroy_process_group()
    gaps = comm.gather(_engine_gaps(run), root=0)
    result = error = None
    if run.rank == 0:
        try:
            result = _write_profile(run, busy, probe_medians, comm_wall_s, gaps)
        except WriteError as exc:
            error = UserError(f"{exc}. The rank files in {outdir} hold every measurement: run the same command "
                              "again to merge them")
    raise_if_any(comm, error)
    return result


def _engine_gaps(run: ProfileRun) -> dict[str, float] | None:
    """This rank's engine gaps (run_profile's `engine_gaps`), every rank at once with its own device; None, with a
    warning, where the copy cannot train (what was measured is kept either way)."""
    if run.engine_gaps is None:
        return None
    try:
        return run.engine_gaps(run.spec, str(run.device))
    except Exception as exc:  # noqa: BLE001 - a profile is written without them rather than lost
        print(f"harness profile: rank {run.rank}: the engine's gaps between steps were not measured "
              f"({type(exc).__name__}: {exc}); predictions from this profile leave them out", file=sys.stderr)
        return None


def _write_profile(run: ProfileRun, busy: list[float], probe_medians: list, comm_wall_s: float,
                   gaps: list[dict[str, float] | None]) -> ProfileResult:
    """Rank 0: the rank files (and what was stored) merged into OUTDIR/profile.h5."""
    import torch

    from harness.profile.probe import DESCRIPTION as PROBE_DESCRIPTION

    topology, outdir = run.topology, run.outdir
    finished = time.time()
    merged = _stored(outdir, run.env_key) if not run.force else {}
    for r in range(topology.size):
        merged.update(read_measurements(rank_file(outdir, r)))
    unmeasured = {eid: why for eid, why in run.placement.unmeasured.items() if eid not in merged}
    # every rank's probe, per compute phase; a resumed profile keeps those of the phases its measurements came
    # from, from the last profile.h5 or, for a run that stopped before its merge, from the rank files
    speeds = {} if run.force else {**_rank_file_speeds(outdir), **_stored_rank_speeds(outdir)}
    speeds[compute_phase_key(run.compute_phase)] = probe_medians
    phases = {compute_phase_key(m.attrs[COMPUTE_PHASE_ATTR]) for m in merged.values()
              if COMPUTE_PHASE_ATTR in m.attrs}
    speeds = {key: value for key, value in speeds.items() if key in phases}
    environment = {
        "hosts": topology.hosts(), "world_size": topology.size, "nodes": topology.nodes,
        "ranks_per_node": topology.ranks_per_node, "topology_source": topology.source,
        "launcher": topology.launcher, **topology.cpu_environment(), "device": run.device_name,
        "backend": run.backend_label, "env_key": run.env_key,
        "torch_version": torch.__version__, "mpi4py_version": module_version("mpi4py"),
        "h5py_version": module_version("h5py"),
        "mpi_library": mpi_library_version(), "python_version": platform.python_version(),
        "start_time": run.started, "end_time": finished, "profiling_wall_s": finished - run.started,
        "slurm": _slurm_environment(topology), "device_seconds": float(sum(busy)),
        "compute_wall_s": run.compute_wall_s, "comm_wall_s": comm_wall_s,
        IN_CONTEXT_WALL_ENV: run.in_context_wall_s, IN_CONTEXT_CHAINS_ENV: run.in_context_chains,
        "warmup": run.warmup, "repeats": run.repeats, "precision": run.spec.profile.precision,
        "budget_s": run.spec.profile.budget_s, "host_memory": run.host_memory,
        SPEED_PROBE_ENV: PROBE_DESCRIPTION, RANK_SPEED_PROBE_ENV: speeds,
    }
    measured_gaps = [g for g in gaps if g]
    if measured_gaps:
        environment[ENGINE_GAPS_ENV] = {kind: float(np.median([g[kind] for g in measured_gaps if kind in g]))
                                        for kind in sorted({kind for g in measured_gaps for kind in g})}
    path = write_profile(outdir / "profile.h5", spec_json=run.spec.to_json(),
                         layers_json=json.dumps([layer.to_dict() for layer in run.unique.layers]),
                         events=run.unique.table(), measurements=merged.values(), unmeasured=unmeasured,
                         environment=environment, placement=run.placement.owner_of())
    placement = run.placement
    measured_now = (sum(len(ids) for ids in placement.compute.values()) + len(placement.comm)
                    + len(placement.composites))
    goal = run.spec.profile.precision
    missed = sorted(((run.unique.events[m.id].name, reached) for m in merged.values()
                     if m.kind in ("compute", *COMM_KINDS) and m.id in run.unique.events
                     and (reached := reached_precision(m)) > goal), key=lambda item: -item[1])
    return ProfileResult(path=path, measured=measured_now, skipped=len(run.stored_ids), unmeasured=unmeasured,
                         wall_s=finished - run.started, device_seconds=float(sum(busy)),
                         binding_note=topology.cpu_notes(torch.get_num_threads()) if run.device.type == "cpu" else None,
                         missed_precision=missed, precision=goal, compute_wall_s=run.compute_wall_s,
                         in_context_wall_s=run.in_context_wall_s, in_context_chains=run.in_context_chains,
                         in_context_skipped=run.in_context_skipped)


def _slurm_environment(topology: Topology) -> dict:
    """Slurm's view of the job (variables, nodes expanded), empty outside Slurm."""
    from launcher.topology import expand_nodelist

    slurm = dict(topology.extra.get("slurm", {}))
    if "SLURM_JOB_NODELIST" in slurm:
        slurm["nodes"] = expand_nodelist(slurm["SLURM_JOB_NODELIST"])
    return slurm


def _stored_rank_speeds(outdir: Path) -> dict[str, list[float]]:
    """The speed probes an earlier profile.h5 in OUTDIR recorded, per compute phase (none if unreadable)."""
    path = outdir / "profile.h5"
    if not path.exists():
        return {}
    try:
        with open_file(path, PROFILE_KIND, READ_VERSIONS) as f, reading(path, PROFILE_KIND):
            speeds = read_environment(f).get(RANK_SPEED_PROBE_ENV, {})
    except UserError:
        return {}
    return speeds if isinstance(speeds, dict) else {}


def _rank_file_speeds(outdir: Path) -> dict[str, list[float | None]]:
    """Per compute phase found in OUTDIR's rank files, every rank's probe median, by rank (None where a rank's
    file has none for that phase, or there is no file)."""
    ranks = [int(p.stem.split("-")[1]) for p in outdir.glob("rank-*.h5") if p.stem.split("-")[1].isdigit()]
    per_rank = [_own_previous_probes(outdir, r) for r in range(max(ranks, default=-1) + 1)]
    keys = {key for probes in per_rank for key in probes}
    return {key: [probes.get(key) for probes in per_rank] for key in keys}


def _fail_if_asked(rank: int, phase: str) -> None:
    """Test-only: on the rank FAIL_RANK_VAR names, at the start of the phase FAIL_PHASE_VAR names, raise, or with
    FAIL_HOW_VAR=kill die of SIGKILL (as a node's out-of-memory killer ends a rank)."""
    fail_rank = os.environ.get(FAIL_RANK_VAR)
    fail_phase = os.environ.get(FAIL_PHASE_VAR, "compute")
    if fail_rank is None:
        return
    if fail_phase not in FAILABLE_PHASES:  # a misspelt phase would otherwise never fail, and a test pass
        raise RuntimeError(f"{FAIL_PHASE_VAR}={fail_phase!r}: not one of {', '.join(FAILABLE_PHASES)}")
    if int(fail_rank) == rank and fail_phase == phase:
        if os.environ.get(FAIL_HOW_VAR) == "kill":
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"failure injected by {FAIL_RANK_VAR}={fail_rank} in phase '{phase}'")


def _own_previous(outdir: Path, rank: int) -> dict[str, Measurement]:
    """What this rank's file from an earlier run holds ({} without a readable one)."""
    return _read_own_file(outdir, rank, read_measurements)


def _own_previous_probes(outdir: Path, rank: int) -> dict[str, float | None]:
    """The speed-probe medians this rank's file from an earlier run holds ({} without a readable one)."""
    return _read_own_file(outdir, rank, read_rank_probes)


def _read_own_file(outdir: Path, rank: int, reader):
    path = rank_file(outdir, rank)
    if not path.exists():
        return {}
    try:
        return reader(path)
    except (UserError, ValueError):  # a damaged file, or a probe attribute that is not JSON
        return {}


def module_version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # a missing module is simply not recorded
        return "unknown"


def check_outdir(outdir: Path) -> None:
    """Refuse an output path that is a file or cannot be created, or in which a folder stands where the profile
    writes a file (before any rank starts measuring)."""
    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"output {outdir} exists and is not a folder; give a folder for the profile (-o OUTDIR)")
    try:
        outdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the output folder {outdir}: {exc.strerror}; "
                        "give a writable folder (-o)") from None
    for path in [outdir / "profile.h5", *sorted(outdir.glob("rank-*.h5"))]:
        if path.is_dir():
            raise UserError(f"{path} is a folder where the profile writes a file; move or remove it, or give another "
                            "output folder (-o)")
