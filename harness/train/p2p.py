"""Point-to-point between adjacent virtual stages of `harness train`: the activations a stage sends to the next
one and the gradients that come back, each recorded as a row of kind `p2p`.

A step that needs an input posts its receive when the device reaches it and waits for it (the row is the
waiting); a send leaves with `isend` and completes in the background (harness.runtime.inflight), recorded once
reaped. On gloo, messages carry a tag per (sending stage, micro-batch, direction); NCCL has no tags, so there
every (kind, sender, receiver) has its own two-rank group whose messages arrive in order (`p2p_groups`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harness.plan.events import EventPlan
from harness.plan.spec import JobSpec
from harness.profile.memory import LiveStorages
from harness.runtime.inflight import Completer, Pending, post_send
from harness.train.model import activation_spec
from harness.train.recorder import DeviceClock, Recorder

ACT, GRAD = "activation", "gradient"


class StageLinks:
    """One rank's sends and receives of activations (ACT, forward) and gradients (GRAD, backward) between its
    virtual stages `local_vs` and their neighbours, on the same dp, tp and cp indexes."""

    def __init__(self, *, spec: JobSpec, plan: EventPlan, rank: int, local_vs: list[int], clock: DeviceClock,
                 recorder: Recorder, memory: LiveStorages, completer: Completer, p2p_groups: dict | None = None):
        self.plan, self.rank, self.clock, self.rec = plan, rank, clock, recorder
        self.memory, self.completer = memory, completer
        self.p2p_groups = p2p_groups or {}
        self.m, self.pp = spec.micro_batches, spec.strategy.pp
        self.dp_i, self.tp_i, _ = plan.coords(rank)
        self.cp_i = plan.cp_index(rank)
        last_vs = spec.strategy.virtual_stages - 1
        # what enters virtual stage vs from the one before it: (shape, dtype), for every stage this rank
        # receives activations for (its own) or gradients from (the next ones)
        self.act_spec: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        for vs in set(local_vs) | {v + 1 for v in local_vs}:
            if 0 < vs <= last_vs:
                self.act_spec[vs] = activation_spec(spec, plan.layers, plan.stages[vs].layers[0])
        self.sends: list[Pending] = []

    def _rank_of_vs(self, vs: int) -> int:
        return self.plan.rank_of(self.dp_i, self.tp_i, vs % self.pp, self.cp_i)

    def _tag(self, sender_vs: int, micro: int, backward: bool) -> int:
        return (sender_vs * self.m + micro) * 2 + int(backward)

    def _channel(self, what: str, src: int, dst: int, tag: int) -> dict[str, Any]:
        if self.p2p_groups:
            # NCCL has no tags and runs a group's P2P between two ranks on one stream: one group per
            # (kind, sender, receiver) keeps every channel FIFO and never queues a send behind a receive.
            return {"group": self.p2p_groups[(what, src, dst)]}
        return {"tag": tag}

    def receive(self, vs: int, micro: int, what: str) -> torch.Tensor:
        """Virtual stage vs's input (ACT, from vs - 1) or its output's gradient (GRAD, from vs + 1), waited for."""
        if what == ACT:
            sender, backward, event = vs - 1, False, self.plan.stages[vs - 1].send_forward
            shape, dtype = self.act_spec[vs]
        else:
            sender, backward, event = vs + 1, True, self.plan.stages[vs + 1].send_backward
            shape, dtype = self.act_spec[vs + 1]
        peer = self._rank_of_vs(sender)
        buffer = torch.empty(shape, dtype=dtype, device=self.clock.device)
        # a received activation is the stage's input, which its first layer saves: an activation, as the model
        # counts it; a received gradient is a pipeline buffer
        self.memory.hold_while(buffer, buffer, "activations" if what == ACT else "pipeline")
        start = self.clock.now()
        with self.clock.annotated(f"recv.{what}"):
            channel = self._channel(what, peer, self.rank, self._tag(sender, micro, backward))
            dist.irecv(buffer, src=peer, **channel).wait()
        end = self.clock.now()
        self.rec.add(start, end, end - start, "p2p", f"recv.{what}", "recv", event, vs, micro, peer)
        return buffer

    def send(self, tensor: torch.Tensor, vs: int, micro: int, what: str) -> None:
        """Virtual stage vs's output (ACT, to vs + 1) or its input's gradient (GRAD, to vs - 1), in the background."""
        if what == ACT:
            peer, backward, event = self._rank_of_vs(vs + 1), False, self.plan.stages[vs].send_forward
        else:
            peer, backward, event = self._rank_of_vs(vs - 1), True, self.plan.stages[vs].send_backward
        start = self.clock.now()
        channel = self._channel(what, self.rank, peer, self._tag(vs, micro, backward))
        self.sends.append(post_send(tensor, peer, channel, self.completer, self.memory, start,
                                    meta=(f"send.{what}", event, vs, micro, peer)))

    def reap_sends(self, block: bool) -> None:
        """Record completed sends (and free their tensors); with block, wait for all of them."""
        still = []
        for pending in self.sends:
            if not block and not pending.done.is_set():
                still.append(pending)
                continue
            blocked = self.completer.wait(pending)
            name, event, vs, micro, peer = pending.meta
            self.rec.add(pending.start_ns, pending.end_ns, blocked if block else 0, "p2p", name, "send", event, vs,
                         micro, peer)
        self.sends = still
