"""What each rank of a real run did, as interval sets: the one data type the breakdown and scaling analyses read,
made from a trace.h5 of `harness train` or from PyTorch profiler (Kineto) traces (docs/runs.md).

Per rank, `RankActivity` holds raw sets that may overlap one another: compute, communication, memory; the
phases the trace names; the collectives it joined (for stragglers); the measured iterations. The breakdown then
applies one precedence to them (compute, then communication, then memory, else idle). The rules that make
the sets:
- GPU Kineto traces (any kernel): HolisticTraceAnalysis's. What runs on a GPU stream (kernels, memcpy, memset,
  stream synchronisations) is classed by name: `nccl...Kernel` communicates; `Memcpy...`, `Memset...`, `dma...`
  and what HTA counts as neither compute nor communication (a name holding `Memcpy` or `Sync`) is memory; the
  rest computes. The span is the first GPU event's start to the last one's end. Phases come from the GPU
  annotations (`gpu_user_annotation`).
- CPU Kineto traces (gloo, no kernels): every thread's operators and annotations, each instant given to the
  innermost event then running on its thread; an event communicates if its name is a communication's
  (COMMUNICATION), else it computes. The span is the first to the last event. ProfilerStep#N annotations are
  the iterations and are no activity.
- Kineto spans (SPANS): "trace" takes every event of the trace; "hta" takes what HolisticTraceAnalysis's reader
  keeps by default: times rounded to whole microseconds where the trace's are fractional, and only the GPU
  events launched (their `cuda_runtime`/`cuda_driver` call, by correlation id) before the start of the trace's
  last profiler step (the latest event off the GPU streams whose name holds `ProfilerStep`), CPU events and
  annotations that start before it, and the iterations but the last. A trace naming fewer than two steps is
  taken whole, as HTA does.
- trace.h5: the measured iterations' rows. Compute: the forward, backward and optimizer rows without the
  tensor-parallel all-reduces inside them; communication: every communication row (TP all-reduces, P2P sends
  and receives, gradient buckets from launch to completion). The span is the first row's start to the last
  row's end.
"""
from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.intervals import EMPTY, Spans, spans
from analysis.kineto import (
    LAUNCH_CATEGORIES,
    STREAM_CATEGORIES,
    TRACE_SUFFIXES,
    Events,
    KinetoTrace,
    is_kineto_path,
    read_kineto,
    trace_files,
)
from harness.common.errors import UserError
from harness.common.progress import Progress

# A communication's name: a library's prefix, or the name of a collective, send, receive or barrier (a bare
# "broadcast" is not one: aten::broadcast_tensors computes).
COMMUNICATION = re.compile(r"nccl|gloo:|c10d::|^mpi4py:|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|"
                           r"all_?to_?all|\bi?send\b|\bi?recv\b|barrier", re.IGNORECASE)
LIBRARY = r"(?:c10d::|gloo:|nccl|mpi4py:|distsim:|record_param_comms)"
ITERATION = re.compile(r"^ProfilerStep#\d+$")
# Phases by name, first match wins; communications that are no collective's (P2P) are pipeline waits.
PHASES = (("tensor-parallel", re.compile(r"allreduce\.tp|tensor.?parallel", re.IGNORECASE)),
          ("context-parallel", re.compile(r"distsim:cp|context.?parallel", re.IGNORECASE)),
          ("expert-parallel", re.compile(r"distsim:ep|expert.?parallel|all_?to_?all", re.IGNORECASE)),
          ("pipeline", re.compile(LIBRARY + r".*(?:send|recv)", re.IGNORECASE)),
          ("dp-sync", re.compile(LIBRARY + r".*(?:all_?reduce|reduce_?scatter|all_?gather|broadcast)",
                                 re.IGNORECASE)),
          ("optimizer", re.compile(r"optimizer|zero\.bucket|zero_grad", re.IGNORECASE)),
          ("backward", re.compile(r"backward|autograd::engine", re.IGNORECASE)),
          ("forward", re.compile(r"forward", re.IGNORECASE)))
