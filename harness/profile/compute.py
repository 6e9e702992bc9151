"""Compute events: build one layer (a tensor-parallel shard) and time its forward, backward or optimizer step.

The layer runs alone: a tensor-parallel shard's collectives are measured as their own events. A split
backward (zero-bubble schedules) is timed in its two parts as torch.distributed.pipelining runs them:
`bwd_input` (stage_backward_input: the input's gradient, keeping the weights' part of the graph) and
`bwd_weight` (stage_backward_weight, after an untimed bwd_input). A layer in a full-recompute group (its events'
content says `checkpointed`) runs its forward under torch.utils.checkpoint, as harness train runs it; alone, its
backward is timed as without recompute (its stage's chain, harness.profile.in_context, times it with the
checkpoint's share). A ZeRO job's layer with weights (`fsdp2`) runs as an FSDP2 unit (harness.profile.sharded).
"""
from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from harness.models import TORCH_DTYPES, build_layer, checkpointed, make_optimizer, split_backward
from harness.models.transformer import Head, cross_entropy
from harness.plan.activations import BackwardTemporaries
from harness.plan.kernels import shard_shape
from harness.plan.precision import relative_half_width
from harness.plan.spec import JobSpec
from harness.profile.memory import activation_bytes, backward_temporaries, kept_for_weights
from harness.profile.sharded import leaving_no_world, shard_alone, sharded_alone
from harness.profile.timer import can_time_issued, synchronize, time_issued, time_region

_USER_MODELS: dict[JobSpec, tuple] = {}


def _user_model(spec: JobSpec) -> tuple:
    """A factory model's description and layers, built once per spec and shared by its events' runners."""
    if spec not in _USER_MODELS:
        from harness.models.user import describe_user_model, load_factory_layers

        _USER_MODELS[spec] = (describe_user_model(spec), load_factory_layers(spec.model))
    return _USER_MODELS[spec]


def _make_layer(spec: JobSpec, content: dict, device: torch.device,
                group=None) -> tuple[torch.nn.Module, Callable]:
    """The layer of a compute event and a function returning a fresh input for it."""
    model = spec.model
    kind = content["layer"]
    signature = content["signature"]
    micro, seq = content.get("micro", spec.batch.micro), content.get("seq", model.seq_len)
    dtype = TORCH_DTYPES[model.dtype]
    if kind == "user":
        descs, layers = _user_model(spec)
        index = next(d.index for d in descs if dict(d.signature) == signature)
        layer = layers[index].to(device)
        if index == 0:
            return layer, lambda: torch.randint(0, model.vocab, (micro, seq), device=device)
        features = descs[index - 1].out_features
        in_dtype = getattr(torch, signature.get("in_dtype", model.dtype))  # what the previous layer returns
        return layer, lambda: torch.randn(micro, seq, *features, device=device, dtype=in_dtype, requires_grad=True)
    tp, sp, cp = int(signature.get("tp", 1)), bool(signature.get("sp", False)), int(signature.get("cp", 1))
    context = {}
    if cp > 1:  # a block's composite's real group is its cp ranks (tp = 1); alone, a LocalRing stands in for them
        context = {"cp": cp, "cp_comm": str(signature.get("cp_comm", "ring"))}
        if group is not None and kind == "block":
            context.update(cp_group=group, cp_rank=dist.get_rank(group))
            group = None
    if "experts" in signature:  # alone, a MoE block as its slowest ep rank runs it (a LocalExperts stand-in of
        # that rank); a composite's real group is its ep ranks, each with its own experts
        context.update(moe_layer=int(signature.get("moe_layer", 0)), ep=int(signature.get("ep", 1)),
                       ep_rank=int(signature.get("ep_rank", 0)))
        if group is not None and context["ep"] > 1:
            context.update(ep_group=group, ep_rank=dist.get_rank(group))
            group = None
    layer = build_layer(model, kind, tp=tp, group=group, tied=bool(signature.get("tied", False)), sp=sp,
                        selective=signature.get("recompute") == "selective", **context).to(device)
    if kind == "embedding":
        return layer, lambda: torch.randint(0, model.vocab, (micro, seq), device=device)
    # the content's seq is a context-parallel rank's (seq / cp); sequence parallelism splits it over tp
    tokens = seq // tp if sp else seq
    return layer, lambda: torch.randn(micro, tokens, model.hidden, device=device, dtype=dtype, requires_grad=True)


