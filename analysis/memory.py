"""The memory model: each pipeline device's peak bytes in one training iteration, by part (docs/analysis.md,
"Memory"). Every dp x tp replica of a pipeline stage holds the same, so one device per stage is modelled.

- weights: its layers' parameters (per tensor-parallel shard; the embedding and head split by vocabulary, or
  whole with vocab_parallel = false) x dtype bytes;
- gradients: as many, in the weights' dtype, or with master weights in the dtype Megatron-LM reduces its main
  gradients in (JobSpec.reduce_dtype: fp32 with bf16 weights, fp16 with fp16 unless `reduce_dtype` says fp32;
  16-bit main gradients get an fp32 copy beside them at the optimizer step, step_copy_bytes) (data-parallel
  buckets are views of them, as DDP's gradient_as_bucket_view and harness train make them: nothing more), from
  the start with DDP's buckets or Megatron's main-gradient buffers (master weights without ZeRO: made when the
  model is wrapped, zeroed at each step), else each chunk's once its first backward (a split backward's W) has
  made them (a MoE block's experts', out of the buckets, so always);
- optimizer: Adam two states per parameter, SGD with momentum one, without none, in the weights' dtype, or
  in fp32 with master weights, which add an fp32 copy of the weights (Megatron-LM's mixed precision: 2 + 4 + 4
  + 8 = 18 bytes a parameter with Adam; with its distributed optimizer, zero = 1, the 12 sharded over dp);
- activations: what a micro-batch's forward saves for its backward, the sum of its layers' `activation_bytes`
  as the profile measured them (harness.profile.memory; where it did not, or without a profile, from the
  layers' formulas, harness.plan.activations), and on every virtual stage but the last the
  stage's output, held until its gradient returns; a micro-batch holds them from its forward to its
  backward, so the schedule's order decides how many are in flight (GPipe all, 1F1B at most pp - stage,
  interleaved 1F1B as it interleaves); with recompute = "full" a recompute group's layers
  (harness.plan.layers.recompute_groups: each recomputed block alone, or with recompute_method "uniform" and
  recompute_layers N chunks of N) keep only the group's input (torch.utils.checkpoint; a factory model's last
  layer also what the loss after it, outside the checkpoint, saves: loss_saved_bytes), and a group's backward
  re-makes all its layers' saved activations at once, each freed as its layer's backward has run; with
  recompute = "selective" a block's measured saves hold none of its attention core's but the inputs, and its
  backward re-makes them (activations.attention_core_bytes, as the fused kernel saves them: a temporary);
  dropout's masks are in what the profile measured;
- pipeline buffers: a backward's gradient received from the next stage (from its start) and the one it sends
  back (from its end until the send completes);
- a split backward (zero-bubble schedules): a micro-batch's activations are held until its W step, and its B
  step keeps what the W needs beside them (the gradients at the layers' weights, as the profile measured each
  layer's bwd_input event to keep; the first virtual stage keeps its received gradient, since its W runs its
  whole backward) and, once it is over, lets go of what only the part above the stage's last weight saved
  (its last layer's measured `released_bytes`: a head's log-probabilities); its gradients are made by the W;
- temporaries: what a backward makes and holds for a moment beyond the activations it frees, computed from the
  layers' descriptions (backward_moments), a factory model's layers' as the profile measured their backwards
  (temporary_bytes); at the stage backward's worst moment, which is a layer k's
  own: its temporaries, beside the activations in flight less what the layers after k in the stage (their
  backward already run) held, and with recompute = "full" plus k's saved activations re-made (not counted:
  the gradient at k's output, the next layer's input gradient within a stage, b s h d for a block);
- zero > 0 (FSDP2, every layer a unit and its own root, sharded over the dp replicas; harness.train.engine):
  each replica keeps its shard of the weights (none of its own with master weights: the fp32 master is the
  shard) and of the optimizer state; zero 1 and 2 hold every weight whole through the iteration (gathered in
  the first forward, let go layer by layer in the last backward), zero 3 only the layer it runs, gathered as
  the layer's backward starts (the model's last layer's once its loss has made the logits' gradient) into an all-gather
  buffer, a second whole copy while it is copied out; zero 1 accumulates whole gradients, zero 2 and 3 a
  shard; a backward that reduce-scatters (zero 2 and 3 every one, zero 1 the last) copies each layer's whole
  gradients into a reduce-scatter input and, while the collective runs, holds its working copy of that input
  (gloo's, as MemTracker saw it on a CPU) and its output, a shard, beside the layer's input gradient, the whole
  gradients themselves let go (at zero 3 a built-in head's held: seen on every GPT-2 job probed, not on a factory
  head, the cause not found; at zero 2 let go too, as MemTracker saw on gpt2, bert and llama jobs); zero 1's
  last backward lets a layer's accumulated whole gradients go into the input and holds no working copy beside it
  (eight ZeRO-1 gpt2, bert and llama jobs under MemTracker: within 0.05%, with the copy and the gradients up to
  12% over, cause not found); every layer being its own root, every such input stays until the backward ends
  (temporaries), but at the first layer's reduce-scatter (its input, token ids, takes no gradient: FSDP2 runs it
  at the backward's end), by when they are let go; gradients are held from the first backward (they are freed
  with the optimizer step).
The peak is the largest total over the device's steps in schedule order: after each forward (weights,
optimizer state, activations in flight, and each chunk's gradients once its backward has made them, or all
from the start with data parallelism, whose buckets persist, or Megatron's main gradients), as each backward
starts (its received gradient beside its micro-batch's activations; its worst moment, with the temporaries) and
after it (its activations freed, its gradients made, both buffers held); and at the optimizer step (the model
states and the step's copies, step_copy_bytes).
"""
from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from analysis.profile_reader import Profile
from harness.common.errors import UserError
from harness.common.output import format_bytes
from harness.plan.activations import (
    BackwardTemporaries,
    attention_core_bytes,
    formula_activation_bytes,
    formula_released_bytes,
    stage_held_bytes,
)
from harness.plan.events import EventPlan, unwrapped_twin
from harness.plan.layers import (
    LayerDesc,
    describe,
    input_bytes,
    megatron_loss,
    recompute_groups,
    selective,
    split_into_stages,
)
from harness.plan.schedules import kept_device_steps, most_in_flight, virtual_stage
from harness.plan.spec import JobSpec
from harness.store.hdf5_schema import (
    ACTIVATION_BYTES_ATTR,
    RELEASED_BYTES_ATTR,
    TEMPORARY_ATTRS,
    TEMPORARY_BYTES_ATTR,
)

