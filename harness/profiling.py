"""`harness profile`: every rank profiles its share of the unique events, then rank 0 merges profile.h5.

Phases, separated by barriers so that measurements do not disturb each other:
  1. set-up: topology, device, plan, what is already stored (resume), placement (rank 0, broadcast);
  2. compute: every rank its own share at once;
  3. communication: one P2P pair or all-reduce group at a time, every rank in step;
  4. merge: rank files -> OUTDIR/profile.h5.
A watchdog ends the whole job if a phase outlives profile.timeout_s; an exception on any rank ends the
job at once with that rank's message (MPI_Abort), so nothing hangs.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py

from harness.errors import UserError
from harness.events import EventPlan, build_plan
from harness.hdf5_schema import (BACKWARD_CALL_ATTR, COMPUTE_PHASE_ATTR, DIVIDE_SERIES, HOST_ISSUE_SERIES,
                                  RANK_SPEED_PROBE_ENV, SAMPLE_END_SERIES, SEND_POST_SERIES, SENDER_BUSY_SERIES,
                                  SPEED_PROBE_ENV, ZERO_SERIES, compute_phase_key, read_environment)
from harness.host_memory import prepare_host_memory
from harness.progress import Progress
from harness.spec import JobSpec
from harness.profile_store import Measurement, read_measurements, read_rank_probes, write_profile, write_rank_file
from launcher.placement import Placement, place
from launcher.topology import Topology, discover, mpi_library_version

FAIL_RANK_VAR = "DISTSIM_FAIL_RANK"  # test-only: this rank raises at the start of a phase:
FAIL_PHASE_VAR = "DISTSIM_FAIL_PHASE"  # test-only: that phase ("compute" unless set)
FAILABLE_PHASES = ("compute", "tensor-parallel composites", "communication")
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
    binding_note: str | None = None  # CPU profiles whose ranks could each have had a core of their own


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


def _complete(m: Measurement) -> bool:
    """Whether a stored measurement has everything this version measures: a P2P its sender-busy and send-post
    samples, an all-reduce its division's and zeroing's samples, a GPU forward or backward the host's issue
    times."""
    if m.kind == "p2p":
        return SENDER_BUSY_SERIES in m.series and SEND_POST_SERIES in m.series
    if m.kind == "allreduce":
        return DIVIDE_SERIES in m.series and ZERO_SERIES in m.series
    if m.kind == "compute" and str(m.attrs.get("device", "")).startswith("cuda") \
            and m.content.get("phase") in ("fwd", "bwd"):
        return HOST_ISSUE_SERIES in m.series
    return True


def _stored(outdir: Path, env_key: str, complete_only: bool = False) -> dict[str, Measurement]:
    """Measurements already in OUTDIR (profile.h5 and rank files) taken in the same environment; with
    `complete_only` those that need no measuring again."""
    found: dict[str, Measurement] = {}
    paths = sorted(outdir.glob("rank-*.h5"))
    if (outdir / "profile.h5").exists():
        paths.insert(0, outdir / "profile.h5")
    for path in paths:
        try:
            found.update({k: m for k, m in read_measurements(path).items() if m.env_key == env_key
                          and (_complete(m) or not complete_only)})
        except OSError:
            print(f"harness profile: ignoring unreadable {path}", file=sys.stderr)
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

    def track_probe(self, phase_key: str, probe: Any) -> None:
        """Write `probe`'s median so far (SpeedProbe.median_s) as this rank's for that compute phase at every
        flush."""
        self._probe = (phase_key, probe)

    def add(self, m: Measurement) -> None:
        self.measurements[m.id] = m
        if time.monotonic() - self._last_flush > FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self._probe is not None:
            key, probe = self._probe
            self.probes[key] = probe.median_s()
        meta = {**self.meta, RANK_SPEED_PROBE_ENV: json.dumps(self.probes)} if self.probes else self.meta
        write_rank_file(self.path, self.rank, self.measurements.values(), meta=meta)
        self._last_flush = time.monotonic()


def _report_progress(comm, rank: int, progress: Progress | None, count: int, requests: list) -> None:
    """Rank 0 counts its own progress; the others send theirs to rank 0 without waiting (see _drain_progress)."""
    if rank == 0:
        progress.advance(count)
    else:
        requests.append(comm.isend(count, dest=0, tag=PROGRESS_TAG))


def _drain_progress(comm, progress: Progress, expected: int) -> None:
    """Rank 0: take the other ranks' progress reports until `expected` events are done in all."""
    while progress.done < expected:
        _poll_progress(comm, progress)
        time.sleep(0.01)


