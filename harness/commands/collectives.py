"""`python -m harness collectives`: collective operations timed over sizes, printed as nccl-tests prints them.

Run under mpirun or srun, best as `mpirun -n N python -m mpi4py -m harness collectives ...`. Definitions
(sizes, bandwidths, the check) in harness.plan.collectives; the file layout in docs/hdf5.md; the figures on this
machine in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

from harness.common.errors import UserError
from harness.common.output import HDF5_NAMES, check_outputs, named
from harness.plan.collectives import ELEMENT_BYTES, OPS, SPLIT_OPS, parse_size, round_size, sweep_sizes
from harness.runtime.mpi_errors import stop_on_error, yielding_barrier

NAME = "collectives"
HELP = "time collective operations over message sizes on the ranks of this MPI job, as nccl-tests does"
MAX_ITERS = 1_000_000  # timed runs a size: nccl-tests takes tens; a typo of 10^12 would allocate terabytes
BACKENDS = ("torch", "gloo", "nccl", "mpi", "ucc", "mpi4py")  # torch: nccl on a GPU, gloo on the CPU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", default=",".join(OPS), help=f"operations, comma-separated (default: {','.join(OPS)})")
    parser.add_argument("--backend", default="torch", help="torch (NCCL on a GPU, gloo on the CPU), one of torch's "
                        "backends by name (gloo, nccl, mpi, ucc), or mpi4py (default: torch)")
    parser.add_argument("-b", "--minbytes", default="8", help="smallest size in bytes, K/M/G allowed (default: 8)")
    parser.add_argument("-e", "--maxbytes", default="64M", help="largest size (default: 64M)")
    parser.add_argument("-f", "--stepfactor", default="2", help="factor between sizes (default: 2)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size (default: 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per size first (default: 5)")
    parser.add_argument("--dtype", default="float32", help=f"element type: {', '.join(ELEMENT_BYTES)} "
                        "(default: float32)")
    parser.add_argument("--group", default="all", help="the ranks that take part: all, intra (one node's) or inter "
                        "(one per node) (default: all)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where torch's buffers live (auto: the GPU of each local rank under NCCL)")
    parser.add_argument("-o", "--output", metavar="FILE.h5", type=named(HDF5_NAMES),
                        help="also write the results here (docs/hdf5.md)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    parser.add_argument("--quiet", action="store_true", help="no progress display")


class Options:
    """The validated command line: the same on every rank, so every rank finds the same mistakes."""

    def __init__(self, args: argparse.Namespace, world: int):
        if world < 2:
            raise UserError("a collective needs 2 or more ranks and this run has 1; start it under MPI, e.g. "
                            "mpirun -n 2 python -m mpi4py -m harness collectives")
        self.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise UserError(f"--ops: unknown operation(s) {', '.join(unknown) or '(none given)'}; known: "
                            f"{', '.join(OPS)}")
        if args.backend not in BACKENDS:
            raise UserError(f"--backend: unknown backend {args.backend!r}; known: {', '.join(BACKENDS)}")
        if args.dtype not in ELEMENT_BYTES:
            raise UserError(f"--dtype: unknown type {args.dtype!r}; known: {', '.join(ELEMENT_BYTES)}")
        if args.backend == "mpi4py":
            from harness.profile.collectives import MPI4PY_DTYPES

            if args.dtype not in MPI4PY_DTYPES:
                raise UserError(f"--dtype {args.dtype} cannot go through mpi4py (numpy and MPI have no such "
                                f"reduction type); use {', '.join(MPI4PY_DTYPES)}, or --backend torch")
            if args.device == "cuda":
                raise UserError("--device cuda: --backend mpi4py times numpy buffers in host memory; use --backend "
                                "torch (NCCL) for GPU buffers, or leave --device out")
        for name in ("iters", "warmup"):
            value, least = getattr(args, name), 1 if name == "iters" else 0
            if not least <= value <= MAX_ITERS:
                raise UserError(f"--{name} {value:,}: give {least} to {MAX_ITERS:,} (each size's timings are held "
                                "in memory)")
        begin, end = parse_size(args.minbytes, "-b"), parse_size(args.maxbytes, "-e")
        try:
            factor = float(args.stepfactor)
        except ValueError:
            raise UserError(f"-f: {args.stepfactor!r} is not a number; give the factor between sizes, e.g. 2") from None
        self.sizes = sweep_sizes(begin, end, factor)
        self.backend, self.dtype, self.group = args.backend, args.dtype, args.group
        self.iters, self.warmup, self.device = args.iters, args.warmup, args.device
        self.output = Path(args.output) if args.output is not None else None
        if self.output is not None:  # refused before measuring, with the ranks agreed: nothing measured is lost
            from harness.store.hdf5_io import check_replaceable
            from harness.store.hdf5_schema import COLLECTIVES_KIND

            check_outputs({"-o": args.output})
            check_replaceable(self.output, COLLECTIVES_KIND, "-o")

    def op_sizes(self, ranks: int) -> tuple[dict[str, list[int]], list[str]]:
        """Each operation's sizes, rounded to whole elements (per rank for the split operations), and what
        was rounded, in words."""
        sizes, notes = {}, []
        for op in self.ops:
            rounded = [round_size(op, s, self.dtype, ranks) for s in self.sizes]
            changed = [(s, r) for s, r in zip(self.sizes, rounded) if s != r]
            sizes[op] = sorted(set(rounded))
            if changed:
                shown = ", ".join(f"{s} -> {r}" for s, r in changed[:3]) + (" ..." if len(changed) > 3 else "")
                per_rank = f" per rank ({ranks} ranks)" if op in SPLIT_OPS else ""
                notes.append(f"{op}: {len(changed)} size(s) rounded to whole {self.dtype} elements{per_rank}: "
                             f"{shown} B")
        return sizes, notes


def _check_host_memory(largest: int, comm, group: list[int]) -> None:
    """UserError where the benchmark group's ranks on this node cannot all hold the largest message's buffers (at
    most an input and an output of the message's size each) in the node's memory. Every rank calls it."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = local.allreduce(int(comm.Get_rank() in group))
    local.Free()
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # a system that does not say
        return
    needed = 2 * largest * ranks_here
    if needed > memory:
        raise UserError(f"-e {largest:,} B: {ranks_here} ranks on this node need about {needed / 2**30:,.1f} GiB for "
                        f"the largest message's buffers, more than the node's {memory / 2**30:,.1f} GiB; give a "
                        "smaller -e")


def _torch_backend(name: str, device_wanted: str) -> tuple[str, str]:
    """(torch backend, device type) for --backend; a backend this torch lacks is a UserError naming those it has."""
    import torch
    import torch.distributed as dist

    known = ("gloo", "nccl", "mpi", "ucc")
    built = [b for b in known if dist.is_available() and dist.is_backend_available(b)]
    cuda = torch.cuda.is_available() and device_wanted != "cpu"
    if name == "torch":
        name = "nccl" if cuda and "nccl" in built else "gloo"
    if name not in built:
        raise UserError(f"--backend {name}: not built into this torch ({torch.__version__}); built in: "
                        f"{', '.join(built) or 'none'} (or use --backend mpi4py)")
    if name == "nccl" and not cuda:
        raise UserError("--backend nccl needs a CUDA device and torch sees none here (or --device cpu was given); "
                        "use --backend gloo or mpi4py")
    if device_wanted == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but torch sees no CUDA device; use --device auto or cpu")
    return name, "cuda" if name == "nccl" or (cuda and device_wanted == "cuda") else "cpu"


def run(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from launcher.placement import benchmark_group
    from launcher.topology import discover

    comm = MPI.COMM_WORLD
    error = options = topology = None
    ranks = placement = torch_backend = device_type = None
    try:
        options = Options(args, comm.Get_size())
        topology = discover(comm)
        ranks, placement = benchmark_group(topology, options.group)
        if options.backend != "mpi4py":
            torch_backend, device_type = _torch_backend(options.backend, options.device)
        if device_type != "cuda":  # host memory: a GPU's own is its allocator's to refuse
            _check_host_memory(max(options.sizes), comm, ranks)
    except UserError as exc:
        error = exc
    status = stop_on_error(comm, error)
    if status is not None:
        return status
    started = time.time()
    bench, label, device = _start(comm, topology, options, ranks, torch_backend, device_type)
    sizes, notes = options.op_sizes(len(ranks))
    leader = ranks[0]
    results = {}
    if bench is not None:
        from harness.common.progress import Progress

        total = sum(len(s) for s in sizes.values())
        progress = Progress("collectives", total, enabled=comm.Get_rank() == leader and not args.quiet, unit="size")
        for op in options.ops:
            results[op] = []
            for nbytes in sizes[op]:
                results[op].append(bench.measure(op, nbytes, options.warmup, options.iters))
                progress.advance()
        progress.close()
        bench.comm.Free()
    if comm.Get_rank() == leader and leader != 0:
        comm.send(results, dest=0)
    if comm.Get_rank() == 0 and leader != 0:
        results = comm.recv(source=leader)
    yielding_barrier(comm, 0.001)
    if torch_backend is not None:
        from harness.runtime.distributed import destroy_process_group

        destroy_process_group()
    record = write_error = None
    if comm.Get_rank() == 0:
        from harness.store.collectives_file import CollectivesRun, write_collectives

        record = CollectivesRun(path=options.output or Path("-"), backend=label, group=options.group,
                                placement=placement, ranks=list(ranks), dtype=options.dtype, iters=options.iters,
                                warmup=options.warmup, results=results,
                                environment=_environment(topology, label, device, started))
        if options.output is not None:
            from harness.common.output import writable

            try:
                writable(options.output, lambda: write_collectives(options.output, record))
            except UserError as exc:
                unsaved = dataclasses.replace(record, path=Path("-"))
                print(_results_text(unsaved, notes, args.json), flush=True)  # what was measured, before the error
                write_error = exc
    status = stop_on_error(comm, write_error)  # a full disk: one message, every rank ends quietly
    if status is not None:
        return status
    if comm.Get_rank() != 0:
        return 0
    print(_results_text(record, notes, args.json))
    sys.stdout.flush()
    return 0


def _results_text(record, notes: list[str], as_json: bool) -> str:
    from harness.store.collectives_report import run_json, run_report

    return json.dumps(run_json(record, notes), indent=1) if as_json else run_report(record, notes)


def _start(comm, topology, options: Options, ranks, torch_backend, device_type):
    """The group's communicator (and torch's process group and group): (bench or None off the group, the
    backend's label, the device's name)."""
    import torch
    from mpi4py import MPI

    from harness.profile.collectives import CollectiveBench
    from harness.profile.run import device_name

    member = comm.Get_rank() in ranks
    sub = comm.Split(0 if member else MPI.UNDEFINED, key=comm.Get_rank())
    if torch_backend is None:  # host buffers: named as a profile names its CPU (analysis simulate --collectives)
        bench = CollectiveBench(sub, ranks, "mpi4py", options.dtype) if member else None
        return bench, "mpi4py", device_name(torch.device("cpu"))
    import torch.distributed as dist

    from harness.runtime.distributed import init_process_group, pick_device

    torch.set_num_threads(1)
    device = pick_device(topology, "cuda" if device_type == "cuda" else "cpu", comm)
    init_process_group(comm, topology, device, backend=torch_backend)
    group = None if len(ranks) == comm.Get_size() else dist.new_group(list(ranks))  # collective over the world
    bench = CollectiveBench(sub, ranks, torch_backend, options.dtype, device, group) if member else None
    return bench, f"torch-{torch_backend}", device_name(device)


def _environment(topology, backend: str, device: str, started: float) -> dict:
    import torch

    from harness.profile.run import module_version
    from launcher.topology import mpi_library_version

    finished = time.time()
    return {"hosts": topology.hosts(), "world_size": topology.size, "nodes": topology.nodes,
            "ranks_per_node": topology.ranks_per_node, "topology_source": topology.source,
            "launcher": topology.launcher, **topology.cpu_environment(), "device": device, "backend": backend,
            "torch_version": torch.__version__, "mpi4py_version": module_version("mpi4py"),
            "h5py_version": module_version("h5py"), "mpi_library": mpi_library_version(),
            "python_version": platform.python_version(), "start_time": started, "end_time": finished,
            "wall_s": finished - started}