PARTS = ("weights", "gradients", "optimizer", "activations", "pipeline", "temporaries")
LOSS_BYTES = 4  # the loss takes the logits in float32 (harness.train.model.loss_of)
GB = 1e9


@dataclass(frozen=True)
class StageMemory:
    """One pipeline device's bytes at its peak, by part."""

    stage: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    pipeline: int
    in_flight: int  # micro-batches (over the device's chunks) holding activations at the peak
    remade: int = 0  # of `activations`: a recomputed layer's, re-made in its backward (recompute = "full")
    temporaries: int = 0  # a backward's, at the peak (backward_moments)
    # the peak over the same moments of what the meter counts (harness.profile.memory): re-made activations
    # (out of the saved-tensor hooks' sight) and temporaries left out
    metered: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, part) for part in PARTS)

    @property
    def dominant(self) -> str:
        """The part that holds the most."""
        return max(PARTS, key=lambda part: getattr(self, part))

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, **{f"{part}_bytes": getattr(self, part) for part in PARTS},
                "total_bytes": self.total, "in_flight": self.in_flight, "dominant": self.dominant,
                "remade_bytes": self.remade, "metered_bytes": self.metered}


@dataclass
class MemoryEstimate:
    """Every pipeline device's peak; `unmeasured`: forward events without measured activations (counted 0)."""

    stages: list[StageMemory]
    unmeasured: list[str] = field(default_factory=list)

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: (s.total, -s.stage))

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    def fits(self, capacity_bytes: float | None) -> bool:
        return capacity_bytes is None or self.peak_bytes <= capacity_bytes

    def shortfall(self, capacity_bytes: float) -> str:
        """Why it does not fit: how much the largest device needs and which part dominates."""
        peak = self.peak
        return (f"needs {format_bytes(peak.total)} on stage {peak.stage}, {format_bytes(capacity_bytes)} per device "
                f"({peak.dominant} {format_bytes(getattr(peak, peak.dominant))})")

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "peak_stage": self.peak.stage,
                "stages": [s.to_dict() for s in self.stages], "unmeasured_activations": list(self.unmeasured)}


