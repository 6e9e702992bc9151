"""From a job spec to the unique events of one training iteration and every device's event flow.

An event's identity is its content (kind, shapes, dtype, degrees, group size, placement) hashed into
a stable id, so identical layers, micro-batches, data-parallel replicas and messages collapse into one
unique event with a multiplicity. Nothing is materialised per device unless asked (`device_flow`).

Counting conventions (docs/events.md): compute events count once per device that runs them;
a P2P event counts once per transfer; a collective counts once per group call.
Ranks are ordered tp fastest, then cp, then dp, then pp; a device's node is rank // gpus_per_node.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from harness.plan.candidates import Grid, expand
from harness.plan.device import RUN_WRAPPERS  # what a compute event's content may say wraps its layer
from harness.plan.layers import (
    HIDDEN_ALLREDUCE,
    LayerDesc,
    attention_core_flops,
    collective_kind,
    describe,
    recompute_groups,
    replicated_params,
    selective,
    sequence_shards,
    split_into_stages,
)
from harness.plan.schedules import device_steps, virtual_stage
from harness.plan.spec import DTYPES, JobSpec

EVENTS_VERSION = 1
INTRA, INTER = "intra", "inter"
# communication a profile measures: what plans send (P2P, all-reduce; expert parallelism's all-to-all), and the
# collectives of sharded data parallelism (all-gather, reduce-scatter), measured on every all-reduce group of a
# plan (launcher.placement)
COMM_KINDS = ("p2p", "allreduce", "allgather", "reducescatter", "alltoall")
SHARDED_KINDS = ("allgather", "reducescatter")


def layer_label(layer: LayerDesc) -> str:
    """'gpt2.block', or for a factory model 'user.Mixer#1' (its class and first position)."""
    sig = dict(layer.signature)
    if layer.kind == "user":
        return f"user.{str(sig.get('class', 'layer')).rsplit('.', 1)[-1]}#{layer.index}"
    return f"{sig.get('family')}.{layer.kind}"


def composite_content(content: dict[str, Any]) -> dict[str, Any]:
    """The content of a tensor-parallel layer profiled as a composite: the layer with its all-reduces, run on
    a real group of tp ranks (its id hashes this content, so it never collides with the layer alone)."""
    return {**content, "kind": "composite"}


def human_bytes(nbytes: float) -> str:
    """1536 -> '1.5KiB', 1353216 -> '1.29MiB': three significant digits, so that buckets of nearly the same
    size (a model's stages differ by a layer's bias or norm) keep names a reader can tell apart."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            break
        nbytes /= 1024
    if unit == "B":
        return f"{nbytes:.0f}B"
    text = f"{nbytes:.3g}"
    return f"{text if 'e' not in text else f'{nbytes:.0f}'}{unit}"  # 999.7 rounds to 1e+03 in .3g


def event_id(content: dict[str, Any]) -> str:
    """Stable content hash: the same content gives the same id in every run and process."""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]




def unwrapped_twin(event: Event) -> str | None:
    """A wrapped compute event's (RUN_WRAPPERS: a layer of a full-recompute group, a ZeRO job's layer or optimizer
    step) twin without the wrapping: the same layer or step as a plain job runs it; None for any other event."""
    if event.kind != "compute" or not any(key in event.content for key in RUN_WRAPPERS):
        return None
    return event_id({key: value for key, value in event.content.items() if key not in RUN_WRAPPERS})


class CommunicationFields:
    """Message size, group size and placement read from `self.content` (events and measurements alike)."""

    kind: str
    content: dict

    @property
    def bytes(self) -> int:
        return int(self.content.get("bytes", 0))

    @property
    def group_size(self) -> int:
        return int(self.content.get("group", 2 if self.kind == "p2p" else 1))

    @property
    def placement(self) -> str | None:
        placement = self.content.get("placement")
        return None if placement is None else str(placement)


@dataclass(frozen=True)
class Event(CommunicationFields):
    """A unique event: `cost` is estimated FLOPs for compute events and bytes for communication; `traffic`
    a compute event's estimated memory traffic in bytes (parameters, activations in and out; a backward
    twice its forward's; an optimizer step every parameter's state), for balancing the profile's shares."""

    id: str
    kind: str  # compute | p2p | allreduce
    name: str
    content: dict = field(hash=False, compare=False)
    cost: float = 0.0
    traffic: float = 0.0


OPTIMIZER_BYTES_PER_PARAMETER = 32  # Adam reads and writes parameter, gradient and two moments, in float32


def optimizer_dtype(model_dtype: str, master_weights: bool) -> str:
    """The dtype an optimizer steps in: the weights' own (harness train keeps no other copy), float32 with master
    weights (an fp32 copy of 16-bit weights, fp32 states)."""
    return "float32" if master_weights else model_dtype


def optimizer_bytes(params: int, dtype: str) -> float:
    """The bytes an optimizer step over `params` parameters moves: OPTIMIZER_BYTES_PER_PARAMETER in float32,
    scaled to `dtype`'s size."""
    return float(params * OPTIMIZER_BYTES_PER_PARAMETER * DTYPES[dtype] / DTYPES["float32"])


