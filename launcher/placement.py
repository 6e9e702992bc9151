"""Placement: which rank measures which unique event, and which ranks form each communication group.

Compute events are spread over all ranks, disjoint and balanced by estimated cost (longest processing
time first). Every communication need (P2P pair or all-reduce group of a size, placement and message
size) gets ranks of the right placement from the world at hand. Each (kind, placement, group size) is also
measured over a sweep (`profile_sweep`): the sizes SWEEP_FACTOR apart from a point below its smallest message
to one above its largest, so that the analysis interpolates any message between them on measured points and fits
latency and bandwidth apart; every all-reduce group is swept with all-gather and reduce-scatter too (the
collectives of sharded data parallelism). Needs that cannot be met are recorded with the reason, and a
stand-in of the largest feasible group size is measured over the same sweep for the analysis's
extrapolation.
"""
from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from harness.plan.collectives import ELEMENT_BYTES, round_size
from harness.plan.events import INTER, INTRA, SHARDED_KINDS, Event, UniqueEvents, composite_content, event_id
from launcher.topology import Topology

SWEEP_FACTOR = 4  # between a sweep's sizes: powers of 4 times MIN_SWEEP_BYTES
SWEEP_DIVISOR = 16  # a sweep starts at or below a sixteenth of its smallest message (the latency's point)
MIN_SWEEP_BYTES = 1024
# A roofline for balancing only: FLOPs per byte moved at which a device turns from memory- to compute-bound.
# Optimizer steps and embeddings do few FLOPs but move every parameter several times.
FLOPS_PER_BYTE = 10.0


@dataclass(frozen=True)
class CommTask:
    """One communication measurement: `content` hashes into `id`; `ranks` take part (P2P: sender first)."""

    id: str
    kind: str  # p2p | allreduce
    content: dict = field(hash=False, compare=False)
    ranks: tuple[int, ...] = ()
    needed: bool = True  # an event of the spec (False: a sweep point or stand-in for the fit)


@dataclass
class Placement:
    """Who measures what; identical on every rank (computed on rank 0 and broadcast)."""

    compute: dict[int, list[str]]  # rank -> compute event ids
    comm: list[CommTask]
    unmeasured: dict[str, str]  # event id -> reason
    composites: list[CommTask] = field(default_factory=list)  # tensor-parallel layers on a real tp group

    def owner_of(self) -> dict[str, list[int]]:
        """Event id -> ranks that measure it (for the profile's /placement table)."""
        owners: dict[str, list[int]] = {}
        for rank, ids in self.compute.items():
            for eid in ids:
                owners.setdefault(eid, []).append(rank)
        for task in self.comm + self.composites:
            owners.setdefault(task.id, list(task.ranks))
        return owners


def balancing_cost(event: Event) -> float:
    """A compute event's estimated cost in FLOP-equivalents: the larger of its FLOPs and its memory traffic
    times FLOPS_PER_BYTE."""
    return max(event.cost, event.traffic * FLOPS_PER_BYTE)


def balance(costs: dict[str, float], ranks: int) -> dict[int, list[str]]:
    """Longest-processing-time-first: each event to the least loaded rank; disjoint and complete."""
    heap = [(0.0, r) for r in range(ranks)]
    share: dict[int, list[str]] = {r: [] for r in range(ranks)}
    for eid in sorted(costs, key=lambda e: (-costs[e], e)):
        load, rank = heapq.heappop(heap)
        share[rank].append(eid)
        heapq.heappush(heap, (load + max(costs[eid], 1.0), rank))
    return share


def _group_ranks(topology: Topology, size: int, placement: str) -> tuple[int, ...] | None:
    """Ranks for a group of `size`: all on one node (intra) or spread over nodes round-robin (inter)."""
    if placement == INTRA:
        for node in range(topology.nodes):
            ranks = topology.ranks_on(node)
            if len(ranks) >= size:
                return tuple(ranks[:size])
        return None
    if topology.nodes < 2 or size > topology.size:
        return None
    by_node = [topology.ranks_on(n) for n in range(topology.nodes)]
    chosen: list[int] = []
    depth = 0
    while len(chosen) < size:
        for ranks in by_node:
            if depth < len(ranks) and len(chosen) < size:
                chosen.append(ranks[depth])
        depth += 1
    return tuple(sorted(chosen))


def _why_not(topology: Topology, size: int, placement: str) -> str:
    if placement == INTER and topology.nodes < 2:
        return f"needs ranks on 2 or more nodes; this run has {topology.nodes} node"
    if size > topology.size:
        return f"group of {size} is larger than the {topology.size} ranks of this run"
    return f"no node of this run has {size} ranks (at most {topology.ranks_per_node} per node)"


def _largest_feasible(topology: Topology, size: int, placement: str) -> int:
    for candidate in range(min(size, topology.size), 1, -1):
        if _group_ranks(topology, candidate, placement) is not None:
            return candidate
    return 0