def _poll_progress(comm, progress: Progress) -> None:
    """Rank 0: take every progress report that has arrived, without waiting."""
    from mpi4py import MPI

    status = MPI.Status()
    while comm.iprobe(source=MPI.ANY_SOURCE, tag=PROGRESS_TAG, status=status):
        progress.advance(comm.recv(source=status.Get_source(), tag=PROGRESS_TAG))


def run_profile(spec: JobSpec, outdir: Path, *, comm, force: bool = False, show_progress: bool = True,
                plan: EventPlan | None = None) -> ProfileResult | None:
    """Profile `spec` on the ranks of `comm` into `outdir`; rank 0 returns the result, others None."""
    import torch

    from harness.distributed import destroy_process_group, init_process_group, pick_device
    from harness.profilers.comm import COMPOSITE_SAMPLE, CommProfiler
    from harness.profilers.compute import measure_compute_share
    from harness.profilers.probe import DESCRIPTION as PROBE_DESCRIPTION, SpeedProbe

    started = time.time()
    topology: Topology = discover(comm)
    rank = topology.rank
    warmup, repeats = spec.profile.warmup, spec.profile.repeats
    watchdog = Watchdog(comm, rank, spec.profile.timeout_s)
    recorder: RankRecorder | None = None
    busy_s = 0.0
    probe: SpeedProbe | None = None
    phase = "set-up"
    try:
        watchdog.start(phase)
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        device = pick_device(topology, spec.profile.device, comm)
        host_memory = prepare_host_memory(device.type)
        outdir.mkdir(parents=True, exist_ok=True)
        plan = plan or build_plan(spec)
        comm_backend = spec.profile.backend
        if topology.size > 1:  # tensor-parallel composites need torch.distributed whatever the comm backend
            init_process_group(comm, topology, device, spec.profile.timeout_s)
        # the label names the backend that measured, whatever the world size (resume compares it)
        backend_label = f"torch-{'nccl' if device.type == 'cuda' else 'gloo'}" if comm_backend == "torch" \
            else comm_backend
        name = device_name(device)
        env_key = environment_key(name, backend_label)

        # Set-up on rank 0: what is stored already, and the placement; everyone gets the same answer.
        if rank == 0:
            stored = {} if force else _stored(outdir, env_key, complete_only=True)
            placement = place(plan, topology, skip=set(stored))
            setup = (sorted(stored), placement)
        else:
            setup = None
        stored_ids, placement = comm.bcast(setup, root=0)
        placement: Placement
        previous = {} if force else {k: m for k, m in _own_previous(outdir, rank).items() if m.env_key == env_key}
        meta = {"env_key": env_key, "hostname": socket.gethostname(), "device": name}
        recorder = RankRecorder(rank_file(outdir, rank), rank, meta, previous,
                                {} if force else _own_previous_probes(outdir, rank))

        # The first optimizer imports torch._dynamo (seconds on a small CPU): pay it before any phase is timed.
        torch.optim.Adam([torch.zeros(1, requires_grad=True)])

        # ---- compute: every rank its own share, all at once
        phase = "compute"
        watchdog.start(phase)
        compute_phase = comm.bcast(time.time() if rank == 0 else None, root=0)  # names this run's phase
        probe = SpeedProbe(device)  # ranks with a share time it once per round: their speeds side by side
        recorder.track_probe(compute_phase_key(compute_phase), probe)
        comm.Barrier()
        phase_start = time.perf_counter()
        total_compute = sum(len(ids) for ids in placement.compute.values())
        # progress counts timed samples: every rank samples its whole share once per round
        progress = Progress("compute", total_compute * repeats, enabled=show_progress,
                            unit="sample") if rank == 0 else None
        _fail_if_asked(rank, phase)

        reports: list = []

        def round_done(count: int) -> None:
            probe.sample()
            _report_progress(comm, rank, progress, count, reports)
            if rank == 0:
                _poll_progress(comm, progress)

        share = {eid: plan.events[eid].content for eid in placement.compute.get(rank, [])}
        t0 = time.perf_counter()
        measured = measure_compute_share(spec, share, device, warmup, repeats, on_round=round_done,
                                         origin_s=phase_start)
        probe.top_up()
        busy_s += time.perf_counter() - t0
        for eid, taken in measured.items():
            event = plan.events[eid]
            series = {SAMPLE_END_SERIES: taken.end_s}
            if taken.host_issue_s is not None:
                series[HOST_ISSUE_SERIES] = taken.host_issue_s
            attrs = {"name": event.name, "warmup": warmup, "device": name, COMPUTE_PHASE_ATTR: compute_phase}
            if taken.backward_call_s is not None:
                attrs[BACKWARD_CALL_ATTR] = taken.backward_call_s
            recorder.add(Measurement(eid, "compute", event.content, taken.samples_s, [rank], env_key, attrs,
                                     series))
        if rank == 0:
            _drain_progress(comm, progress, total_compute * repeats)
            progress.close()
        from mpi4py import MPI

        MPI.Request.Waitall(reports)
        recorder.flush()
        comm.Barrier()
        compute_wall_s = time.perf_counter() - phase_start

        # ---- tensor-parallel layers as composites on real tp groups, one group at a time
        phase = "tensor-parallel composites"
        watchdog.start(phase)
        _fail_if_asked(rank, phase)
        profiler = CommProfiler(comm, comm_backend, device)
        progress = Progress(phase, len(placement.composites), enabled=show_progress) if rank == 0 else None
        for task in placement.composites:
            t0 = time.perf_counter()
            samples = profiler.measure_composite(task, spec, warmup, repeats)
            if rank in task.ranks:
                busy_s += time.perf_counter() - t0
            if samples is not None:
                recorder.add(Measurement(task.id, "composite", task.content, samples, list(task.ranks), env_key,
                                         {"group_size": len(task.ranks), "placement": "intra",
                                          "backend": backend_label, "warmup": warmup,
                                          "composite_sample": COMPOSITE_SAMPLE}))
            if rank == 0:
                progress.advance()
        if rank == 0:
            progress.close()
        recorder.flush()

        # ---- communication: one group at a time, every rank in step
        phase = "communication"
        watchdog.start(phase)
        _fail_if_asked(rank, phase)
        phase_start = time.perf_counter()
        progress = Progress("communication", len(placement.comm), enabled=show_progress) if rank == 0 else None
        for task in placement.comm:
            t0 = time.perf_counter()
            measured = profiler.measure(task, warmup, repeats)
            if rank in task.ranks:
                busy_s += time.perf_counter() - t0
            if measured is not None:
                content = task.content
                series = {name: values for name, values in ((SENDER_BUSY_SERIES, measured.sender_busy_s),
                                                            (SEND_POST_SERIES, measured.send_post_s),
                                                            (DIVIDE_SERIES, measured.divide_s),
                                                            (ZERO_SERIES, measured.zero_s)) if values.size}
                recorder.add(Measurement(task.id, task.kind, content, measured.samples_s, list(task.ranks), env_key,
                                         {"bytes": content["bytes"], "group_size": len(task.ranks),
                                          "placement": content["placement"], "backend": backend_label,
                                          "needed": task.needed, "warmup": warmup}, series))
            if rank == 0:
                progress.advance()
        if rank == 0:
            progress.close()
        recorder.flush()
        watchdog.stop()
    except Exception as exc:  # any failure ends every rank now, with this rank's message
        print(f"harness profile: rank {rank} ({topology.hostnames[rank]}) failed in phase '{phase}': "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        try:
            if recorder is not None:
                recorder.flush()  # keep what this rank finished
        finally:
            comm.Abort(exc.exit_status if isinstance(exc, UserError) else 1)  # bad input keeps its status 2
        raise

    busy = comm.gather(busy_s, root=0)
    probe_medians = comm.gather(probe.median_s(), root=0)
    comm.Barrier()
    comm_wall_s = time.perf_counter() - phase_start
    destroy_process_group()
    if rank != 0:
        return None

    # ---- merge on rank 0
    finished = time.time()
    merged = _stored(outdir, env_key) if not force else {}
    for r in range(topology.size):
        merged.update(read_measurements(rank_file(outdir, r)))
    unmeasured = {eid: why for eid, why in placement.unmeasured.items() if eid not in merged}
    # every rank's probe, per compute phase; a resumed profile keeps those of the phases its measurements came
    # from, from the last profile.h5 or, for a run that stopped before its merge, from the rank files
    speeds = {} if force else {**_rank_file_speeds(outdir), **_stored_rank_speeds(outdir)}
    speeds[compute_phase_key(compute_phase)] = probe_medians
    phases = {compute_phase_key(m.attrs[COMPUTE_PHASE_ATTR]) for m in merged.values() if COMPUTE_PHASE_ATTR in m.attrs}
    speeds = {key: value for key, value in speeds.items() if key in phases}
    owners = placement.owner_of()
    environment = {
        "hosts": topology.hosts(), "world_size": topology.size, "nodes": topology.nodes,
        "ranks_per_node": topology.ranks_per_node, "topology_source": topology.source,
        "launcher": topology.launcher, **topology.cpu_environment(), "device": name, "backend": backend_label,
        "env_key": env_key,
        "torch_version": torch.__version__, "mpi4py_version": _version("mpi4py"), "h5py_version": _version("h5py"),
        "mpi_library": mpi_library_version(), "python_version": platform.python_version(),
        "start_time": started, "end_time": finished, "profiling_wall_s": finished - started,
        "slurm": _slurm_environment(topology), "device_seconds": float(sum(busy)), "compute_wall_s": compute_wall_s, "comm_wall_s": comm_wall_s,
        "warmup": warmup, "repeats": repeats, "host_memory": host_memory,
        SPEED_PROBE_ENV: PROBE_DESCRIPTION, RANK_SPEED_PROBE_ENV: speeds,
    }
    path = write_profile(outdir / "profile.h5", spec_json=spec.to_json(),
                         layers_json=json.dumps([layer.to_dict() for layer in plan.layers]),
                         events=plan.table(),
                         measurements=merged.values(), unmeasured=unmeasured, environment=environment,
                         placement={eid: ranks for eid, ranks in owners.items()})
    measured_now = (sum(len(ids) for ids in placement.compute.values()) + len(placement.comm)
                    + len(placement.composites))
    return ProfileResult(path=path, measured=measured_now, skipped=len(stored_ids), unmeasured=unmeasured,
                         wall_s=finished - started, device_seconds=float(sum(busy)),
                         binding_note=topology.unbound_note() if device.type == "cpu" else None)


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
        with h5py.File(path, "r") as f:
            speeds = read_environment(f).get(RANK_SPEED_PROBE_ENV, {})
    except OSError:
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
    """Test-only: raise on the rank FAIL_RANK_VAR names at the start of the phase FAIL_PHASE_VAR names."""
    fail_rank = os.environ.get(FAIL_RANK_VAR)
    fail_phase = os.environ.get(FAIL_PHASE_VAR, "compute")
    if fail_rank is None:
        return
    if fail_phase not in FAILABLE_PHASES:  # a misspelt phase would otherwise never fail, and a test pass
        raise RuntimeError(f"{FAIL_PHASE_VAR}={fail_phase!r}: not one of {', '.join(FAILABLE_PHASES)}")
    if int(fail_rank) == rank and fail_phase == phase:
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
    except (OSError, ValueError):  # a file cut short, or a probe attribute that is not JSON
        return {}


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # a missing module is simply not recorded
        return "unknown"


def check_outdir(outdir: Path) -> None:
    """Refuse an output path that is a file or cannot be created (before any rank starts measuring)."""
    if outdir.exists() and not outdir.is_dir():
        raise UserError(f"output {outdir} exists and is not a folder; give a folder for the profile (-o OUTDIR)")
    try:
        outdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the output folder {outdir}: {exc.strerror}; give a writable folder (-o)")