def parameter_shapes(spec: JobSpec, runs: list, device: torch.device,
                     trainable: bool = True) -> list[tuple[torch.Size, torch.dtype]]:
    """The shapes and dtypes of the trainable parameters (every one with `trainable` False) of a device's
    layers, given as runs of identical layers ([{"layer", "signature"}, count], an optimizer event's content),
    in order; each run's layer is built once."""
    shapes = []
    for layer, count in runs:
        module, _ = _make_layer(spec, layer, device)
        shapes += [(p.shape, p.dtype) for p in module.parameters() if p.requires_grad or not trainable] * int(count)
    return shapes


def _fresh_parameters(shapes: list[tuple[torch.Size, torch.dtype]], device: torch.device,
                      sharded: bool = False) -> torch.nn.ParameterList:
    """New parameters of these shapes, each with a gradient, as a stage holds them after its backward; `sharded`:
    as FSDP2 holds a ZeRO replica's shards, DTensors (harness.profile.sharded.sharded_alone)."""
    def made(tensor: torch.Tensor) -> torch.Tensor:
        return sharded_alone(tensor, device) if sharded else tensor

    params = torch.nn.ParameterList(torch.nn.Parameter(made(torch.randn(shape, dtype=dtype, device=device) * 0.02))
                                    for shape, dtype in shapes)
    for p in params:
        p.grad = made(torch.randn(tuple(p.shape), dtype=p.dtype, device=device))  # one rank: its shard is whole
    return params


def _forward(spec: JobSpec, layer: torch.nn.Module, x: torch.Tensor, content: dict) -> torch.Tensor:
    """The layer's forward (with the loss on the model's last layer), saving for its backward as without
    recompute."""
    return _loss(spec, layer, layer(x), content)


def _loss(spec: JobSpec, layer: torch.nn.Module, out: torch.Tensor, content: dict) -> torch.Tensor:
    """The model's last layer's output made the loss, part of its forward event; any other layer's as it is."""
    if content.get("last"):
        targets = torch.randint(0, spec.model.vocab, out.shape[:2], device=out.device)
        return layer.loss(out, targets) if isinstance(layer, Head) else cross_entropy(out, targets)
    return out


def _run_forward(spec: JobSpec, layer: torch.nn.Module, x: torch.Tensor, content: dict) -> torch.Tensor:
    """The forward a step runs: a checkpointed event's (full recompute) under torch.utils.checkpoint, its loss
    after it, as harness train runs them."""
    if content.get("checkpointed"):
        return _loss(spec, layer, checkpointed(layer, x), content)
    return _forward(spec, layer, x, content)


