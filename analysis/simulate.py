"""The timeline model: every device's timeline of one training iteration from the durations of its events.

Hierarchy (docs/analysis.md):
- layer: its compute plus its tensor-parallel all-reduces, inline and blocking, in sequence; with
  recompute = "full" a layer's backward first runs its forward again (StageProgram.backward_again); with
  zero > 0 (FSDP2) its weights are all-gathered before it and its gradients reduce-scattered after it,
  inline too, in the steps StageProgram.forward_of and backward_of list them (the iteration's first forward
  and last backward differ for zero 1 and 2);
- pipeline: each device runs its forward (F) and backward (B) steps in the schedule's order
  (harness.plan.schedules); a step starts when the device is free and its P2P input has arrived. A zero-bubble
  schedule's B computes the input's gradient only and its W step, after its own B, the weights' (no P2P;
  StageProgram.weight); its data-parallel buckets are ready as the last micro-batch's W makes them. A P2P
  transfer starts when the sender has finished the step and the receiver has posted its receive (on
  reaching the step), and takes its duration, plus the sender-busy extra if it waited for the receiver
  while the sender computes; the sender does not wait (asynchronous send). The transfer is
  communication on both devices;
- data parallel: gradient buckets all-reduced in order on the device's communication track, either as
  they become ready during the last micro-batch's backward (dp_overlap, as DDP) or all after the
  device's whole backward (as DistSim); then the optimizer step once compute and all-reduces are done.
  A bucket is ready once the slowest replica has its gradients: where the profile shows how the ranks'
  speeds differ (analysis.skew), that replica is expected to lag by a fraction of the compute done (among the
  replicas that drift apart: cp's ring and ep's all-to-alls hold theirs together, drifting_replicas). A
  bucket's interval holds its averaging (the division by the replica count, Costs.bucket_divide) and then
  its all-reduce; the optimizer phase ends with each bucket zeroed for the next iteration
  (Costs.bucket_zero);
- sequence parallelism: each device all-reduces its replicated parameters' gradients over tp once its buckets
  are done, blocking, before the tie and the optimizer;
- tied embeddings (tie_embeddings, pp > 1): the first and the last device all-reduce the token table's
  gradient between them once both are done with their buckets, blocking, and step their optimizer after it;

Data-parallel replicas (but for that lag) and tensor-parallel ranks are identical, so one pipeline replica
(pp devices holding `chunks` virtual stages each) is simulated step by step, with each step's events
summed into one duration; per-event intervals are only expanded on demand (Timeline.intervals) for
traces, plots and timeline files. A device's rank is (pp_i * dp + dp_i) * tp + tp_i.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np

from analysis.costs import Costs
from analysis.intervals import spans
from harness.plan.events import SHARDED_KINDS, EventPlan
from harness.plan.schedules import kept_device_steps, virtual_stage
from harness.plan.spec import JobSpec

COMPUTE_TRACK, COMM_TRACK = "compute", "comm"
FORWARD, BACKWARD, TP_ALLREDUCE = "forward", "backward", "tp-allreduce"
P2P_SEND, P2P_RECV, DP_ALLREDUCE, OPTIMIZER = "p2p-send", "p2p-recv", "dp-allreduce", "optimizer"
P2P_POST = "p2p-post"  # the host posting a send after a step (Costs.send_post), on the compute track
RECOMPUTE = "recompute"  # a layer's forward run again in the backward step (recompute = "full")
BACKWARD_WEIGHT = "backward-weight"  # a split backward's weight gradients (zero-bubble schedules' W steps)
# zero > 0 (FSDP2): a layer's weights gathered before it, its gradients reduce-scattered after, inline in the step
ZERO_ALLGATHER, ZERO_REDUCESCATTER = "zero-allgather", "zero-reducescatter"
CATEGORIES = (FORWARD, BACKWARD, TP_ALLREDUCE, P2P_SEND, P2P_RECV, DP_ALLREDUCE, OPTIMIZER, P2P_POST, RECOMPUTE,
              ZERO_ALLGATHER, ZERO_REDUCESCATTER, BACKWARD_WEIGHT)


class StepRecord(NamedTuple):
    """One forward, backward or weight-gradient step of one micro-batch on one virtual stage, as simulated."""

    phase: str  # F | B | W
    chunk: int
    virtual_stage: int
    micro: int
    ready_s: float  # when its input was available (P2P arrival, or its own forward for the last stage)
    start_s: float
    end_s: float


class Post(NamedTuple):
    """The sender's host posting a send right after the step that produced its data (Costs.send_post)."""

    start_s: float
    end_s: float
    event: str  # the P2P event
    virtual_stage: int  # of the step that sends
    micro: int


class Transfer(NamedTuple):
    """A P2P transfer between virtual stages: activations forward, gradients backward."""

    direction: str  # activation | gradient
    event: str
    src_stage: int  # virtual stages
    dst_stage: int
    micro: int
    start_s: float
    end_s: float


def transfer_name(transfer: Transfer, verb: str) -> str:
    """'send act s1->s2 mb3' / 'recv grad s2->s1 mb0': unique per device, shared by sender and receiver."""
    what = "act" if transfer.direction == "activation" else "grad"
    return f"{verb} {what} s{transfer.src_stage}->s{transfer.dst_stage} mb{transfer.micro}"


class BucketRecord(NamedTuple):
    """One data-parallel gradient bucket all-reduce of a virtual stage (or, index -1, its tied embedding's)."""

    virtual_stage: int
    index: int
    event: str
    nbytes: int
    ready_s: float
    start_s: float
    end_s: float


