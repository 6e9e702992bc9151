"""`run_training`: set up torch.distributed over MPI, run K traced iterations, write and merge the traces.

Collective over the MPI communicator given (every rank calls it). Every rank returns a TrainResult; rank 0's
holds the merged trace and the summary.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.common.errors import UserError, WriteError
from harness.models.user import factory_layers
from harness.plan.spec import JobSpec
from harness.runtime.host_memory import prepare_host_memory
from harness.runtime.mpi_errors import (
    AgreedError,
    abort_on_failure,
    factory_packages,
    raise_if_any,
    yielding_barrier,
)
from launcher.topology import mpi_library_version

DEFAULT_ITERATIONS = 5
DEFAULT_WARMUP = 2
DP_BACKENDS = ("torch", "mpi4py")


@dataclass
class TrainResult:
    """What one rank knows after the run; `trace_path`, `iterations_s` and `losses` are complete on rank 0."""

    rank: int
    rundir: Path
    rank_file: Path
    trace_path: Path | None = None
    iteration_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # end - start of every iteration
    losses: np.ndarray = field(default_factory=lambda: np.zeros(0))  # mean loss of every iteration
    warmup: int = 0
    local_losses: list[float] = field(default_factory=list)
    backend: str = ""
    dp_backend: str = ""  # what all-reduces the gradient buckets: the torch backend's name, or mpi4py
    device: str = ""
    # CPU runs: notes on where the ranks ran (free to share cores that binding would have given each; more torch
    # threads than CPUs)
    binding_note: str | None = None

    @property
    def measured_s(self) -> np.ndarray:
        return self.iteration_s[self.warmup:]


MAX_ITERATIONS = 100_000  # a run measures a few to a few hundred; more is a typo that would run for days


def check_run(spec: JobSpec, world_size: int, iterations: int, warmup: int, dp_backend: str = "torch",
              layer_times: bool = False) -> None:
    """Raise UserError when this run cannot start (same verdict on every rank); the ranks it needs last, so that
    what is wrong with the arguments is said before a user asks for more ranks."""
    s = spec.strategy
    if layer_times and s.recompute != "none":
        raise UserError(f"--layer-times cannot time layers under recompute = {s.recompute!r} (torch.utils.checkpoint "
                        "runs their forward again inside the backward); drop --layer-times or set recompute = 'none'")
    if s.split_backward:
        from harness.models import split_backward

        split_backward()  # a torch without it stops here, on every rank alike
    if layer_times and s.split_backward:
        raise UserError(f"--layer-times cannot time layers under schedule = {s.schedule!r} (its backward is split "
                        "into input and weight gradients, each over the whole stage); drop --layer-times or use "
                        "schedule = '1f1b'")
    if dp_backend not in DP_BACKENDS:
        raise UserError(f"--backend must be one of {', '.join(DP_BACKENDS)}, got {dp_backend!r}")
    if dp_backend == "mpi4py" and s.zero:
        raise UserError(f"--backend mpi4py all-reduces data-parallel buckets; zero = {s.zero} runs FSDP2, whose "
                        "collectives go through torch.distributed: use --backend torch or zero = 0")
    if dp_backend == "mpi4py":
        if spec.model.dtype == "bfloat16":
            raise UserError("--backend mpi4py cannot all-reduce bfloat16 (numpy has no such type); use --backend "
                            "torch or dtype float32")
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise UserError("--backend mpi4py needs an MPI with MPI_THREAD_MULTIPLE (a watcher thread tests the "
                            "all-reduces while the main thread computes); this MPI gives less: use --backend torch "
                            "or an MPI built with thread support")
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise UserError(f"--iterations must be from 1 to {MAX_ITERATIONS:,}, got {iterations:,}")
    if not 0 <= warmup < iterations:
        raise UserError(f"--warmup must be between 0 and --iterations - 1 = {iterations - 1}, got {warmup}")
    if spec.optimizer.master_weights:
        raise UserError("harness train trains in the model's dtype and keeps no fp32 master weights; "
                        "[optimizer] master_weights = true is for the memory model only (set it to false to run)")
    if spec.strategy.grad_accumulation_fusion:
        raise UserError("harness train accumulates a step's gradients by adds, as PyTorch does; [strategy] "
                        "grad_accumulation_fusion = true is Megatron-LM's fused weight-gradient accumulation (APEX), "
                        "for estimates only (set it to false to run)")
    if world_size != s.world:
        raise UserError(f"the job needs {s.layout} = {s.world} ranks but runs on "
                        f"{world_size}; start it with mpirun -n {s.world} (the [cluster] section is the target "
                        "machine, the MPI world is what runs)")


def _environment(topology, device, backend: str, dp_backend: str, threads: int, start: float,
                 end: float) -> dict[str, Any]:
    import h5py
    import mpi4py
    import torch

    if device.type == "cuda":
        device_name = f"cuda:{torch.cuda.get_device_name(device)}"
    else:
        device_name = "cpu"
    return {
        "hosts": topology.hosts(), "world_size": topology.size, "ranks_per_node": topology.ranks_per_node,
        "device": device_name, "backend": f"torch-{backend}", "dp_backend": dp_backend,
        "torch_version": torch.__version__,
        "mpi4py_version": mpi4py.__version__, "h5py_version": h5py.__version__, "numpy_version": np.__version__,
        "mpi_library": mpi_library_version(),
        "python_version": platform.python_version(), "start_time": start, "end_time": end,
        "topology_source": topology.source, "launcher": topology.launcher, "torch_threads": threads,
        **topology.cpu_environment(),
    }


def _make_groups(plan, p2p_channels: bool):
    """Every rank creates every group in the same order (torch.distributed requires it)."""
    import torch.distributed as dist

    s = plan.spec.strategy
    rank = dist.get_rank()

    def mine(groups_of_ranks):
        """Create every group (collective) and return the one holding this rank."""
        own = None
        for ranks in groups_of_ranks:
            group = dist.new_group(ranks)
            if rank in ranks:
                own = group
        return own

    replicas = plan.replicas()  # (dp, cp) indexes
    tp_group = mine([plan.rank_of(d, t, p, c) for t in range(s.tp)] for p in range(s.pp) for d, c in replicas) \
        if s.tp > 1 else None
    # the gradients' group: the data- and context-parallel ranks of one stage and tp index (Megatron-Core's)
    dp_group = mine([plan.rank_of(d, t, p, c) for d, c in replicas] for p in range(s.pp) for t in range(s.tp)) \
        if s.gradient_replicas > 1 else None
    cp_group = mine([plan.rank_of(d, t, p, c) for c in range(s.cp)] for p in range(s.pp) for d in range(s.dp)
                    for t in range(s.tp)) if s.cp > 1 else None
    # expert parallelism: ep consecutive dp ranks share the experts; the dp / ep ranks at one place in them hold
    # the same experts
    blocks = s.dp // s.ep
    ep_group = mine([plan.rank_of(g * s.ep + e, t, p, c) for e in range(s.ep)] for p in range(s.pp)
                    for g in range(blocks) for t in range(s.tp) for c in range(s.cp)) if s.ep > 1 else None
    expert_dp_group = mine([plan.rank_of(g * s.ep + e, t, p, c) for g in range(blocks)] for p in range(s.pp)
                           for e in range(s.ep) for t in range(s.tp) for c in range(s.cp)) \
        if blocks > 1 and plan.spec.model.moe else None
    p2p_groups: dict = {}
    if p2p_channels and s.pp > 1:
        from harness.train.p2p import ACT, GRAD

        # One group per (kind, sender, receiver): activations go to the next device, gradients come back.
        for d, c in replicas:
            for t in range(s.tp):
                for p in range(s.pp):
                    a, b = plan.rank_of(d, t, p, c), plan.rank_of(d, t, (p + 1) % s.pp, c)
                    for key in ((ACT, a, b), (GRAD, b, a)):
                        if key not in p2p_groups:
                            p2p_groups[key] = dist.new_group([a, b])
        p2p_groups = {k: g for k, g in p2p_groups.items() if rank in k[1:]}
    # tie_embeddings, pp > 1: the first and the last stage of each (dp, tp) coordinate (Megatron's embedding group)
    tie_group = mine([plan.rank_of(d, t, 0, c), plan.rank_of(d, t, s.pp - 1, c)] for d, c in replicas
                     for t in range(s.tp)) if plan.stages[0].tie else None
    return tp_group, dp_group, p2p_groups, tie_group, cp_group, ep_group, expert_dp_group


@dataclass
class _Run:
    """One rank's run as set-up makes it: what the iterations and the trace need, and what `_running` closes."""

    rank: int
    topology: Any
    engine: Any = None
    dp_comm: Any = None  # --backend mpi4py: this rank's data-parallel group as an MPI communicator
    device: Any = None
    host_memory: Any = None
    backend: str = ""
    plan: Any = None
    recorder: Any = None
    start_time: float = 0.0
    first_sync: Any = None
    phase: str = "set-up"  # what the rank is doing: a failure's message names it


