"""In-context compute samples: each distinct stage's chain run as a training step runs it, every event timed inside.

A chain is one virtual stage's compute for one micro-batch: its layers' forwards in order (the model's last layer
with the loss), one backward() call over the whole stage in reverse, then the optimizer step of the device
holding the stage. Isolated samples (harness.profile.compute) time one layer at a time; inside a chain the
same layer meets its neighbours' working set in the caches, a graph as big as the stage's for the allocator and
autograd's engine walking the whole stage at once (docs/profiling.md, "In context"; bench/in_context.py
separates these). The samples of an event at every position of every chain holding it are its in-context samples.

A full-recompute group runs under torch.utils.checkpoint as harness train runs it: its forwards are timed inside
the checkpoint, and the backward of the group's last layer, which starts by running the group's forwards again,
is timed less those (each a further sample of its forward event, as the plan costs it again).

A split backward (the zero-bubble schedules) runs as harness train's B and W steps: the B one stage_backward_input
call over the stage (its layers' bwd_input marked as a whole backward's are), the W stage_backward_weight a layer's
parameter groups at a time, last layer first, each layer's bwd_weight between marks. A split schedule's first stage
runs its W as one whole backward, as the run does.

Timing: on a CPU perf_counter marks each layer's forward and, inside the backward, the moment autograd hands
each layer's input its gradient (a tensor hook: that layer's backward is over, the one before starts); on a GPU
CUDA events recorded at the same marks (the hooks run on autograd's device thread, on the stream of the op
that made the gradient), the device synchronized before the backward and the optimizer as harness train's clock
does before every step: a step starts on an idle GPU, whose first kernels wait for the host (the backward() call
starting autograd's engine). A layer's backward is the time between the gradient of its output and that of its
input; the stage's first layer's ends with the call. A split backward with recompute, or of ZeRO's layers, runs
its forwards and optimizer in context, its bwd_input and bwd_weight keeping the isolated figures.

Over a pair of ranks (a ZeRO job's, or a context-parallel job's with cp = 2: harness.profile.run.chain_pairs), a
block whose composite is over two ranks is built on the pair, its ring exchanged with the other rank as the run's
cp group exchanges it: its samples there are its composite's (the block with its ring), not the block's alone.
"""
from __future__ import annotations

import copy
import functools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from harness.models import checkpointed, make_optimizer, split_backward
from harness.plan.events import INTRA, EventPlan
from harness.plan.layers import recompute_groups
from harness.plan.spec import JobSpec
from harness.profile.compute import ComputeRunner, _forward, _loss, _make_layer, parameter_shapes, runner_content
from harness.profile.sharded import leaving_no_world, shard_alone, shard_over
from harness.profile.timer import synchronize

# timed rounds every chain gets, even past the time budget: an event sits at several positions of several
# chains, so two rounds already give it several samples
MIN_ROUNDS = 2
# the in-context rounds stop once they have run this fraction of the isolated compute phase (the profile grows by
# at most about this much: docs/profiling.md, "In context")
BUDGET_FRACTION = 0.5


@dataclass(frozen=True)
class StageChain:
    """One distinct stage's compute events in the order a step runs them: forward event ids in layer order,
    backward ids in the order they run (reverse; empty for a split backward), the device's optimizer step, and
    the full-recompute groups (positions into `forward`, each run under torch.utils.checkpoint together)."""

    forward: tuple[str, ...]
    backward: tuple[str, ...]
    optimizer: str | None
    groups: tuple[tuple[int, ...], ...] = ()
    weight: tuple[str, ...] = ()  # a split backward's W events in the order they run (`backward` its B events)

    @property
    def events(self) -> set[str]:
        return (set(self.forward) | set(self.backward) | set(self.weight)
                | ({self.optimizer} if self.optimizer else set()))


