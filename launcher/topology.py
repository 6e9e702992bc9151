"""Topology discovery: rank, size, hosts, local ranks and devices of the profiling (or training) run.

Hosts come from MPI (a shared-memory split), cross-checked against the launcher's own variables: a
`mpirun` that does not match the MPI library mpi4py loaded, or `srun --mpi=none`, starts N silent
one-rank jobs, which we refuse with a clear error.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from harness.common.errors import UserError
from harness.common.launch_env import promised_world_size

# Test-only: pretend every `k` consecutive ranks form one node (multi-node placement on one machine).
EMULATE_VAR = "DISTSIM_EMULATE_RANKS_PER_NODE"


class LaunchError(UserError):
    """The MPI world does not match what the launcher promised."""


@dataclass(frozen=True)
class Topology:
    """Where every rank runs: `node_of[r]` is rank r's node index (0..nodes-1, in order of first rank)."""

    rank: int
    size: int
    node_of: tuple[int, ...]
    hostnames: tuple[str, ...]
    source: str = "mpi"  # mpi | emulated
    launcher: str = "unknown"
    extra: dict = field(default_factory=dict, compare=False)
    cpus: tuple[tuple[int, ...], ...] = field(default=(), compare=False)  # each rank's CPU affinity

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def nodes(self) -> int:
        return max(self.node_of) + 1

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    @property
    def local_rank(self) -> int:
        return self.ranks_on(self.node).index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.ranks_on(self.node))

    @property
    def ranks_per_node(self) -> int:
        return max(len(self.ranks_on(n)) for n in range(self.nodes))

    @property
    def cpu_binding(self) -> str:
        """"bound", "shared", "single" or "unknown" (classify_cpu_binding of the ranks' affinities)."""
        return classify_cpu_binding(self.hostnames, self.cpus)

    def unbound_note(self) -> str | None:
        """For CPU work: a note when ranks may share cores although every host has a CPU for each of its ranks
        (binding would give each its own); None when bound, oversubscribed, alone on a host, or unknown."""
        if self.cpu_binding != "shared":
            return None
        if any(len(sets) > len(set().union(*sets)) for sets in _cpu_sets_by_host(self.hostnames, self.cpus)):
            return None  # more ranks than CPUs: they share cores however they are bound
        return ("the ranks were free to share cores: on a CPU, one rank's communication threads and the host's "
                "tasks then land on another rank's core and slow its compute; bind each rank to its own core "
                "(mpirun --bind-to core, srun --cpu-bind=cores) to profile and run alike (docs/train.md)")

    def threads_note(self, threads: int) -> str | None:
        """For CPU work: a note when the ranks' torch threads outnumber the CPUs they may run on (a rank's own set,
        or a host's for all its ranks), so that threads share cores and every timing slows; None otherwise (one
        thread a rank: more ranks than CPUs share them however they are run; or CPUs unknown)."""
        if threads <= 1 or not self.cpus or not all(self.cpus):
            return None
        for sets in _cpu_sets_by_host(self.hostnames, self.cpus):
            own = min(len(cpus) for cpus in sets)
            host = len(set().union(*sets))
            if threads > own or threads * len(sets) > host:
                return (f"{len(sets)} rank(s) of {threads} torch thread(s) each ran on {host} CPU(s) of a host, at "
                        f"least one on {own} of its own: threads shared cores and slowed every step; give each rank "
                        f"{max(1, min(own, host // len(sets)))} thread(s) or fewer (harness train --threads; "
                        "OMP_NUM_THREADS for harness profile)")
        return None

    def cpu_notes(self, threads: int) -> str | None:
        """What a CPU job's summary notes about where its ranks ran (unbound_note, threads_note), one a line."""
        notes = [note for note in (self.unbound_note(), self.threads_note(threads)) if note]
        return "\nNOTE: ".join(notes) or None

    def cpu_environment(self) -> dict:
        """What the profile's and the trace's environment record of the ranks' CPUs."""
        return {"cpu_binding": self.cpu_binding, "cpu_affinity": [list(c) for c in self.cpus]}

    def hosts(self) -> list[str]:
        """One name per node (emulated nodes are named host/nodeN)."""
        names = []
        for n in range(self.nodes):
            first = self.ranks_on(n)[0]
            names.append(self.hostnames[first] + (f"/node{n}" if self.source == "emulated" else ""))
        return names


def classify_cpu_binding(hostnames: tuple[str, ...] | list[str], cpus: tuple[tuple[int, ...], ...] | list) -> str:
    """How the launcher placed the ranks on their hosts' CPUs: "bound" when the ranks of every host run on
    disjoint CPU sets (mpirun --bind-to core, srun --cpu-bind=cores), "shared" when two ranks of one host may
    run on the same CPU (unbound ranks, oversubscription), "single" with one rank per host (nothing to
    share), "unknown" without affinities."""
    if not cpus or len(cpus) != len(hostnames) or not all(cpus):
        return "unknown"
    by_host = _cpu_sets_by_host(hostnames, cpus)
    if all(len(sets) == 1 for sets in by_host):
        return "single"
    if any(sum(len(c) for c in sets) != len(set().union(*sets)) for sets in by_host):
        return "shared"
    return "bound"