@contextmanager
def _running(comm, threads: int) -> Iterator[_Run]:
    """The run's process settings (torch threads, a short switch interval so that watcher threads note
    completions promptly) and its one teardown. On success the engine's watchers are joined, the MPI
    communicator freed and the process group destroyed. On an exception it leaves at once: `python -m mpi4py`
    turns the exception into MPI_Abort, which ends every rank, and tearing down the process group could block
    on peers that are stuck or gone."""
    import torch

    from harness.models.tp import set_collective_hook
    from harness.runtime.distributed import destroy_process_group
    from harness.runtime.inflight import SWITCH_INTERVAL_S
    from launcher.topology import discover

    run = _Run(rank=comm.Get_rank(), topology=discover(comm))
    old_threads, old_switch = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(threads)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    failed = True
    try:
        yield run
        failed = False
    finally:
        set_collective_hook(None)
        if run.engine is not None:
            run.engine.close(join=not failed)
        if not failed:
            if run.dp_comm is not None:
                run.dp_comm.Free()
            destroy_process_group()
        torch.set_num_threads(old_threads)
        sys.setswitchinterval(old_switch)


def _make_folders(comm, rundir: Path, torch_profiler: str | Path | None) -> None:
    """Rank 0 creates the run folder (and the profiler's); every rank stops alike if it cannot."""
    problem = None
    if comm.Get_rank() == 0:
        for folder, what in ((rundir, "run folder"), (torch_profiler, "profiler trace folder")):
            if folder is None or problem:
                continue
            try:
                Path(folder).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                problem = f"cannot create the {what} {folder}: {exc.strerror}"
    problem = comm.bcast(problem, root=0)
    if problem:
        raise UserError(problem)