class Usage(NamedTuple):
    """How a device spent the iteration: compute_s + comm_s + idle_s = batch time.

    comm_s is exposed communication (no compute running: blocking tensor-parallel all-reduces and ZeRO
    collectives, and the part of asynchronous P2P / data-parallel all-reduces outside the compute stream's
    busy time);
    overlapped_comm_s is asynchronous communication hidden behind the compute stream.
    """

    compute_s: float
    comm_s: float
    overlapped_comm_s: float
    idle_s: float


class Interval(NamedTuple):
    """One event on one device's timeline (per-event detail, expanded on demand)."""

    start_s: float
    end_s: float
    track: str  # compute | comm
    category: str  # one of CATEGORIES
    event_id: str
    name: str  # e.g. "F gpt2.block.fwd L3 s1 mb2"
    virtual_stage: int
    micro: int  # -1 when not per micro-batch (buckets, optimizer)
    layer: int  # index into plan.layers; -1 for P2P and buckets


def item_layers(plan: EventPlan, items: Sequence[str], layers: Sequence[int]) -> list[int]:
    """The layer each item of a step counts for: a layer's own compute its index, a collective the layer it
    follows, FSDP's all-gather the layer it gathers (right before it); -1 before any layer."""
    out, layer = [], -1
    for k, eid in enumerate(items):
        if layers[k] >= 0:
            layer = layers[k]
        elif k + 1 < len(items) and layers[k + 1] >= 0:
            event = plan.events[eid]
            if event.kind == "allgather" and "fsdp" in event.content:
                out.append(layers[k + 1])
                continue
        out.append(layer)
    return out


@dataclass(frozen=True)
class DeviceSummary:
    """One device's share of the iteration."""

    rank: int
    stage: int
    dp: int
    tp: int
    compute_s: float
    comm_s: float
    overlapped_comm_s: float
    idle_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "stage": self.stage, "dp": self.dp, "tp": self.tp, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "overlapped_comm_s": self.overlapped_comm_s, "idle_s": self.idle_s}


class StepCost(NamedTuple):
    """One step's items summed: its duration, the inline communication part, each item's start offset then its
    end."""

    seconds: float
    comm_s: float
    offsets: tuple[float, ...]


@dataclass(frozen=True)
class StageCosts:
    """A virtual stage's per-micro-batch durations, its events summed (the simulation's unit of work); with
    zero > 0 the first forward and the last backward of an iteration may differ (StageProgram.forward_of)."""

    forward_s: float  # compute + inline tensor-parallel all-reduces
    forward_comm_s: float  # the inline collectives' part of forward_s (tensor-parallel all-reduces, ZeRO's)
    backward_s: float
    backward_comm_s: float
    forward_offsets: tuple[float, ...]  # start offset of each forward item within the step, then its end
    backward_offsets: tuple[float, ...]
    optimizer_s: float
    send_forward_s: float  # P2P of activations to the next virtual stage
    send_backward_s: float  # P2P of gradients to the previous virtual stage
    first_forward: StepCost | None = None
    last_backward: StepCost | None = None
    weight: StepCost = StepCost(0.0, 0.0, (0.0,))  # a split backward's W step (zero-bubble schedules)

    def step(self, phase: str, micro: int, micro_batches: int) -> StepCost:
        """The cost of this stage's step of `phase` (F, B or W) for micro-batch `micro`."""
        if phase == "F":
            return self.forward_step(micro)
        if phase == "W":
            return self.weight
        return self.backward_step(micro, micro_batches)

    def forward_step(self, micro: int) -> StepCost:
        if micro == 0 and self.first_forward is not None:
            return self.first_forward
        return self._forward

    def backward_step(self, micro: int, micro_batches: int) -> StepCost:
        if micro == micro_batches - 1 and self.last_backward is not None:
            return self.last_backward
        return self._backward

    @cached_property
    def _forward(self) -> StepCost:
        return StepCost(self.forward_s, self.forward_comm_s, self.forward_offsets)

    @cached_property
    def _backward(self) -> StepCost:
        return StepCost(self.backward_s, self.backward_comm_s, self.backward_offsets)


@dataclass
class PipelineDevice:
    """The simulated timeline of pipeline device `stage` (the same for all its dp x tp replicas)."""

    stage: int
    steps: list[StepRecord]
    sends: list[Transfer]
    receives: list[Transfer]
    buckets: list[BucketRecord]
    optimizer_start_s: float
    optimizer_end_s: float
    usage: Usage
    # dp > 1: how far behind this device the slowest of its data-parallel replicas is expected to finish its
    # backward (analysis.skew); its gradient all-reduces wait for it
    replica_lag_s: float = 0.0
    replica_window_s: float = 0.0  # the compute span whose speed the lag is taken over (first step to last)
    # the host's posts of sends after steps (Costs.send_post): communication on the device's compute track
    posts: list[Post] = field(default_factory=list)
    # tie_embeddings with pp > 1, on the first and the last device: the token table's gradient all-reduce
    # between the two, once both have their gradients (their backward and buckets done), before the optimizer
    tie: BucketRecord | None = None
    # sequence parallelism: each chunk's all-reduce of its replicated parameters' gradients over tp (and expert
    # parallelism's of its experts' gradients), blocking, after the backward and buckets, before the tie and the
    # optimizer
    gradient_syncs: list[BucketRecord] = field(default_factory=list)

    @property
    def end_s(self) -> float:
        return self.optimizer_end_s