def last_level_cache_bytes() -> int:
    """The CPU's largest cache (Linux sysfs); 32 MiB when it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=32 * 2**20)


MAX_COPIES = 16
MAX_COPY_BYTES = 512 * 2**20
MIN_LEAD_S = 1e-3  # how long the GPU is held busy before a sample, at least (see timer.time_issued)
MAX_LEAD_S = 0.5  # and at most: a layer whose issue outlasts this waits for its device (it synchronizes)
LEAD_TRIES = 4  # a forward whose issue outlasted the lead is taken again with twice the lead, this many times
# On a GPU a sample issues the layer this many times back to back and counts the mean device time (and the
# host's mean over the later issues, ComputeRunner._host_issue_s): a stage issues its layers one after
# another, with the host's code paths warm (issued one at a time, layers took the host 1.5 to 1.7 times as
# long on an H200 as in the training run; docs/profiling.md)
ISSUE_CHAIN = 4


BACKWARD_PHASES = ("bwd", "bwd_input", "bwd_weight")
CALLED_PHASES = ("bwd",)  # backwards a training step's stage runs in one call (measure_backward_call)
SPLIT_PHASES = ("bwd_input", "bwd_weight")  # ... and in one call each, their cost per call measured on the layer
SPLIT_CALL_REPEATS = 7


class ComputeSamples(NamedTuple):
    """The samples of one compute event (seconds); for forwards and backwards on a GPU, the host's time to
    issue each (None where the host and the device are one: on a CPU, and for optimizer steps); and when
    each sample ended on the host's clock, in seconds after `origin_s` of measure_compute_share (how fast
    this rank ran over time: the analysis compares ranks measuring at the same moment); for backwards, what
    each further backward() call cost this rank's host (measure_backward_call; a split backward's half: on its
    own layer, measure_split_call): every sample paid it once, a training step's stage pays it once in all."""

    samples_s: np.ndarray
    host_issue_s: np.ndarray | None = None
    end_s: np.ndarray | None = None
    backward_call_s: float | None = None
    # forwards: what one forward saves for its backward; bwd_input: what it keeps for bwd_weight, and what it
    # lets go of as a stage's last layer (profilers.memory.kept_for_weights)
    activation_bytes: int | None = None
    released_bytes: int | None = None
    # whole backwards: its temporaries at its worst moments (profilers.memory.backward_temporaries)
    temporaries: BackwardTemporaries | None = None


def runner_content(spec: JobSpec, content: dict) -> dict:
    """An event's content as its runners use it: with `last` set on the model's last layer, whose forward
    includes the loss."""
    kind = content.get("layer")
    return dict(content, last=kind == "head" or (kind == "user" and _is_last_user_layer(spec, content)))


