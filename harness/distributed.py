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


def check_devices_per_node(local_size: int, device_count: int, host: str) -> None:
    """Refuse more ranks on a node than it has GPUs: NCCL fails at the first collective with "Duplicate GPU
    detected", and ranks sharing a GPU would time each other's kernels."""
    if local_size > device_count:
        from harness.errors import UserError

        raise UserError(f"{local_size} ranks run on {host}, but torch sees {device_count} CUDA device(s) there; "
                        "every rank needs its own GPU (NCCL refuses two ranks on one device). Start at most "
                        f"{device_count} rank(s) per node (mpirun --map-by ppr:{device_count}:node, or Slurm "
                        f"--ntasks-per-node={device_count}), or set profile.device = 'cpu' (train: --device cpu)")


def pick_device(topology: Topology, wanted: str = "auto") -> torch.device:
    """One device per local rank when CUDA is present (and wanted), else the CPU."""
    if wanted in ("auto", "cuda") and torch.cuda.is_available():
        check_devices_per_node(topology.local_size, torch.cuda.device_count(), topology.hosts()[topology.node])
        index = topology.local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if wanted == "cuda":
        from harness.errors import UserError

        raise UserError("profile.device = 'cuda' but torch sees no CUDA device on "
                        f"{topology.hostnames[topology.rank]}; use device = 'auto' or 'cpu'")
    return torch.device("cpu")


def _rendezvous_host(topology: Topology) -> str:
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    if topology.nodes == 1 or topology.source == "emulated":
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def init_process_group(comm, topology: Topology, device: torch.device, timeout_s: float = 600.0) -> str:
    """Start torch.distributed over the MPI world; returns the backend name (nccl or gloo)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
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
