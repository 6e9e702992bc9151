"""Collectives over a tiered network, as NCCL's tuner costs them (docs/analysis.md, "The network model").

Each algorithm and protocol costs `base + steps x hop latency + bytes moved / bandwidth (+ the buffer's pass through
device memory)`, and the fastest is the prediction, as NCCL's tuner picks per size (src/graph/tuning.cc, NCCL 2.30:
its base and per-hop latencies and its protocols' bandwidth shares, below). The rules, for a group of n ranks in d
innermost domains of at most g:
- ring (all-reduce 2(n-1) steps, all-gather and reduce-scatter n-1), 2(d-1) (or d-1) of them between domains;
  its bandwidth the slowest link on the ring: the innermost tier's, and g links in parallel (the rails: one NIC a
  GPU, NCCL a channel on each) of every tier it crosses;
- tree (all-reduce): a chain inside each domain (every byte in and out twice: half the link) pipelined with
  NCCL's double binary tree between domains on each rail (tree_load: the busiest domain's bytes on its NIC), at
  0.92 of the slower; 2((g-1) intra + log2(d) inter) hops;
- NVLS (all-reduce in one domain of an `nvls` tier): each GPU pulls its reduced 1/g of the buffer from the switch
  and multicasts it back, S (1 + 1/g) each way on its link, at 0.85 of the link (NCCL's Hopper NVLS efficiency);
- NVLS-tree (all-reduce over domains of an `nvls` tier): NVLS inside, pipelined with the double binary tree of
  each GPU's 1/g between domains over its rail: the slower half's bandwidth;
- hierarchical (all-reduce over several domains): reduce-scatter in each domain, an all-reduce of 1/g of the
  bytes between domains on each rail, an all-gather back, one after the other;
- all-to-all: every pair at once, a GPU's bytes to its own domain over the innermost tier, the rest over its
  NIC, whichever is slower; off-rail pairs of a `rails` tier take one more innermost hop (NCCL's PXN);
- send/recv: one hop over the outermost tier the pair crosses.
- a network whose collectives run on gloo (`library`, PyTorch's CPU backend) all-reduces by the ring alone (none of
  NCCL's trees, NVLS or hierarchy) and reduce-scatters as PyTorch's ProcessGroupGloo does: an all-reduce of the
  whole input (a clone of it all-reduced, then the rank's chunk copied out), so a reduce-scatter costs that ring
  all-reduce of its bytes, not half of it (its clone and copy are not costed: a lower bound). MPI's (mpi4py's)
  are costed by NCCL's formulas.
A hop between domains is costed at the outermost tier the group crosses. Where the innermost tier gives
`memory_gbs`, every algorithm also reads its input from and writes its output to device memory once, at that
bandwidth, not hidden behind the links (MEMORY_PASSES). A network calibrated from a profile (no
`[[cluster.network]]`) costs a group as the fits it came from do, whatever the backend: ring (and pairwise
all-to-all) steps at the latency and bandwidth fitted for the outermost placement the group crosses, one protocol,
no base, so that it gives back the fit at every measured point.
Not modelled: the host's kernel launches. A training job launches one GPU's collective a process; a benchmark that
drives n GPUs from one process (nccl-tests `-g n`, as vTrain's A100 tables were taken) takes at least n launches an
iteration, whatever the network: bench/network_model.py applies that floor to its comparison alone.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.plan.collectives import bus_factor
from harness.plan.events import INTER, INTRA
from harness.plan.network import GroupSpan, NetworkTier, contiguous_span, group_span, with_overrides
from harness.plan.spec import MAX_DEVICES

NCCL_VERSION = "2.30"
OPS = ("allreduce", "allgather", "reducescatter", "alltoall", "sendrecv")
PROTOCOLS = ("LL", "LL128", "Simple")
PROTOCOL_BANDWIDTH = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}  # LL: a flag per word; LL128: NCCL's 0.92 cap
BASE_LATENCY_US = {"ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4},
                   "tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4}}
# per hop, by the tier's class: the innermost (scale-up, NVLink) and the others (the network)
HOP_LATENCY_US = {
    "scale-up": {"ring": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4}, "tree": {"LL": 0.6, "LL128": 1.25, "Simple": 4.0},
                 "nvls": {"Simple": 25.0}},
    "scale-out": {"ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}, "tree": {"LL": 5.0, "LL128": 8.5, "Simple": 14.0},
                  "nvls": {"Simple": 18.0}, "nvls_tree": {"Simple": 20.9}},
}
TREE_EFFICIENCY = 0.92
NVLS_EFFICIENCY = 0.85  # Hopper
# a collective's own pass through device memory, in buffer sizes S (the input read, the output written) per op
MEMORY_PASSES = {"allreduce": lambda n: 2.0, "allgather": lambda n: 1.0 + 1.0 / n,
                 "reducescatter": lambda n: 1.0 + 1.0 / n, "alltoall": lambda n: 2.0, "sendrecv": lambda n: 1.0}
NCCL, MEASURED = "nccl", "measured"  # algorithm sets: NCCL's, or the calibrated fits' own form (ring)
GLOO, MPI = "gloo", "mpi"
# what runs a job's collectives: torch.distributed's NCCL on GPUs and gloo on CPUs, or MPI (the mpi4py backend)
LIBRARIES = (NCCL, GLOO, MPI)
LINK_FIELDS = ("bandwidth_gbs", "latency_us", "efficiency", "oversubscription")  # what a measured link stands for
CALIBRATED_NAMES = (INTRA, INTER)


def network_op(kind: str) -> str:
    """The operation (OPS) a plan event's communication kind runs: a P2P send is a sendrecv."""
    return "sendrecv" if kind == "p2p" else kind