def activation_bytes(profile: Profile) -> dict[str, int]:
    """Forward event id -> the bytes the profile measured its forward to save, and input-gradient event id
    (bwd_input) -> the bytes it keeps for the weight-gradient step (events without the measurement, from
    profiles written before it, are absent)."""
    out = {}
    for eid, m in profile.measurements.items():
        if m.kind == "compute" and m.content.get("phase") in ("fwd", "bwd_input"):
            value = m.attrs.get(ACTIVATION_BYTES_ATTR)
            if value is not None:
                out[eid] = int(value)
    return out


def released_bytes(profile: Profile) -> dict[str, int]:
    """Input-gradient event id (bwd_input) -> the saved bytes its layer lets go of as a stage's last, as the
    profile measured them (absent before the measurement)."""
    return {eid: int(m.attrs[RELEASED_BYTES_ATTR]) for eid, m in profile.measurements.items()
            if m.kind == "compute" and m.content.get("phase") == "bwd_input" and RELEASED_BYTES_ATTR in m.attrs}


def temporary_bytes(profile: Profile) -> dict[str, BackwardTemporaries]:
    """Whole-backward event id (bwd) -> its backward's worst moments as the profile measured them
    (harness.profile.memory.backward_temporaries: beyond its saved activations, its weights' gradients and its
    output's gradient, with the saved bytes let go of by then; absent before the measurement)."""
    return {eid: BackwardTemporaries(*(int(m.attrs.get(name, 0)) for name in TEMPORARY_ATTRS))
            for eid, m in profile.measurements.items()
            if m.kind == "compute" and m.content.get("phase") == "bwd" and TEMPORARY_BYTES_ATTR in m.attrs}


def gradient_bytes(spec: JobSpec) -> int:
    """Bytes per parameter of a gradient: with master weights Megatron-LM's main gradients, in the dtype it
    reduces them in (JobSpec.reduce_dtype: fp32 with bf16 weights), else the weights' dtype."""
    return spec.reduce_bytes if spec.optimizer.master_weights else spec.model.dtype_bytes


