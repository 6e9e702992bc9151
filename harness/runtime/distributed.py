"""torch.distributed started from MPI: rank and size from mpi4py, a race-free TCPStore rendezvous.

Rank 0 opens a TCPStore on port 0 (the OS picks a free port) and broadcasts host and port over MPI,
so concurrent jobs on one machine never collide. NCCL with one device per local rank when CUDA is
present, gloo on CPU.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from launcher.topology import Topology


def check_one_rank_per_gpu(gpus: list[tuple[str, str | None]]) -> None:
    """Refuse two ranks on one GPU. `gpus[r]` is rank r's (host, GPU identity), None off a GPU. NCCL fails at
    the first collective with "Duplicate GPU detected", and ranks sharing a GPU would time each other."""
    first: dict[tuple[str, str], int] = {}
    for rank, (host, gpu) in enumerate(gpus):
        if gpu is None:
            continue
        other = first.setdefault((host, gpu), rank)
        if other != rank:
            from harness.common.errors import UserError

            count = len({g for h, g in gpus if h == host and g is not None})
            on_host = sum(1 for h, g in gpus if h == host and g is not None)
            raise UserError(f"ranks {other} and {rank} on {host} share one GPU ({gpu}): {on_host} ranks run there "
                            f"on {count} GPU(s), and every rank needs its own (NCCL refuses two ranks on one "
                            f"device). Start at most {count} rank(s) per node (mpirun --map-by ppr:{count}:node, "
                            f"or Slurm --ntasks-per-node={count} or --gpus-per-task=1), or set profile.device = "
                            "'cpu' (train: --device cpu)")


def _gpu_identity(index: int) -> str | None:
    """A GPU's UUID (the same whichever CUDA_VISIBLE_DEVICES numbering a rank sees it under)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else None


def pick_device(topology: Topology, wanted: str = "auto", comm=None) -> torch.device:
    """One device per local rank when CUDA is present (and wanted), else the CPU; `wanted` "cuda:N" takes GPU N.
    With `comm` (collective over it) two ranks that would share one GPU are refused."""
    device = torch.device("cpu")
    gpu = None
    cuda = wanted == "auto" or wanted.startswith("cuda")
    if cuda and torch.cuda.is_available():
        # Slurm may show each rank only its own GPU: the local rank picks among those it sees
        index = int(wanted[5:]) if wanted.startswith("cuda:") else topology.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device, gpu = torch.device("cuda", index), _gpu_identity(index)
    elif cuda and wanted != "auto":
        from harness.common.errors import UserError

        raise UserError("profile.device = 'cuda' but torch sees no CUDA device on "
                        f"{topology.hostnames[topology.rank]}; use device = 'auto' or 'cpu'")
    if comm is not None:
        check_one_rank_per_gpu(comm.allgather((topology.hostnames[topology.rank], gpu)))
    return device


def _rendezvous_host(topology: Topology) -> str:
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    if topology.nodes == 1 or topology.source == "emulated":
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def init_process_group(comm, topology: Topology, device: torch.device, timeout_s: float = 600.0,
                       backend: str | None = None) -> str:
    """Start torch.distributed over the MPI world; returns the backend name: `backend`, else nccl on a GPU
    and gloo on the CPU."""
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "mpi":  # torch's own MPI backend takes its ranks from MPI, without a store
        dist.init_process_group("mpi", timeout=timeout)
        return backend
    if topology.rank == 0:
        host = _rendezvous_host(topology)
        store = dist.TCPStore(host, 0, topology.size, is_master=True, timeout=timeout, wait_for_workers=False)
        comm.bcast((host, store.port), root=0)
    else:
        host, port = comm.bcast(None, root=0)
        store = dist.TCPStore(host, port, topology.size, is_master=False, timeout=timeout)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=topology.rank, world_size=topology.size, timeout=timeout,
                            **kwargs)
    return backend


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