def stage_chains(plans: Iterable[EventPlan]) -> list[StageChain]:
    """The distinct chains of every virtual stage of `plans`, in first-seen order."""
    chains: dict[StageChain, None] = {}
    for plan in plans:
        for stage in plan.stages:
            items = [(eid, layer) for eid, layer in zip(stage.forward, stage.forward_layers)
                     if layer >= 0 and plan.events[eid].kind == "compute"]
            forward = tuple(eid for eid, _ in items)
            again = stage.backward_again or [False] * len(stage.backward)
            backward = tuple(eid for eid, redo in zip(stage.backward, again)
                             if not redo and eid and plan.events[eid].kind == "compute")
            weight = tuple(eid for eid in stage.weight if eid and plan.events[eid].kind == "compute")
            if not backward and _phases(plan, weight, len(forward)) == {"bwd"}:
                backward, weight = weight, ()  # a split schedule's first stage: its W step is the whole backward
            if not forward:
                continue
            position = {layer: p for p, (_, layer) in enumerate(items)}
            groups = tuple(tuple(position[stage.layers[q]] for q in group)
                           for group in recompute_groups(plan.spec, [plan.layers[i] for i in stage.layers]))
            whole = _phases(plan, backward, len(forward)) == {"bwd"}
            split = (not groups and _phases(plan, backward, len(forward)) == {"bwd_input"}
                     and _phases(plan, weight, len(forward)) == {"bwd_weight"}
                     and not any(plan.events[e].content.get("fsdp2") for e in forward))
            optimizer = stage.optimizer[0] if stage.optimizer else None
            chains[StageChain(forward, backward if whole or split else (), optimizer, groups,
                              weight if split else ())] = None
    return list(chains)


def _phases(plan: EventPlan, ids: tuple[str, ...], layers: int) -> set[str]:
    """The phases of events `ids`, one an event of each of `layers` layers (an empty set where they are not)."""
    return {plan.events[e].content.get("phase") for e in ids} if ids and len(ids) == layers else set()


def fsdp_key(layer: dict) -> str:
    """The key of the FSDP2 unit holding a layer of this content (its layer and signature), as a ZeRO collective's
    content names it (`fsdp`)."""
    return json.dumps({"layer": layer["layer"], "signature": layer["signature"]}, sort_keys=True)


def reduce_scatters_over(contents: dict[str, dict], group_size: int, placement: str) -> dict[str, str]:
    """The ZeRO reduce-scatter events of `contents` over a group of `group_size` ranks at `placement` (intra,
    inter), by the key of the unit whose gradients they carry (fsdp_key): what a chain sharded over such a group
    runs in its units' post-backwards."""
    return {fsdp_key(c["fsdp"]): eid for eid, c in contents.items()
            if c.get("kind") == "reducescatter" and c.get("fsdp") and c.get("group") == group_size
            and c.get("placement") == placement}