PHASE_NAMES = ("forward", "backward", "optimizer", "dp-sync", "tensor-parallel", "context-parallel",
               "expert-parallel", "pipeline")
COLLECTIVE_LAUNCH = re.compile(r"^((?:c10d::|mpi4py:)\w+?)_?$")  # c10d::allreduce_, ..., mpi4py:allreduce
NCCL_COLLECTIVE = re.compile(r"^nccl(?:Dev)?Kernel_(AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|AllToAll)",
                             re.IGNORECASE)
P2P_OPS = ("send", "recv", "recv_any_source", "barrier")
# HolisticTraceAnalysis's classes of what runs on a GPU stream, by name from its start (case-sensitive)
NCCL_KERNEL = re.compile(r"nccl.*Kernel")
MEMORY_KERNEL = re.compile(r"Memcpy|Memset|dma")
NOT_COMPUTE_KERNEL = re.compile(r".*Memcpy|Memset|.*Sync")  # neither NCCL nor memory, yet no compute either
COMPUTE, COMMUNICATION_CLASS, MEMORY_CLASS = 0, 1, 2
STEP_MARK = "ProfilerStep"
SPANS = ("trace", "hta")  # the whole trace, or HolisticTraceAnalysis's (docs/runs.md)
SWEEP_BLOCK = 1 << 16


@dataclass
class Arrival:
    """A rank's arrival at one collective: `key` names the collective instance the same way on every rank."""

    key: tuple
    start_s: float
    label: str = ""  # the collective as a reader names it (the key's parts otherwise)


@dataclass
class RankActivity:
    rank: int
    span: tuple[float, float]
    compute: Spans
    communication: Spans
    memory: Spans = EMPTY
    phases: dict[str, Spans] = field(default_factory=dict)
    arrivals: list[Arrival] = field(default_factory=list)


@dataclass
class RunActivity:
    """Every rank of one run, with what the run says of itself."""

    source: Path
    kind: str  # "trace.h5", "kineto-gpu" or "kineto-cpu"
    ranks: dict[int, RankActivity]
    iteration_s: np.ndarray  # the measured iterations' times
    model: str | None = None  # None where the trace does not say (Kineto)
    backend: str | None = None
    world_size: int = 0
    global_batch: int | None = None  # samples per iteration, all replicas together
    replica_batch: int | None = None  # samples per iteration of one data-parallel replica
    model_config: dict[str, Any] = field(default_factory=dict)  # what makes two runs the same model
    spec: dict[str, Any] = field(default_factory=dict)  # trace.h5: the run's whole spec
    notes: list[str] = field(default_factory=list)
    span: str = "trace"  # one of SPANS: which part of a Kineto trace was taken

    @property
    def start(self) -> float:
        return min(r.span[0] for r in self.ranks.values())

    @property
    def end(self) -> float:
        return max(r.span[1] for r in self.ranks.values())


# ---- Kineto --------------------------------------------------------------------------------------------------
def innermost(start: np.ndarray, end: np.ndarray, label: np.ndarray, labels: int) -> list[Spans]:
    """On one thread, whose events nest: for each label 0..labels-1, the time when the innermost running event
    has that label. An event that outlasts the one it started in is cut at that one's end."""
    order = np.lexsort((-end, start))
    parts = [(array("d"), array("d")) for _ in range(labels)]  # 8 bytes a bound, not a Python float's 32
    stack: list[tuple[float, int]] = []
    now = 0.0

    def emit(code: int, a: float, b: float) -> None:
        if b > a:
            parts[code][0].append(a)
            parts[code][1].append(b)
    for block in range(0, len(order), SWEEP_BLOCK):  # Python numbers for a block at a time, not all at once
        chosen = order[block:block + SWEEP_BLOCK]
        for s, e, c in zip(start[chosen].tolist(), end[chosen].tolist(), label[chosen].tolist()):
            while stack and stack[-1][0] <= s:
                top_end, code = stack.pop()
                emit(code, now, top_end)
                now = top_end
            if stack:
                emit(stack[-1][1], now, s)
                e = min(e, stack[-1][0])
            now = s
            stack.append((e, c))
    while stack:
        top_end, code = stack.pop()
        emit(code, now, top_end)
        now = top_end
    return [spans(np.frombuffer(a, dtype=np.float64), np.frombuffer(b, dtype=np.float64)) for a, b in parts]