def _set_up(run: _Run, spec: JobSpec, comm, *, seed: int, lr: float, device: str | None, timeout_s: float | None,
            clock_samples: int, p2p_channels: bool | None, layer_times: bool, dp_backend: str,
            annotate: bool) -> None:
    """torch.distributed over MPI, the process groups, this rank's layers and the engine over them, then the
    first clock sync (into `run`)."""
    import torch

    from harness.plan.events import build_plan
    from harness.runtime.distributed import init_process_group, pick_device
    from harness.train.clock import sync_clocks
    from harness.train.engine import PipelineEngine
    from harness.train.model import build_layers, dropout_seed
    from harness.train.recorder import Recorder

    run.device = dev = pick_device(run.topology, device or spec.profile.device, comm)
    run.host_memory = prepare_host_memory(dev.type)
    timeout = timeout_s or spec.profile.timeout_s
    run.start_time = time.time()
    run.backend = init_process_group(comm, run.topology, dev, timeout)
    run.plan = plan = build_plan(spec, factory_layers(spec))
    s = spec.strategy
    dp_i, tp_i, pp_i = plan.coords(run.rank)
    channels = run.backend == "nccl" if p2p_channels is None else p2p_channels
    tp_group, dp_group, p2p_groups, tie_group, cp_group, ep_group, expert_dp_group = _make_groups(plan, channels)
    cp_i = plan.cp_index(run.rank)
    # mpi4py: the same gradient groups as MPI communicators (every rank splits, collectively)
    run.dp_comm = comm.Split(color=tp_i * s.pp + pp_i, key=dp_i * s.cp + cp_i) \
        if dp_backend == "mpi4py" and s.gradient_replicas > 1 else None
    positions = [p for c in range(s.chunks) for p in plan.stages[c * s.pp + pp_i].layers]
    modules = build_layers(spec, plan.layers, positions, seed, tp_i, tp_group, dev, cp_index=cp_i,
                           cp_group=cp_group, ep_index=dp_i % s.ep, ep_group=ep_group)
    torch.manual_seed(dropout_seed(seed, pp_i))  # what dropout draws from (the layers' weights have their own)
    run.recorder = Recorder()
    run.engine = PipelineEngine(spec=spec, plan=plan, rank=run.rank, device=dev, modules=modules,
                                tp_group=tp_group, dp_group=dp_group, p2p_groups=p2p_groups, tie_group=tie_group,
                                expert_dp_group=expert_dp_group, lr=lr, timeout_s=timeout,
                                recorder=run.recorder, layer_times=layer_times, dp_comm=run.dp_comm,
                                annotate=annotate)
    run.first_sync = sync_clocks(comm, clock_samples)