class _Clock:
    """Marks on a device's clock: perf_counter on a CPU, CUDA events on a GPU; seconds between marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class ChainRunner:
    """A stage chain built on a device: a layer per forward position, the stage's input, the optimizer over the
    stage's own parameters (or, where the device's optimizer covers more than this stage, over fresh parameters
    of its shapes, as ComputeRunner steps it).

    A ZeRO job's layers (`fsdp2`) are FSDP2 units over this rank alone, or with `group` over that group of ranks,
    every member running the same chains in step (harness.profile.sharded.shard_over): each run() is then one
    micro-batch of `micro_batches`, reduce-scattering and resharding as the run does at the job's zero level
    (spec.strategy.zero; 2 where the spec has none, a search's), the weights gathered before the timed forward.
    A backward that reduce-scatters is timed less its units' post-backwards (the collectives' events hold them),
    and each unit's post-backward is a sample of its reduce-scatter event over such a group (`placement`: the
    group's, intra or inter; reduce_scatters_over), as the run meets it; a backward that does not keeps them, as
    the run's backward step does (gradients accumulated, no collective).

    `composites` (compute event id -> its composite's id, the layer with its collectives on a group the size of
    `group`): with `group` and no ZeRO layer in the chain, a position whose forward and backward both have one is
    built on `group` (a context-parallel block's ring, a tensor-parallel layer's all-reduces, as the run's group
    runs them), and its samples are the composites' (in-context composite samples) instead of the events'."""

    def __init__(self, spec: JobSpec, chain: StageChain, contents: dict[str, dict], device: torch.device,
                 group=None, micro_batches: int = 1, placement: str = INTRA,
                 composites: dict[str, str] | None = None):
        self.spec, self.chain, self.device = spec, chain, device
        self.clock = _Clock(device)
        self.contents = []
        self.layers = []
        self.units: list[torch.nn.Module] = []  # the layers sharded over `group`
        self.unit_reduce_scatters: list[str | None] = []  # each unit's reduce-scatter event over such a group
        self.post_backwards: list[tuple] = []  # (unit, start, end): marks of their post-backwards in this run()
        self.zero, self.micro_batches, self.micro = spec.strategy.zero or 2, max(1, micro_batches), 0
        self.syncing = False  # whether this run()'s backward reduce-scatters
        over = reduce_scatters_over(contents, group.size(), placement) if group is not None else {}
        self.renamed = self._on_group(chain, contents, group, composites or {})
        make_input = None
        for eid in chain.forward:
            content = runner_content(spec, contents[eid])
            layer, inputs = _make_layer(spec, content, device, group=group if eid in self.renamed else None)
            if content.get("fsdp2"):  # as the run holds a ZeRO job's layer (a factory's layers are shared: a copy)
                layer = copy.deepcopy(layer) if content["layer"] == "user" else layer
                if group is None:
                    layer = shard_alone(layer, device)
                else:
                    unit = len(self.units)
                    layer = shard_over(layer, device, group,
                                       lambda start, end, u=unit: self.post_backwards.append((u, start, end)),
                                       self.clock.mark)
                    if any(True for _ in layer.parameters()):
                        self.units.append(layer)
                        self.unit_reduce_scatters.append(over.get(fsdp_key(content)))
            make_input = make_input or inputs
            self.contents.append(content)
            self.layers.append(layer)
        self.make_input = make_input
        self.optimizer = None
        if chain.optimizer is not None:
            content = contents[chain.optimizer]
            own = self._parameters()
            shapes = parameter_shapes(spec, content["layers"], device)
            params = own
            if int(content.get("shard", 1)) > 1 or [(p.shape, p.dtype) for p in own] != shapes or not chain.backward:
                params = list(ComputeRunner(spec, content, device, copies=1).layers[0].parameters())
            self.optimizer = make_optimizer(content.get("optimizer", "adam"), content.get("momentum", 0.0), params,
                                            lr=1e-4)

    @staticmethod
    def _on_group(chain: StageChain, contents: dict[str, dict], group, composites: dict[str, str]) -> dict[str, str]:
        """The chain's events whose samples are their composites' (ChainRunner's `composites`), by event id."""
        if group is None or not composites or chain.weight or any(
                contents[eid].get("fsdp2") for eid in chain.forward):
            return {}
        backward = dict(zip(chain.forward, reversed(chain.backward))) if chain.backward else {}
        out = {}
        for eid in chain.forward:
            if eid in composites and (not chain.backward or backward.get(eid) in composites):
                out[eid] = composites[eid]
                if chain.backward:
                    out[backward[eid]] = composites[backward[eid]]
        return out

    def _segments(self) -> list[tuple[int, ...]]:
        """The chain's positions in runs, in order: each recompute group together, every other position alone."""
        start = {group[0]: group for group in self.chain.groups}
        runs, position = [], 0
        while position < len(self.layers):
            run = start.get(position, (position,))
            runs.append(run)
            position += len(run)
        return runs

    def _micro_batch_begins(self) -> None:
        """Over a group: which backward reduce-scatters and reshards, as harness train's ShardedReplicas sets it
        (zero 1 keeps whole gradients to the last micro-batch; zero 3 reshards after each backward), and the
        weights gathered again where they were resharded, before the timed forward."""
        last = self.micro % self.micro_batches == self.micro_batches - 1
        self.micro += 1
        self.syncing = last or self.zero >= 2
        for unit in self.units:
            unit.set_requires_gradient_sync(self.syncing)
            unit.set_reshard_after_backward(last or self.zero == 3)
            unit.unshard()
        self.post_backwards.clear()

    def _less_post_backwards(self, start, bounds: list) -> list[float]:
        """Seconds of each backward window [bounds[p + 1], bounds[p]] (marks, latest first), less the time the units'
        post-backwards took inside it where they reduce-scattered."""
        at = [self.clock.seconds(start, mark) for mark in bounds]
        spans = [(self.clock.seconds(start, a), self.clock.seconds(start, b))
                 for _, a, b in (self.post_backwards if self.syncing else ())]
        return [at[p] - at[p + 1] - sum(max(0.0, min(b, at[p]) - max(a, at[p + 1])) for a, b in spans)
                for p in range(len(at) - 1)]

    def run(self) -> dict[str, list[float]]:
        """One chain: seconds of each event at each of its positions."""
        if self.units:
            self._micro_batch_begins()
        clock, marks_in = self.clock, {}
        x = self.make_input()
        if self.chain.weight and x.is_floating_point():  # a split backward's B is the stage input's gradient
            x.requires_grad_(True)
        stage_input = x
        forward_marks = [clock.mark()]
        redo: dict[int, list] = {}  # a recomputed position's forward again inside the backward: [start, end]
        in_backward = False
        groups = {group[0]: group for group in self.chain.groups}

        def through(run: tuple[int, ...], x, checkpointed_run: bool = False):
            """The layers at `run`'s positions in order; marks the forward, or the recompute inside the backward.
            A checkpointed run leaves the model's loss to its caller, as harness train computes it after."""
            for position in run:
                layer, content = self.layers[position], self.contents[position]
                if in_backward:
                    start = clock.mark()
                    x = layer(x)
                    redo[position] = [start, clock.mark()]
                    continue
                if position and self.chain.backward and isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(lambda grad, p=position: marks_in.__setitem__(p, clock.mark()))
                if checkpointed_run and content.get("last"):
                    x = layer(x)  # its forward mark after the loss
                    continue
                x = _forward(self.spec, layer, x, content)
                forward_marks.append(clock.mark())
            return x

        for run in self._segments():
            if run[0] in groups:  # as harness train runs a full-recompute group
                x = checkpointed(functools.partial(through, run, checkpointed_run=True), x)
                last = run[-1]
                if self.contents[last].get("last"):
                    x = _loss(self.spec, self.layers[last], x, self.contents[last])
                    forward_marks.append(clock.mark())
            else:
                x = through(run, x)
        backward_marks, weight_seconds = [], []
        if self.chain.backward:
            grad = None if x.dim() == 0 else torch.randn_like(x)
            in_backward = True
            synchronize(self.device)  # harness train's clock waits for the device at every step's start
            start = clock.mark()
            if self.chain.weight:  # as harness train's B step: the input's gradient over the stage in one call
                backward_input, _ = split_backward()
                _, param_groups = backward_input([x], None if grad is None else [grad], [stage_input],
                                                 self._parameters())
            else:
                x.backward(grad)
            end = clock.mark()
            # the last layer's backward starts with the call; each earlier one when its output got its gradient
            backward_marks = [marks_in.get(p) for p in range(1, len(self.layers))]
            backward_marks = [end] + backward_marks + [start]  # position p's backward: marks[p + 1] .. marks[p]
            if self.chain.weight:
                weight_seconds = self._weight_gradients(param_groups)
        del x, stage_input
        if self.optimizer is not None:
            synchronize(self.device)
            opt_start = clock.mark()
            self.optimizer.step()
            opt_end = clock.mark()
        synchronize(self.device)
        out: dict[str, list[float]] = {}
        for position, eid in enumerate(self.chain.forward):
            out.setdefault(eid, []).append(clock.seconds(forward_marks[position], forward_marks[position + 1]))
        recomputed = sum(len(group) for group in groups.values())
        if backward_marks and all(m is not None for m in backward_marks) and len(redo) == recomputed:
            # a group runs its forwards again at the start of its last layer's backward: that backward less them
            again = {group[-1]: sum(clock.seconds(*redo[p]) for p in group) for group in groups.values()}
            windows = self._less_post_backwards(start, backward_marks)
            backward = [windows[position] - again.get(position, 0.0) for position in range(len(self.layers))]
            # a group whose last layer saves nothing runs its forwards again inside an earlier layer's backward:
            # where that shows (a negative remainder), this run's backward samples cannot be split and are left out
            if min(backward) > 0:
                for eid, seconds in zip(reversed(self.chain.backward), backward):  # backward ids in forward order
                    out.setdefault(eid, []).append(seconds)
                for position, marks in redo.items():  # the forward again: a sample of the same event as the first
                    out[self.chain.forward[position]].append(clock.seconds(*marks))
                for eid, seconds in zip(self.chain.weight, weight_seconds):  # W ids in the order they ran
                    out.setdefault(eid, []).append(seconds)
                if self.syncing:
                    self._reduce_scatter_samples(out)
        if self.optimizer is not None:
            out.setdefault(self.chain.optimizer, []).append(clock.seconds(opt_start, opt_end))
        for eid, composite in self.renamed.items():  # built on the group: the layer with its collectives
            if eid in out:
                out.setdefault(composite, []).extend(out.pop(eid))
        return out

    def _parameters(self) -> list[torch.nn.Parameter]:
        return [p for layer in self.layers for p in layer.parameters() if p.requires_grad]

    def _weight_gradients(self, param_groups: list[dict]) -> list[float]:
        """A split backward's W step after its B (harness train's one stage_backward_weight call over the stage's
        parameter groups), run a layer's groups at a time in the order the run meets them (the last layer's
        first), a step of its own (synchronized first): seconds per layer in that order; none where a group
        holds weights of two layers (the step then runs whole, untimed)."""
        from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

        _, backward_weight = split_backward()
        owner = {_get_grad_fn_or_grad_acc(p): position for position, layer in enumerate(self.layers)
                 for p in layer.parameters() if p.requires_grad}
        by_layer: dict[int, list[dict]] = {}
        for group in param_groups:
            owners = {owner.get(node) for node in group["params"]}
            if len(owners) != 1 or None in owners:
                backward_weight(self._parameters(), param_groups)
                return []
            by_layer.setdefault(owners.pop(), []).append(group)
        synchronize(self.device)
        marks = [self.clock.mark()]
        for position in reversed(range(len(self.layers))):
            backward_weight([p for p in self.layers[position].parameters() if p.requires_grad],
                            by_layer.get(position, []))
            marks.append(self.clock.mark())
        return [self.clock.seconds(a, b) for a, b in zip(marks, marks[1:])]

    def _reduce_scatter_samples(self, out: dict[str, list[float]]) -> None:
        """Each unit's post-backward in this run() (all of its parameter groups') as a sample of the unit's
        reduce-scatter event, where it has one over this group."""
        per_unit: dict[int, float] = {}
        for unit, a, b in self.post_backwards:
            per_unit[unit] = per_unit.get(unit, 0.0) + self.clock.seconds(a, b)
        for unit, seconds in per_unit.items():
            if (eid := self.unit_reduce_scatters[unit]) is not None:
                out.setdefault(eid, []).append(seconds)


@leaving_no_world()
def measure_chains(spec: JobSpec, chains: list[StageChain], contents: dict[str, dict], device: torch.device,
                   warmup: int, repeats: int, budget_s: float,
                   on_skip: Callable[[StageChain, str], None] | None = None, group=None,
                   agree: Callable[[bool], bool] | None = None, placement: str = INTRA,
                   composites: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """In-context samples of every event of `chains` (ids of `contents`): the chains round-robin, `warmup` untimed
    rounds then up to `repeats` timed ones, stopping after MIN_ROUNDS once `budget_s` have passed since the call
    (building and warming up included).
    A chain that cannot be built or run on this device is left out (`on_skip(chain, why)`): its events keep
    their isolated samples.
    `group`: the ranks that run these same chains together, a ZeRO job's layers sharded over it (ChainRunner; at
    `placement`, intra or inter, the samples of its reduce-scatter events over such a group with them);
    `agree(stop)` then tells every member whether any wants to stop, so that all run the same rounds;
    `composites` (event id -> composite id) the layers built on it, whose samples are their composites'."""
    start = time.perf_counter()
    runners = []
    for chain in chains:
        try:
            runner = ChainRunner(spec, chain, contents, device, group=group, micro_batches=spec.micro_batches,
                                 placement=placement, composites=composites)
            for _ in range(max(1, warmup)):
                runner.run()
        except (RuntimeError, ValueError, TypeError, AttributeError) as exc:  # a shape a stage never chains
            if on_skip is not None:
                on_skip(chain, f"{type(exc).__name__}: {exc}")
            continue
        runners.append(runner)
    samples: dict[str, list[float]] = {}
    for round_ in range(repeats):
        stop = round_ >= MIN_ROUNDS and time.perf_counter() - start > budget_s
        if agree(stop) if agree is not None else stop:
            break
        for runner in runners:
            for eid, seconds in runner.run().items():
                samples.setdefault(eid, []).extend(seconds)
    return {eid: np.asarray(values) for eid, values in samples.items()}