def _step_durations(costs: Costs, items: Sequence[str], layers: Sequence[int]) -> list[float]:
    """Durations of a step's items. A tensor-parallel layer profiled as a composite (with its all-reduces, on a
    real group) takes the composite's time: its compute as profiled alone, its all-reduces share the rest.
    Where a GPU profile gives the host's issue times, the step is issued and run as on a GPU (`_issued`; the
    host waits after the inline collectives unless `Costs.host_waits_on_collectives` says it does not; it issues
    each of them in `Costs.collective_issue_s`).
    A backward step is one backward() call: every backward but the first sheds the call's start that its
    own sample paid (`Costs.backward_call`), from the host's issue time on a GPU, from its time on a CPU."""
    out = _composite_split(costs, items, layers)
    host = [costs.host_issue.get(e) if layer != -1 else (costs.collective_issue_s or None)
            for e, layer in zip(items, layers)]
    called = False
    for i, eid in enumerate(items):
        call = costs.backward_call.get(eid)
        if call is None or layers[i] == -1:
            continue
        if called:
            if host[i] is not None:
                host[i] = max(0.0, host[i] - call)
            else:
                out[i] = max(0.0, out[i] - call)
        called = True
    if any(h is not None for h in host):
        waits = [layer == -1 for layer in layers] if costs.host_waits_on_collectives else None
        out = _issued(out, [h or 0.0 for h in host], waits)
    return out


def _issued(device_s: Sequence[float], host_s: Sequence[float],
            host_waits: Sequence[bool] | None = None) -> list[float]:
    """Item durations of a step on a GPU that starts idle: the host issues item i in host_s[i] after the
    previous ones, the device runs it in device_s[i] after the previous item and cannot finish it before its
    last kernel was issued; after an item with host_waits[i] (an inline collective: harness train times
    each between two synchronizations) the host goes on only once the device is done. An item's duration is
    how much later the device finishes it than the one before: a host-bound start (a backward's first
    layer, small layers) shows, a host running ahead costs nothing."""
    out, host_end, device_end = [], 0.0, 0.0
    for i, (device, host) in enumerate(zip(device_s, host_s)):
        host_end += host
        end = max(device_end + device, host_end)
        out.append(end - device_end)
        device_end = end
        if host_waits is not None and host_waits[i]:
            host_end = device_end
    return out


def _composite_split(costs: Costs, items: Sequence[str], layers: Sequence[int]) -> list[float]:
    out = [costs.seconds(e) for e in items]
    i = 0
    while i < len(items):
        end = i + 1
        while end < len(items) and layers[end] == -1:  # the layer's inline collectives
            end += 1
        if items[i] in costs.composites and end > i + 1:
            rest = max(0.0, costs.composites[items[i]] - out[i])
            for k in range(i + 1, end):
                out[k] = rest / (end - i - 1)
        i = end
    return out


def stage_costs(plan: EventPlan, costs: Costs) -> list[StageCosts]:
    """Sum each virtual stage's events into per-step durations (prefix offsets kept for buckets and detail)."""
    def step(items: Sequence[str], layers: Sequence[int]) -> StepCost:
        durations = _step_durations(costs, items, layers)
        offsets = tuple(accumulate(durations, initial=0.0))
        return StepCost(offsets[-1], sum(d for e, d in zip(items, durations) if plan.events[e].kind != "compute"),
                        offsets)

    out = []
    for program in plan.stages:
        fwd = step(program.forward, program.forward_layers)
        bwd = step(program.backward, program.backward_layers)
        out.append(StageCosts(
            forward_s=fwd.seconds, forward_comm_s=fwd.comm_s,
            backward_s=bwd.seconds, backward_comm_s=bwd.comm_s,
            forward_offsets=fwd.offsets, backward_offsets=bwd.offsets,
            optimizer_s=(sum(costs.seconds(e) for e in program.optimizer)
                         + sum(costs.bucket_zero.get(b.event, 0.0) for b in program.buckets)),
            send_forward_s=costs.seconds(program.send_forward) if program.send_forward else 0.0,
            send_backward_s=costs.seconds(program.send_backward) if program.send_backward else 0.0,
            first_forward=step(*program.first_forward) if program.first_forward else None,
            last_backward=step(*program.last_backward[:2]) if program.last_backward else None,
            weight=step(program.weight, program.weight_layers)))
    return out


MAX_PASSES = 6  # the schedule is redone while which transfers wait on a computing sender, or are received late, changes


class _Schedule(NamedTuple):
    records: list[list[StepRecord]]
    transfers: dict[tuple[str, int, int], tuple[float, float]]  # (direction, src stage, micro) -> start, end
    free: list[float]
    backward_start: list[list[float]]  # per virtual stage and micro-batch: when the step making its gradients began
    sender_busy: frozenset  # the (direction, src stage, micro) transfers costed with the sender computing
    posts: list[list[Post]]  # per device, its host's posts of sends after steps
    late: frozenset = frozenset()  # the (direction, src stage, micro) transfers costed as received late


def engine_gap(gaps: dict[str, float], before: str | None, after: str) -> float:
    """The training engine's host seconds between a device's step of phase `before` and its next of phase `after`
    (Costs.engine_gaps; a split backward's W counted as a B): none before the first step (the iteration's start
    gap holds it) or where the profile has none."""
    if before is None or not gaps:
        return 0.0
    return gaps.get(f"{'B' if before == 'W' else before}->{'B' if after == 'W' else after}", 0.0)


def _computing(steps: Sequence[StepRecord], starts: Sequence[float], t: float) -> bool:
    """Whether a device runs a step at time t (`steps` in start order, `starts` their start times)."""
    i = bisect_right(starts, t) - 1
    return i >= 0 and t < steps[i].end_s