def memory_iteration(warmup: int) -> int:
    """The iteration whose peak a run reports: the last warm-up one where two or more warm up (the optimizer's
    states exist from the second iteration on), which alone runs the saved-tensor count, so the measured
    iterations carry none of its cost; else the first measured one, the count running in every measured
    iteration."""
    return warmup - 1 if warmup >= 2 else warmup


def _iterate(run: _Run, spec: JobSpec, comm, iterations: int, warmup: int, *, seed: int, fresh_data: bool,
             barrier: bool, torch_profiler: str | Path | None, dp_backend: str) -> tuple[list, list, list]:
    """The training iterations: each one's start and end (ns, this rank's clock) and loss."""
    import torch

    from harness.train.model import make_tokens
    from harness.train.profiler_trace import start_profiler, write_profiler_trace

    engine, dev = run.engine, run.device
    metered = memory_iteration(warmup)
    starts, ends, losses = [], [], []
    fixed = make_tokens(spec, seed, 0)
    profiler = None
    for iteration in range(iterations):
        run.phase = f"iteration {iteration}"
        tokens = make_tokens(spec, seed, iteration) if fresh_data else fixed
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if iteration == warmup and torch_profiler is not None:
            profiler = start_profiler(dev)  # before the barrier: its start-up is no iteration's
        elif profiler is not None:
            profiler.step()  # one ProfilerStep#N per measured iteration, from before its barrier
        if barrier:
            yielding_barrier(comm)
        if iteration == metered:
            engine.reset_memory_peak()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
        engine.meter_activations = iteration >= metered if metered == warmup else iteration == metered
        starts.append(engine.now())
        losses.append(engine.run_iteration(iteration, tokens))
        ends.append(engine.now())
    run.phase = "writing the profiler's trace"
    if profiler is not None:
        write_profiler_trace(profiler, Path(torch_profiler) / f"rank-{run.rank}.json", run.recorder.rows, warmup,
                             mpi_buckets=dp_backend == "mpi4py")
    return starts, ends, losses