@dataclass
class UniqueEvents:
    """What a profile measures: the unique events of one plan, or the union of several (a search), with
    how often each occurs in all of them, and the model's layer descriptions (stored for the analysis)."""

    events: dict[str, Event]
    multiplicity: Counter
    layers: list[LayerDesc]
    separate: int  # the sum of each plan's own unique events (what profiling each plan alone measures)

    @classmethod
    def union(cls, plans: Iterable[EventPlan]) -> UniqueEvents:
        """The events of several plans (a search's candidates), each measured once; plans may be a generator."""
        events: dict[str, Event] = {}
        multiplicity: Counter = Counter()
        layers, separate = None, 0
        for plan in plans:
            events.update(plan.events)
            multiplicity.update(plan.multiplicity)
            layers = plan.layers if layers is None else layers
            separate += plan.unique_events
        if layers is None:
            raise ValueError("a union of no plans")
        return cls(events, multiplicity, layers, separate)

    def __len__(self) -> int:
        return len(self.events)

    def summary(self) -> dict[str, Any]:
        """Unique events, the total over all plans, and by kind (docs/events.md)."""
        by_kind: dict[str, dict[str, int]] = {}
        for eid, event in self.events.items():
            entry = by_kind.setdefault(event.kind, {"unique": 0, "total": 0})
            entry["unique"] += 1
            entry["total"] += self.multiplicity[eid]
        total = sum(self.multiplicity.values())
        return {"unique_events": len(self.events), "total_events": total,
                "dedup_ratio": total / max(1, len(self.events)), "by_kind": dict(sorted(by_kind.items()))}

    def table(self) -> list[dict[str, Any]]:
        """One row per unique event, sorted by kind then name."""
        rows = [{"id": e.id, "kind": e.kind, "name": e.name, "multiplicity": self.multiplicity[e.id],
                 "cost": e.cost, "content": e.content} for e in self.events.values()]
        return sorted(rows, key=lambda r: (r["kind"], r["name"], r["id"]))


@dataclass
class Bucket:
    """A data-parallel gradient bucket: all-reduced once its last layer's backward is done."""

    event: str
    nbytes: int
    # index into StageProgram.backward (a split backward's: into StageProgram.weight) after which every
    # gradient in the bucket is made
    ready_after: int


@dataclass
class StageProgram:
    """What one virtual pipeline stage runs per micro-batch (identical on its dp x tp devices)."""

    virtual_stage: int
    layers: list[int]  # indexes into EventPlan.layers
    forward: list[str]
    backward: list[str]
    buckets: list[Bucket]
    optimizer: list[str]
    send_forward: str | None  # activation to the next virtual stage
    send_backward: str | None  # gradient to the previous virtual stage
    forward_layers: list[int] = field(default_factory=list)  # layer index of each forward item (-1: collective)
    backward_layers: list[int] = field(default_factory=list)
    # recompute = "full": which backward items run a recomputed layer's forward again, its tensor-parallel
    # all-reduces included, right before the backward of the last layer of its group (harness.plan.layers
    # .recompute_groups: the group's forwards in order, then their backwards in reverse)
    backward_again: list[bool] = field(default_factory=list)
    # zero > 0: the first micro-batch's forward (events, layers) where it differs (FSDP gathers the weights
    # then), and the last one's backward (events, layers, again) where it differs (zero 1 reduce-scatters then)
    first_forward: tuple[list[str], list[int]] | None = None
    last_backward: tuple[list[str], list[int], list[bool]] | None = None
    # split backward (zero-bubble schedules): `backward` computes the input's gradient (the first virtual
    # stage's is empty: its input is token ids) and the W step runs these, the weights' gradients (the first
    # virtual stage's whole backward, as torch.distributed.pipelining runs it); buckets index into them
    weight: list[str] = field(default_factory=list)
    weight_layers: list[int] = field(default_factory=list)
    # the stage's collectives inside its layers, by the name the models give them (harness.models.tp: tp.allreduce,
    # a vocabulary-parallel head's tp.loss_max and tp.loss_sums, sp's tp.allgather and tp.reducescatter;
    # harness.models.context's cp.*; harness.models.moe's ep.*): what harness train records each as
    tp_events: dict[str, str] = field(default_factory=dict)
    # tie_embeddings with pp > 1: on the first and the last virtual stage, the all-reduce of the token table's
    # gradient between the two copies (Megatron-LM's embedding group), after the iteration's backward and buckets
    tie: str | None = None
    # sequence parallelism: the all-reduce over the stage's tp group of its replicated parameters' gradients
    # (harness.plan.layers.replicated_params), after the iteration's backward and buckets, before the optimizer
    sequence_grads: str | None = None
    # expert parallelism with dp > ep: the all-reduce of the stage's experts' gradients over the dp / ep ranks
    # holding the same experts, after the backward and buckets (phase ep in device_flow)
    expert_grads: str | None = None

    def forward_of(self, micro: int) -> tuple[list[str], list[int]]:
        """The items of micro-batch `micro`'s forward step and their layers."""
        if micro == 0 and self.first_forward is not None:
            return self.first_forward
        return self.forward, self.forward_layers

    def backward_of(self, micro: int, micro_batches: int) -> tuple[list[str], list[int], list[bool]]:
        """The items of micro-batch `micro`'s backward step, their layers and which run a forward again."""
        if micro == micro_batches - 1 and self.last_backward is not None:
            return self.last_backward
        return self.backward, self.backward_layers, self.backward_again or [False] * len(self.backward)