def place(unique: UniqueEvents, topology: Topology, skip: set[str] = frozenset()) -> Placement:
    """Place unique events (one plan's or a search's union) over the ranks of `topology`; ids in `skip` are
    already measured."""
    events = unique.events
    costs = {eid: balancing_cost(e) for eid, e in events.items() if e.kind == "compute" and eid not in skip}
    compute = balance(costs, topology.size)
    tasks: dict[str, CommTask] = {}
    unmeasured: dict[str, str] = {}

    def add(content: dict[str, Any], ranks: tuple[int, ...], needed: bool) -> None:
        eid = event_id(content)
        if eid not in skip and eid not in tasks:
            tasks[eid] = CommTask(eid, content["kind"], content, ranks, needed)

    # (kind, placement, group size, ranks, dtype) -> the message sizes the events send over it
    swept: dict[tuple[str, str, int, tuple[int, ...], str], set[int]] = {}
    for eid, event in sorted(events.items(), key=lambda item: (item[1].kind, item[1].cost, item[0])):
        if event.kind == "compute":
            continue
        size = event.group_size
        placement = event.placement or INTRA
        ranks = _group_ranks(topology, size, placement)
        if ranks is not None:
            add(event.content, ranks, True)
        else:
            unmeasured[eid] = _why_not(topology, size, placement)
            size = _largest_feasible(topology, size, placement)
            if size < 2:
                continue
            ranks = _group_ranks(topology, size, placement)
        dtype = str(event.content.get("dtype", "float32"))
        for kind in (event.kind,) + (SHARDED_KINDS if event.kind == "allreduce" else ()):
            swept.setdefault((kind, placement, size, ranks, dtype), set()).add(event.bytes)
    for (kind, placement, size, ranks, dtype), needs in swept.items():
        for nbytes in sorted(needs) + profile_sweep(sorted(needs)):  # the needs again: a stand-in's or a kind's own
            if kind in SHARDED_KINDS or kind == "alltoall":  # whole elements per rank (harness.plan.collectives)
                nbytes = round_size(kind, nbytes, dtype if dtype in ELEMENT_BYTES else "float32", size)
            content = {"kind": kind, "bytes": int(nbytes), "dtype": dtype, "placement": placement}
            if kind != "p2p":
                content["group"] = size
            add(content, ranks, False)
    comm = sorted(tasks.values(), key=lambda t: (t.kind, t.content.get("placement", ""),
                                                 t.content.get("group", 2), t.content["bytes"], t.id))
    return Placement(compute=compute, comm=comm, unmeasured=unmeasured,
                     composites=_composites(events, topology, skip))


def profile_sweep(needed: list[int]) -> list[int]:
    """The sizes a (kind, placement, group size) is swept over besides its needs: MIN_SWEEP_BYTES x
    SWEEP_FACTOR^k from the largest such size at or below a SWEEP_DIVISOR-th of the smallest need to the first
    one above the largest need, so that every need lies between two measured sizes (fixed points, so that
    groups and kinds share sizes and a resume finds them again)."""
    low, high = min(needed), max(needed)
    size = MIN_SWEEP_BYTES
    while size * SWEEP_FACTOR <= low / SWEEP_DIVISOR:
        size *= SWEEP_FACTOR
    sizes = []
    while size <= high:
        sizes.append(size)
        size *= SWEEP_FACTOR
    return sizes + [size]


def _composites(events: Mapping[str, Event], topology: Topology, skip: set[str]) -> list[CommTask]:
    """Each tensor-parallel layer's forward and backward, to run with its all-reduces on tp ranks of one node
    (DistSim's composite events: they catch the skew between the ranks that separate events miss), and each
    context-parallel one's (tp = 1) with its ring on cp ranks (what its compute hides of the ring), and each
    Mixture-of-Experts block's with its all-to-alls on ep ranks (every rank its own experts: a sample ends with
    the slowest, the load's imbalance and the ranks' skew in it). A layer both tensor- and context-parallel has
    none: it is costed as its compute and its collectives in turn."""
    out = []
    for _, event in sorted(events.items()):
        signature = event.content.get("signature", {})
        tp, cp, ep = (int(signature.get(key, 1)) for key in ("tp", "cp", "ep"))
        # context and expert parallelism communicate in the blocks alone (an embedding's cp is its positions')
        block = event.content.get("layer") == "block"
        size = tp if (cp == 1 and ep == 1) or not block else cp if tp == 1 and ep == 1 else ep if tp == 1 else 0
        if event.kind != "compute" or size < 2 or event.content.get("phase") not in ("fwd", "bwd"):
            continue
        ranks = _group_ranks(topology, size, INTRA)
        content = composite_content(event.content)
        cid = event_id(content)
        if ranks is not None and cid not in skip:
            out.append(CommTask(cid, "composite", content, ranks, needed=False))
    return out


def benchmark_group(topology: Topology, group: str) -> tuple[tuple[int, ...], str]:
    """The ranks a collective benchmark runs on and their placement: `all` the world (intra-node when it is
    one node); `intra` the ranks of one node (rank 0's, else the first with two ranks); `inter` the first
    rank of every node, so that every link it uses crosses nodes. UserError where the topology has no such
    group of two or more ranks."""
    from harness.common.errors import UserError

    if group == "all":
        return tuple(range(topology.size)), INTRA if topology.nodes == 1 else INTER
    if group == "intra":
        for node in range(topology.nodes):
            ranks = topology.ranks_on(node)
            if len(ranks) >= 2:
                return tuple(ranks), INTRA
        raise UserError(f"--group intra needs a node with 2 or more ranks; every one of this run's {topology.nodes} "
                        "nodes has 1 (start more ranks per node, or use --group inter)")
    if group == "inter":
        if topology.nodes < 2:
            raise UserError(f"--group inter needs ranks on 2 or more nodes; this run's {topology.size} ranks are on "
                            f"1 node (use --group intra, or emulate nodes with {EMULATE_HINT})")
        return tuple(topology.ranks_on(node)[0] for node in range(topology.nodes)), INTER
    raise UserError(f"unknown --group {group!r}; known: all, intra, inter")


EMULATE_HINT = "DISTSIM_EMULATE_RANKS_PER_NODE=K"