@dataclass(frozen=True)
class Estimate:
    """One collective's predicted time and how: the algorithm and protocol chosen, the span of its group."""

    op: str
    nbytes: float
    seconds: float
    algorithm: str
    protocol: str
    span: GroupSpan

    def describe(self, tiers: Sequence[NetworkTier]) -> str:
        protocol = "" if self.protocol == MEASURED else f"/{self.protocol}"
        return f"{self.algorithm}{protocol}, {self.span.describe(tiers)}"


@dataclass(frozen=True)
class NetworkModel:
    """Tiers (innermost first), the algorithm set (NCCL's, or the calibrated fits' ring) and, for a calibrated
    network, each (op kind, tier) link's own latency and bandwidth measured by the profile."""

    tiers: tuple[NetworkTier, ...]
    algorithms: str = NCCL
    origin: str = "spec"  # spec | calibrated from PROFILE | what-if
    links: Mapping[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # -> (latency s, bytes/s)
    notes: tuple[str, ...] = ()
    # (op kind, tier) -> the (kind, placement) of the profile's fit its link came from (a calibrated network)
    link_fits: Mapping[tuple[str, int], tuple[str, str]] = field(default_factory=dict)
    library: str = NCCL  # LIBRARIES: the collective library whose algorithms a spec's tiers are costed by
    # (op, bytes, ranks) -> Estimate: a search costs the same groups' collectives for many candidates
    _estimates: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def with_overrides(self, overrides: Mapping[str, float | bool], devices: int) -> NetworkModel:
        """A what-if: the tiers with fields replaced; a calibrated link's measured values give way to them."""
        tiers = with_overrides(self.tiers, overrides, max(devices, 1))
        changed = {key.partition(".")[0] for key in overrides if key.partition(".")[2] in LINK_FIELDS}
        kept = {key: value for key, value in self.links.items() if self.tiers[key[1]].name not in changed}
        return NetworkModel(tiers, self.algorithms, f"{self.origin}, what-if {_overrides_text(overrides)}", kept,
                            self.notes, {key: value for key, value in self.link_fits.items() if key in kept},
                            self.library)

    # ---- the links ---------------------------------------------------------------------------------------
    def _link(self, kind: str, tier: int) -> tuple[float, float]:
        """(hop latency s for Simple or the calibrated protocol, bytes/s per GPU) of `tier` for `kind`."""
        if (kind, tier) in self.links:
            return self.links[(kind, tier)]
        t = self.tiers[tier]
        default = HOP_LATENCY_US[_tier_class(tier)]["ring"]["Simple"]
        latency = default if t.latency_us is None else t.latency_us
        return latency * 1e-6, t.bytes_per_s

    def hop_s(self, kind: str, tier: int, algorithm: str, protocol: str) -> float:
        latency, _ = self._link(kind, tier)
        if self.algorithms != NCCL:
            return latency
        table = HOP_LATENCY_US[_tier_class(tier)]
        ring_simple = table["ring"]["Simple"]
        return latency * table.get(algorithm, table["ring"]).get(protocol, ring_simple) / ring_simple

    def bandwidth(self, kind: str, tier: int) -> float:
        return self._link(kind, tier)[1]

    def _crossing_bandwidth(self, kind: str, span: GroupSpan) -> float:
        """Bytes/s a ring reaches through the tiers between domains: g GPUs' links in parallel, the slowest tier."""
        return span.per_domain * min(self.bandwidth(kind, k) for k in range(1, span.crossing + 1))

    def _ring_bandwidth(self, kind: str, span: GroupSpan) -> float:
        if self.algorithms == MEASURED:  # the fit's own link for the placement it crosses
            return self.bandwidth(kind, span.crossing)
        inner = self.bandwidth(kind, 0)
        if span.crossing == 0:
            return inner
        crossing = self._crossing_bandwidth(kind, span)
        return min(inner, crossing) if span.per_domain > 1 else crossing

    def memory_s(self, op: str, nbytes: float, ranks: int) -> float:
        """The buffer's pass in and out of device memory (the innermost tier's `memory_gbs`; 0 without it)."""
        memory = self.tiers[0].memory_gbs if self.algorithms == NCCL else None
        return MEMORY_PASSES[op](ranks) * nbytes / (memory * 1e9) if memory else 0.0

    def _tree_bandwidth(self, span: GroupSpan) -> float:
        """Bytes/s of the buffer through the double binary trees between domains: each of a domain's g GPUs carries
        its 1/g over its own rail, the busiest domain tree_load(d) shares of it each way."""
        return span.per_domain * self._rail_bandwidth(span) / tree_load(span.domains)

    def _rail_bandwidth(self, span: GroupSpan) -> float:
        return min(self.bandwidth("allreduce", k) for k in range(1, span.crossing + 1))

    def _protocols(self) -> tuple[str, ...]:
        return PROTOCOLS if self.algorithms == NCCL else (MEASURED,)

    def _base_s(self, algorithm: str, protocol: str) -> float:
        if self.algorithms != NCCL:
            return 0.0
        return BASE_LATENCY_US.get(algorithm, {}).get(protocol, 0.0) * 1e-6

    # ---- the algorithms ------------------------------------------------------------------------------------
    def _ring(self, op: str, nbytes: float, span: GroupSpan, memory: bool = True) -> list[tuple[float, str, str]]:
        kind = op  # all-reduce, all-gather, reduce-scatter: the plan's kinds too
        n, d = span.ranks, span.domains
        steps, inter = (2 * (n - 1), 2 * (d - 1)) if op == "allreduce" else (n - 1, d - 1)
        if self.algorithms == MEASURED and span.crossing:
            inter = steps  # the fit of the placement it crosses stands for every step, as it was fitted
        moved = steps / n * nbytes
        passes = self.memory_s(op, nbytes, n) if memory else 0.0
        out = []
        for protocol in self._protocols():
            latency = (self._base_s("ring", protocol) + (steps - inter) * self.hop_s(kind, 0, "ring", protocol)
                       + inter * self.hop_s(kind, span.crossing, "ring", protocol))
            bandwidth = self._ring_bandwidth(kind, span) * PROTOCOL_BANDWIDTH.get(protocol, 1.0)
            out.append((latency + moved / bandwidth + passes, "ring", protocol))
        return out

    def _tree(self, nbytes: float, span: GroupSpan) -> list[tuple[float, str, str]]:
        d, g = span.domains, span.per_domain
        chain = self.bandwidth("allreduce", 0) / 2 if g > 1 else math.inf  # up and down the chain: 2 S each way
        between = self._tree_bandwidth(span) if span.crossing else math.inf
        passes = self.memory_s("allreduce", nbytes, span.ranks)
        out = []
        for protocol in PROTOCOLS:
            latency = self._base_s("tree", protocol) + 2 * (
                (g - 1) * self.hop_s("allreduce", 0, "tree", protocol)
                + math.log2(d) * self.hop_s("allreduce", span.crossing, "tree", protocol))
            bandwidth = min(chain, between) * TREE_EFFICIENCY * PROTOCOL_BANDWIDTH[protocol]
            out.append((latency + nbytes / bandwidth + passes, "tree", protocol))
        return out

    def _nvls(self, nbytes: float, span: GroupSpan) -> list[tuple[float, str, str]]:
        g = span.per_domain
        if g < 2:  # one GPU a domain: nothing for the switch to reduce
            return []
        inner = NVLS_EFFICIENCY * self.bandwidth("allreduce", 0) * g / (g + 1)  # S (1 + 1/g) each way on the link
        nvls_hop = self.hop_s("allreduce", 0, "nvls", "Simple")
        passes = self.memory_s("allreduce", nbytes, span.ranks)
        if span.crossing == 0:
            return [(nvls_hop + nbytes / inner + passes, "nvls", "Simple")]
        latency = nvls_hop + 2 * math.log2(span.domains) * self.hop_s("allreduce", span.crossing, "nvls_tree", "Simple")
        return [(latency + nbytes / min(inner, self._tree_bandwidth(span)) + passes, "nvls_tree", "Simple")]

    def _hierarchical(self, nbytes: float, span: GroupSpan) -> list[tuple[float, str, str]]:
        g, d = span.per_domain, span.domains
        inside = GroupSpan(g, 1, g, 0)
        between = GroupSpan(d, d, 1, span.crossing)
        seconds = (self._best(self._ring("reducescatter", nbytes, inside, memory=False))[0]
                   + self._best(self._ring("allreduce", nbytes / g, between, memory=False))[0]
                   + self._best(self._ring("allgather", nbytes, inside, memory=False))[0]
                   + self.memory_s("allreduce", nbytes, span.ranks))
        return [(seconds, "hierarchical", "Simple")]

    def _alltoall(self, nbytes: float, span: GroupSpan) -> list[tuple[float, str, str]]:
        n, g = span.ranks, span.per_domain
        share = nbytes / n
        protocol = "Simple" if self.algorithms == NCCL else MEASURED
        if self.algorithms == MEASURED:  # the fit's form: one hop, every other rank's share over its link
            return [(self.hop_s("alltoall", span.crossing, "ring", protocol)
                     + (n - 1) * share / self.bandwidth("alltoall", span.crossing), "pairwise", protocol)]
        inside = (g - 1) * share / self.bandwidth("alltoall", 0) if g > 1 else 0.0
        if span.crossing == 0:
            return [(self._base_s("ring", protocol) + self.hop_s("alltoall", 0, "ring", protocol) + inside
                     + self.memory_s("alltoall", nbytes, n), "pairwise", protocol)]
        remote = (n - g) * share / min(self.bandwidth("alltoall", k) for k in range(1, span.crossing + 1))
        pxn = self.hop_s("alltoall", 0, "ring", protocol) if self.tiers[span.crossing].rails and g > 1 else 0.0
        latency = self._base_s("ring", protocol) + self.hop_s("alltoall", span.crossing, "ring", protocol) + pxn
        return [(latency + max(inside, remote) + self.memory_s("alltoall", nbytes, n), "pairwise", protocol)]

    def _sendrecv(self, nbytes: float, span: GroupSpan) -> list[tuple[float, str, str]]:
        tier = span.crossing
        out = []
        for protocol in self._protocols():
            pxn = (self.hop_s("p2p", 0, "ring", protocol)
                   if span.off_rail and tier and self.tiers[tier].rails else 0.0)
            latency = self._base_s("ring", protocol) + self.hop_s("p2p", tier, "ring", protocol) + pxn
            out.append((latency + nbytes / (self.bandwidth("p2p", tier) * PROTOCOL_BANDWIDTH.get(protocol, 1.0))
                        + self.memory_s("sendrecv", nbytes, 2), "p2p", protocol))
        return out

    @staticmethod
    def _best(options: Iterable[tuple[float, str, str]]) -> tuple[float, str, str]:
        return min(options, key=lambda o: o[0])

    def candidates(self, op: str, nbytes: float, span: GroupSpan) -> list[tuple[float, str, str]]:
        """Every (seconds, algorithm, protocol) this network can run `op` of `nbytes` over `span` with."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
        if span.ranks <= 1:
            return [(0.0, "none", "-")]
        if op == "sendrecv":
            return self._sendrecv(nbytes, span)
        if op == "alltoall":
            return self._alltoall(nbytes, span)
        if op == "reducescatter" and self.library == GLOO and self.algorithms == NCCL:
            return [(seconds, "allreduce-ring", protocol)
                    for seconds, _, protocol in self._ring("allreduce", nbytes, span)]
        options = self._ring(op, nbytes, span)
        if op == "allreduce" and self.algorithms == NCCL and self.library != GLOO:
            options += self._tree(nbytes, span)
            if self.tiers[0].nvls:
                options += self._nvls(nbytes, span)
            if span.crossing and span.per_domain > 1:
                options += self._hierarchical(nbytes, span)
        return options

    def estimate(self, op: str, nbytes: float, span: GroupSpan) -> Estimate:
        """The fastest way to run `op` of `nbytes` (nccl-tests' size: the whole array; a message for sendrecv)."""
        seconds, algorithm, protocol = self._best(self.candidates(op, nbytes, span))
        return Estimate(op, nbytes, seconds, algorithm, protocol, span)

    def estimate_group(self, op: str, nbytes: float, ranks: Iterable[int]) -> Estimate:
        key = (op, nbytes, tuple(ranks))
        if key not in self._estimates:
            self._estimates[key] = self.estimate(op, nbytes, group_span(key[2], self.tiers))
        return self._estimates[key]

    def to_dict(self) -> dict[str, Any]:
        return {"origin": self.origin, "algorithms": self.algorithms,
                "nccl_version": NCCL_VERSION if self.algorithms == NCCL and self.library != GLOO else None,
                "library": self.library,
                "tiers": [{**t.to_dict(), "latency_us": self._link("allreduce", i)[0] * 1e6,
                           "bytes_per_s": self._link("allreduce", i)[1]} for i, t in enumerate(self.tiers)],
                "notes": list(self.notes)}


@functools.cache
def tree_load(domains: int) -> float:
    """Each way, the bytes the busiest domain moves over one rail in NCCL's double binary tree of `domains`, in
    shares of what that rail carries (its GPU's 1/g of the buffer). The buffer is split between two trees, each
    moving a domain's half once up (reduced) and once down (the result) every edge it has. The first is an in-order
    binary tree (odd ranks its leaves, rank 0 the root above it); the second is the first mirrored (an even count)
    or shifted by one (odd), so a domain inner in one is a leaf in the other. 2 domains: 1 (each sends and
    receives its share once); 3: 1.5; 4 and more: 2 (an inner domain's parent and two children, plus its leaf
    edge)."""
    if domains < 2:
        return 0.0
    edges = [0] * domains
    for a, b in _inorder_tree_edges(domains):
        for tree in (lambda r: r, lambda r: domains - 1 - r if domains % 2 == 0 else (r + 1) % domains):
            edges[tree(a)] += 1
            edges[tree(b)] += 1
    return max(edges) / 2


def _inorder_tree_edges(count: int) -> list[tuple[int, int]]:
    """(parent, child) edges of the in-order binary tree over 0..count-1: rank 0 on top, then ranks 1..count-1,
    each range's root the rank divisible by the highest power of two in it."""
    def root_of(lo: int, hi: int) -> int:
        power = 1 << hi.bit_length()
        while (hi // power) * power < lo:
            power >>= 1
        return (hi // power) * power

    def below(parent: int, lo: int, hi: int) -> list[tuple[int, int]]:
        if lo > hi:
            return []
        root = root_of(lo, hi)
        return [(parent, root), *below(root, lo, root - 1), *below(root, root + 1, hi)]

    return below(0, 1, count - 1)


def _tier_class(tier: int) -> str:
    return "scale-up" if tier == 0 else "scale-out"


def _overrides_text(overrides: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in overrides.items())


def spec_network(tiers: Sequence[NetworkTier], library: str = NCCL) -> NetworkModel:
    """The network of a spec's `[[cluster.network]]` with its collectives run by `library` (LIBRARIES), one model
    per distinct tiers and library (its estimates kept)."""
    if library not in LIBRARIES:
        raise ValueError(f"unknown collective library {library!r}; known: {', '.join(LIBRARIES)}")
    return _spec_network(tuple(tiers), library)


@functools.lru_cache(maxsize=64)
def _spec_network(tiers: tuple[NetworkTier, ...], library: str) -> NetworkModel:
    return NetworkModel(tiers, NCCL, "spec" if library == NCCL else f"spec, {library}", library=library)


def calibrated_network(points: Mapping[tuple[str, str], Iterable[tuple[float, int, float]]], gpus_per_node: int,
                       source: str, fit, library: str = NCCL) -> NetworkModel | None:
    """A two-tier network (`intra`: a node of `gpus_per_node`; `inter`: the rest, unbounded) whose links are the
    profile's own: per op kind and placement the latency and bandwidth `fit` (analysis.costs.fit_alpha_beta)
    draws from its points. A (kind, placement) without points takes, in turn, the same kind's other placement,
    another kind's at the same placement, another kind's at the other (COMM_KINDS' order: the formulas share the
    link's alpha and beta). `library`: what ran them (said, not used: each kind's link is its own fit). None when
    nothing was measured."""
    from harness.plan.events import COMM_KINDS

    kinds = tuple(dict.fromkeys((*COMM_KINDS, "alltoall")))
    measured: dict[tuple[str, int], tuple[float, float]] = {}
    for (kind, placement), pts in points.items():
        if placement in CALIBRATED_NAMES and (link := _link_of(fit(kind, placement, list(pts)))):
            measured[(kind, CALIBRATED_NAMES.index(placement))] = link
    if not measured:
        return None
    links: dict[tuple[str, int], tuple[float, float]] = {}
    origin: dict[tuple[str, int], tuple[str, str]] = {}
    for tier in range(2):
        for kind in kinds:
            others = [k for k in kinds if k != kind]
            order = [(kind, tier), (kind, 1 - tier), *((k, tier) for k in others), *((k, 1 - tier) for k in others)]
            key = next((k for k in order if k in measured), None)
            if key is not None:
                links[(kind, tier)] = measured[key]
                origin[(kind, tier)] = (key[0], CALIBRATED_NAMES[key[1]])
    notes = []
    for tier, placement in enumerate(CALIBRATED_NAMES):
        borrowed = [(kind, o) for (kind, t), o in sorted(origin.items()) if t == tier
                    and (kind, placement) != o and any(k == kind for k, _ in measured)]
        own_kind = [kind for kind, o in borrowed if o[0] == kind]
        if own_kind:
            notes.append(f"no {placement}-node {', '.join(own_kind)} measured: each takes its own "
                         f"{CALIBRATED_NAMES[1 - tier]}-node fit")
        notes += [f"no {placement}-node {kind} measured: its link is the {o[0]} {o[1]} fit's"
                  for kind, o in borrowed if o[0] != kind]

    def typical(tier: int) -> tuple[float, float]:  # what the tier's row shows: its all-reduce link
        return links[("allreduce", tier)]

    per_node = max(1, gpus_per_node)
    # the inter tier holds any cluster the spec may grow to (harness.plan.spec's device limit): a calibration has no
    # outer edge to ask about
    tiers = (NetworkTier(INTRA, per_node, typical(0)[1] / 1e9, typical(0)[0] * 1e6),
             NetworkTier(INTER, per_node * max(2, -(-MAX_DEVICES // per_node)), typical(1)[1] / 1e9,
                         typical(1)[0] * 1e6))
    return NetworkModel(tiers, MEASURED, f"calibrated from {source}", links, tuple(notes), origin, library)


def _link_of(fit) -> tuple[float, float] | None:
    """(latency s, bytes/s) of a fit with points; an infinite bandwidth (latency-only) or none: None."""
    if not fit.points or fit.beta_s_per_byte <= 0:
        return None
    return fit.alpha_s, 1.0 / fit.beta_s_per_byte


def nccl_tests_rows(model: NetworkModel, op: str, ranks: int, sizes: Sequence[int]) -> list[dict[str, Any]]:
    """nccl-tests' columns for `op` on ranks 0..ranks-1: size, time, algbw, busbw (its factors), algorithm."""
    span = contiguous_span(ranks, model.tiers) if op != "sendrecv" else group_span(
        (0, ranks - 1), model.tiers)
    rows = []
    for size in sizes:
        estimate = model.estimate(op, float(size), span)
        algbw = size / estimate.seconds / 1e9 if estimate.seconds > 0 else 0.0
        rows.append({"op": op, "ranks": ranks, "size_bytes": int(size), "time_s": estimate.seconds,
                     "algbw_gbs": algbw, "busbw_gbs": algbw * bus_factor(op, span.ranks),
                     "algorithm": estimate.algorithm + ("" if estimate.protocol in (MEASURED, "-")
                                                        else f"/{estimate.protocol}")})
    return rows
