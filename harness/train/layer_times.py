"""`harness train --layer-times`: every layer of every forward and backward step as a row of the device's
`layers` group, from marks taken inside the step.

A forward's marks are taken after each module; a backward's where the gradient reaches each module's output
(a hook on the output the forward registered), so a layer's backward runs from its output's gradient to its
input's.
"""
from __future__ import annotations

import functools
import time
from typing import Any

import torch

from harness.plan.events import EventPlan
from harness.train.recorder import Recorder


class LayerClock:
    """Marks within a compute step: on a CPU the host clock (ns); on a GPU CUDA events, read once the step has
    synchronized, as offsets from an event recorded at the step's (synchronized) start."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def to_ns(self, anchor_ns: int, anchor: Any, mark: Any) -> int:
        """A mark on the host clock, given the anchor mark taken at host time `anchor_ns` (the device idle)."""
        if not self.cuda:
            return mark
        return anchor_ns + int(anchor.elapsed_time(mark) * 1e6)


class LayerTimes:
    """Turns a step's marks into layer rows of `recorder`, for the virtual stages `local_vs` of `plan`."""

    def __init__(self, plan: EventPlan, local_vs: list[int], device: torch.device, recorder: Recorder):
        self.clock = LayerClock(device)
        self.rec = recorder
        # per virtual stage, each module's (layer position, forward event, backward event)
        self.layer_events: dict[int, list[tuple[int, str, str]]] = {}
        for vs in local_vs:
            program = plan.stages[vs]
            self.layer_events[vs] = [(p, program.forward[program.forward_layers.index(p)],
                                      program.backward[program.backward_layers.index(p)]) for p in program.layers]
        # (vs, micro) -> when the gradient reached each module's output (by the module's index in the stage)
        self.gradient_marks: dict[tuple[int, int], dict[int, Any]] = {}

    def mark(self) -> Any:
        return self.clock.mark()

    def record_forward(self, vs: int, micro: int, start_ns: int, anchor: Any, marks: list,
                       outputs: list[torch.Tensor]) -> None:
        """Record each module's forward (the last stage's last module with the loss) and hook the module
        outputs, so that the backward notes when its gradient reaches each of them."""
        ends = [self.clock.to_ns(start_ns, anchor, m) for m in marks]
        begin = start_ns
        for (layer, forward_event, _), end in zip(self.layer_events[vs], ends):
            self.rec.add_layer(begin, end, "F", forward_event, layer, vs, micro)
            begin = end
        arrivals: dict[int, Any] = {}
        self.gradient_marks[(vs, micro)] = arrivals
        for index, output in enumerate(outputs[:-1]):  # the last module's backward starts with the step
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(functools.partial(self._note_gradient, arrivals, index))

    def _note_gradient(self, arrivals: dict[int, Any], index: int, _grad: torch.Tensor) -> None:
        arrivals[index] = self.clock.mark()

    def record_backward(self, vs: int, micro: int, start_ns: int, anchor: Any, tail: Any) -> None:
        """Record each module's backward: from its output's gradient (the step's start for the stage's last
        module, whose event includes the loss) to its input's; the first module's runs to the step's end,
        since autograd may accumulate some of its weight gradients (and launch a data-parallel bucket) after
        the stage input's gradient is out."""
        clock = self.clock
        arrivals = self.gradient_marks.pop((vs, micro), {})
        layers = self.layer_events[vs]
        last = len(layers) - 1

        def at(index: int) -> int | None:
            mark = arrivals.get(index)
            return None if mark is None else clock.to_ns(start_ns, anchor, mark)

        for index in range(last, -1, -1):
            begin = start_ns if index == last else at(index)
            end = at(index - 1) if index > 0 else clock.to_ns(start_ns, anchor, tail)
            if begin is None or end is None:
                continue  # a module whose output or input carries no gradient: no boundary to time it by
            layer, _, backward_event = layers[index]
            self.rec.add_layer(begin, end, "B", backward_event, layer, vs, micro)