def _phase_of(name: str) -> str | None:
    return next((phase for phase, pattern in PHASES if pattern.search(name)), None)


def _phases(events, mask: np.ndarray) -> dict[str, Spans]:
    names = events.name[mask]
    start, end = events.start_s[mask], events.end_s[mask]
    phase_of = np.array([_phase_of(n) or "" for n in events.names], dtype=object)
    out = {}
    for phase in PHASE_NAMES:
        keep = phase_of[names] == phase
        if keep.any():
            out[phase] = spans(start[keep], end[keep])
    return out


def _arrivals(events, mask: np.ndarray, pattern: re.Pattern) -> list[Arrival]:
    """The collective launches among the masked events, keyed (operation, ordinal on this rank)."""
    seen: dict[str, int] = {}
    out = []
    idx = np.flatnonzero(mask)
    for i in idx[np.argsort(events.start_s[idx], kind="stable")]:
        match = pattern.match(events.names[events.name[i]])
        if not match or match.group(1).lower().rsplit(":", 1)[-1] in P2P_OPS:
            continue
        op = match.group(1).lower()  # with its library: torch's and MPI's all-reduces are different collectives
        ordinal = seen.get(op, 0)
        seen[op] = ordinal + 1
        out.append(Arrival((op, ordinal), float(events.start_s[i]), f"{op} #{ordinal}"))
    return out


def kernel_class(name: str) -> int:
    """HolisticTraceAnalysis's class of a GPU stream's event: COMMUNICATION_CLASS, MEMORY_CLASS (memory, and what
    it counts as neither compute nor communication) or COMPUTE."""
    if NCCL_KERNEL.match(name):
        return COMMUNICATION_CLASS
    if MEMORY_KERNEL.match(name) or NOT_COMPUTE_KERNEL.match(name):
        return MEMORY_CLASS
    return COMPUTE


def last_step_start(ev: Events) -> float | None:
    """Where HolisticTraceAnalysis's reader cuts a trace: the latest start of an event off the GPU streams whose
    name holds "ProfilerStep"; None where fewer than two step names occur (it then keeps the whole trace)."""
    marked = ~ev.mask(category=STREAM_CATEGORIES) & ev.mask(name=lambda n: STEP_MARK in n)
    if np.unique(ev.name[marked]).size < 2:
        return None
    return float(ev.start_s[marked].max())


def launched_before(ev: Events, cutoff: float) -> np.ndarray:
    """The GPU stream events whose launch (the event off the streams of the same correlation id) started before
    `cutoff`; one without a correlation id counts by its own start."""
    on_stream = ev.mask(category=STREAM_CATEGORIES)
    correlated = on_stream & (ev.correlation >= 0)
    launches = ev.mask(category=LAUNCH_CATEGORIES) & (ev.correlation >= 0) & (ev.start_s < cutoff)
    return (correlated & np.isin(ev.correlation, ev.correlation[launches])) | (
        on_stream & ~correlated & (ev.start_s < cutoff))