def step_copy_bytes(spec: JobSpec, params: int) -> int:
    """What the optimizer step holds for a moment beyond the model states of a device holding `params`
    parameters: with master weights and 16-bit main gradients, Megatron-LM's fp32 copy of them for its fp32
    master weights (Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads: `main_grad.float()`, no
    copy when they are fp32 already), of the device's shard with ZeRO; held until the next iteration zeroes the
    gradients, after the activations are gone."""
    if not spec.optimizer.master_weights or spec.reduce_bytes >= 4:
        return 0
    return 4 * (-(-params // spec.strategy.dp) if spec.strategy.zero else params)


def _state_bytes(spec: JobSpec) -> tuple[int, int]:
    """(bytes per parameter of optimizer state, of the master copy) for the spec's optimizer and dtype."""
    o = spec.optimizer
    states = {"adam": 2, "sgd": 1 if o.momentum > 0 else 0}[o.name]
    if o.master_weights:
        return 4 * states, 4
    return spec.model.dtype_bytes * states, 0


def model_state_bytes(spec: JobSpec, params: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) in bytes that a device holding `params` parameters of the model keeps
    between layers (module docstring: precision, master weights, zero). Its peak holds at least their sum: all
    three are held once the iteration's last backward has made the gradients."""
    s = spec.strategy
    dtype, grad = spec.model.dtype_bytes, gradient_bytes(spec)
    state, master = _state_bytes(spec)
    if not s.zero:
        return params * dtype, params * grad, params * (state + master)
    shard = -(-params // s.dp)  # FSDP2 over the dp replicas (module docstring, "zero")
    own = 0 if master else shard * dtype  # with master weights the fp32 master is the shard
    weights = own + (params * dtype if s.zero < 3 else 0)
    return weights, params * grad if s.zero == 1 else shard * grad, shard * (state + master)


def model_state_floor(spec: JobSpec, layers: list[LayerDesc] | None = None) -> int:
    """The most weights, gradients and optimizer state (model_state_bytes) any pipeline device of `spec` holds: a
    floor under its peak from the layers alone, without an event plan (the search rules out what cannot fit with
    it). `layers`: a factory model's, as for build_plan."""
    s = spec.strategy
    stages = split_into_stages(describe(spec, layers), spec.model, s.virtual_stages)
    return max(sum(model_state_bytes(spec, sum(layer.params for c in range(s.chunks)
                                               for layer in stages[virtual_stage(c, d, s.pp)])))
               for d in range(s.pp))


def in_flight_floor(spec: JobSpec, layers: list[LayerDesc] | None = None) -> int:
    """A floor under a built-in model's peak from its layers' formulas alone, without an event plan: on each
    pipeline device, its weights and optimizer state (model_state_bytes) beside what its first chunk's layers
    hold (harness.plan.activations.held_bytes) for as many micro-batches as its schedule has in flight there at
    once (forwards run less backwards begun). All of these are held together after that device's busiest
    forward: gradients, pipeline buffers, temporaries and the other chunks only add to it. For a search from a
    spec alone, whose activations are the same formulas; where a profile measured them they may be smaller, so
    the floor is not for it. 0 for a factory model (its layers' saves are measured only)."""
    if spec.model.family == "user":
        return 0
    s = spec.strategy
    described = describe(spec, layers)
    stages = split_into_stages(described, spec.model, s.virtual_stages)
    first = [0]
    for stage in stages:
        first.append(first[-1] + len(stage))
    micro, seq = spec.batch.micro, spec.model.seq_len // s.cp
    floor = 0
    for d in range(s.pp):
        params = sum(layer.params for c in range(s.chunks) for layer in stages[virtual_stage(c, d, s.pp)])
        weights, _, optimizer = model_state_bytes(spec, params)
        held = stage_held_bytes(spec, described, first[d], len(stages[d]), micro, seq)
        most = most_in_flight(s.schedule, d, s.pp, spec.micro_batches, s.chunks)
        floor = max(floor, weights + optimizer + most * held)
    return floor


def loss_saved_bytes(spec: JobSpec) -> int:
    """What the loss saves for its backward, beside the last layer's output: the float32 log-probabilities of
    a micro-batch's whole logits and its int64 targets (torch's cross_entropy, harness.models.transformer)."""
    tokens = spec.batch.micro * spec.model.seq_len // spec.strategy.cp
    return tokens * spec.model.vocab * LOSS_BYTES + tokens * 8


def backward_moments(spec: JobSpec, layer: LayerDesc,
                     measured: BackwardTemporaries | None = None) -> list[tuple[int, int, str]]:
    """A built-in layer's backward moments as (temporaries, freed, when): what its backward holds then beyond its
    saved activations and its output's gradient, what of its own saved activations it has let go of by then, and
    whether its weights are in use ("before": not yet, "start": as its backward starts, "during") (torch's
    autograd on harness.models, micro-batch b, sequence s (a context-parallel rank's seq / cp), hidden h, dtype
    bytes d):
    - head with the loss: its loss's moment, the gradient of the float32 log-probabilities and the logits'
      gradient made from it (2 b s V x 4 bytes, nothing freed, before its weights), its start, the logits'
      gradient (b s V d, the log-probabilities b s V x 4 freed), and its projection's: the logits' gradient,
      its weight's gradient (V h d) and its input's (b s h d), the log-probabilities freed;
    - transformer block: its start (nothing; with ring attention its ring's buffers in flight, two of the rank's
      keys and values and two of their float32 gradients, 4 b s (h / tp)(d + 4)) and its MLP's last
      projection's, its input's gradient (b s F d, F = ffn / tp) and its weight's gradient (F h d);
    - embedding: its start and its token table's dense gradient (V h d);
    - a factory model's layer: its start and, where the profile measured its backward (`measured`,
      temporary_bytes(profile)), that backward's worst moment, with its weights in use, and the model's last
      layer its loss's before its weights (the loss after it outside the layer).
    Split by vocabulary over tp (vocab_parallel), V is the shard's vocab / tp, and the head's loss makes the
    logits' gradient in place of the softmax it saved (harness.models.tp): nothing beyond it before its start; so
    does a whole head's Megatron-LM loss (its signature's ("cross_entropy", "megatron")).
    A weight's gradient is a temporary when it accumulates into one the iteration's earlier backwards made
    (with data parallelism, always), else the gradient itself, made a moment early: counted here either way."""
    signature = dict(layer.signature)
    b, s, d = spec.batch.micro, spec.model.seq_len // spec.strategy.cp, spec.model.dtype_bytes
    h = int(signature.get("hidden", spec.model.hidden))
    shards = int(signature.get("tp", 1)) if layer.kind in ("embedding", "head") else 1  # vocabulary-parallel
    if layer.kind == "head":
        vocab = int(signature.get("vocab", spec.model.vocab)) // shards
        log_probs = b * s * vocab * LOSS_BYTES
        return [(0 if megatron_loss(signature) else 2 * log_probs, 0, "before"),
                (b * s * vocab * d, log_probs, "start"),
                (b * s * vocab * d + (vocab + b * s) * h * d, log_probs, "during")]
    if layer.kind == "block" and "experts" in signature:
        # a MoE block's experts: the stacked gradient of all this rank's experts made at once, beside the
        # busiest expert's rows' hidden gradient (harness.models.moe)
        rows = max(ast.literal_eval(str(signature.get("received", "(0,)"))), default=0)
        return [(0, 0, "start"), (layer.expert_params * d + rows * int(signature["expert_ffn"]) * d, 0, "during")]
    if layer.kind == "block":
        tp = int(signature.get("tp", 1))
        ffn = int(signature.get("ffn", spec.model.ffn)) // tp
        ring = 0
        if int(signature.get("cp", 1)) > 1 and signature.get("cp_comm", "ring") == "ring":
            ring = 4 * b * s * h // tp * (d + 4)  # two key-and-value buffers and two of their float32 gradients
        return [(ring, 0, "start"), ((b * s + h) * ffn * d, 0, "during")]
    if layer.kind == "embedding":
        return [(0, 0, "start"), (int(signature.get("vocab", spec.model.vocab)) // shards * h * d, 0, "during")]
    if measured is None:
        return [(0, 0, "start")]
    loss = [(measured.loss_made, measured.loss_freed, "before")] if measured.loss_made else []
    return loss + [(0, 0, "start"), (measured.made, measured.freed, "during")]


@dataclass(frozen=True)
class _Layer:
    """What one layer of a stage holds in a micro-batch's backward (estimate_memory)."""

    held: int  # saved activations, held until its backward
    again: int  # re-made in its backward (recompute = "full")
    moments: list  # backward_moments
    whole: int  # its weights' bytes, whole (and its gradients')
    shard: int  # a replica's shard of its gradients (zero)
    input_gradient: int = 0  # the gradient at its input (zero: held through its reduce-scatter)
    keeps_gradients: bool = False  # its whole gradients held through its reduce-scatter (zero 3: a built-in head's)


def _worst_backward_moment(layers: list[_Layer], zero: int = 0, last: bool = False) -> tuple[int, ...]:
    """(activations, temporaries, re-made, weights, gradients) beyond what a stage's micro-batch holds as its
    backward starts, at its worst moment, `layers` in forward order; weights and gradients beyond the stage's
    between-layer count (estimate_memory), `last`: the iteration's last backward (module docstring, "zero")."""
    scatters = zero >= 2 or (zero == 1 and last)
    best, freed, retained, scattered, resharded = (0, 0, 0, 0, 0), 0, 0, 0, 0
    for layer in reversed(layers):
        gathered = layer.whole if zero == 3 else -resharded
        candidates = []
        for temporary, own, when in layer.moments:
            weights = 0 if zero == 3 and when == "before" else gathered
            buffer = layer.whole if zero == 3 and when == "start" else 0  # the all-gather's
            again = layer.again if when == "during" else 0
            candidates.append((again - freed - own, temporary + buffer + retained, again, weights, scattered))
        if scatters and layer.whole:  # its reduce-scatter: its whole gradients copied into the input, the
            # collective's working copy of it and the output, a shard, beside its input's gradient; weights let go.
            # zero 1: its accumulated whole gradients let go into the input, no working copy beside it
            held_whole = layer.whole if zero == 3 and layer.keeps_gradients else 0
            copies, let_go = (1, layer.whole) if zero == 1 else (2, 0)
            candidates.append((-freed - layer.held, copies * layer.whole + layer.shard + layer.input_gradient
                               + (retained if layer.input_gradient else 0),
                               0, 0 if zero == 3 else -resharded, scattered + held_whole - let_go))
        best = max([best, *candidates], key=lambda m: m[0] + m[1] + m[3] + m[4])  # m[2] is within m[0]
        freed += layer.held
        if scatters:
            retained += layer.whole
            scattered += layer.shard - layer.whole if zero == 1 else 0
        if zero in (1, 2) and last:
            resharded += layer.whole
    return best


def _gradients_held(gradients: int, params: int, from_start: int, once_made: dict[int, int],
                    chunks_made: set[int]) -> int:
    """The bytes of the gradients a device holds: of its `gradients` bytes (for its `params` parameters) the
    share of the parameters held `from_start` and those of each chunk in `chunks_made` (`once_made`)."""
    held_params = from_start + sum(once_made[vs] for vs in chunks_made)
    return gradients * held_params // max(1, params)


T = TypeVar("T")


def _with_twins(plan: EventPlan, table: Mapping[str, T]) -> dict[str, T]:
    """`table` with every wrapped event of `plan` it lacks given its unwrapped twin's entry (events.unwrapped_twin):
    what its layer saves does not change with the wrapping."""
    out = dict(table)
    for eid, event in plan.events.items():
        twin = unwrapped_twin(event) if eid not in out else None
        if twin is not None and twin in out:
            out[eid] = out[twin]
    return out


def estimate_memory(plan: EventPlan, activations: Mapping[str, int], released: Mapping[str, int] | None = None,
                    temporaries: Mapping[str, BackwardTemporaries] | None = None) -> MemoryEstimate:
    """Each pipeline device's peak (module docstring); `activations` from `activation_bytes(profile)`,
    `released` (split backwards) from `released_bytes(profile)`: the measurement where there is one, else the
    layers' formulas (harness.plan.activations; none for a factory model's layers: `unmeasured`);
    `temporaries` from `temporary_bytes(profile)`: a factory model's layers' backward temporaries (a built-in
    layer's come from its formulas, backward_moments, which know when in its backward each falls). A B step's
    released bytes come from the formulas only where what it keeps does too: a profile that measured the B step
    but not its release (written before that measurement) releases nothing, as it always has."""
    # a profile from before wrapped events (recompute's checkpoint, ZeRO's FSDP2) measured their layers unwrapped
    activations, released, temporaries = (_with_twins(plan, table) if table is not None else None
                                          for table in (activations, released, temporaries))
    measured = activations
    activations = {**formula_activation_bytes(plan), **measured}
    released = {**{eid: n for eid, n in formula_released_bytes(plan).items() if eid not in measured},
                **(released or {})}
    spec = plan.spec
    s = spec.strategy
    V = s.virtual_stages
    dtype = spec.model.dtype_bytes
    unmeasured = sorted({plan.events[e].name for program in plan.stages for e in program.forward + program.backward
                         if plan.events[e].kind == "compute" and plan.events[e].content.get("phase") in
                         ("fwd", "bwd_input") and e not in activations})
    held = []  # per virtual stage: what one micro-batch in flight holds there
    worst = []  # per virtual stage: its backward's worst moment (_worst_backward_moment)
    kept = []  # per virtual stage, split backward: what a B step keeps for its W
    let_go = []  # ... and what it lets go of once it is over (its output, its last layer's released bytes)
    waiting = []  # ... and the received gradient the first stage's B keeps for its W (a pipeline buffer)
    worst_last = []  # ... in the iteration's last backward (zero)
    for vs, program in enumerate(plan.stages):
        saved, largest, again = 0, 0, 0
        layers = []  # _Layer per layer, in forward order
        positions = [(eid, index) for eid, index in zip(program.forward, program.forward_layers) if index >= 0]
        groups = recompute_groups(spec, [plan.layers[i] for i in program.layers])
        group_of = {program.layers[p]: program.layers[group[0]] for group in groups for p in group}
        remade = 0  # the saves of the layers of a recompute group so far, all re-made before its last's backward
        backward_of = {index: eid for eid, index in zip(program.backward, program.backward_layers) if index >= 0}
        for eid, index in positions:
            layer_saves = activations.get(eid, 0)
            moments = backward_moments(spec, plan.layers[index], (temporaries or {}).get(backward_of.get(index)))
            if selective(plan.layers[index]):  # its attention core's saves re-made in its backward
                micro, seq = plan.events[eid].content["micro"], plan.events[eid].content["seq"]
                moments = moments + [(attention_core_bytes(spec, plan.layers[index], micro, seq), 0, "during")]
            whole = plan.layers[index].params * dtype
            shard = -(-plan.layers[index].params // s.dp) * dtype
            input_gradient = input_bytes(spec, plan.layers, index) if index else 0  # none for token ids
            kind = plan.layers[index].kind
            if index in group_of:
                kept_input = input_bytes(spec, plan.layers, index) if group_of[index] == index else 0
                if index == len(plan.layers) - 1:
                    # a factory model's last layer: the loss after it, outside the checkpoint, keeps its own
                    loss = loss_saved_bytes(spec)
                    kept_input, layer_saves = kept_input + loss, max(0, layer_saves - loss)
                saved += kept_input
                largest = max(largest, layer_saves)
                again += 1
                remade = layer_saves + (remade if group_of[index] != index else 0)
                layers.append(_Layer(kept_input, remade, moments, whole, shard, input_gradient, kind == "head"))
            else:
                saved += layer_saves
                layers.append(_Layer(layer_saves, 0, moments, whole, shard, input_gradient, kind == "head"))
        if again and not largest and not unmeasured:
            raise UserError(f"recompute = {s.recompute!r}: the layers of stage {vs} save no activations for their "
                            "backward (as profiled), so recomputing them costs time and frees nothing; set "
                            "recompute = 'none' or split the model differently")
        output = plan.events[program.send_forward].bytes if program.send_forward else 0
        held.append(saved + output)
        worst.append(_worst_backward_moment(layers, s.zero))
        worst_last.append(_worst_backward_moment(layers, s.zero, last=True))
        if s.split_backward:  # the first stage's W runs its whole backward: it keeps its output and gradient
            received = plan.events[plan.stages[vs + 1].send_backward].bytes if vs < V - 1 else 0
            kept.append(sum(activations.get(e, 0) for e in program.backward) if vs else 0)
            # B runs the layers in reverse: its first item is the stage's last layer's
            let_go.append(output + (released or {}).get(program.backward[0], 0) if vs and program.backward else 0)
            waiting.append(0 if vs else received)
    # each virtual stage's backward: the gradient it receives from the next, the one it sends back
    received_of = [plan.events[plan.stages[vs + 1].send_backward].bytes if vs < V - 1 else 0 for vs in range(V)]
    sent_of = [plan.events[plan.stages[vs].send_backward].bytes if vs > 0 else 0 for vs in range(V)]
    last_micro, split = spec.micro_batches - 1, s.split_backward
    stages = []
    for d in range(s.pp):
        local = [virtual_stage(c, d, s.pp) for c in range(s.chunks)]
        params = sum(plan.layers[i].params for vs in local for i in plan.stages[vs].layers)
        weights, gradients, optimizer = model_state_bytes(spec, params)
        # the gradients held: with DDP's buckets all of them from the start, else each chunk's once its first
        # backward (a split backward's W) has made them; a MoE block's experts' (out of the buckets) so always.
        # Megatron's main gradients (master weights) are buffers made when the model is wrapped, experts' too,
        # zeroed at each step and never freed: all of them from the start, whatever dp
        chunk_params = {vs: sum(plan.layers[i].params for i in plan.stages[vs].layers) for vs in local}
        chunk_experts = {vs: sum(plan.layers[i].expert_params for i in plan.stages[vs].layers) for vs in local}
        main_buffers = spec.optimizer.master_weights and not s.zero
        bucketed = s.gradient_replicas > 1 and not s.zero
        if main_buffers:
            from_start, once_made = params, {vs: 0 for vs in local}
        else:
            from_start = sum(chunk_params[vs] - chunk_experts[vs] for vs in local) if bucketed else 0
            once_made = {vs: chunk_experts[vs] if bucketed else chunk_params[vs] for vs in local}
        made: set[int] = set()
        grads_made = _gradients_held(gradients, params, from_start, once_made, made)  # again as each chunk's are made

        live, in_flight = 0, 0
        kept_buffers = 0  # split backward: received gradients the first stage keeps until their W
        best = (-1, 0, 0, 0, 0, 0, 0, 0)  # (total, weights, gradients, activations, pipeline, in flight, re-made,
        # temporaries)
        # (gradients made, activations, buffers, in flight, re-made, temporaries, weights and gradients beyond
        # the stage's between-layer count) at each moment of the schedule
        points = []
        for step in kept_device_steps(s.schedule, d, s.pp, spec.micro_batches, s.chunks):
            vs = step.chunk * s.pp + d  # virtual_stage
            if step.phase == "F":
                live += held[vs]
                in_flight += 1
                points.append((grads_made, live, kept_buffers, in_flight, 0, 0, 0, 0))
                continue
            if step.phase == "W":  # its activations and what its B kept freed, its gradients made
                if vs == 0:  # the first stage's W runs its whole backward
                    extra, temporaries, again, more_weights, more_gradients = worst[vs]
                    points.append((grads_made, live + extra, kept_buffers, in_flight, again, temporaries,
                                   more_weights, more_gradients))
                live -= held[vs] + kept[vs] - let_go[vs]
                kept_buffers -= waiting[vs]
                in_flight -= 1
                if vs not in made:
                    made.add(vs)
                    grads_made = _gradients_held(gradients, params, from_start, once_made, made)
                points.append((grads_made, live, kept_buffers, in_flight, 0, 0, 0, 0))
                continue
            received, sent = received_of[vs], sent_of[vs]
            points.append((grads_made, live, received + kept_buffers, in_flight, 0, 0, 0, 0))
            if not split or vs:  # a split backward's B of the first stage does nothing
                moment = worst_last[vs] if step.micro == last_micro else worst[vs]
                extra, temporaries, again, more_weights, more_gradients = moment
                points.append((grads_made, live + extra, received + kept_buffers, in_flight, again, temporaries,
                               more_weights, more_gradients))
            if split:  # the activations stay for the W, with what the B keeps for it (a later stage's
                live += kept[vs]  # kept gradients hold its received one; the first stage keeps that whole)
                kept_buffers += waiting[vs]
                points.append((grads_made, live, sent + kept_buffers, in_flight, 0, 0, 0, 0))
                live -= let_go[vs]  # as the step ends and lets go of its output
                continue
            live -= held[vs]
            in_flight -= 1
            if vs not in made:
                made.add(vs)
                grads_made = _gradients_held(gradients, params, from_start, once_made, made)
            points.append((grads_made, live, received + sent, in_flight, 0, 0, 0, 0))
        # the optimizer step, every backward done: the model states and the step's own copies (step_copy_bytes)
        points.append((grads_made, live, 0, in_flight, 0, step_copy_bytes(spec, params), 0, 0))
        metered = 0
        for made_then, act, buffers, flight, again, temporaries, more_weights, more_gradients in points:
            grads = made_then + more_gradients
            total = weights + more_weights + optimizer + grads + act + buffers + temporaries
            if total - again - temporaries > metered:
                metered = total - again - temporaries
            if total > best[0]:
                best = (total, weights + more_weights, grads, act, buffers, flight, again, temporaries)
        _, held_weights, grads, act, buffers, flight, again, temporaries = best
        stages.append(StageMemory(d, held_weights, grads, optimizer, act, buffers, flight, again, temporaries,
                                  metered))
    return MemoryEstimate(stages, unmeasured)