def _schedule(plan: EventPlan, per_stage: Sequence[StageCosts], costs: Costs,
              previous: _Schedule | None) -> _Schedule:
    """One pass of list scheduling: every device runs its steps in the schedule's order, each when the device
    is free (and the engine's gap since its last step has passed: engine_gap) and its input has arrived; the
    first after the iteration's start gap; a step that sends keeps its device for the send's post after it. A P2P
    transfer starts once the sender has finished the step and the receiver has posted its receive (when it
    reaches the step): a transfer that waits for its receiver pays the P2P's sender-busy extra if the sender
    computes at that moment in the `previous` pass. A transfer that waits for its receiver takes its
    late_transfer_cpu from both ends' compute: from the receiving step, and from the sender after its post where
    the transfer waited so in the `previous` pass."""
    s = plan.spec.strategy
    pp, V, m = s.pp, s.virtual_stages, plan.spec.micro_batches
    schedules = [kept_device_steps(s.schedule, d, pp, m, s.chunks) for d in range(pp)]
    forward_end: list[list[float | None]] = [[None] * m for _ in range(V)]
    backward_end: list[list[float | None]] = [[None] * m for _ in range(V)]
    backward_start: list[list[float]] = [[0.0] * m for _ in range(V)]
    records: list[list[StepRecord]] = [[] for _ in range(pp)]
    transfers: dict[tuple[str, int, int], tuple[float, float]] = {}
    sender_busy: set = set()
    late: set = set()
    previous_late = previous.late if previous is not None else frozenset()
    gaps = costs.engine_gaps
    free = [gaps.get("start", 0.0)] * pp  # the engine's gap from the iteration's start to its first step
    last_phase: list[str | None] = [None] * pp
    posts: list[list[Post]] = [[] for _ in range(pp)]
    position = [0] * pp
    previous_records = previous.records if previous is not None else None
    previous_starts = [[r.start_s for r in steps] for steps in previous_records] if previous is not None else None
    # the sender's host time to post a step's send to another device (Costs.send_post)
    post_after = {"F": [(plan.stages[vs].send_forward, costs.send_post.get(plan.stages[vs].send_forward, 0.0))
                        if vs < V - 1 and (vs + 1) % pp != vs % pp else (None, 0.0) for vs in range(V)],
                  "B": [(plan.stages[vs].send_backward, costs.send_post.get(plan.stages[vs].send_backward, 0.0))
                        if vs > 0 and (vs - 1) % pp != vs % pp else (None, 0.0) for vs in range(V)]}

    def arrival(direction: str, src: int, dst_device: int, micro: int, sent: float, event: str | None,
                duration: float) -> tuple[float, float]:
        """When the transfer's data is at the receiver, and the compute its receiving step loses to it."""
        posted = free[dst_device]
        src_device = src % pp
        taken = 0.0
        if posted <= sent or src_device == dst_device:
            start = sent
        else:  # the data waited at the sender for this receive
            start = posted
            extra = costs.sender_busy_extra.get(event, 0.0) if event else 0.0
            if extra and previous is not None and _computing(previous_records[src_device],
                                                             previous_starts[src_device], posted):
                duration += extra
                sender_busy.add((direction, src, micro))
            taken = costs.late_transfer_cpu.get(event, 0.0) if event else 0.0
            if taken:
                late.add((direction, src, micro))
        transfers[(direction, src, micro)] = (start, start + duration)
        return start + duration, taken

    no_post = ((None, 0.0),) * V
    gradients_begin = "W" if s.split_backward else "B"  # the step whose start backward_start keeps
    remaining = sum(len(steps) for steps in schedules)
    while remaining:
        progressed = False
        for d in range(pp):
            steps, k = schedules[d], position[d]
            while k < len(steps):
                phase, chunk, micro = steps[k]
                vs = chunk * pp + d
                if phase == "W":  # after its own B, on the same device: nothing to wait for but the device
                    ready = backward_end[vs][micro]
                    duration = per_stage[vs].weight.seconds
                elif phase == "F":
                    if vs > 0:
                        sent = forward_end[vs - 1][micro]
                        if sent is None:
                            break
                        ready, taken = arrival("activation", vs - 1, d, micro, sent, plan.stages[vs - 1].send_forward,
                                               per_stage[vs - 1].send_forward_s)
                    else:
                        ready, taken = 0.0, 0.0
                    duration = per_stage[vs].forward_step(micro).seconds + taken
                else:
                    if vs < V - 1:
                        sent = backward_end[vs + 1][micro]
                        if sent is None:
                            break
                        ready, taken = arrival("gradient", vs + 1, d, micro, sent, plan.stages[vs + 1].send_backward,
                                               per_stage[vs + 1].send_backward_s)
                    else:
                        own_forward = forward_end[vs][micro]
                        if own_forward is None:
                            break
                        ready, taken = own_forward, 0.0
                    duration = per_stage[vs].backward_step(micro, m).seconds + taken
                start = max(free[d] + engine_gap(gaps, last_phase[d], phase), ready)
                last_phase[d] = phase
                end = start + duration
                if phase == "F":
                    forward_end[vs][micro] = end
                elif phase == "B":
                    backward_end[vs][micro] = end
                if phase == gradients_begin:
                    backward_start[vs][micro] = start
                records[d].append(StepRecord(phase, chunk, vs, micro, ready, start, end))
                # a step that sends posts its send before the device goes on (a W sends nothing)
                event, post = post_after.get(phase, no_post)[vs]
                if event and ("activation" if phase == "F" else "gradient", vs, micro) in previous_late:
                    post += costs.late_transfer_cpu.get(event, 0.0)  # its library's threads, after the post
                if post:
                    posts[d].append(Post(end, end + post, event, vs, micro))
                free[d] = end + post
                k += 1
            if k > position[d]:
                progressed = True
                remaining -= k - position[d]
                position[d] = k
        if not progressed:
            stuck = {d: schedules[d][position[d]] for d in range(pp) if position[d] < len(schedules[d])}
            raise RuntimeError(f"schedule {s.schedule!r} deadlocks: devices wait on {stuck}")
    return _Schedule(records, transfers, free, backward_start, frozenset(sender_busy), posts, frozenset(late))


