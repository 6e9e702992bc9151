"""The pipeline engine of `harness train`: one device's steps of one iteration, exactly in the order of
harness.plan.schedules.device_steps, Megatron tensor parallelism inside the blocks and one optimizer step over
the device's parameters (the spec's: Adam or SGD), every interval recorded.

It composes the pieces of a device: StageLinks (harness.train.p2p) carries activations and gradients between
adjacent virtual stages; GradientSync (harness.train.grad_sync) makes the replicas' gradients agree (buckets
or FSDP, then the expert, sequence-parallel and tied-embedding sums); MemoryMeter (harness.train.memory_meter)
counts what the device holds by part; the Recorder and DeviceClock (harness.train.recorder) record every
interval, LayerTimes (harness.train.layer_times) every layer's with `--layer-times`; the Completer
(harness.runtime.inflight) watches the communication left in flight.

A zero-bubble schedule's backward runs in two steps as torch.distributed.pipelining's stages run it: B with
stage_backward_input (the stage input's gradient, sent on at once), W with stage_backward_weight (the
weights'); the first virtual stage's B does nothing and its W the whole backward. Its data-parallel buckets
are all launched after the last micro-batch's W, which makes their gradients.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from harness.models import checkpointed, make_optimizer, split_backward
from harness.models.tp import set_collective_hook
from harness.plan.events import EventPlan
from harness.plan.layers import collective_kind, recompute_groups
from harness.plan.schedules import device_steps, virtual_stage
from harness.plan.spec import JobSpec
from harness.profile.memory import kept_gradients, saving_into
from harness.runtime.inflight import Completer
from harness.train.grad_sync import GradientSync
from harness.train.layer_times import LayerTimes
from harness.train.memory_meter import MemoryMeter
from harness.train.model import loss_of, micro_batch
from harness.train.p2p import ACT, GRAD, StageLinks
from harness.train.recorder import DeviceClock, Recorder


class PipelineEngine:
    """Runs one rank's share of every training iteration of `spec`."""

    def __init__(self, *, spec: JobSpec, plan: EventPlan, rank: int, device: torch.device,
                 modules: dict[int, nn.Module], tp_group=None, dp_group=None, p2p_groups: dict | None = None,
                 tie_group=None, expert_dp_group=None,
                 lr: float = 1e-3, timeout_s: float = 600.0, recorder: Recorder | None = None,
                 layer_times: bool = False, dp_comm=None, annotate: bool = False):
        """`layer_times`: also time every layer of every step (recorder.layer_rows). `dp_comm`: an mpi4py
        communicator of this rank's data-parallel group, which then all-reduces the buckets instead of
        torch.distributed. `annotate`: mark every recorded interval for torch.profiler (recorder.ANNOTATIONS).
        `tie_group`: tie_embeddings with pp > 1, this rank and the other end of its pipeline (first, last stage).
        `expert_dp_group`: expert parallelism with dp > ep, the ranks holding this rank's experts."""
        self.spec, self.plan, self.rank, self.device = spec, plan, rank, device
        s = spec.strategy
        self.tp, self.pp = s.tp, s.pp
        self.m = spec.micro_batches
        self.last_vs = s.virtual_stages - 1
        self.dp_i, _, self.pp_i = plan.coords(rank)
        self.cp_i = plan.cp_index(rank)
        self.rec = recorder or Recorder()
        self.clock = DeviceClock(device, annotate)
        self.completer = Completer(poll=device.type == "cuda", timeout_s=timeout_s)
        self.steps = device_steps(s.schedule, self.pp_i, s.pp, self.m, s.chunks)
        self.split = s.split_backward
        # split backward: (vs, micro) -> what its W step runs: ("whole", output or scaled loss, its gradient)
        # on the first virtual stage, else ("weights", stage_backward_input's parameter groups)
        self.weight_state: dict[tuple[int, int], tuple] = {}
        self.local_vs = [virtual_stage(c, self.pp_i, s.pp) for c in range(s.chunks)]
        self.stage_modules: dict[int, list[nn.Module]] = {}
        # per virtual stage, its modules in runs: (modules, whether torch.utils.checkpoint runs them again)
        self.segments: dict[int, list[tuple[list[nn.Module], bool]]] = {}
        self.tp_event: dict[int, dict[str, str]] = {}  # per virtual stage, its tp all-reduces' events by name
        for vs in self.local_vs:
            program = plan.stages[vs]
            self.stage_modules[vs] = [modules[p] for p in program.layers]
            # recompute = "full": torch.utils.checkpoint keeps each group's input and runs the group again in the
            # backward, as Megatron-LM's full recompute (harness.plan.layers.recompute_groups)
            self.segments[vs] = _segments(self.stage_modules[vs],
                                          recompute_groups(spec, [plan.layers[p] for p in program.layers]))
            self.tp_event[vs] = program.tp_events
        self.grads = GradientSync(spec=spec, plan=plan, stage_modules=self.stage_modules, modules=modules,
                                  device=device, clock=self.clock, recorder=self.rec, completer=self.completer,
                                  dp_group=dp_group, tp_group=tp_group, tie_group=tie_group,
                                  expert_dp_group=expert_dp_group, dp_comm=dp_comm)
        # One optimizer over every trainable parameter of this device (all its chunks), as frameworks step a
        # model; torch's default implementation for the device (foreach on CUDA, one tensor at a time on a CPU).
        # The plan's optimizer event is the device's first virtual stage's.
        every = [p for vs in self.local_vs for module in self.stage_modules[vs] for p in module.parameters()]
        params = [p for p in every if p.requires_grad]
        self.optimizer_event = next(iter(plan.stages[self.local_vs[0]].optimizer), "")
        self.optimizer = (make_optimizer(spec.optimizer.name, spec.optimizer.momentum, params, lr)
                          if params and self.optimizer_event else None)
        # what this device holds, by part, and its peak (harness.profile.memory; the memory model counts alike)
        self.memory = MemoryMeter()
        # a Python call for every tensor autograd saves: the runner turns it on for the iteration whose peak it
        # reports only, so the timed iterations run as training does (docs/train.md, "Memory")
        self.meter_activations = True
        self.memory.hold_weights(every)
        self.memory.watch_gradients(p for p in every if p.requires_grad and self.grads.outside_buckets(p))
        self.memory.hold_gradient_buffers(self.grads.bucket_buffers())
        self.links = StageLinks(spec=spec, plan=plan, rank=rank, local_vs=self.local_vs, clock=self.clock,
                                recorder=self.rec, memory=self.memory, completer=self.completer,
                                p2p_groups=p2p_groups)
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.losses: list[torch.Tensor] = []
        self.layer_times = LayerTimes(plan, self.local_vs, device, self.rec) if layer_times else None

    def now(self) -> int:
        return self.clock.now()

    def bucket_info(self) -> list[dict]:
        return self.grads.bucket_info()

    def reset_memory_peak(self) -> None:
        """Measure the peak from here on (after the warm-up iterations)."""
        self.memory.reset_peak()

    # ---- compute ------------------------------------------------------------------------------
    def _tp_hook(self, name: str, run: Callable[[], None]) -> None:
        start = self.now()
        group = name.split(".", 1)[0] if name.startswith(("cp.", "ep.")) else "tp"
        with self.clock.annotated(group):
            run()
        end = self.now()
        _, vs, micro = self.rec.step
        self.rec.add(start, end, end - start, collective_kind(name), self.rec.step_name(name), group,
                     self.tp_event.get(vs, {}).get(name, ""), vs, micro)

    def _forward(self, vs: int, micro: int, tokens: torch.Tensor) -> None:
        if vs == 0:
            ids, _ = micro_batch(tokens, self.spec, self.dp_i, micro, self.cp_i)
            x = ids.to(self.device)
        else:
            x = self.links.receive(vs, micro, ACT)
            x.requires_grad_(True)
        targets = None
        if vs == self.last_vs:
            targets = micro_batch(tokens, self.spec, self.dp_i, micro, self.cp_i)[1].to(self.device)
        self.rec.step = ("F", vs, micro)
        layers = self.layer_times
        start = self.now()
        with self.clock.annotated("F"):
            anchor = layers.mark() if layers else None
            marks, outputs = [], []
            out = x
            with saving_into(self.memory) if self.meter_activations else nullcontext():
                for run, again in self.segments[vs]:
                    if again:
                        out = checkpointed(_through, run, out)
                    else:
                        out = run[0](out)
                    if layers:
                        marks.append(layers.mark())
                        outputs.append(out)
                if targets is not None:
                    out = loss_of(out, targets, self.stage_modules[vs][-1])
                    self.losses.append(out.detach())
                    if layers:  # the last layer's event includes the loss
                        marks[-1] = layers.mark()
        end = self.now()
        self.rec.add(start, end, 0, "compute", "forward", "F", "", vs, micro)
        self.saved[(vs, micro)] = (x, out)
        self.memory.hold_while(out, out, "activations")  # the stage's output, until its gradient returns
        if vs < self.last_vs:
            self.links.send(out, vs, micro, ACT)
        if layers:  # after the send, which the bookkeeping would delay
            layers.record_forward(vs, micro, start, anchor, marks, outputs)

    def _backward(self, vs: int, micro: int) -> None:
        grad = self.links.receive(vs, micro, GRAD) if vs < self.last_vs else None
        x, out = self.saved.pop((vs, micro))
        self.rec.step = ("B", vs, micro)
        self.grads.before_backward(vs, micro, whole=not self.split)
        layers = self.layer_times
        start = self.now()
        with self.clock.annotated("B"):
            anchor = layers.mark() if layers else None
            if self.split:
                self._input_gradient(vs, micro, x, out, grad)
            elif grad is None:
                (out / self.m).backward()
            else:
                out.backward(grad)
            tail = layers.mark() if layers else None
        end = self.now()
        self.grads.after_backward()
        self.rec.add(start, end, 0, "compute", "backward", "B", "", vs, micro)
        if micro == self.m - 1 and not self.split:
            self.grads.stage_done(vs)
        if vs > 0:
            self.links.send(x.grad, vs, micro, GRAD)
        if layers:
            layers.record_backward(vs, micro, start, anchor, tail)

    def _parameters(self, vs: int) -> list[nn.Parameter]:
        return [p for module in self.stage_modules[vs] for p in module.parameters()]

    def _input_gradient(self, vs: int, micro: int, x: torch.Tensor, out: torch.Tensor,
                        grad: torch.Tensor | None) -> None:
        """A split backward's B: the stage input's gradient (into x.grad), keeping what its W needs."""
        out = out / self.m if grad is None else out  # the last stage's loss, scaled as the whole backward's
        if vs == 0:  # nothing to send back: the W runs the whole backward (as torch's first stage)
            self.weight_state[(vs, micro)] = ("whole", out, grad)
            return
        stage_backward_input, _ = split_backward()
        _, groups = stage_backward_input([out], None if grad is None else [grad], [x], self._parameters(vs))
        for tensor in kept_gradients(groups):  # kept for the W, counted until it has used them
            self.memory.hold_while(tensor, tensor, "activations")
        self.weight_state[(vs, micro)] = ("weights", groups)

    def _weight_gradient(self, vs: int, micro: int) -> None:
        """A split backward's W step: the weights' gradients of a micro-batch whose B has run."""
        kind, *state = self.weight_state.pop((vs, micro))
        self.rec.step = ("W", vs, micro)
        start = self.now()
        with self.clock.annotated("W"):
            if kind == "whole":
                out, grad = state
                out.backward(grad)
            else:
                _, stage_backward_weight = split_backward()
                stage_backward_weight(self._parameters(vs), state[0])
        end = self.now()
        self.rec.add(start, end, 0, "compute", "weight", "W", "", vs, micro)
        del state
        if self.grads.dp == 1:  # gradients assigned, not accumulated by autograd: no hook saw them
            for param in self._parameters(vs):
                self.memory.gradient_made(param)
        if micro == self.m - 1:
            self.grads.stage_done(vs)

    # ---- one iteration ------------------------------------------------------------------------
    def _optimizer_step(self) -> None:
        if self.optimizer is not None:
            start = self.now()
            with self.clock.annotated("opt"):
                self.optimizer.step()
            end = self.now()
            self.rec.add(start, end, 0, "optimizer", self.plan.events[self.optimizer_event].name, "opt",
                         self.optimizer_event, self.local_vs[0], -1)
        self.grads.after_step()
        self.memory.hold_optimizer_states(self.optimizer)

    def run_iteration(self, iteration: int, tokens: torch.Tensor) -> float:
        """One training iteration of this rank; returns its replica's mean loss (NaN off the last stage)."""
        self.rec.iteration = iteration
        self.losses = []
        self.grads.start_iteration()
        self.memory.release_gradients()
        s = self.spec.strategy
        set_collective_hook(self._tp_hook if self.tp > 1 or s.cp > 1 or s.ep > 1 else None)
        try:
            for step in self.steps:
                self.links.reap_sends(block=False)
                vs = virtual_stage(step.chunk, self.pp_i, self.pp)
                if step.phase == "F":
                    self._forward(vs, step.micro, tokens)
                elif step.phase == "W":
                    self._weight_gradient(vs, step.micro)
                else:
                    self._backward(vs, step.micro)
            self.grads.finish()
            self._optimizer_step()
            self.links.reap_sends(block=True)
        finally:
            set_collective_hook(None)
        assert not self.saved and not self.weight_state, \
            f"activations left after the iteration: {sorted(self.saved) + sorted(self.weight_state)}"
        if not self.losses:
            return float("nan")
        return float(torch.stack(self.losses).sum()) / self.m

    def close(self, join: bool = True) -> None:
        self.completer.close(join)


def _segments(modules: list[nn.Module], groups: list[list[int]]) -> list[tuple[list[nn.Module], bool]]:
    """A stage's modules in runs, in order: each recompute group's together (checkpointed), every other module
    alone."""
    start = {group[0]: group for group in groups}
    out, position = [], 0
    while position < len(modules):
        group = start.get(position)
        out.append(([modules[p] for p in group], True) if group else ([modules[position]], False))
        position += len(group) if group else 1
    return out


def _through(run: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """`x` through the modules of `run` in order."""
    for module in run:
        x = module(x)
    return x