def kineto_rank(trace: KinetoTrace, span: str = "trace") -> tuple[RankActivity, np.ndarray]:
    """One rank's activity from its Kineto trace, and the durations of its ProfilerStep iterations; `span` one
    of SPANS (module docstring)."""
    ev = trace.events
    step_mask = ev.mask(category="user_annotation", name=ITERATION.match)
    order = np.argsort(ev.start_s[step_mask], kind="stable")
    steps = (ev.end_s[step_mask] - ev.start_s[step_mask])[order]
    cutoff = last_step_start(ev) if span == "hta" else None
    before = np.ones(len(ev), dtype=bool) if cutoff is None else ev.start_s < cutoff
    if cutoff is not None:
        steps = steps[:-1]
    if trace.has_gpu:
        gpu = ev.mask(category=STREAM_CATEGORIES)
        if cutoff is not None:
            gpu &= launched_before(ev, cutoff)
            if not gpu.any():
                raise UserError(f"{trace.path}: rank {trace.rank} launched nothing on the GPU before its last "
                                "profiler step, which --span hta leaves out; give --span trace")
        classes = np.array([kernel_class(n) for n in ev.names], dtype=np.int8)[ev.name]

        def of(keep: np.ndarray) -> Spans:
            return spans(ev.start_s[keep], ev.end_s[keep])
        comm_kernel = gpu & (classes == COMMUNICATION_CLASS)
        compute, comm, memory = of(gpu & (classes == COMPUTE)), of(comm_kernel), of(gpu & (classes == MEMORY_CLASS))
        rank_span = (float(ev.start_s[gpu].min()), float(ev.end_s[gpu].max()))
        phases = _phases(ev, ev.mask(category="gpu_user_annotation") & before)
        for phase, under in _phases(ev, comm_kernel).items():
            phases[phase] = phases[phase] | under if phase in phases else under
        arrivals = _arrivals(ev, comm_kernel, NCCL_COLLECTIVE)
        return RankActivity(trace.rank, rank_span, compute, comm, memory, phases, arrivals), steps
    active = ev.mask(category=("cpu_op", "user_annotation", "python_function")) & ~step_mask & before
    if not active.any():
        raise UserError(f"{trace.path}: the trace holds no operators"
                        + (" before its last profiler step" if cutoff is not None else "") + ", only iteration marks")
    is_comm = np.array([bool(COMMUNICATION.search(n)) for n in ev.names], dtype=bool)
    label = is_comm[ev.name].astype(np.int64)  # 0 computes, 1 communicates
    compute_parts, comm_parts = [], []
    for thread in np.unique(ev.thread[active]):
        on = active & (ev.thread == thread)
        compute_part, comm_part = innermost(ev.start_s[on], ev.end_s[on], label[on], 2)
        compute_parts.append(compute_part)
        comm_parts.append(comm_part)
    compute = _union(compute_parts)
    comm = _union(comm_parts)
    span = (float(ev.start_s[active].min()), float(ev.end_s[active].max()))
    arrivals = _arrivals(ev, active, COLLECTIVE_LAUNCH)
    return RankActivity(trace.rank, span, compute, comm, EMPTY, _phases(ev, active), arrivals), steps


def _shifted(activity: RankActivity, seconds: float) -> RankActivity:
    """The same activity `seconds` later."""
    if seconds == 0:
        return activity

    def move(s: Spans) -> Spans:
        return Spans(s.start + seconds, s.end + seconds)
    return RankActivity(activity.rank, (activity.span[0] + seconds, activity.span[1] + seconds),
                        move(activity.compute), move(activity.communication), move(activity.memory),
                        {k: move(v) for k, v in activity.phases.items()},
                        [Arrival(a.key, a.start_s + seconds, a.label) for a in activity.arrivals])


def _union(parts: Sequence[Spans]) -> Spans:
    if not parts:
        return EMPTY
    return spans(np.concatenate([p.start for p in parts]), np.concatenate([p.end for p in parts]))