def simulate(plan: EventPlan, costs: Costs, dp_overlap: bool | None = None,
             per_stage: Sequence[StageCosts] | None = None) -> Timeline:
    """Simulate one iteration of `plan` with `costs`; dp_overlap None takes the spec's strategy.dp_overlap.
    `per_stage` replaces the step durations that stage_costs sums from `costs` (`analysis validate` replays
    a run's own compute so); the transfers, posts and buckets still take their costs from `costs`. Such a
    timeline is for its batch time and usage: its `intervals()` still lay out the optimizer's events at
    their costs."""
    return _simulate(plan, costs, dp_overlap, per_stage, usage=True)


def least_batch_time(plan: EventPlan, per_stage: Sequence[StageCosts]) -> float:
    """A floor under simulate()'s batch time from the stages' step costs alone, whatever the transfers and
    buckets add: on each pipeline device, its steps and optimizer back to back (every step lasts at least its
    cost), after the forwards its first step waits for on the virtual stages before it, and, where its last
    step is a backward, before the backwards of that micro-batch on the virtual stages before it and the first
    device's optimizer, which wait for it. The search sizes what it simulates with it."""
    s = plan.spec.strategy
    pp, m = s.pp, plan.spec.micro_batches
    floor = 0.0
    for d in range(pp):
        local = [per_stage[virtual_stage(c, d, pp)] for c in range(s.chunks)]
        steps = sum((m - 1) * st.forward_s + st.forward_step(0).seconds
                    + (m - 1) * st.backward_s + st.backward_step(m - 1, m).seconds
                    + (m * st.weight.seconds if s.split_backward else 0.0) for st in local)
        optimizer = sum(st.optimizer_s for st in local)
        schedule = kept_device_steps(s.schedule, d, pp, m, s.chunks)
        first, last = schedule[0], schedule[-1]
        fill = sum(per_stage[vs].forward_step(first.micro).seconds
                   for vs in range(virtual_stage(first.chunk, d, pp))) if first.phase == "F" else 0.0
        after = optimizer
        last_stage = virtual_stage(last.chunk, d, pp)
        if last.phase == "B" and last_stage > 0:
            chain = sum(per_stage[vs].backward_step(last.micro, m).seconds for vs in range(last_stage))
            after = max(after, chain + sum(per_stage[virtual_stage(c, 0, pp)].optimizer_s for c in range(s.chunks)))
        floor = max(floor, fill + steps + after)
    return floor


def batch_time(plan: EventPlan, costs: Costs, dp_overlap: bool | None = None) -> float:
    """simulate(plan, costs, dp_overlap).batch_time_s, without the devices' usage (what a resample needs)."""
    return _simulate(plan, costs, dp_overlap, None, usage=False).batch_time_s


