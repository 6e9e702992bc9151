"""What one device of `harness train` holds, by part, and its peak: harness.profile.memory's LiveStorages fed
by the engine as the memory model counts (weights, gradients, optimizer states, activations, pipeline buffers).

The pieces of the engine hold what they make through `hold` and `hold_while` (a received input, a send, an
output until its gradient returns); this meter adds what lives across a whole iteration or longer.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from harness.profile.memory import LiveStorages


class MemoryMeter(LiveStorages):
    """A device's live storages, with the parts that outlive a step: its weights, the gradients autograd makes
    outside any bucket (held from when they are made until the next iteration starts), the bucket buffers and
    the optimizer's states (held from its first step on)."""

    def __init__(self) -> None:
        super().__init__()
        self._held_states: set[int] = set()
        self._grad_releases: dict[int, Any] = {}

    def hold_weights(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            self.hold(param, "weights")

    def hold_gradient_buffers(self, buffers: Iterable[torch.Tensor]) -> None:
        """Gradient storages that live for the whole run (a data-parallel bucket's flat buffer)."""
        for buffer in buffers:
            self.hold(buffer, "gradients")

    def watch_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Hold each of `params`' gradients once autograd has made it (a hook after its accumulation)."""
        for param in params:
            param.register_post_accumulate_grad_hook(self.gradient_made)

    def gradient_made(self, param: nn.Parameter) -> None:
        """A gradient just made (a zero-bubble W step's are assigned, not accumulated: the engine calls this)."""
        if id(param) not in self._grad_releases and param.grad is not None:
            self._grad_releases[id(param)] = self.hold(param.grad, "gradients")

    def release_gradients(self) -> None:
        """An iteration starts: the gradients made in the last one are gone (set to None) or zeroed in place."""
        for release in self._grad_releases.values():
            if release is not None:
                release()
        self._grad_releases.clear()

    def hold_optimizer_states(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The optimizer's states, once it has made them (at its first step); they live from then on."""
        for state in (optimizer.state.values() if optimizer is not None else ()):
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in self._held_states:
                    self._held_states.add(id(value))
                    self.hold(value, "optimizer")