def from_kineto(paths: Sequence[Path], source: Path, span: str = "trace") -> RunActivity:
    """One run from its ranks' Kineto traces, over `span` (SPANS); UserError for two traces of one rank or traces
    of mixed runs."""
    ranks: dict[int, RankActivity] = {}
    where: dict[int, Path] = {}
    steps: dict[int, np.ndarray] = {}
    bases: dict[int, int] = {}
    backends, worlds, gpu = set(), set(), set()
    progress = Progress("reading profiler traces", len(paths), enabled=len(paths) > 1, unit="trace")
    for path in paths:
        trace = read_kineto(path, whole_microseconds=span == "hta")
        if trace.rank in ranks:
            raise UserError(f"{path} and {where[trace.rank]} both claim rank {trace.rank} (from their "
                            f"{trace.rank_source}); give one trace per rank")
        ranks[trace.rank], steps[trace.rank] = kineto_rank(trace, span)
        bases[trace.rank] = int(trace.metadata.get("baseTimeNanoseconds") or 0)
        where[trace.rank] = path
        backends.add(trace.backend)
        worlds.add(trace.world_size)
        gpu.add(trace.has_gpu)
        progress.advance()
    progress.close()
    if len(gpu) > 1:
        raise UserError(f"{source}: some traces hold GPU kernels and some do not; give the traces of one run")
    # each trace's times count from its own baseTimeNanoseconds: put every rank on the earliest one's
    first = min(bases.values())
    ranks = {rank: _shifted(activity, (bases[rank] - first) / 1e9) for rank, activity in ranks.items()}
    notes = []
    world = max((w for w in worlds if w), default=len(ranks))
    if len(ranks) < world:
        notes.append(f"{len(ranks)} of {world} ranks' traces given; the others are left out")
    counts = {r: len(s) for r, s in steps.items()}
    if not any(counts.values()):
        raise UserError(f"{source}: the traces mark no iteration (no ProfilerStep#N); record them with "
                        "torch.profiler.profile(schedule=...) and call prof.step() once per iteration")
    used = min(c for c in counts.values())
    if len(set(counts.values())) > 1:
        notes.append(f"the ranks' traces hold {min(counts.values())}-{max(counts.values())} iterations; "
                     f"the first {used} are compared")
    # an iteration lasts as long as its slowest rank took for it
    iteration_s = np.max(np.stack([s[:used] for s in steps.values()]), axis=0) if used else np.zeros(0)
    backend = next(iter(backends)) if len(backends) == 1 else None
    return RunActivity(source=source, kind="kineto-gpu" if gpu.pop() else "kineto-cpu",
                       ranks=dict(sorted(ranks.items())), iteration_s=iteration_s, backend=backend,
                       world_size=world, notes=notes, span=span)


# ---- trace.h5 --------------------------------------------------------------------------------------------------
def from_trace(trace) -> RunActivity:
    """One run from the measured iterations of a trace.h5 (analysis.trace_reader.Trace)."""
    measured = trace.measured()
    if not len(measured):
        raise UserError(f"{trace.path}: every iteration is warm-up; nothing was measured")
    ranks = {}
    for rank, device in trace.devices.items():
        cols = device.select(iteration=list(measured.tolist()))
        if not len(cols["start_s"]):
            raise UserError(f"{trace.path}: rank {rank} recorded no interval in the measured iterations")
        kind, phase, start, end = cols["kind"], cols["phase"], cols["start_s"], cols["end_s"]

        def of(keep: np.ndarray, start: np.ndarray = start, end: np.ndarray = end) -> Spans:
            return spans(start[keep], end[keep])
        tp = of(phase == "tp")
        context = of(phase == "cp")  # context parallelism's exchanges inside a step (the part left unhidden)
        experts = of((phase == "ep") & (kind == "alltoall"))  # expert parallelism's all-to-alls inside a step
        compute = of(np.isin(kind, ["compute", "optimizer"])) - tp - context - experts
        comm = of(np.isin(kind, ["allreduce", "p2p", "allgather", "reducescatter", "alltoall"]))
        compute = compute - of(phase == "zero")  # FSDP's collectives inside the steps (zero > 0)
        # a zero-bubble schedule's weight-gradient steps (W) are backward too
        phases = {"forward": of(phase == "F"), "backward": of(np.isin(phase, ["B", "W"])),
                  "optimizer": of(phase == "opt"),
                  "dp-sync": of(np.isin(phase, ["dp", "zero", "tie"]) | ((phase == "ep") & (kind == "allreduce"))),
                  "tensor-parallel": tp,
                  "context-parallel": context, "expert-parallel": experts,
                  "pipeline": of(phase == "recv")}
        phases = {k: v for k, v in phases.items() if len(v)}
        ranks[rank] = RankActivity(rank, (float(start.min()), float(end.max())), compute, comm, EMPTY, phases,
                                   _trace_arrivals(device, cols))
    spec = trace.spec
    batch = spec.get("batch", {})
    dp = int(spec.get("strategy", {}).get("dp", 1))
    global_batch = int(batch.get("global", 0)) or None
    env = trace.environment
    return RunActivity(source=trace.path, kind="trace.h5", ranks=ranks, iteration_s=trace.iteration_times(),
                       model=str(spec.get("model", {}).get("name", "")) or None,
                       backend=str(env.get("dp_backend") or env.get("backend") or "") or None,
                       world_size=trace.world_size, global_batch=global_batch,
                       replica_batch=global_batch // dp if global_batch else None,
                       model_config=dict(spec.get("model", {})), spec=spec)