def _cpu_sets_by_host(hostnames, cpus) -> list[list[set[int]]]:
    """The ranks' CPU sets, grouped by host."""
    by_host: dict[str, list[set[int]]] = {}
    for name, rank_cpus in zip(hostnames, cpus):
        by_host.setdefault(name, []).append(set(rank_cpus))
    return list(by_host.values())


def launcher_name(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "open-mpi"
    if "SLURM_STEP_ID" in env and "PMI_SIZE" in env and "HYDRA_CONTROL_FD" not in env and "PMI_PORT" not in env:
        return "srun"
    if "PMI_SIZE" in env or "PMI_PORT" in env:
        return "mpich-hydra"
    if "SLURM_STEP_ID" in env:
        return "srun"
    return "singleton"


SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
              "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST", "SLURM_STEP_GPUS")


def slurm_context(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The Slurm variables of this task (empty outside Slurm), recorded with every profile."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in SLURM_VARS if name in env}


def expand_nodelist(nodelist: str) -> list[str]:
    """`scontrol show hostnames` of a Slurm node list (the list itself if scontrol is not there)."""
    import subprocess

    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        return out.split() or [nodelist]
    except (OSError, subprocess.SubprocessError):
        return [nodelist]


def check_slurm_task(rank: int, size: int, node: int, local_rank: int, environ: dict[str, str] | None = None) -> None:
    """Under a direct `srun` launch, Slurm's task ids must be MPI's: SLURM_PROCID is the rank, SLURM_NODEID
    and SLURM_LOCALID the node and local rank. mpirun inside an allocation starts its own proxies with srun
    (one task per node, each rank seeing SLURM_PROCID=0): those are not checked."""
    env = os.environ if environ is None else environ
    direct = (launcher_name(env) == "srun" and "MPI_LOCALRANKID" not in env
              and env.get("SLURM_STEP_NUM_TASKS") == str(size))
    if not direct:
        return
    for name, ours in (("SLURM_PROCID", rank), ("SLURM_NODEID", node), ("SLURM_LOCALID", local_rank)):
        if name in env and int(env[name]) != ours:
            raise LaunchError(f"{name}={env[name]} but MPI says {ours}: srun's task layout and MPI's disagree; "
                              "launch with srun --mpi=pmi2 (MPICH) or --mpi=pmix (Open MPI)")


def check_world_size(size: int, environ: dict[str, str] | None = None) -> None:
    """Raise LaunchError when MPI's world size disagrees with the launcher's promise."""
    promised = promised_world_size(environ)
    if promised is not None and promised[0] != size:
        count, name = promised
        raise LaunchError(
            f"MPI world size is {size} but the launcher promised {count} ranks ({name}={count}): the launcher "
            "and the MPI library that mpi4py loaded do not match, so every rank runs alone. Use the mpirun of the "
            "same MPI as mpi4py (the venv's .venv/bin/mpirun for the default MPICH), or srun with the right "
            "--mpi plugin (pmi2 for MPICH, pmix for Open MPI).")


def mpi_library_version(text: str | None = None) -> str:
    """The first line of the MPI library's version string (Open MPI ends it with a NUL, which HDF5 refuses)."""
    if text is None:
        from mpi4py import MPI

        text = MPI.Get_library_version()
    lines = text.replace("\x00", "").strip().splitlines()
    return lines[0].strip() if lines else "unknown"


def discover(comm) -> Topology:
    """Discover the topology collectively over an mpi4py communicator (every rank must call it); the launcher's
    promised rank count is held against the world's (or a copy of it), not against a part such as COMM_SELF."""
    from mpi4py import MPI

    if comm.Compare(MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
        check_world_size(comm.Get_size())
    rank, size = comm.Get_rank(), comm.Get_size()
    hostname = socket.gethostname()
    hostnames = tuple(comm.allgather(hostname))
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only; elsewhere the binding is "unknown"
    cpus = tuple(tuple(c) for c in comm.allgather(sorted(affinity(0)) if affinity else []))
    emulate = os.environ.get(EMULATE_VAR)
    if emulate:
        try:
            per_node = int(emulate)
            assert per_node > 0
        except (ValueError, AssertionError):
            raise UserError(f"{EMULATE_VAR}={emulate!r} must be a positive integer (ranks per emulated node)") from None
        node_of = tuple(r // per_node for r in range(size))
        return Topology(rank, size, node_of, hostnames, source="emulated", launcher=launcher_name(),
                        extra={"slurm": slurm_context()}, cpus=cpus)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    leader = local.allreduce(rank, op=MPI.MIN)  # the lowest world rank on my node names the node
    local.Free()
    leaders = comm.allgather(leader)
    order = {lead: i for i, lead in enumerate(sorted(set(leaders)))}
    topology = Topology(rank, size, tuple(order[lead] for lead in leaders), hostnames, launcher=launcher_name(),
                        extra={"slurm": slurm_context()}, cpus=cpus)
    check_slurm_task(rank, size, topology.node, topology.local_rank)
    return topology