def _simulate(plan: EventPlan, costs: Costs, dp_overlap: bool | None, per_stage: Sequence[StageCosts] | None,
              usage: bool) -> Timeline:
    spec = plan.spec
    s = spec.strategy
    overlap = s.dp_overlap if dp_overlap is None else dp_overlap
    pp, m = s.pp, spec.micro_batches
    per_stage = list(per_stage) if per_stage is not None else stage_costs(plan, costs)
    if len(per_stage) != s.virtual_stages:
        raise ValueError(f"{len(per_stage)} stage costs for {s.virtual_stages} virtual stages")
    # Which senders compute when their receivers post, and which transfers are received late, depend on the
    # schedule they shape: redo the schedule with the previous pass's until that stops changing (at once without
    # sender-busy extras or late transfers' compute).
    schedule = _schedule(plan, per_stage, costs, None)
    if costs.sender_busy_extra or costs.late_transfer_cpu:
        for _ in range(MAX_PASSES):
            again = _schedule(plan, per_stage, costs, schedule)
            done = again.sender_busy == schedule.sender_busy and again.late == schedule.late
            schedule = again
            if done:
                break
    records, free, backward_start = schedule.records, schedule.free, schedule.backward_start

    sends: list[list[Transfer]] = [[] for _ in range(pp)]
    receives: list[list[Transfer]] = [[] for _ in range(pp)]
    for d in range(pp) if usage else ():  # the transfers as each device sees them: for its usage alone
        for r in records[d]:
            program = plan.stages[r.virtual_stage]
            if r.phase == "F" and program.send_forward:
                key, t_event, dst = ("activation", r.virtual_stage, r.micro), program.send_forward, r.virtual_stage + 1
            elif r.phase == "B" and program.send_backward:
                key, t_event, dst = ("gradient", r.virtual_stage, r.micro), program.send_backward, r.virtual_stage - 1
            else:
                continue
            start, end = schedule.transfers[key]
            t = Transfer(key[0], t_event, r.virtual_stage, dst, r.micro, start, end)
            sends[d].append(t)
            receives[t.dst_stage % pp].append(t)

    pipeline = []
    for d in range(pp):
        compute_end = free[d]
        lag, window = _replica_lag(records[d], costs, drifting_replicas(plan, d))
        pending = []
        for chunk in range(s.chunks):
            vs = chunk * pp + d
            offsets = per_stage[vs].step("W" if s.split_backward else "B", m - 1, m).offsets
            for index, bucket in enumerate(plan.stages[vs].buckets):
                # a split backward's W is one call over the stage: its buckets are ready at its end
                made = offsets[-1] if s.split_backward else offsets[bucket.ready_after + 1]
                gradients_ready = backward_start[vs][m - 1] + made
                pending.append((gradients_ready, vs, index, bucket))
        pending.sort(key=lambda item: item[:3])
        buckets, comm_free = [], 0.0 if overlap else compute_end + lag(compute_end)
        for ready, vs, index, bucket in pending:
            ready += lag(ready)  # the slowest replica's gradients, which the all-reduce waits for
            start = max(ready, comm_free)
            # the bucket's interval covers its averaging (divided by the replica count) and its all-reduce
            comm_free = start + costs.bucket_divide.get(bucket.event, 0.0) + costs.seconds(bucket.event)
            buckets.append(BucketRecord(vs, index, bucket.event, bucket.nbytes, ready, start, comm_free))
        optimizer_start = max([compute_end + costs.engine_gaps.get("B->opt", 0.0)] + [b.end_s for b in buckets])
        optimizer_s = sum(per_stage[chunk * pp + d].optimizer_s for chunk in range(s.chunks))
        receives[d].sort(key=lambda t: t.start_s)
        pipeline.append(PipelineDevice(d, records[d], sends[d], receives[d], buckets, optimizer_start,
                                       optimizer_start + optimizer_s, Usage(0.0, 0.0, 0.0, 0.0),
                                       lag(compute_end), window, schedule.posts[d]))
    _gradient_syncs(plan, costs, pipeline)
    _tie_embeddings(plan, costs, pipeline)
    batch_time_s = max(device.end_s for device in pipeline) + costs.engine_gaps.get("end", 0.0)
    if usage:
        for device in pipeline:
            device.usage = _usage(device, per_stage, batch_time_s, m)
    return Timeline(plan=plan, costs=costs, dp_overlap=overlap, batch_time_s=batch_time_s, pipeline=pipeline,
                    stage_costs=per_stage)