class ComputeRunner:
    """One compute event ready to run: its layer, inputs and (for the optimizer step) its optimizer with gradients.

    On a CPU the runner rotates over several copies of the layer whose weights together exceed the last-level
    cache: a real stage streams through many distinct layers, so a single copy kept warm in cache would be
    measured faster than any layer of a real iteration runs. A backward sample consumes a forward run at the
    copy's previous sample, not just before: with the forward's activations still in cache, profiled
    backwards of pipeline stages came out 15-25% faster than the real ones.
    """

    def __init__(self, spec: JobSpec, content: dict, device: torch.device, group=None, copies: int | None = None):
        """`group`: a real tensor-parallel process group, to run the layer with its all-reduces (composite)."""
        self.spec, self.device = spec, device
        self.phase = content["phase"]
        kind = content.get("layer")
        self.content = runner_content(spec, content)
        self.optimizers = []
        if self.phase == "optimizer":  # one optimizer over a device's parameters, as harness train steps it
            shapes = parameter_shapes(spec, content["layers"], device)
            shard = int(content.get("shard", 1))
            if shard > 1:  # ZeRO: the first replica's shard, as FSDP2 splits each parameter along dimension 0
                shapes = [(torch.Size(shard_shape(tuple(shape), shard)), dtype) for shape, dtype in shapes]
            # a ZeRO job's (`fsdp2`): FSDP2's DTensor shards, each step's every operation through DTensor's
            # dispatch, which made the runs' steps 2-7 times the plain tensors' (docs/profiling.md, "ZeRO's layers")
            sharded = bool(content.get("fsdp2"))
            first = _fresh_parameters(shapes, device, sharded)
            copies = copies or self._cold_cache_copies(first)
            self.layers = [first] + [_fresh_parameters(shapes, device, sharded) for _ in range(copies - 1)]
            self.make_input = lambda: None
            self.memory_layer = None
            self.optimizers = [make_optimizer(content.get("optimizer", "adam"), content.get("momentum", 0.0),
                                              list(params.parameters()), lr=1e-4) for params in self.layers]
        else:
            first, self.make_input = _make_layer(spec, content, device, group)
            if copies is None:  # a factory model's layers are built once and shared: no copies to rotate
                copies = 1 if kind == "user" else self._cold_cache_copies(first)
            self.layers = [first] + [_make_layer(spec, content, device, group)[0] for _ in range(copies - 1)]
            self.memory_layer = first
            if content.get("fsdp2") and group is None:  # as a ZeRO run holds its layers (harness.profile.sharded)
                self.memory_layer = copy.deepcopy(first)  # what a forward saves, counted without FSDP2's views
                self.layers = [shard_alone(copy.deepcopy(layer) if kind == "user" else layer, device)
                               for layer in self.layers]
        self._next = 0
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}  # backward: copy -> forwards
        # On a GPU, forwards and backwards are timed with the host ahead (as in a training step, where one
        # layer is issued while the GPU runs the previous one); an optimizer step is timed on its own, as
        # the trainer synchronizes around each; so is a composite, whose ranks must run the same number of
        # all-reduces in step (a per-rank retry or lead would desynchronize them).
        self.issued = can_time_issued(device) and self.phase in ("fwd",) + BACKWARD_PHASES and group is None
        self.chain = ISSUE_CHAIN if self.issued else 1
        self.last_host_s: float | None = None
        self.waits_for_device = False  # found to synchronize: timed alone, host time = its time
        self._issue_marks_ns = (0, 0)  # when a chained sample's first and last layer were issued (host clock)
        self._lead_s = MIN_LEAD_S

    def _cold_cache_copies(self, layer: torch.nn.Module) -> int:
        if self.device.type != "cpu":
            return 1
        # bytes a step touches: weights, plus gradients and two Adam moments for the optimizer
        touched = sum(p.numel() * p.element_size() for p in layer.parameters()) * (4 if self.phase == "optimizer"
                                                                                  else 2)
        if touched == 0:
            return 1
        wanted = -(-2 * last_level_cache_bytes() // touched)
        return int(max(1, min(MAX_COPIES, wanted, MAX_COPY_BYTES // touched)))

    @property
    def parameters(self) -> int:
        return sum(p.numel() for layer in self.layers for p in layer.parameters())

    def sample(self) -> float:
        """One timed run (seconds) of the next copy: a forward, a backward after an untimed forward, or an
        optimizer step (on a GPU the mean of `chain` forwards or backwards issued back to back)."""
        index = self._next
        self._next = (index + 1) % len(self.layers)
        layer = self.layers[index]
        if self.optimizers:
            return time_region(self.optimizers[index].step, self.device)
        try:
            return self._sample(index, layer)
        except torch.cuda.OutOfMemoryError:
            if self.chain == 1:
                raise
            # 4 graphs of this layer at once do not fit: issue one at a time (the host time is then
            # that of a layer issued alone, an overestimate; docs/profiling.md)
            self.chain = 1
            self._pending.clear()
            torch.cuda.empty_cache()
            return self._sample(index, layer)

    def _sample(self, index: int, layer: torch.nn.Module) -> float:
        if self.phase == "fwd":
            xs = [self.make_input() for _ in range(self.chain)]
            return self._time(self._chained(xs, lambda x: _run_forward(self.spec, layer, x, self.content)))
        graphs = self._pending.pop(index, None) or self._forwards_for_backward(layer)
        # Gradients are left to accumulate, as they do over a real iteration's micro-batches.
        seconds = self._time(self._chained(graphs, self._backward_of(layer)), retry=False)
        del graphs
        self._pending[index] = self._forwards_for_backward(layer)
        return seconds

    def _backward_of(self, layer: torch.nn.Module) -> Callable[[object], object]:
        """What a backward sample issues per prepared graph, by phase."""
        if self.phase == "bwd":
            return lambda graph: graph[0].backward(graph[1])
        backward_input, backward_weight = split_backward()
        if self.phase == "bwd_input":
            return lambda graph: backward_input([graph[0]], None if graph[1] is None else [graph[1]], [graph[2]],
                                                layer.parameters())
        return lambda param_groups: backward_weight(layer.parameters(), param_groups)

    def _chained(self, items: list, issue: Callable[[object], object]) -> Callable[[], list]:
        """run(): issue(item) for every item, back to back, noting on the host's clock when the first and the
        last were issued (`_issue_marks_ns`)."""
        def run() -> list:
            out = [issue(items[0])]
            first = time.perf_counter_ns()
            out += [issue(item) for item in items[1:]]
            self._issue_marks_ns = (first, time.perf_counter_ns())
            return out
        return run

    def _host_issue_s(self, sample_host_s: float, chain: int) -> float:
        """The host's time to issue one layer of a chained sample: the mean of the chain's later issues. The
        first pays for host code paths and allocations that the round-robin over other events left cold;
        in a training step the layers before it have just warmed them (on an H200 a block's forward took
        the profile's host 0.67 ms per issue over the whole chain against 0.47 ms issued repeatedly, and
        0.4 ms in the training run). A chain of one has only its own time."""
        if chain <= 1:
            return sample_host_s
        first, last = self._issue_marks_ns
        return (last - first) / 1e9 / (chain - 1)

    def _time(self, run: Callable[[], object], retry: bool = True) -> float:
        """Device seconds of `run()` (per layer of the chain); on a GPU also notes the host's issue time in
        `last_host_s`.

        A forward whose issue outlasted the GPU's lead is taken again with twice the lead (a backward, which
        consumes its graph, only lengthens the lead for the next sample). A layer whose issue outlasts even
        the longest lead makes its host wait for its device (it synchronizes, e.g. `.item()` in a factory
        model): the host cannot run ahead of it, so from then on it is timed alone and its host time is
        its whole time."""
        if not self.issued:
            seconds = time_region(run, self.device)
            if self.waits_for_device:
                self.last_host_s = seconds
            return seconds
        chain = self.chain
        for _ in range(LEAD_TRIES if retry else 1):
            sample = time_issued(run, self.device, self._lead_s)
            if sample.ahead:
                self._lead_s = min(MAX_LEAD_S, max(MIN_LEAD_S, 2 * sample.host_s))
                self.last_host_s = self._host_issue_s(sample.host_s, chain)
                return sample.device_s / chain
            if self._lead_s >= MAX_LEAD_S:
                self.issued, self.waits_for_device, self.chain = False, True, 1
                break
            self._lead_s = min(MAX_LEAD_S, 2 * max(self._lead_s, sample.host_s))
        # not ahead: the device time holds the gaps where the GPU waited for the host, as a layer run alone
        self.last_host_s = (sample.device_s / chain if self.waits_for_device
                            else self._host_issue_s(sample.host_s, chain))
        return sample.device_s / chain

    def _forwards_for_backward(self, layer: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The untimed forwards whose graphs a later backward sample consumes: run at the copy's previous
        sample, so that every other copy and event runs in between and, as in a pipeline, where a
        micro-batch's backward comes long after its forward, the saved activations are no longer in cache."""
        graphs = []
        for _ in range(self.chain):
            x = self.make_input()
            out = _forward(self.spec, layer, x, self.content)
            graphs.append((out, None if out.dim() == 0 else torch.randn_like(out), x))
        if self.phase == "bwd_weight":  # what a W step starts from: the input's gradient done (untimed)
            backward_input, _ = split_backward()
            graphs = [backward_input([out], None if grad is None else [grad], [x], layer.parameters())[1]
                      for out, grad, x in graphs]
        synchronize(self.device)
        return graphs


@dataclass(frozen=True)
class Precision:
    """The stopping rule of a compute share: after `repeats` rounds, keep sampling every event whose
    `statistic`'s 95% interval is wider than `goal` of it (harness.plan.precision) until the timed rounds, the
    repeats included, have run `budget_s` seconds."""

    goal: float
    budget_s: float
    statistic: str = "mean"

    def missed(self, samples: list[float]) -> bool:
        """Whether these samples' statistic is not yet known within the goal."""
        return relative_half_width(np.asarray(samples), self.statistic) > self.goal


@leaving_no_world()
def measure_compute_share(spec: JobSpec, contents: dict[str, dict], device: torch.device, warmup: int,
                          repeats: int, on_round: Callable[[int], None] | None = None,
                          max_parameters: int = 2**28, origin_s: float | None = None,
                          warmed: Callable[[], None] | None = None,
                          precision: Precision | None = None) -> dict[str, ComputeSamples]:
    """Samples of several compute events, taken round-robin: one sample of each event per round, in
    heavy_light_order of their last warm-up sample. The warm-up runs every copy of an event's layer once
    (ComputeRunner rotates over copies on a CPU), then `warmup` more samples. `warmed()` is called exactly once,
    right before the first batch's first timed round (at once with nothing to measure): profiling calls a
    barrier there, so that every rank's timed rounds start together and the ranks' speeds compare at the same
    moments.

    Interleaving spreads the machine's slow and fast moments over all events instead of letting one event
    take all its repeats in a slow moment (on shared machines this halves the spread between runs).
    After `repeats` rounds, with a `precision`, further rounds take the events that miss it, each after the
    event it follows in a full round (whose sample is kept too), so that every sample still follows the same
    kind of work; until every event meets it or the budget is spent (each batch its share of what is left).
    Events are held in memory together up to `max_parameters` parameters, in batches beyond that.
    `on_round(n)` is called after each timed round with the number of events sampled in it. Each sample's
    end is noted in seconds after `origin_s` (a time.perf_counter() value; default: this call's start).
    """
    origin_s = time.perf_counter() if origin_s is None else origin_s
    samples: dict[str, list[float]] = {eid: [] for eid in contents}
    ends: dict[str, list[float]] = {eid: [] for eid in contents}
    host: dict[str, list[float]] = {}
    saved: dict[str, int] = {}
    released: dict[str, int] = {}
    temporaries: dict[str, BackwardTemporaries] = {}
    pending = list(contents)
    backward_call: float | None = None
    split_call: dict[str, float | None] = {}
    deadline: float | None = None
    if not pending and warmed is not None:
        warmed()

    def sample_round(runners: dict[str, ComputeRunner], ids: list[str]) -> None:
        for eid in ids:
            samples[eid].append(runners[eid].sample())
            ends[eid].append(time.perf_counter() - origin_s)
            if eid in host:
                host[eid].append(runners[eid].last_host_s)
        if on_round is not None:
            on_round(len(ids))

    while pending:
        runners: dict[str, ComputeRunner] = {}
        total = 0
        while pending and (not runners or total < max_parameters):
            eid = pending.pop(0)
            runners[eid] = ComputeRunner(spec, contents[eid], device)
            total += runners[eid].parameters
        warm_s = {eid: 0.0 for eid in runners}
        # every copy of a layer runs once before the warm-up proper: a copy's first run touches its memory
        # fresh (page faults, allocations), up to 4x slower, and would otherwise land in the timed samples
        for round_ in range(max(len(r.layers) for r in runners.values()) + warmup):
            for eid, runner in runners.items():
                if round_ < len(runner.layers) + warmup:
                    warm_s[eid] = runner.sample()
        order = heavy_light_order(warm_s)
        if backward_call is None and any(runner.phase in CALLED_PHASES for runner in runners.values()):
            backward_call = measure_backward_call(device)
        for eid, runner in runners.items():  # untimed, once: what a further split call costs on this layer
            if runner.phase in SPLIT_PHASES and eid not in split_call:
                # 0 where it cannot be measured: the item still is a call, which makes the next one a further call
                split_call[eid] = measure_split_call(runner, device) or 0.0
        for eid, runner in runners.items():  # untimed, once: the memory a forward holds until its backward
            forward = functools.partial(_forward, spec, content=runner.content)
            if runner.phase == "fwd":
                saved[eid] = activation_bytes(runner.memory_layer, runner.make_input, forward)
            elif runner.phase == "bwd_input":  # what it keeps for the W, what it lets go of as a stage's last
                saved[eid], released[eid] = kept_for_weights(runner.memory_layer, runner.make_input, forward)
            elif runner.phase == "bwd":  # what its backward makes and holds for a moment
                temporaries[eid] = backward_temporaries(runner.memory_layer, runner.make_input, forward)
            runner.memory_layer = None  # measured: a ZeRO layer's plain copy is not held through the sampling
        for eid, runner in runners.items():
            if runner.issued or runner.waits_for_device:
                host[eid] = []
        if warmed is not None:  # right before the first timed round
            warmed()
            warmed = None
        if precision is not None:
            now = time.perf_counter()
            left = precision.budget_s if deadline is None else max(0.0, deadline - now)
            deadline = now + left
            batch_deadline = now + left * len(runners) / (len(runners) + len(pending))
        for _ in range(repeats):
            sample_round(runners, order)
        if precision is not None:
            missing = set(order)
            while time.perf_counter() < batch_deadline:
                missing = {eid for eid in missing if precision.missed(samples[eid])}
                if not missing:
                    break
                # each missing event with the one it follows in a full round (cyclically: the first follows the last)
                wanted = missing | {order[order.index(eid) - 1] for eid in missing}
                sample_round(runners, [eid for eid in order if eid in wanted])
        del runners
    return {eid: ComputeSamples(np.asarray(samples[eid]), np.asarray(host[eid]) if eid in host else None,
                                np.asarray(ends[eid]),
                                backward_call if contents[eid]["phase"] in CALLED_PHASES else split_call.get(eid),
                                saved.get(eid), released.get(eid), temporaries.get(eid))
            for eid in contents}


def backward_call_times(modules: list[torch.nn.Module], make_input: Callable[[], torch.Tensor],
                        device: torch.device, loss: Callable[[torch.Tensor], torch.Tensor] | None = None
                        ) -> tuple[float, float]:
    """The host's seconds for the backwards of `modules` chained (the last output through `loss` when given):
    (one call per module on its own graph with a leaf input, as profiled backward samples run, summed; one
    call over the whole chain, as a training step's stage runs)."""
    def outputs(x: torch.Tensor, per_layer: bool) -> list[torch.Tensor]:
        outs = []
        for module in modules:
            if per_layer and x.is_floating_point():
                x = x.detach().requires_grad_(True)
            x = module(x)
            outs.append(x)
        if loss is not None:
            outs[-1] = loss(outs[-1])
        return outs

    def backward(out: torch.Tensor) -> float:
        grad = None if out.dim() == 0 else torch.ones_like(out)
        synchronize(device)
        start = time.perf_counter()
        out.backward(grad)
        return time.perf_counter() - start

    many = sum(backward(out) for out in reversed(outputs(make_input(), per_layer=True)))
    synchronize(device)
    one = backward(outputs(make_input(), per_layer=False)[-1])
    synchronize(device)
    return many, one


def measure_backward_call(device: torch.device, repeats: int = 30, layers: int = 4) -> float:
    """The host's seconds that each further `backward()` call costs (median of `repeats`): on `layers` tiny
    linear layers, backward_call_times' per-layer calls against its one call, the difference over
    `layers - 1`. It is the autograd engine's start (on a GPU it hands the graph task to the device's worker
    thread and waits for it) and the gradient of the leaf input: every profiled backward pays it, a step
    once (bench/backward_call.py measures the same on a model's own layers)."""
    modules = [torch.nn.Linear(8, 8).to(device) for _ in range(layers)]

    def make_input() -> torch.Tensor:
        return torch.randn(4, 8, device=device, requires_grad=True)

    excess = []
    for i in range(repeats + 3):
        many, one = backward_call_times(modules, make_input, device)
        if i >= 3:
            excess.append((many - one) / (layers - 1))
    return max(0.0, float(np.median(excess)))


def measure_split_call(runner: ComputeRunner, device: torch.device,
                       repeats: int = SPLIT_CALL_REPEATS) -> float | None:
    """What each further call of a split backward's half (runner.phase: stage_backward_input or _weight) costs
    on the runner's own layer, which a training step's stage runs in one call over its layers: the layer
    chained with a copy of itself, a call per layer against one call over both (median of `repeats`, at least
    0). Unlike a plain backward's start (measure_backward_call, tens of microseconds), this grows with the
    layer's graph, which both halves walk in Python (a block of the accuracy bench's model: 0.77 ms for the
    input's half, 0.45 for the weights'). None for a layer that cannot follow itself (its output is not its
    input: an embedding, a head)."""
    layer, make_input = runner.layers[0], runner.make_input
    x = make_input()
    if not x.is_floating_point():
        return None
    with torch.no_grad():
        out = layer(x)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
        return None
    backward_input, backward_weight = split_backward()
    chain = [layer, copy.deepcopy(layer)]  # not the layer twice: its weights would be shared, their groups one
    params = [p for module in chain for p in module.parameters()]

    def halves(per_layer: bool) -> float:
        """Seconds of runner.phase's calls over the chain of two: one per layer or one over both."""
        x0 = make_input()
        ins, outs, y = [], [], x0
        for module in chain:
            if per_layer:
                y = y.detach().requires_grad_(True)
            ins.append(y)
            y = module(y)
            outs.append(y)
        calls = (list(zip(chain, ins, outs))[::-1] if per_layer else [(None, x0, outs[-1])])
        timed = 0.0
        groups = []
        for module, inp, output in calls:
            weights = list(module.parameters()) if module is not None else params
            synchronize(device)
            start = time.perf_counter()
            _, group = backward_input([output], [torch.ones_like(output)], [inp], weights)
            synchronize(device)
            timed += time.perf_counter() - start if runner.phase == "bwd_input" else 0.0
            groups.append((weights, group))
        for weights, group in groups:
            synchronize(device)
            start = time.perf_counter()
            backward_weight(weights, group)
            synchronize(device)
            timed += time.perf_counter() - start if runner.phase == "bwd_weight" else 0.0
        return timed

    excess = [halves(True) - halves(False) for _ in range(repeats + 1)][1:]
    for p in layer.parameters():  # the gradients these calls left are not the samples'
        p.grad = None
    return max(0.0, float(np.median(excess)))


def heavy_light_order(seconds: dict[str, float]) -> list[str]:
    """Event ids in the order a round samples them: the longest, the shortest, the second longest, the
    second shortest, ... so that every short event follows a long one.

    In a training step a layer runs right after another layer's forward, backward or optimizer step, which
    has pushed its working set out of the caches; in cost order, the small events (an embedding, its
    optimizer step) followed each other and were measured warm: a GPT-2 embedding's forward at 0.29 ms,
    against 0.46 ms in a real stage, 0.44 ms when sampled after a block's backward (docs/benchmarks.md).
    Ties keep the given order; with no times (no warm-up) the given order is kept as it is.
    """
    ids = list(seconds)
    if not any(seconds.values()):
        return ids
    by_time = sorted(ids, key=lambda eid: -seconds[eid])  # stable: ties keep the given order
    order = []
    lo, hi = 0, len(by_time) - 1
    while lo <= hi:
        order.append(by_time[lo])
        if lo != hi:
            order.append(by_time[hi])
        lo, hi = lo + 1, hi - 1
    return order


def _is_last_user_layer(spec: JobSpec, content: dict) -> bool:
    descs, _ = _user_model(spec)
    return dict(descs[-1].signature) == content["signature"]