def _write_trace(run: _Run, spec: JobSpec, comm, rundir: Path, times: tuple[list, list, list], *,
                 iterations: int, warmup: int, seed: int, lr: float, fresh_data: bool, barrier: bool, threads: int,
                 clock_samples: int, layer_times: bool, dp_backend: str) -> TrainResult:
    """The last clock sync, this rank's trace file, then (rank 0) the merged trace.h5; every rank stops alike
    if any could not write."""
    import torch

    from harness.store.hdf5_schema import CUDA_PEAK_MEMORY_ATTR, MEMORY_PARTS_ATTR, PEAK_MEMORY_ATTR
    from harness.train.clock import Timebase, sync_clocks
    from harness.train.trace_writer import (
        columns_from_rows,
        layer_columns_from_rows,
        merge_traces,
        rank_file_name,
        write_rank_trace,
    )

    rank, dev, plan, engine, first_sync = run.rank, run.device, run.plan, run.engine, run.first_sync
    starts, ends, losses = times
    s = spec.strategy
    last_sync = sync_clocks(comm, clock_samples)
    end_time = time.time()
    timebase = Timebase(rank, first_sync.reference_ns, first_sync, last_sync)
    dp_i, tp_i, pp_i = plan.coords(rank)
    columns = columns_from_rows(run.recorder.rows, timebase.seconds)
    attrs = {"dp": dp_i, "tp": tp_i, "pp": pp_i, "cp": plan.cp_index(rank),
             "hostname": run.topology.hostnames[rank], "node": run.topology.node, "device": str(dev),
             "clock_offset_s": float(first_sync.applied_ns[rank]) / 1e9,
             "buckets_json": json.dumps(engine.bucket_info())}
    if not s.zero:  # FSDP2 frees and re-fills storages in place, which the meter cannot follow
        attrs |= {PEAK_MEMORY_ATTR: int(engine.memory.peak), MEMORY_PARTS_ATTR: json.dumps(engine.memory.at_peak)}
    if dev.type == "cuda":
        attrs[CUDA_PEAK_MEMORY_ATTR] = int(torch.cuda.max_memory_allocated(dev))
    its = {"start_s": timebase.seconds(np.array(starts, dtype=np.int64)),
           "end_s": timebase.seconds(np.array(ends, dtype=np.int64)),
           "loss": np.array(losses, dtype=np.float64)}
    layers = layer_columns_from_rows(run.recorder.layer_rows, timebase.seconds) if layer_times else None
    rank_path, write_error = None, None
    try:
        rank_path = write_rank_trace(rundir / rank_file_name(rank), rank=rank, columns=columns, attrs=attrs,
                                     iterations=its, layers=layers)
    except WriteError as exc:
        write_error = UserError(f"{exc}; the run's iterations were not saved: free space and run again")
    yielding_barrier(comm)
    raise_if_any(comm, write_error)  # every rank stops if any rank could not write its trace
    result = TrainResult(rank=rank, rundir=rundir, rank_file=rank_path, warmup=warmup, local_losses=losses,
                         backend=f"torch-{run.backend}", dp_backend=_dp_backend_name(dp_backend, run.backend),
                         device=str(dev),
                         binding_note=run.topology.cpu_notes(threads) if dev.type == "cpu" else None)
    env = dict(_environment(run.topology, dev, run.backend, result.dp_backend, threads, run.start_time, end_time),
               host_memory=run.host_memory)
    merge_error = None
    if rank == 0:
        loss_ranks = [plan.rank_of(d, 0, s.pp - 1, c) for d, c in plan.replicas()]
        clock = {
            "rank": np.arange(comm.Get_size(), dtype=np.int64),
            "offset_s": first_sync.applied_ns / 1e9, "measured_offset_s": first_sync.measured_ns / 1e9,
            "rtt_s": first_sync.rtt_ns / 1e9, "method": np.array(first_sync.method, dtype=object),
            "offset_end_s": last_sync.applied_ns / 1e9, "measured_offset_end_s": last_sync.measured_ns / 1e9,
            "rtt_end_s": last_sync.rtt_ns / 1e9,
        }
        root = {"spec_json": spec.to_json(), "layers_json": json.dumps([layer.to_dict() for layer in plan.layers]),
                "iterations": iterations, "warmup": warmup, "seed": seed, "lr": lr, "fresh_data": fresh_data,
                "barrier": barrier, "time_zero_unix": run.start_time, "micro_batches": spec.micro_batches}
        try:
            result.trace_path = merge_traces(rundir / "trace.h5",
                                             [rundir / rank_file_name(r) for r in range(comm.Get_size())],
                                             root_attrs=root, environment=env, clock=clock, warmup=warmup,
                                             loss_ranks=loss_ranks)
        except WriteError as exc:
            merge_error = UserError(f"{exc}; the run's trace.h5 was not written: free space and run again")
    raise_if_any(comm, merge_error)
    if rank == 0:
        from harness.store.hdf5_io import open_file, reading
        from harness.store.hdf5_schema import READ_VERSIONS, TRACE_KIND

        path = result.trace_path
        with open_file(path, TRACE_KIND, READ_VERSIONS, verify_all=False) as f, reading(path, TRACE_KIND):
            result.iteration_s = f["iterations/end_s"][()] - f["iterations/start_s"][()]
            result.losses = f["iterations/loss"][()]
    return result