MAX_GROUP_EXAMPLES = 16


class GroupPlacements(Counter):
    """How many groups of one kind lie within a node (INTRA) or across nodes (INTER), and some groups' ranks of
    each (`examples`): the 1st, 2nd, 4th, 8th, ... and the last, so that groups which lie differently on a
    network's tiers (pipeline boundaries, dp groups at other offsets) are among them."""

    def __init__(self) -> None:
        super().__init__()
        self.examples: dict[str, list[tuple[int, ...]]] = {}
        self._last: dict[str, list[int]] = {}

    def add(self, placement: str, ranks: list[int]) -> None:
        self[placement] += 1
        count = self[placement]
        if count & (count - 1) == 0:  # a power of two
            self.examples.setdefault(placement, []).append(tuple(ranks))
        else:
            self._last[placement] = ranks

    def groups(self, placement: str) -> list[tuple[int, ...]]:
        last = self._last.get(placement)
        return self.examples.get(placement, []) + ([tuple(last)] if last is not None else [])


class EventPlan:
    """The unique events of one iteration, their multiplicities and the per-stage programs."""

    def __init__(self, spec: JobSpec, layers: list[LayerDesc] | None = None):
        self.spec = spec
        self.layers = describe(spec, layers)
        self.events: dict[str, Event] = {}
        self.multiplicity: Counter[str] = Counter()
        self.placement_mixed: list[str] = []
        # communication event id -> the ranks of some groups that run it (where they lie on a network's tiers;
        # the slowest of them is what the analysis costs)
        self.group_ranks: dict[str, list[tuple[int, ...]]] = {}
        self._collective_ids: dict[tuple, tuple] = {}  # _collective's (placements, [(id, placement)]), for the next
        self._build()

    # ---- construction -------------------------------------------------------------------------
    def _add(self, kind: str, name: str, content: dict[str, Any], cost: float, count: int,
             traffic: float = 0.0) -> str:
        content = {"kind": kind, **content}
        eid = event_id(content)
        if eid not in self.events:
            self.events[eid] = Event(eid, kind, name, content, cost, traffic)
        self.multiplicity[eid] += count
        return eid

    def rank_of(self, dp_i: int, tp_i: int, pp_i: int, cp_i: int = 0) -> int:
        s = self.spec.strategy
        return ((pp_i * s.dp + dp_i) * s.cp + cp_i) * s.tp + tp_i

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp index, tp index, pp index) of a global rank."""
        s = self.spec.strategy
        return (rank // (s.tp * s.cp)) % s.dp, rank % s.tp, rank // (s.tp * s.cp * s.dp)

    def cp_index(self, rank: int) -> int:
        """The context-parallel index of a global rank (0 without context parallelism)."""
        return (rank // self.spec.strategy.tp) % self.spec.strategy.cp

    def replicas(self) -> list[tuple[int, int]]:
        """Every (dp index, cp index): the ranks of a pipeline stage and tp index that hold the same parameters."""
        s = self.spec.strategy
        return [(d, c) for d in range(s.dp) for c in range(s.cp)]

    def _placements(self, groups: Iterator[list[int]]) -> GroupPlacements:
        counts = GroupPlacements()
        per_node = self.spec.cluster.gpus_per_node
        for ranks in groups:  # a node holds consecutive ranks: a group is on one if its ends are
            counts.add(INTRA if min(ranks) // per_node == max(ranks) // per_node else INTER, ranks)
        return counts

    def _collective(self, kind: str, nbytes: int, group: int, placements: GroupPlacements,
                    calls_per_group: int, what: str, fsdp: dict | None = None, dtype: str | None = None) -> str:
        """Add a collective (or P2P) once per placement it occurs with; the simulated replica uses the
        slowest (inter-node) variant when groups of one kind straddle nodes unevenly. `fsdp` (the layer:
        {"layer", "signature"}): an all-gather or reduce-scatter as FSDP2 runs it for a unit holding that
        layer's parameters (its copies in and out per parameter, its allocations; harness.profile.comm).
        `dtype`: the elements' (the model's by default)."""
        dtype = dtype or self.spec.model.dtype
        # every layer of a stage adds the same collectives: the second time, only the counts (ids cost a hash)
        key = (kind, nbytes, group, id(placements), dtype, repr(fsdp) if fsdp else "")
        if key in self._collective_ids:
            _, added = self._collective_ids[key]
            for eid, placement in added:
                self.multiplicity[eid] += placements[placement] * calls_per_group
            return added[-1][0]
        chosen = None
        added = []
        for placement in (INTRA, INTER):
            if placements[placement]:
                content = {"bytes": nbytes, "dtype": dtype, "placement": placement}
                if kind != "p2p":
                    content["group"] = group
                if fsdp:
                    content["fsdp"] = fsdp
                label = f"{kind} {human_bytes(nbytes)}" + (f" x{group}" if kind != "p2p" else "") + f" {placement}" \
                    + (" fsdp" if fsdp else "")
                chosen = self._add(kind, label, content, float(nbytes),
                                   placements[placement] * calls_per_group)
                added.append((chosen, placement))
                known = self.group_ranks.setdefault(chosen, [])
                known += [g for g in placements.groups(placement) if g not in known][:MAX_GROUP_EXAMPLES - len(known)]
        if len(placements) > 1 and what not in self.placement_mixed:
            self.placement_mixed.append(what)
        assert chosen is not None
        self._collective_ids[key] = (placements, added)  # the placements held, so no other object takes its id
        return chosen

    def _build(self) -> None:
        spec, s = self.spec, self.spec.strategy
        # with context parallelism a rank holds seq / cp tokens of every micro-batch
        m, micro, seq = spec.micro_batches, spec.batch.micro, spec.model.seq_len // s.cp
        dtype_bytes, reduce_bytes = spec.model.dtype_bytes, spec.reduce_bytes
        devices_per_stage = s.dp * s.tp * s.cp
        stages = split_into_stages(self.layers, spec.model, s.virtual_stages)
        activation = micro * seq * spec.model.hidden * dtype_bytes
        tp_groups_of_stage = [self._placements([self.rank_of(d, t, p, c) for t in range(s.tp)]
                                               for d, c in self.replicas()) for p in range(s.pp)]
        # context parallelism: each rank's ring pair (it and the next cp rank), or the cp groups (all-gather)
        cp_pairs_of_stage = [self._placements([self.rank_of(d, t, p, c), self.rank_of(d, t, p, (c + 1) % s.cp)]
                                              for d in range(s.dp) for t in range(s.tp) for c in range(s.cp))
                             for p in range(s.pp)] if s.cp > 1 else []
        cp_groups_of_stage = [self._placements([self.rank_of(d, t, p, c) for c in range(s.cp)]
                                               for d in range(s.dp) for t in range(s.tp))
                              for p in range(s.pp)] if s.cp > 1 else []
        # expert parallelism: ep consecutive dp ranks share a block's experts; the dp / ep ranks at the same
        # place in their ep groups hold the same experts
        ep_groups_of_stage = [self._placements([self.rank_of(g * s.ep + e, t, p, c) for e in range(s.ep)]
                                               for g in range(s.dp // s.ep) for t in range(s.tp) for c in range(s.cp))
                              for p in range(s.pp)] if s.ep > 1 else []
        expert_dp_of_stage = [self._placements([self.rank_of(g * s.ep + e, t, p, c) for g in range(s.dp // s.ep)]
                                               for e in range(s.ep) for t in range(s.tp) for c in range(s.cp))
                              for p in range(s.pp)] if s.dp // s.ep > 1 and spec.model.moe else []
        # the gradients' groups: the dp x cp ranks holding the same parameters (cp = 1: the dp replicas)
        dp_groups_of_stage = [self._placements([self.rank_of(d, t, p, c) for d, c in self.replicas()]
                                               for t in range(s.tp)) for p in range(s.pp)]
        self.stages: list[StageProgram] = []
        index_of = {id(layer): i for i, layer in enumerate(self.layers)}
        per_layer: dict[tuple, tuple[str, str]] = {}  # identical layers share their events (ids cost a hash)
        for vs, stage_layers in enumerate(stages):
            tp_groups, dp_groups = tp_groups_of_stage[vs % s.pp], dp_groups_of_stage[vs % s.pp]
            # a stage's tensor-parallel all-reduces are one event (hidden-sized, tp ranks), counted once for all
            groups = recompute_groups(spec, stage_layers)
            again = {id(stage_layers[position]) for group in groups for position in group}
            calls = sum(layer.tp_allreduces for layer in stage_layers)
            calls_again = sum(layer.tp_allreduces for layer in stage_layers if id(layer) in again)
            tp_allreduce = self._collective("allreduce", activation, s.tp, tp_groups, m * (2 * calls + calls_again),
                                            "tensor-parallel groups") if calls else ""
            tp_events = {HIDDEN_ALLREDUCE: tp_allreduce} if tp_allreduce else {}

            def layer_collectives(layer: LayerDesc, pass_: str, vs: int = vs, again: set[int] = again,
                                  tp_groups: GroupPlacements = tp_groups,
                                  tp_events: dict[str, str] = tp_events) -> list[tuple[str, int]]:
                """A layer's own tensor-parallel collectives in its forward or backward (LayerDesc.tp_forward: a
                vocabulary-parallel layer's all-reduces, sequence parallelism's all-gathers and reduce-scatters)."""
                out = []
                runs = 2 if pass_ == "fwd" and id(layer) in again else 1
                for name, per_token, dtype in layer.tp_forward if pass_ == "fwd" else layer.tp_backward:
                    eid = self._collective(collective_kind(name), micro * seq * per_token, s.tp, tp_groups, m * runs,
                                           "tensor-parallel groups", dtype=dtype)
                    tp_events[name] = eid
                    out.append((eid, -1))
                for name, per_token, dtype, count in layer.cp_forward if pass_ == "fwd" else layer.cp_backward:
                    kind = collective_kind(name)
                    groups = (cp_pairs_of_stage if kind == "p2p" else cp_groups_of_stage)[vs % s.pp]
                    eid = self._collective(kind, micro * seq * per_token, s.cp, groups, m * runs * count,
                                           "context-parallel groups", dtype=dtype)
                    tp_events[name] = eid
                    out += [(eid, -1)] * count
                for name, nbytes, dtype in layer.ep_forward if pass_ == "fwd" else layer.ep_backward:
                    eid = self._collective(collective_kind(name), nbytes, s.ep, ep_groups_of_stage[vs % s.pp],
                                           m * runs, "expert-parallel groups", dtype=dtype)
                    tp_events[name] = eid
                    out.append((eid, -1))
                return out
            # per layer, in forward order: its forward items, backward event, and (zero > 0) its FSDP collectives
            per_stage: list[tuple[LayerDesc, int, list[tuple[str, int]], str, str, str, list[tuple[str, int]]]] = []
            weights: list[tuple[str, int]] = []  # split backward: each layer's W event ('' for none)
            for layer in stage_layers:
                index = index_of[id(layer)]
                # past the first virtual stage a split backward's B is the input's gradient, W the weights' (if
                # any); on the first, B is empty and W the whole backward
                split = s.split_backward and vs > 0
                checkpointed = id(layer) in again
                key = (layer.kind, layer.signature, layer.params, self.layers[index - 1].out_features if index else (),
                       split, checkpointed)
                if key not in per_layer:
                    per_layer[key] = self._layer_events(layer, index, micro, seq, split, checkpointed)
                f_id, b_id, w_id = per_layer[key]
                if s.split_backward and not split:
                    b_id, w_id = "", b_id
                self.multiplicity[f_id] += (2 if id(layer) in again else 1) * m * devices_per_stage
                for eid in (b_id, w_id):
                    if eid:
                        self.multiplicity[eid] += m * devices_per_stage
                gather = scatter = ""
                if s.zero and layer.params:
                    elements = -(-layer.params // s.dp) * s.dp  # FSDP pads every shard alike
                    unit = {"layer": layer.kind, "signature": dict(layer.signature)}
                    gather = self._collective("allgather", elements * dtype_bytes, s.dp, dp_groups,
                                              2 * m if s.zero == 3 else 1, "data-parallel groups", fsdp=unit)
                    scatter = self._collective("reducescatter", elements * reduce_bytes, s.dp, dp_groups,
                                               1 if s.zero == 1 else m, "data-parallel groups", fsdp=unit,
                                               dtype=spec.reduce_dtype)
                items = [(f_id, index)] + [(tp_allreduce, -1)] * layer.tp_allreduces + layer_collectives(layer, "fwd")
                per_stage.append((layer, index, items, b_id, gather, scatter, layer_collectives(layer, "bwd")))
                weights.append((w_id, index))

            def forward(first: bool, per_stage: list = per_stage) -> list[tuple[str, int]]:
                """zero 1 and 2 gather a layer's weights in the iteration's first forward, zero 3 in every one."""
                out = []
                for _, _, items, _, gather, _, _ in per_stage:
                    out += ([(gather, -1)] if gather and (first or s.zero == 3) else []) + items
                return out

            def backward(last: bool, per_stage: list = per_stage, groups: list[list[int]] = groups,
                         tp_allreduce: str = tp_allreduce
                         ) -> tuple[list[tuple[str, int]], list[bool], list[tuple[int, int]]]:
                """Per layer in reverse: zero 3 gathers its weights, recompute runs its group's forwards again (at
                the group's last layer), its backward, and zero 2 and 3 (zero 1 in the last one) reduce-scatter its
                gradients. Also each layer's (position of its last item, gradient bytes), for the data-parallel
                buckets."""
                out, flags, grads = [], [], []
                group_ending = {group[-1]: group for group in groups}
                for position in reversed(range(len(per_stage))):
                    layer, index, items, b_id, gather, scatter, after = per_stage[position]
                    head = [(gather, -1)] if gather and s.zero == 3 else []
                    redo = [item for q in group_ending.get(position, ()) for item in per_stage[q][2]]
                    own = ([(b_id, index)] if b_id else []) + [(tp_allreduce, -1)] * layer.tp_allreduces + after
                    out += head + redo + own
                    flags += [False] * len(head) + [True] * len(redo) + [False] * len(own)
                    grads.append((len(out) - 1, (layer.params - layer.expert_params) * reduce_bytes))
                    if scatter and (last or s.zero >= 2):
                        out.append((scatter, -1))
                        flags.append(False)
                return out, flags, grads

            fwd, first_fwd = forward(False), forward(True)
            (bwd, bwd_again, grads), (last_bwd, last_again, _) = backward(False), backward(True)
            weight = [(w_id, index) for w_id, index in reversed(weights) if w_id]
            if s.split_backward:  # a layer's gradients are made by its W item (all ready at the W step's end)
                grads, position = [], -1
                for (w_id, _), (layer, *_) in zip(reversed(weights), reversed(per_stage)):
                    position += bool(w_id)
                    grads.append((max(position, 0), (layer.params - layer.expert_params) * reduce_bytes))
            buckets = self._buckets(grads, dp_groups) if s.gradient_replicas > 1 and not s.zero else []
            self.stages.append(StageProgram(
                virtual_stage=vs, layers=[index for _, index, *_ in per_stage], forward=[e for e, _ in fwd],
                backward=[e for e, _ in bwd], buckets=buckets, optimizer=[], send_forward=None, send_backward=None,
                forward_layers=[i for _, i in fwd], backward_layers=[i for _, i in bwd], backward_again=bwd_again,
                first_forward=([e for e, _ in first_fwd], [i for _, i in first_fwd]) if first_fwd != fwd else None,
                last_backward=([e for e, _ in last_bwd], [i for _, i in last_bwd], last_again)
                if last_bwd != bwd else None, weight=[e for e, _ in weight], weight_layers=[i for _, i in weight],
                tp_events=tp_events, sequence_grads=self._sequence_grads(stage_layers, tp_groups),
                expert_grads=self._expert_grads(stage_layers, expert_dp_of_stage[vs % s.pp] if expert_dp_of_stage
                                                else None)))
        for pp_i in range(s.pp):
            # one optimizer over every parameter of the device (all its chunks), as frameworks step it; the
            # device's first virtual stage holds it
            device_layers = [layer for vs in range(pp_i, s.virtual_stages, s.pp) for layer in stages[vs]]
            o_id = self._optimizer_event(device_layers)
            if o_id:
                self.multiplicity[o_id] += devices_per_stage
                self.stages[pp_i].optimizer.append(o_id)
        if spec.model.tie_embeddings and s.pp > 1:
            shards = s.tp if s.vocab_sharded else 1
            pairs = self._placements([self.rank_of(d, t, 0, c), self.rank_of(d, t, s.pp - 1, c)]
                                     for d, c in self.replicas() for t in range(s.tp))
            tie = self._collective("allreduce", spec.model.vocab // shards * spec.model.hidden * reduce_bytes, 2,
                                   pairs, 1, "tied embedding pairs", dtype=spec.reduce_dtype)
            self.stages[0].tie = self.stages[-1].tie = tie
        for vs in range(s.virtual_stages - 1):
            # What crosses the boundary: the sending stage's last output (hidden for the built-ins, seq / tp
            # tokens of it with sequence parallelism).
            features = stages[vs][-1].out_features or (spec.model.hidden,)
            activation = micro * seq * math.prod(features) * dtype_bytes // sequence_shards(spec)
            src, dst = vs % s.pp, (vs + 1) % s.pp
            pairs = self._placements([self.rank_of(d, t, src, c), self.rank_of(d, t, dst, c)]
                                     for d, c in self.replicas() for t in range(s.tp))
            what = f"pipeline pairs {vs}->{vs + 1}"
            self.stages[vs].send_forward = self._collective("p2p", activation, 2, pairs, m, what)
            self.stages[vs + 1].send_backward = self._collective("p2p", activation, 2, pairs, m, what)

    def _sequence_grads(self, layers: list[LayerDesc], tp_groups: GroupPlacements) -> str | None:
        """Sequence parallelism: the stage's all-reduce of its replicated parameters' gradients over tp."""
        s = self.spec.strategy
        if not s.sp:
            return None
        nbytes = sum(replicated_params(self.spec.model, layer.kind) for layer in layers) * self.spec.reduce_bytes
        return self._collective("allreduce", nbytes, s.tp, tp_groups, 1, "tensor-parallel groups",
                                dtype=self.spec.reduce_dtype)

    def _expert_grads(self, layers: list[LayerDesc], groups: GroupPlacements | None) -> str | None:
        """Expert parallelism with dp > ep: the stage's experts' gradient all-reduce over the dp / ep ranks holding
        the same experts (None where each expert is on one rank, or the stage has none)."""
        nbytes = sum(layer.expert_params for layer in layers) * self.spec.reduce_bytes
        if groups is None or not nbytes:
            return None
        return self._collective("allreduce", nbytes, self.spec.strategy.dp // self.spec.strategy.ep, groups, 1,
                                "expert data-parallel groups", dtype=self.spec.reduce_dtype)

    def _layer_events(self, layer: LayerDesc, index: int, micro: int, seq: int, split: bool,
                      checkpointed: bool = False) -> tuple[str, str, str]:
        """A layer's forward, backward and weight-gradient events (multiplicities left to the caller): the
        backward whole (2 forwards' FLOPs, and a selectively recomputed block's attention core's forward again)
        and no weight event, or with `split` torch.distributed.pipelining's stage_backward_input and
        stage_backward_weight, a forward's FLOPs each (no weight event, '', for a layer without parameters).
        `checkpointed`: the layer is in a full-recompute group, which runs under torch.utils.checkpoint; its
        events say so (`"checkpointed": true`), as they cost more than the same layer's without it. With zero > 0
        a layer with parameters runs as an FSDP2 unit, its events' `fsdp2` true (harness.profile.sharded)."""
        sig = dict(layer.signature)
        label = layer_label(layer)
        compute = {"layer": layer.kind, "signature": sig, "micro": micro, "seq": seq}
        if checkpointed:
            compute["checkpointed"] = True
        if self.spec.strategy.zero and layer.params:
            compute["fsdp2"] = True
        flops = layer.fwd_flops(micro, seq)
        traffic = self._traffic(layer, index, micro * seq)
        forward = self._add("compute", f"{label}.fwd", {**compute, "phase": "fwd"}, flops, 0, traffic)
        if not split:
            again = attention_core_flops(layer, micro, seq) if selective(layer) else 0.0
            return (forward, self._add("compute", f"{label}.bwd", {**compute, "phase": "bwd"}, 2.0 * flops + again,
                                       0, 2.0 * traffic), "")
        inputs = self._add("compute", f"{label}.bwd_input", {**compute, "phase": "bwd_input"}, flops, 0, traffic)
        weights = self._add("compute", f"{label}.bwd_weight", {**compute, "phase": "bwd_weight"}, flops, 0,
                            traffic) if layer.params else ""
        return forward, inputs, weights

    def _optimizer_event(self, layers: list[LayerDesc]) -> str:
        """The optimizer step of one device: one optimizer over the parameters of `layers`, in order (multiplicity
        left to the caller); '' where they have no parameters. With zero > 0 it steps each replica's shard
        (`shard`, where dp > 1) of FSDP2's parameters, its content's `fsdp2` true (harness.profile.compute)."""
        params = sum(layer.params for layer in layers)
        if not params:
            return ""
        runs: list[list] = []  # [layer, count]: runs of identical layers, in order
        labels: list[str] = []  # each run's
        for layer in layers:
            described = {"layer": layer.kind, "signature": dict(layer.signature)}
            if runs and runs[-1][0] == described:
                runs[-1][1] += 1
            else:
                runs.append([described, 1])
                labels.append(layer_label(layer))
        name = "optimizer(" + ", ".join(f"{n}x {label}" if n > 1 else label
                                        for label, (_, n) in zip(labels, runs)) + ")"
        content = {"phase": "optimizer", "params": params, **self._optimizer_content(), "layers": runs}
        shard = self.spec.strategy.dp if self.spec.strategy.zero else 1
        if shard > 1:  # ZeRO: each replica steps its shard, every weight split along its first dimension (FSDP2)
            content["shard"] = shard
            name += f" shard 1/{shard}"
            params = -(-params // shard)
        if self.spec.strategy.zero:  # it steps FSDP2's sharded parameters (DTensors), as the run does
            content["fsdp2"] = True
        dtype = optimizer_dtype(self.spec.model.dtype, self.spec.optimizer.master_weights)
        return self._add("compute", name, content, 12.0 * params, 0, optimizer_bytes(params, dtype))

    def _optimizer_content(self) -> dict[str, Any]:
        """What an optimizer step's content adds for its optimizer: nothing for Adam (the default, so that
        profiles of Adam jobs keep their ids), the name and momentum for SGD; master weights where set."""
        o = self.spec.optimizer
        content = {} if o.name == "adam" else {"optimizer": o.name, "momentum": o.momentum}
        return {**content, "master_weights": True} if o.master_weights else content

    def _traffic(self, layer: LayerDesc, index: int, tokens: int) -> float:
        """A forward's memory traffic: its parameters and its activations in and out, in bytes."""
        in_features = self.layers[index - 1].out_features if index > 0 else ()
        return float((layer.params + tokens * (math.prod(in_features) + math.prod(layer.out_features)))
                     * self.spec.model.dtype_bytes)

    def _buckets(self, grads: list[tuple[int, int]], dp_groups: Counter[str]) -> list[Bucket]:
        """DDP-style buckets: layers' gradients in backward order, a bucket closing once it holds bucket_mb."""
        s = self.spec.strategy
        cap = int(s.bucket_mb * 2**20)
        buckets: list[Bucket] = []
        size, last = 0, -1
        for position, nbytes in grads:
            size += nbytes
            last = position
            if size >= cap:
                buckets.append(Bucket("", size, last))
                size = 0
        if size:
            buckets.append(Bucket("", size, last))
        for bucket in buckets:
            bucket.event = self._collective("allreduce", bucket.nbytes, s.gradient_replicas, dp_groups, 1,
                                            "data-parallel groups", dtype=self.spec.reduce_dtype)
        return buckets

    # ---- queries -----------------------------------------------------------------------------
    @property
    def unique_events(self) -> int:
        return len(self.events)

    @property
    def total_events(self) -> int:
        return sum(self.multiplicity.values())

    def summary(self) -> dict[str, Any]:
        """Counts for `harness events --json` (docs/events.md)."""
        s = self.spec.strategy
        return {
            "events_version": EVENTS_VERSION,
            "model": self.spec.model.name,
            "strategy": {"dp": s.dp, "tp": s.tp, "pp": s.pp, "schedule": s.schedule, "chunks": s.chunks,
                         "recompute": s.recompute, "zero": s.zero, "sp": s.sp, "cp": s.cp, "cp_comm": s.cp_comm,
                         "ep": s.ep},
            "devices": s.world,
            "micro_batches": self.spec.micro_batches,
            **self.unique().summary(),
            "placement_mixed": self.placement_mixed,
        }

    def table(self) -> list[dict[str, Any]]:
        """One row per unique event, sorted by kind then name."""
        return self.unique().table()

    def unique(self) -> UniqueEvents:
        """This plan's unique events, as a profile measures them."""
        return UniqueEvents(self.events, self.multiplicity, self.layers, self.unique_events)

    def device_flow(self, rank: int) -> Iterator[tuple[str, str, int, int]]:
        """Materialise one device's iteration: (event id, phase, virtual stage, micro-batch) in order.

        phase is F/B (compute and tensor-parallel collectives), R (the forward run again at the start of
        a backward step, recompute = "full"), W (a split backward's weight gradients), send/recv (P2P),
        dp (gradient all-reduce), tp (sequence parallelism's all-reduce of replicated gradients), ep (the experts'
        gradient all-reduce over the ranks holding the same experts), tie (the tied
        embedding's gradient all-reduce) or opt (optimizer).
        Receives are listed where the device waits for them.
        """
        s = self.spec.strategy
        if not 0 <= rank < s.world:
            raise ValueError(f"rank {rank} outside 0..{s.world - 1}")
        _, _, pp_i = self.coords(rank)
        last_micro = self.spec.micro_batches - 1
        for step in device_steps(s.schedule, pp_i, s.pp, self.spec.micro_batches, s.chunks):
            vs = virtual_stage(step.chunk, pp_i, s.pp)
            program = self.stages[vs]
            if step.phase == "W":  # one call over the stage: its buckets are launched after it
                for eid in program.weight:
                    yield eid, "W", vs, step.micro
                for bucket in program.buckets if step.micro == last_micro else ():
                    yield bucket.event, "dp", vs, step.micro
            elif step.phase == "F":
                if vs > 0:
                    yield self.stages[vs - 1].send_forward, "recv", vs, step.micro
                for eid in program.forward_of(step.micro)[0]:
                    yield eid, "F", vs, step.micro
                if program.send_forward:
                    yield program.send_forward, "send", vs, step.micro
            else:
                if vs < s.virtual_stages - 1:
                    yield self.stages[vs + 1].send_backward, "recv", vs, step.micro
                items, _, again = program.backward_of(step.micro, self.spec.micro_batches)
                for position, eid in enumerate(items):
                    yield eid, "R" if again[position] else "B", vs, step.micro
                    if step.micro == last_micro and not s.split_backward:
                        for bucket in program.buckets:
                            if bucket.ready_after == position:
                                yield bucket.event, "dp", vs, step.micro
                if program.send_backward:
                    yield program.send_backward, "send", vs, step.micro
        for chunk in range(s.chunks):
            vs = virtual_stage(chunk, pp_i, s.pp)
            if self.stages[vs].sequence_grads:
                yield self.stages[vs].sequence_grads, "tp", vs, -1
            if self.stages[vs].expert_grads:
                yield self.stages[vs].expert_grads, "ep", vs, -1
        for chunk in range(s.chunks):
            vs = virtual_stage(chunk, pp_i, s.pp)
            if self.stages[vs].tie:
                yield self.stages[vs].tie, "tie", vs, -1
        for chunk in range(s.chunks):
            for eid in self.stages[virtual_stage(chunk, pp_i, s.pp)].optimizer:
                yield eid, "opt", virtual_stage(chunk, pp_i, s.pp), -1


def build_plan(spec: JobSpec, layers: list[LayerDesc] | None = None) -> EventPlan:
    """The event plan of one iteration of `spec` (user models need `layers` or their factory)."""
    return EventPlan(spec, layers)


def events_to_profile(spec: JobSpec, layers: list[LayerDesc] | None = None,
                      gpus: int | None = None) -> tuple[UniqueEvents, Grid]:
    """What a profile of `spec` measures: its plan's events or, with a [search] grid, the union of every
    candidate's (harness.plan.candidates); and the grid (the spec alone without one). A factory model's
    `layers` are described once for all its candidates (harness.models.user.factory_layers)."""
    grid = expand(spec, gpus) if spec.search else Grid([spec], [])
    return UniqueEvents.union(build_plan(candidate, layers) for candidate in grid.candidates), grid