def drifting_replicas(plan: EventPlan, device: int) -> int:
    """How many groups of pipeline device `device`'s gradient replicas (dp x cp) drift apart: replicas that its
    stages' every step exchanges with inside a layer (cp's ring, ep's all-to-all) wait for each other there,
    layer by layer, and end their compute together, as one."""
    s = plan.spec.strategy
    axes = {name.split(".")[0] for chunk in range(s.chunks)
            for name in plan.stages[virtual_stage(chunk, device, s.pp)].tp_events}
    held = (s.cp if "cp" in axes else 1) * (s.ep if "ep" in axes else 1)
    return max(1, s.gradient_replicas // held)


def _replica_lag(steps: Sequence[StepRecord], costs: Costs, replicas: int):
    """(t -> how far the slowest of `replicas` data-parallel replicas of this device is expected to lag at
    time t, the window): the skew's lag fraction over the device's compute span (the window), times the
    compute done before t."""
    skew = costs.replica_skew
    if skew is None or not steps:
        return (lambda t: 0.0), 0.0
    window = max(r.end_s for r in steps) - min(r.start_s for r in steps)
    fraction = skew.lag_fraction(replicas, window) if replicas > 1 else 0.0
    if fraction <= 0:
        return (lambda t: 0.0), window
    step_spans = sorted((r.start_s, r.end_s) for r in steps)
    starts = [a for a, _ in step_spans]
    done = list(accumulate((b - a for a, b in step_spans), initial=0.0))

    def lag(t: float) -> float:
        i = bisect_right(starts, t)  # steps that started by t; the last of them may still run
        if i == 0:
            return 0.0
        a, b = step_spans[i - 1]
        return fraction * (done[i - 1] + min(t, b) - a)
    return lag, window


def _gradient_syncs(plan: EventPlan, costs: Costs, pipeline: list[PipelineDevice]) -> None:
    """Sequence parallelism: each device's chunks all-reduce their replicated gradients over tp, and expert
    parallelism (dp > ep) their experts' gradients over the ranks holding the same experts, one after another,
    before its optimizer step (harness train's order)."""
    s = plan.spec.strategy
    for device in pipeline:
        for chunk in range(s.chunks):
            vs = virtual_stage(chunk, device.stage, s.pp)
            for event in (plan.stages[vs].sequence_grads, plan.stages[vs].expert_grads):
                if event:
                    _blocking_before_optimizer(plan, costs, device, vs, event)


def _blocking_before_optimizer(plan: EventPlan, costs: Costs, device: PipelineDevice, vs: int, event: str) -> None:
    """A blocking all-reduce of gradients right before the device's optimizer step, which it delays."""
    start = device.optimizer_start_s
    end = start + costs.seconds(event)
    device.gradient_syncs.append(BucketRecord(vs, -1, event, plan.events[event].bytes, start, start, end))
    device.optimizer_start_s, device.optimizer_end_s = end, device.optimizer_end_s + end - start


def _tie_embeddings(plan: EventPlan, costs: Costs, pipeline: list[PipelineDevice]) -> None:
    """tie_embeddings with pp > 1: the first and the last device all-reduce the token table's gradient once both
    are ready for their optimizer step (as harness train and Megatron-LM do, after the data-parallel buckets);
    both step their optimizer after it."""
    tie = plan.stages[0].tie
    if not tie:
        return
    ends = (pipeline[0], 0), (pipeline[-1], len(plan.stages) - 1)
    start = max(device.optimizer_start_s for device, _ in ends)
    end = start + costs.seconds(tie)
    for device, vs in ends:
        device.tie = BucketRecord(vs, -1, tie, plan.events[tie].bytes, device.optimizer_start_s, start, end)
        device.optimizer_end_s += end - device.optimizer_start_s
        device.optimizer_start_s = end


def _usage(device: PipelineDevice, per_stage: Sequence[StageCosts], batch_time: float,
           micro_batches: int) -> Usage:
    compute = tp_comm = 0.0
    busy = []
    for r in device.steps:
        step_comm = per_stage[r.virtual_stage].step(r.phase, r.micro, micro_batches).comm_s
        compute += (r.end_s - r.start_s) - step_comm
        tp_comm += step_comm
        busy.append((r.start_s, r.end_s))
    compute += device.optimizer_end_s - device.optimizer_start_s
    busy.append((device.optimizer_start_s, device.optimizer_end_s))
    for g in device.gradient_syncs:
        tp_comm += g.end_s - g.start_s
        busy.append((g.start_s, g.end_s))
    asynchronous = spans([(t.start_s, t.end_s) for t in device.sends + device.receives]
                         + [(b.start_s, b.end_s) for b in device.buckets + ([device.tie] if device.tie else [])]
                         + [(p.start_s, p.end_s) for p in device.posts])
    hidden = (asynchronous & spans(busy)).length
    exposed = tp_comm + asynchronous.length - hidden
    # idle is what is left: the three parts sum to the batch time (a rounding-level negative becomes 0)
    return Usage(compute, exposed, hidden, max(0.0, batch_time - compute - exposed))


@dataclass
class Timeline:
    """The simulated iteration: one pipeline replica, expandable to every device of the job."""

    plan: EventPlan
    costs: Costs
    dp_overlap: bool
    batch_time_s: float
    pipeline: list[PipelineDevice]  # index: pipeline stage (device position in the pipeline)
    stage_costs: list[StageCosts]  # index: virtual stage

    @property
    def spec(self) -> JobSpec:
        return self.plan.spec

    @property
    def world(self) -> int:
        return self.spec.strategy.world

    @property
    def throughput_samples_s(self) -> float:
        return self.spec.batch.global_size / self.batch_time_s if self.batch_time_s > 0 else float("inf")

    @property
    def throughput_tokens_s(self) -> float:
        return self.throughput_samples_s * self.spec.model.seq_len

    @property
    def bubble_fraction(self) -> float:
        """Mean over devices of idle time / batch time (replicas are identical: the mean over stages)."""
        if self.batch_time_s <= 0:
            return 0.0
        return sum(d.usage.idle_s for d in self.pipeline) / (len(self.pipeline) * self.batch_time_s)

    @property
    def total_events(self) -> int:
        """Events of the whole iteration over all devices (the plan's multiplicities)."""
        return self.plan.total_events

    def stage_dp_tp(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, dp index, tp index) of a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1}")
        dp_i, tp_i, pp_i = self.plan.coords(rank)
        return pp_i, dp_i, tp_i

    def device(self, rank: int) -> DeviceSummary:
        """The usage of global `rank` (that of its pipeline stage)."""
        stage, dp_i, tp_i = self.stage_dp_tp(rank)
        u = self.pipeline[stage].usage
        return DeviceSummary(rank, stage, dp_i, tp_i, u.compute_s, u.comm_s, u.overlapped_comm_s, u.idle_s)

    def devices(self, ranks: Sequence[int]) -> list[DeviceSummary]:
        return [self.device(rank) for rank in ranks]

    def layer_passes(self) -> list[dict[str, Any]]:
        """Per pipeline device and layer kind, one micro-batch's pass through a layer of that kind, the median over
        the device's layers of it (seconds): `forward_s`, `backward_s` (its recompute and, with a split backward,
        its weight gradients included), `recompute_s` (full recompute's forward run again; selective recompute's
        attention core is part of the block's backward event), and of the forward and backward what their
        collectives took (`forward_comm_s`, `backward_comm_s`). A collective counts for the layer it follows, as on the
        timeline (`intervals`), and FSDP's all-gather for the layer it gathers. The steady steps: not ZeRO's
        first forward or last backward."""
        plan = self.plan
        parts = ("forward_s", "forward_comm_s", "backward_s", "backward_comm_s", "recompute_s")
        passes: dict[tuple[int, int], dict[str, float]] = {}
        for vs, program in enumerate(plan.stages):
            c = self.stage_costs[vs]
            steps = (("forward", program.forward, program.forward_layers, c.forward_offsets, ()),
                     ("backward", program.backward, program.backward_layers, c.backward_offsets,
                      program.backward_again),
                     ("backward", program.weight, program.weight_layers, c.weight.offsets, ()))
            for part, items, layers, offsets, again in steps:
                for k, (eid, layer) in enumerate(zip(items, item_layers(plan, items, layers))):
                    if layer < 0:
                        continue
                    seconds = offsets[k + 1] - offsets[k]
                    entry = passes.setdefault((vs % self.spec.strategy.pp, layer), dict.fromkeys(parts, 0.0))
                    entry[f"{part}_s"] += seconds
                    if plan.events[eid].kind != "compute":
                        entry[f"{part}_comm_s"] += seconds
                    if k < len(again) and again[k]:
                        entry["recompute_s"] += seconds
        kinds: dict[tuple[int, str], list[dict[str, float]]] = {}
        for (stage, layer), entry in sorted(passes.items()):
            kinds.setdefault((stage, plan.layers[layer].kind), []).append(entry)
        return [{"stage": stage, "layer": kind, "layers": len(entries),
                 **{part: float(np.median([e[part] for e in entries])) for part in parts}}
                for (stage, kind), entries in kinds.items()]

    def intervals(self, stage: int) -> list[Interval]:
        """Every event of pipeline device `stage` (any of its replicas), sorted by start then track."""
        plan, device = self.plan, self.pipeline[stage]
        out: list[Interval] = []
        for r in device.steps:
            program = plan.stages[r.virtual_stage]
            groups = {eid: name.split(".", 1)[0] for name, eid in program.tp_events.items()
                      if name.startswith(("cp.", "ep."))}
            c = self.stage_costs[r.virtual_stage]
            m = self.spec.micro_batches
            if r.phase == "F":
                items, layers = program.forward_of(r.micro)
                again, offsets, category = [False] * len(items), c.forward_step(r.micro).offsets, FORWARD
            elif r.phase == "W":
                items, layers = program.weight, program.weight_layers
                again, offsets, category = [False] * len(items), c.weight.offsets, BACKWARD_WEIGHT
            else:
                items, layers, again = program.backward_of(r.micro, m)
                offsets, category = c.backward_step(r.micro, m).offsets, BACKWARD
            for k, (eid, layer) in enumerate(zip(items, item_layers(plan, items, layers))):
                event = plan.events[eid]
                start, end = r.start_s + offsets[k], r.start_s + offsets[k + 1]
                suffix = f"L{layer} s{r.virtual_stage} mb{r.micro}"
                phase = "R" if again[k] else r.phase
                if event.kind == "compute":
                    out.append(Interval(start, end, COMPUTE_TRACK, RECOMPUTE if again[k] else category, eid,
                                        f"{phase} {event.name} {suffix}", r.virtual_stage, r.micro, layer))
                elif event.kind in SHARDED_KINDS and "fsdp" in event.content:
                    out.append(Interval(start, end, COMPUTE_TRACK, ZERO_ALLGATHER if event.kind == "allgather"
                                        else ZERO_REDUCESCATTER, eid, f"{phase} zero {event.name} {suffix}",
                                        r.virtual_stage, r.micro, layer))
                else:
                    group = groups.get(eid, "tp")
                    out.append(Interval(start, end, COMPUTE_TRACK, TP_ALLREDUCE, eid,
                                        f"{phase} {group} {event.name} {suffix}", r.virtual_stage, r.micro, layer))
        for p in device.posts:
            out.append(Interval(p.start_s, p.end_s, COMPUTE_TRACK, P2P_POST, p.event,
                                f"post {plan.events[p.event].name} s{p.virtual_stage} mb{p.micro}", p.virtual_stage,
                                p.micro, -1))
        for t in device.sends:
            out.append(Interval(t.start_s, t.end_s, COMM_TRACK, P2P_SEND, t.event, transfer_name(t, "send"),
                                t.src_stage, t.micro, -1))
        for t in device.receives:
            out.append(Interval(t.start_s, t.end_s, COMM_TRACK, P2P_RECV, t.event, transfer_name(t, "recv"),
                                t.dst_stage, t.micro, -1))
        for b in device.buckets:
            out.append(Interval(b.start_s, b.end_s, COMM_TRACK, DP_ALLREDUCE, b.event,
                                f"dp {plan.events[b.event].name} bucket {b.index} s{b.virtual_stage}",
                                b.virtual_stage, -1, -1))
        for g in device.gradient_syncs:
            experts = g.event == plan.stages[g.virtual_stage].expert_grads
            out.append(Interval(g.start_s, g.end_s, COMPUTE_TRACK, DP_ALLREDUCE if experts else TP_ALLREDUCE, g.event,
                                f"{'ep' if experts else 'tp'} {plan.events[g.event].name} "
                                f"{'expert' if experts else 'replicated'} gradients s{g.virtual_stage}",
                                g.virtual_stage, -1, -1))
        if device.tie:
            b = device.tie
            out.append(Interval(b.start_s, b.end_s, COMM_TRACK, DP_ALLREDUCE, b.event,
                                f"tie {plan.events[b.event].name} s{b.virtual_stage}", b.virtual_stage, -1, -1))
        t = device.optimizer_start_s
        for chunk in range(self.spec.strategy.chunks):
            vs = chunk * self.spec.strategy.pp + stage
            program = plan.stages[vs]
            for eid in program.optimizer:  # one optimizer over the device's parameters (its first chunk holds it)
                end = t + self.costs.seconds(eid)
                out.append(Interval(t, end, COMPUTE_TRACK, OPTIMIZER, eid, f"opt {plan.events[eid].name} s{vs}",
                                    vs, -1, -1))
                t = end
            for index, bucket in enumerate(program.buckets):
                zero = self.costs.bucket_zero.get(bucket.event)
                if zero is not None:  # the bucket's gradients cleared for the next iteration
                    out.append(Interval(t, t + zero, COMPUTE_TRACK, OPTIMIZER, "", f"zero bucket {index} s{vs}",
                                        vs, -1, -1))
                    t += zero
        out.sort(key=lambda i: (i.start_s, i.track != COMPUTE_TRACK, i.end_s))
        return out