def run_training(spec: JobSpec, comm, rundir: str | Path, iterations: int = DEFAULT_ITERATIONS,
                 warmup: int = DEFAULT_WARMUP, *, seed: int = 0, lr: float = 1e-3, fresh_data: bool = False,
                 barrier: bool = True, device: str | None = None, timeout_s: float | None = None, threads: int = 1,
                 clock_samples: int = 20, report: bool = False, p2p_channels: bool | None = None,
                 layer_times: bool = False, dp_backend: str = "torch",
                 torch_profiler: str | Path | None = None, abort_on_error: bool = False) -> TrainResult:
    """Train `iterations` iterations of `spec` on the ranks of `comm` and trace them into RUNDIR/trace.h5.

    dp x tp x cp x pp must equal comm's size. `barrier` starts every iteration on all ranks together (so each
    iteration is one timeline from a common start, as the simulator predicts it); `fresh_data` draws a new
    batch every iteration instead of training on one fixed batch. `report` prints the summary on rank 0.
    `p2p_channels` sends P2P over one process group per (kind, sender, receiver) in FIFO order instead of
    tagged messages on the world group (default: only with NCCL, which has no tags; True tests it on gloo).
    `layer_times` also traces every layer of every compute step (docs/train.md). `dp_backend` "mpi4py"
    all-reduces the gradient buckets through MPI instead of torch.distributed; `torch_profiler` (a folder)
    also records the measured iterations with torch.profiler into FOLDER/rank-<rank>.json. `abort_on_error` (the
    command's): a failure on this rank in set-up or an iteration ends every rank at once with one line
    (harness.runtime.mpi_errors.abort_on_failure) and never returns; else the exception propagates.
    """
    check_run(spec, comm.Get_size(), iterations, warmup, dp_backend, layer_times)
    rundir = Path(rundir)
    _make_folders(comm, rundir, torch_profiler)
    with _running(comm, threads) as run:
        try:
            _set_up(run, spec, comm, seed=seed, lr=lr, device=device, timeout_s=timeout_s,
                    clock_samples=clock_samples, p2p_channels=p2p_channels, layer_times=layer_times,
                    dp_backend=dp_backend, annotate=torch_profiler is not None)
            times = _iterate(run, spec, comm, iterations, warmup, seed=seed, fresh_data=fresh_data, barrier=barrier,
                             torch_profiler=torch_profiler, dp_backend=dp_backend)
        except AgreedError:  # every rank holds it: the front end ends MPI quietly
            raise
        except Exception as exc:  # a failure on this rank (a user's model that breaks on real tensors) ends all
            if abort_on_error:
                abort_on_failure(comm, "harness train", run.rank, run.topology.hostnames[run.rank], run.phase, exc,
                                 factory_packages(spec))
            raise
        result = _write_trace(run, spec, comm, rundir, times, iterations=iterations, warmup=warmup, seed=seed,
                              lr=lr, fresh_data=fresh_data, barrier=barrier, threads=threads,
                              clock_samples=clock_samples, layer_times=layer_times, dp_backend=dp_backend)
        if report and run.rank == 0:
            print(summary_text(spec, result, comm.Get_size()), flush=True)
        yielding_barrier(comm)
    return result


def _dp_backend_name(dp_backend: str, torch_backend: str) -> str:
    return "mpi4py" if dp_backend == "mpi4py" else f"torch-{torch_backend}"


def summary_text(spec: JobSpec, result: TrainResult, world: int) -> str:
    from harness.common.output import format_seconds, format_table

    s = spec.strategy
    measured = result.measured_s
    head = (f"{spec.model.name}: {s.dp} dp x {s.tp} tp{' (sp)' if s.sp else ''}"
            + (f" x {s.cp} cp" if s.cp > 1 else "") + f" x {s.pp} pp on {world} ranks ({result.device}, "
            f"{result.backend}, gradients through {result.dp_backend}), "
            f"{s.schedule}{f' x{s.chunks} chunks' if s.chunks > 1 else ''}, "
            f"{spec.micro_batches} micro-batches of {spec.batch.micro}")
    row = (len(result.iteration_s), result.warmup, format_seconds(float(np.median(measured))),
           format_seconds(float(measured.min())), format_seconds(float(measured.max())),
           f"{result.losses[0]:.4f}", f"{result.losses[-1]:.4f}")
    table = format_table(("iterations", "warm-up", "median", "min", "max", "loss first", "loss last"), [row])
    note = f"\nNOTE: {result.binding_note}" if result.binding_note else ""
    return f"{head}\n{table}\ntrace: {result.trace_path}{note}"