def _trace_arrivals(device, cols: dict[str, np.ndarray]) -> list[Arrival]:
    """The collectives a device joined: its gradient buckets (one per stage, bucket and iteration, keyed by its
    tensor-parallel coordinate, which with the stage names its data-parallel group) and its tensor-parallel
    all-reduces (keyed by order within each step, with its data-parallel coordinate)."""
    out = []
    order: dict[tuple, int] = {}
    for i in np.argsort(cols["start_s"], kind="stable"):
        phase = cols["phase"][i]
        iteration, vs, micro = int(cols["iteration"][i]), int(cols["virtual_stage"][i]), int(cols["micro"][i])
        name = str(cols["name"][i])
        if phase == "dp":
            key = ("dp", name, iteration, vs, device.tp)
            label = f"{name} iteration {iteration} stage {vs} tp {device.tp}"
        elif phase == "tp":
            step = (iteration, vs, micro, name)
            ordinal = order[step] = order.get(step, -1) + 1
            key = ("tp", *step, ordinal, device.dp, device.cp)
            label = f"{name} #{ordinal} iteration {iteration} stage {vs} micro {micro} dp {device.dp}"
        else:
            continue
        out.append(Arrival(key, float(cols["start_s"][i]), label))
    return out


# ---- runs ------------------------------------------------------------------------------------------------------
def load_run(path: str | Path, span: str = "trace") -> RunActivity:
    """A run given as a trace.h5 (or the RUNDIR holding it), a Kineto trace, or a folder of Kineto traces; `span`
    (SPANS) says which part of a Kineto trace to take; a trace.h5 is taken whole."""
    path = Path(path)
    if span not in SPANS:
        raise UserError(f"span {span!r}: give one of {', '.join(SPANS)}")
    if not path.exists():
        raise UserError(f"{path}: no such file or folder; give a trace.h5 of `harness train`, a RUNDIR, or "
                        "PyTorch profiler traces (a folder of them, or .json/.json.gz files)")
    if is_kineto_path(path):
        files = trace_files(path) if path.is_dir() else [path]
        return from_kineto(files, path, span)
    if path.is_dir() and not (path / "trace.h5").exists():
        raise UserError(f"{path}: the folder holds neither a trace.h5 nor .json/.json.gz profiler traces")
    if span != "trace":
        raise UserError(f"{path}: --span {span} is HolisticTraceAnalysis's reading of PyTorch profiler traces; a "
                        "trace.h5 holds only the measured iterations and is taken whole: leave --span out")
    from analysis.trace_reader import read_trace

    return from_trace(read_trace(path))


def load_runs(paths: Sequence[str | Path], span: str = "trace") -> list[RunActivity]:
    """Runs from the command line: trace.h5 files and RUNDIRs are a run each; Kineto files given one by one
    are the ranks of one run, Kineto folders a run each."""
    runs, loose = [], []
    for path in map(Path, paths):
        if path.is_file() and path.name.endswith(TRACE_SUFFIXES):
            loose.append(path)
        else:
            runs.append(load_run(path, span))
    if loose:
        runs.append(from_kineto(loose, loose[0].parent if len(loose) > 1 else loose[0], span))
    return runs
