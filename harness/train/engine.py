"""The pipeline engine of `harness train`: one device's steps of one iteration, exactly in the order of
harness.plan.schedules.device_steps, with P2P between adjacent virtual stages, Megatron tensor parallelism inside
the blocks, DDP-style bucketed gradient all-reduces and one optimizer step over the device's parameters (the
spec's: Adam or SGD), every interval recorded, and what the device holds counted by part (harness.profile.memory).

A zero-bubble schedule's backward runs in two steps as torch.distributed.pipelining's stages run it: B with
stage_backward_input (the stage input's gradient, sent on at once), W with stage_backward_weight (the
weights'); the first virtual stage's B does nothing and its W the whole backward. Its data-parallel buckets
are all launched after the last micro-batch's W, which makes their gradients.

Communication that completes in the background (P2P sends, data-parallel buckets) is watched by one small
thread per channel that blocks in `Work.wait()` (gloo: a send's `is_completed()` stays False until someone
waits on it) or polls `is_completed()` (NCCL), and notes when it completed; the main thread records the
interval when it reaps it, with how long it had to block for it (`wait`).

With `dp_backend="mpi4py"` the buckets are all-reduced by MPI instead (MpiAllreduce); with `annotate`, every
interval the main thread records is also a torch.profiler annotation (ANNOTATIONS, docs/train.md; the
background communications join the profiler's trace afterwards, harness.train.profiler_trace).
"""
from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

try:  # what FSDPModule.set_custom_all_gather and set_custom_reduce_scatter take (torch 2.8 on; private module)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # zero > 0 then stops in PipelineEngine._shard with a message
    AllGather = ReduceScatter = object

from harness.common.errors import UserError
from harness.models import make_optimizer, split_backward
from harness.models.tp import set_collective_hook
from harness.plan.events import EventPlan
from harness.plan.layers import collective_kind, recomputed
from harness.plan.schedules import device_steps, virtual_stage
from harness.plan.spec import JobSpec
from harness.profile.memory import LiveStorages, kept_gradients, saving_into
from harness.train.model import activation_spec, loss_of, micro_batch, replicated

ACT, GRAD = "activation", "gradient"
MPI_POLL_S = 150e-6  # MPICH's blocking Wait spins a core; a watcher that sleeps between Tests leaves it to compute
# torch.profiler annotation of each kind of recorded interval (harness train --torch-profiler)
ANNOTATIONS = {"F": "distsim:forward", "B": "distsim:backward", "W": "distsim:backward.weight",
               "tp": "distsim:allreduce.tp", "cp": "distsim:cp", "ep": "distsim:ep",
               "ep_grads": "distsim:allreduce.ep",
               "recv.activation": "distsim:recv.activation", "recv.gradient": "distsim:recv.gradient",
               "opt": "distsim:optimizer", "zero": "distsim:zero.bucket", "tie": "distsim:allreduce.tie"}


class MpiAllreduce:
    """A bucket's sum over an MPI communicator, in place, in the background: a Work as the Completer waits on.
    On a CPU the tensor's own memory is reduced; on a GPU a host copy (`host`), which the main thread copies
    back once the reduction is complete."""

    def __init__(self, comm, tensor: torch.Tensor, host: torch.Tensor | None):
        from mpi4py import MPI

        if host is not None:
            host.copy_(tensor)
        self.request = comm.Iallreduce(MPI.IN_PLACE, (host if host is not None else tensor).numpy(), op=MPI.SUM)
        self.complete = False

    def is_completed(self) -> bool:
        self.complete = self.complete or self.request.Test()
        return self.complete

    def wait(self) -> None:
        while not self.is_completed():
            time.sleep(MPI_POLL_S)


def _annotation(name: str, on: bool):
    """A torch.profiler annotation (record_function) when `on`, else nothing."""
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import record_function

    return record_function(name)


class Recorder:
    """Intervals of one rank, on its own clock (ns): appended as tuples, so threads may add safely."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.layer_rows: list[tuple] = []  # (start_ns, end_ns, phase, event_id, layer, vs, micro, iteration)
        self.iteration = -1

    def add(self, start_ns: int, end_ns: int, wait_ns: int, kind: str, name: str, phase: str, event_id: str = "",
            vs: int = -1, micro: int = -1, peer: int = -1) -> None:
        self.rows.append((start_ns, end_ns, wait_ns, kind, name, phase, event_id or "", vs, micro, self.iteration,
                          peer))

    def add_layer(self, start_ns: int, end_ns: int, phase: str, event_id: str, layer: int, vs: int,
                  micro: int) -> None:
        self.layer_rows.append((start_ns, end_ns, phase, event_id, layer, vs, micro, self.iteration))


class LayerClock:
    """Marks within a compute step, for `--layer-times`: on a CPU the host clock (ns); on a GPU CUDA events,
    read once the step has synchronized, as offsets from an event recorded at the step's (synchronized) start."""

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


@dataclass(eq=False)
class Pending:
    """A communication in flight: its work, when it was launched and (once done) when it completed."""

    work: Any
    start_ns: int
    keep: Any = None  # tensors that must live until the work completes
    meta: tuple = ()
    end_ns: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Completer:
    """Per-channel watcher threads that note when in-flight works complete (in submission order per channel)."""

    def __init__(self, poll: bool, timeout_s: float):
        self.poll = poll
        self.timeout_s = timeout_s
        self._queues: dict[Any, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []

    def submit(self, channel: Any, work: Any, start_ns: int, keep: Any = None, meta: tuple = ()) -> Pending:
        pending = Pending(work, start_ns, keep, meta)
        q = self._queues.get(channel)
        if q is None:
            q = self._queues[channel] = queue.SimpleQueue()
            thread = threading.Thread(target=self._watch, args=(q,), name=f"distsim-watch-{channel}", daemon=True)
            thread.start()
            self._threads.append(thread)
        q.put(pending)
        return pending

    def _watch(self, q: queue.SimpleQueue) -> None:
        while True:
            pending = q.get()
            if pending is None:
                return
            try:
                if self.poll:
                    deadline = time.monotonic() + self.timeout_s
                    while not pending.work.is_completed():
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"communication not complete after {self.timeout_s:.0f} s")
                        time.sleep(20e-6)
                else:
                    pending.work.wait()
                pending.end_ns = time.perf_counter_ns()
                pending.keep = None  # complete: its tensors may go once the main thread has reaped it
            except BaseException as exc:  # handed to the main thread, which raises it
                pending.error = exc
                pending.end_ns = time.perf_counter_ns()
            finally:
                pending.done.set()
            del pending  # hold nothing (a work holds its tensors) while waiting for the next

    def wait(self, pending: Pending) -> int:
        """Block until `pending` completed; returns how long this call blocked (ns)."""
        t0 = time.perf_counter_ns()
        if not pending.done.wait(self.timeout_s + 30):
            raise TimeoutError(f"communication {pending.meta} not complete after {self.timeout_s:.0f} s")
        if pending.error is not None:
            raise RuntimeError(f"communication {pending.meta} failed: {pending.error}") from pending.error
        if self.poll:
            pending.work.wait()  # NCCL: order the compute stream after the collective
        return time.perf_counter_ns() - t0

    def close(self, join: bool = True) -> None:
        """Stop the watchers (after a failure do not wait for them: they may be stuck in a dead peer's wait)."""
        for q in self._queues.values():
            q.put(None)
        if join:
            for thread in self._threads:
                thread.join(timeout=5)
        self._queues.clear()
        self._threads.clear()


@dataclass(eq=False)
class BucketState:
    """A data-parallel gradient bucket: its parameters' gradients are views into one flat buffer (as DDP's
    gradient_as_bucket_view), all-reduced once the chunk's last micro-batch has produced all of them."""

    vs: int
    index: int
    event_id: str
    plan_bytes: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    remaining: int = 0
    ready: bool = False
    launched: bool = False
    pending: Pending | None = None
    host: torch.Tensor | None = None  # mpi4py on a GPU: the host copy MPI reduces

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class PipelineEngine:
    """Runs one rank's share of every training iteration of `spec`."""

    def __init__(self, *, spec: JobSpec, plan: EventPlan, rank: int, device: torch.device,
                 modules: dict[int, nn.Module], tp_group=None, dp_group=None, p2p_groups: dict | None = None,
                 tie_group=None, expert_dp_group=None,
                 lr: float = 1e-3, timeout_s: float = 600.0, recorder: Recorder | None = None,
                 layer_times: bool = False, dp_comm=None, annotate: bool = False):
        """`layer_times`: also time every layer of every step (recorder.layer_rows). `dp_comm`: an mpi4py
        communicator of this rank's data-parallel group, which then all-reduces the buckets instead of
        torch.distributed. `annotate`: mark every recorded interval for torch.profiler (ANNOTATIONS).
        `tie_group`: tie_embeddings with pp > 1, this rank and the other end of its pipeline (first, last stage)."""
        self.spec, self.plan, self.rank, self.device = spec, plan, rank, device
        s = spec.strategy
        # self.dp: the ranks that average their gradients, the data- and context-parallel ones (dp_group's)
        self.dp, self.tp, self.pp, self.chunks = s.gradient_replicas, s.tp, s.pp, s.chunks
        self.m = spec.micro_batches
        self.last_vs = s.virtual_stages - 1
        self.dp_i, self.tp_i, self.pp_i = plan.coords(rank)
        self.cp_i = plan.cp_index(rank)
        self.overlap = s.dp_overlap
        self.tp_group, self.dp_group, self.tie_group = tp_group, dp_group, tie_group
        # expert parallelism with dp > ep: the ranks holding this rank's experts, who sum their gradients
        self.expert_dp_group = expert_dp_group
        self.dp_comm = dp_comm
        self.annotate = annotate
        self.p2p_groups = p2p_groups or {}
        self.rec = recorder or Recorder()
        self.cuda = device.type == "cuda"
        self.completer = Completer(poll=self.cuda, timeout_s=timeout_s)
        self.steps = device_steps(s.schedule, self.pp_i, s.pp, self.m, s.chunks)
        self.split = s.split_backward
        # split backward: (vs, micro) -> what its W step runs: ("whole", output or scaled loss, its gradient)
        # on the first virtual stage, else ("weights", stage_backward_input's parameter groups)
        self.weight_state: dict[tuple[int, int], tuple] = {}
        self.local_vs = [virtual_stage(c, self.pp_i, s.pp) for c in range(s.chunks)]
        self.stage_modules: dict[int, list[nn.Module]] = {}
        self.checkpointed: dict[int, list[bool]] = {}
        self.act_spec: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self.tp_event: dict[int, dict[str, str]] = {}  # per virtual stage, its tp all-reduces' events by name
        for vs in self.local_vs:
            program = plan.stages[vs]
            self.stage_modules[vs] = [modules[p] for p in program.layers]
            # recompute = "full": torch.utils.checkpoint keeps these modules' inputs and runs them again in the
            # backward, as Megatron-LM's full recompute (harness.plan.layers.recomputed)
            self.checkpointed[vs] = [s.recompute == "full" and recomputed(plan.layers[p]) for p in program.layers]
            self.tp_event[vs] = program.tp_events
        self.zero = s.zero
        # a Mixture-of-Experts block's experts: out of the data-parallel buckets (other ranks hold other experts)
        self.expert_params = [p for vs in self.local_vs for mod in self.stage_modules[vs]
                              if getattr(mod, "moe", None) is not None for p in mod.moe.expert_parameters()]
        self._expert_ids = {id(p) for p in self.expert_params}
        self.sharded: dict[int, list[nn.Module]] = {vs: [] for vs in self.local_vs}
        if self.zero:
            self._shard(dp_group)
        # One optimizer over every trainable parameter of this device (all its chunks), as frameworks step a
        # model; torch's default implementation for the device (foreach on CUDA, one tensor at a time on a CPU).
        # The plan's optimizer event is the device's first virtual stage's.
        params = [p for vs in self.local_vs for mod in self.stage_modules[vs] for p in mod.parameters()
                  if p.requires_grad]
        self.optimizer_event = next(iter(plan.stages[self.local_vs[0]].optimizer), "")
        self.optimizer = (make_optimizer(spec.optimizer.name, spec.optimizer.momentum, params, lr)
                          if params and self.optimizer_event else None)
        for vs in set(self.local_vs) | {v + 1 for v in self.local_vs}:
            if 0 < vs <= self.last_vs:
                self.act_spec[vs] = activation_spec(spec, plan.layers, plan.stages[vs].layers[0])
        self.buckets: dict[int, list[BucketState]] = {vs: [] for vs in self.local_vs}
        if self.dp > 1 and not self.zero:
            self._make_buckets(modules)
        # what this device holds, by part, and its peak (harness.profile.memory; the memory model counts alike)
        self.memory = LiveStorages()
        self._held_states: set[int] = set()
        self._grad_releases: dict[int, Any] = {}
        for vs in self.local_vs:
            for module in self.stage_modules[vs]:
                for param in module.parameters():
                    self.memory.hold(param, "weights")
                    if (self.dp == 1 or id(param) in self._expert_ids) and param.requires_grad:  # else in a bucket
                        param.register_post_accumulate_grad_hook(self._grad_made)
        for vs in self.local_vs:
            for bucket in self.buckets[vs]:
                self.memory.hold(bucket.buffer, "gradients")
        self.ctx: tuple[str, int, int] = ("F", -1, -1)
        self.armed: int | None = None
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.sends: list[Pending] = []
        self.finished: list[int] = []
        self.losses: list[torch.Tensor] = []
        self.layer_clock = LayerClock(device) if layer_times else None
        # with layer times, per virtual stage, each module's (layer position, forward event, backward event)
        self.layer_events: dict[int, list[tuple[int, str, str]]] = {}
        for vs in self.local_vs if layer_times else ():
            program = plan.stages[vs]
            self.layer_events[vs] = [(p, program.forward[program.forward_layers.index(p)],
                                      program.backward[program.backward_layers.index(p)]) for p in program.layers]
        # (vs, micro) -> when the gradient reached each module's output (by the module's index in the stage)
        self.gradient_marks: dict[tuple[int, int], dict[int, Any]] = {}

    # ---- ZeRO (FSDP2) --------------------------------------------------------------------------
    def _shard(self, dp_group) -> None:
        """zero > 0: every layer with parameters becomes an FSDP2 unit over the data-parallel group (torch's
        fully_shard), which gathers its weights before it and reduce-scatters its gradients after it. zero 1
        and 2 keep the weights whole from the first forward to the last backward; zero 1 also keeps whole
        gradients until the last backward; zero 3 reshards after every forward and backward."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if AllGather is object or not hasattr(FSDPModule, "set_custom_all_gather"):
            raise UserError(f"zero = {self.zero} needs torch 2.8 or later (FSDP2's custom collectives, which "
                            f"time its all-gathers and reduce-scatters); this is torch {torch.__version__}")
        mesh = DeviceMesh.from_group(dp_group, device_type=self.device.type)
        gather, scatter = _TimedAllGather(self), _TimedReduceScatter(self)
        for vs in self.local_vs:
            for module in self.stage_modules[vs]:
                if not any(True for _ in module.parameters()):  # as the plan: a layer with parameters is a unit
                    continue
                fully_shard(module, mesh=mesh, reshard_after_forward=self.zero == 3)
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(scatter)
                self.sharded[vs].append(module)

    def _prepare_backward(self, vs: int, micro: int) -> None:
        """Before a backward: which FSDP units reduce-scatter and reshard after it (module docstring)."""
        last = micro == self.m - 1
        for module in self.sharded[vs]:
            module.set_requires_gradient_sync(last or self.zero >= 2)
            module.set_reshard_after_backward(last or self.zero == 3)

    def _record_zero(self, kind: str, start: int, end: int) -> None:
        phase, vs, micro = self.ctx
        self.rec.add(start, end, end - start, kind, f"zero.{kind}.{'fwd' if phase == 'F' else 'bwd'}", "zero", "",
                     vs, micro)

    # ---- helpers ------------------------------------------------------------------------------
    def _annotated(self, kind: str):
        """The torch.profiler annotation of a recorded interval of this kind (nothing unless `annotate`)."""
        return _annotation(ANNOTATIONS[kind], self.annotate)

    def now(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter_ns()

    def _rank_of_vs(self, vs: int) -> int:
        return self.plan.rank_of(self.dp_i, self.tp_i, vs % self.pp, self.cp_i)

    def _tag(self, sender_vs: int, micro: int, backward: bool) -> int:
        return (sender_vs * self.m + micro) * 2 + int(backward)

    def _p2p_kwargs(self, what: str, src: int, dst: int, tag: int) -> dict[str, Any]:
        if self.p2p_groups:
            # NCCL has no tags and runs a group's P2P between two ranks on one stream: one group per
            # (kind, sender, receiver) keeps every channel FIFO and never queues a send behind a receive.
            return {"group": self.p2p_groups[(what, src, dst)]}
        return {"tag": tag}

    def bucket_info(self) -> list[dict[str, Any]]:
        return [{"virtual_stage": b.vs, "index": b.index, "event_id": b.event_id, "plan_bytes": b.plan_bytes,
                 "bytes": b.nbytes, "params": len(b.params)} for vs in self.local_vs for b in self.buckets[vs]]

    # ---- data-parallel buckets ------------------------------------------------------------------
    def _make_buckets(self, modules: dict[int, nn.Module]) -> None:
        seen: set[int] = set()
        for vs in self.local_vs:
            program = self.plan.stages[vs]
            previous = -1
            made_by = program.weight_layers if self.split else program.backward_layers
            for index, bucket in enumerate(program.buckets):
                positions = [made_by[i] for i in range(previous + 1, bucket.ready_after + 1) if made_by[i] >= 0]
                previous = bucket.ready_after
                params = []
                for position in positions:
                    for param in modules[position].parameters():
                        if param.requires_grad and id(param) not in seen and id(param) not in self._expert_ids:
                            seen.add(id(param))
                            params.append(param)
                dtype = params[0].dtype if params else torch.float32
                buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=self.device)
                state = BucketState(vs, index, bucket.event, bucket.nbytes, params, buffer)
                offset = 0
                for param in params:
                    param.grad = buffer[offset:offset + param.numel()].view_as(param)
                    offset += param.numel()
                    param.register_post_accumulate_grad_hook(lambda _p, b=state: self._grad_ready(b))
                self.buckets[vs].append(state)

    def _grad_ready(self, bucket: BucketState) -> None:
        if not self.overlap or self.armed != bucket.vs:
            return
        bucket.remaining -= 1
        if bucket.remaining == 0:
            bucket.ready = True
            self._launch_ready(bucket.vs)

    def _launch_ready(self, vs: int) -> None:
        """Launch ready buckets strictly in bucket order (as DDP), so every replica issues the same sequence."""
        for bucket in self.buckets[vs]:
            if bucket.launched:
                continue
            if not bucket.ready:
                return
            self._launch(bucket)

    def _launch(self, bucket: BucketState) -> None:
        bucket.buffer.div_(self.dp)
        start = self.now()
        if self.dp_comm is not None:
            if self.cuda and bucket.host is None:
                bucket.host = torch.empty(bucket.buffer.shape, dtype=bucket.buffer.dtype, pin_memory=True)
            work = MpiAllreduce(self.dp_comm, bucket.buffer, bucket.host if self.cuda else None)
        else:
            work = dist.all_reduce(bucket.buffer, group=self.dp_group, async_op=True)
        bucket.launched = True
        bucket.pending = self.completer.submit(("dp", bucket.vs), work, start, keep=bucket.buffer,
                                               meta=("dp bucket", bucket.vs, bucket.index))

    # ---- memory ---------------------------------------------------------------------------------
    def _grad_made(self, param: nn.Parameter) -> None:
        """dp = 1: a gradient autograd has just made (freed again when the iteration starts, set to None)."""
        if id(param) not in self._grad_releases and param.grad is not None:
            self._grad_releases[id(param)] = self.memory.hold(param.grad, "gradients")

    def _hold_optimizer_states(self) -> None:
        """The optimizer's states, once it has made them (at its first step); they live from then on."""
        for state in (self.optimizer.state.values() if self.optimizer is not None else ()):
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in self._held_states:
                    self._held_states.add(id(value))
                    self.memory.hold(value, "optimizer")

    def reset_memory_peak(self) -> None:
        """Measure the peak from here on (after the warm-up iterations)."""
        self.memory.reset_peak()

    # ---- P2P ----------------------------------------------------------------------------------
    def _recv(self, vs: int, micro: int, what: str) -> torch.Tensor:
        if what == ACT:
            sender, backward, event = vs - 1, False, self.plan.stages[vs - 1].send_forward
            shape, dtype = self.act_spec[vs]
        else:
            sender, backward, event = vs + 1, True, self.plan.stages[vs + 1].send_backward
            shape, dtype = self.act_spec[vs + 1]
        peer = self._rank_of_vs(sender)
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        # a received activation is the stage's input, which its first layer saves: an activation, as the model
        # counts it; a received gradient is a pipeline buffer
        self.memory.hold_while(buffer, buffer, "activations" if what == ACT else "pipeline")
        start = self.now()
        with self._annotated(f"recv.{what}"):
            kwargs = self._p2p_kwargs(what, peer, self.rank, self._tag(sender, micro, backward))
            dist.irecv(buffer, src=peer, **kwargs).wait()
        end = self.now()
        self.rec.add(start, end, end - start, "p2p", f"recv.{what}", "recv", event, vs, micro, peer)
        return buffer

    def _send(self, tensor: torch.Tensor, vs: int, micro: int, what: str) -> None:
        if what == ACT:
            peer, backward, event = self._rank_of_vs(vs + 1), False, self.plan.stages[vs].send_forward
        else:
            peer, backward, event = self._rank_of_vs(vs - 1), True, self.plan.stages[vs].send_backward
        tensor = tensor.detach().contiguous()
        start = self.now()
        kwargs = self._p2p_kwargs(what, self.rank, peer, self._tag(vs, micro, backward))
        work = dist.isend(tensor, dst=peer, **kwargs)
        self.memory.hold_while(tensor, tensor, "pipeline")  # until the send completes and lets it go
        self.sends.append(self.completer.submit(("p2p", peer), work, start, keep=tensor,
                                                meta=(f"send.{what}", event, vs, micro, peer)))

    def _reap_sends(self, block: bool) -> None:
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

    # ---- compute ------------------------------------------------------------------------------
    def _tp_hook(self, name: str, run: Callable[[], None]) -> None:
        start = self.now()
        group = name.split(".", 1)[0] if name.startswith(("cp.", "ep.")) else "tp"
        with self._annotated(group):
            run()
        end = self.now()
        phase, vs, micro = self.ctx
        self.rec.add(start, end, end - start, collective_kind(name), f"{name}.{'fwd' if phase == 'F' else 'bwd'}",
                     group, self.tp_event.get(vs, {}).get(name, ""), vs, micro)

    def _forward(self, vs: int, micro: int, tokens: torch.Tensor) -> None:
        if vs == 0:
            ids, _ = micro_batch(tokens, self.spec, self.dp_i, micro, self.cp_i)
            x = ids.to(self.device)
        else:
            x = self._recv(vs, micro, ACT)
            x.requires_grad_(True)
        targets = None
        if vs == self.last_vs:
            targets = micro_batch(tokens, self.spec, self.dp_i, micro, self.cp_i)[1].to(self.device)
        self.ctx = ("F", vs, micro)
        clock = self.layer_clock
        start = self.now()
        with self._annotated("F"):
            anchor = clock.mark() if clock else None
            marks, outputs = [], []
            out = x
            with saving_into(self.memory):
                for module, again in zip(self.stage_modules[vs], self.checkpointed[vs]):
                    if again:
                        # the whole forward again, as Megatron-LM (and the plan): torch's default early stop
                        # would skip a pre-LN block's last projection and all-reduce, which nothing saves
                        with set_checkpoint_early_stop(False):
                            out = checkpoint(module, out, use_reentrant=False)
                    else:
                        out = module(out)
                    if clock:
                        marks.append(clock.mark())
                        outputs.append(out)
                if targets is not None:
                    out = loss_of(out, targets, self.stage_modules[vs][-1])
                    self.losses.append(out.detach())
                    if clock:  # the last layer's event includes the loss
                        marks[-1] = clock.mark()
        end = self.now()
        self.rec.add(start, end, 0, "compute", "forward", "F", "", vs, micro)
        self.saved[(vs, micro)] = (x, out)
        self.memory.hold_while(out, out, "activations")  # the stage's output, until its gradient returns
        if vs < self.last_vs:
            self._send(out, vs, micro, ACT)
        if clock:  # after the send, which the bookkeeping would delay
            self._record_layer_forwards(vs, micro, start, anchor, marks, outputs)

    def _backward(self, vs: int, micro: int) -> None:
        grad = self._recv(vs, micro, GRAD) if vs < self.last_vs else None
        x, out = self.saved.pop((vs, micro))
        last_micro = micro == self.m - 1
        self.armed = vs if last_micro and not self.split else None
        self.ctx = ("B", vs, micro)
        if self.zero:
            self._prepare_backward(vs, micro)
        clock = self.layer_clock
        start = self.now()
        with self._annotated("B"):
            anchor = clock.mark() if clock else None
            if self.split:
                self._input_gradient(vs, micro, x, out, grad)
            elif grad is None:
                (out / self.m).backward()
            else:
                out.backward(grad)
            tail = clock.mark() if clock else None
        end = self.now()
        self.armed = None
        self.rec.add(start, end, 0, "compute", "backward", "B", "", vs, micro)
        if last_micro and self.dp > 1 and not self.split:
            self.finished.append(vs)
            if self.overlap:  # buckets whose parameters got no gradient this iteration
                for bucket in self.buckets[vs]:
                    bucket.ready = True
                self._launch_ready(vs)
        if vs > 0:
            self._send(x.grad, vs, micro, GRAD)
        if clock:
            self._record_layer_backwards(vs, micro, start, anchor, tail)

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
        self.ctx = ("W", vs, micro)
        start = self.now()
        with self._annotated("W"):
            if kind == "whole":
                out, grad = state
                out.backward(grad)
            else:
                _, stage_backward_weight = split_backward()
                stage_backward_weight(self._parameters(vs), state[0])
        end = self.now()
        self.rec.add(start, end, 0, "compute", "weight", "W", "", vs, micro)
        del state
        if self.dp == 1:  # gradients assigned, not accumulated by autograd: no hook saw them
            for param in self._parameters(vs):
                self._grad_made(param)
        if micro == self.m - 1 and self.dp > 1:
            self.finished.append(vs)
            if self.overlap:  # every bucket of the stage is ready now
                for bucket in self.buckets[vs]:
                    bucket.ready = True
                self._launch_ready(vs)

    # ---- per-layer times (--layer-times) ------------------------------------------------------
    def _record_layer_forwards(self, vs: int, micro: int, start_ns: int, anchor: Any, marks: list,
                               outputs: list[torch.Tensor]) -> None:
        """Record each module's forward (the last stage's last module with the loss) and hook the module
        outputs, so that the backward notes when its gradient reaches each of them."""
        clock = self.layer_clock
        ends = [clock.to_ns(start_ns, anchor, m) for m in marks]
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
        arrivals[index] = self.layer_clock.mark()

    def _record_layer_backwards(self, vs: int, micro: int, start_ns: int, anchor: Any, tail: Any) -> None:
        """Record each module's backward: from its output's gradient (the step's start for the stage's last
        module, whose event includes the loss) to its input's; the first module's runs to the step's end,
        since autograd may accumulate some of its weight gradients (and launch a data-parallel bucket) after
        the stage input's gradient is out."""
        clock = self.layer_clock
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

    # ---- one iteration ------------------------------------------------------------------------
    def _zero_grads(self) -> None:
        """Ready the gradients for an iteration. A data-parallel bucket's buffer was zeroed at the end of the
        last one (_optimizer_steps, where the trace shows it) or was allocated zeroed: an iteration that
        raised before its optimizer steps would leave its gradients in the buckets (the runner stops then)."""
        if self.dp > 1 and not self.zero:
            for vs in self.local_vs:
                for bucket in self.buckets[vs]:
                    bucket.remaining = len(bucket.params)
                    bucket.ready = bucket.launched = False
                    bucket.pending = None
            for param in self.expert_params:
                param.grad = None
            for release in self._grad_releases.values():
                if release is not None:
                    release()
            self._grad_releases.clear()
        else:
            for vs in self.local_vs:
                for module in self.stage_modules[vs]:
                    module.zero_grad(set_to_none=True)
            for release in self._grad_releases.values():
                if release is not None:
                    release()
            self._grad_releases.clear()

    def _finish_data_parallel(self) -> None:
        if self.dp == 1 or self.zero:  # FSDP reduce-scattered in the backward
            return
        if not self.overlap:
            for vs in self.finished:
                for bucket in self.buckets[vs]:
                    self._launch(bucket)
        for vs in self.finished:
            for bucket in self.buckets[vs]:
                pending = bucket.pending
                assert pending is not None, f"bucket {bucket.index} of stage {vs} was never launched"
                blocked = self.completer.wait(pending)
                if bucket.host is not None:  # mpi4py on a GPU: the sum is in the host copy
                    bucket.buffer.copy_(bucket.host)
                self.rec.add(pending.start_ns, pending.end_ns, blocked, "allreduce", f"dp.bucket{bucket.index}",
                             "dp", bucket.event_id, vs, self.m - 1)

    def _reduce_expert_grads(self) -> None:
        """Expert parallelism: an expert's gradient holds the tokens every ep rank sent it; the dp / ep ranks
        holding the same experts sum theirs (one flat all-reduce per virtual stage), and all divide by dp, as the
        buckets average the rest."""
        if self.dp == 1 or not self.expert_params:
            return
        for vs in self.local_vs:
            params = [p for mod in self.stage_modules[vs] if getattr(mod, "moe", None) is not None
                      for p in mod.moe.expert_parameters() if p.grad is not None]
            if not params:
                continue
            event = self.plan.stages[vs].expert_grads
            start = self.now()
            with self._annotated("ep_grads"):
                _sum_in_place([p.grad for p in params], self.expert_dp_group if event else None, self.dp)
            end = self.now()
            if event:
                self.rec.add(start, end, end - start, "allreduce", "ep.expert_grads", "ep", event, vs, -1)

    def _all_reduce_sequence_grads(self) -> None:
        """Sequence parallelism: each tp rank's gradients of the replicated parameters (norms, biases, positions)
        cover its own tokens; the group sums them, one flat all-reduce per virtual stage, as Megatron-LM does
        after the data-parallel reduction."""
        for vs in self.local_vs:
            event = self.plan.stages[vs].sequence_grads
            if not event:
                continue
            grads = [p.grad for module in self.stage_modules[vs] for name, p in module.named_parameters()
                     if p.grad is not None and replicated(name, self.spec.model)]
            start = self.now()
            with self._annotated("tp"):
                _sum_in_place(grads, self.tp_group)
            end = self.now()
            self.rec.add(start, end, end - start, "allreduce", "tp.sequence_grads", "tp", event, vs, -1)

    def _all_reduce_tied(self) -> None:
        """tie_embeddings with pp > 1: the first stage's token table and the last stage's copy of it sum their
        gradients (each replica's already averaged over dp), so that both take the same optimizer step."""
        for vs in self.local_vs:
            event = self.plan.stages[vs].tie
            if not event:
                continue
            module = self.stage_modules[vs][0 if vs == 0 else -1]
            weight = module.tokens.weight if vs == 0 else module.out.weight
            start = self.now()
            with self._annotated("tie"):
                dist.all_reduce(weight.grad, group=self.tie_group)
            end = self.now()
            self.rec.add(start, end, end - start, "allreduce", "tie.allreduce", "tie", event, vs, -1)

    def _optimizer_steps(self) -> None:
        if self.optimizer is not None:
            start = self.now()
            with self._annotated("opt"):
                self.optimizer.step()
            end = self.now()
            self.rec.add(start, end, 0, "optimizer", self.plan.events[self.optimizer_event].name, "opt",
                         self.optimizer_event, self.local_vs[0], -1)
        for vs in self.local_vs:
            if self.dp > 1 and not self.zero:  # clear the buckets for the next iteration's gradients (Megatron-LM)
                for bucket in self.buckets[vs]:
                    start = self.now()
                    with self._annotated("zero"):
                        bucket.buffer.zero_()
                    end = self.now()
                    self.rec.add(start, end, 0, "optimizer", f"zero.bucket{bucket.index}", "opt", "", vs, -1)
        self._hold_optimizer_states()

    def run_iteration(self, iteration: int, tokens: torch.Tensor) -> float:
        """One training iteration of this rank; returns its replica's mean loss (NaN off the last stage)."""
        self.rec.iteration = iteration
        self.losses = []
        self.finished = []
        self._zero_grads()
        s = self.spec.strategy
        set_collective_hook(self._tp_hook if self.tp > 1 or s.cp > 1 or s.ep > 1 else None)
        try:
            for step in self.steps:
                self._reap_sends(block=False)
                vs = virtual_stage(step.chunk, self.pp_i, self.pp)
                if step.phase == "F":
                    self._forward(vs, step.micro, tokens)
                elif step.phase == "W":
                    self._weight_gradient(vs, step.micro)
                else:
                    self._backward(vs, step.micro)
            self._finish_data_parallel()
            self._reduce_expert_grads()
            self._all_reduce_sequence_grads()
            self._all_reduce_tied()
            self._optimizer_steps()
            self._reap_sends(block=True)
        finally:
            set_collective_hook(None)
        assert not self.saved and not self.weight_state, \
            f"activations left after the iteration: {sorted(self.saved) + sorted(self.weight_state)}"
        if not self.losses:
            return float("nan")
        return float(torch.stack(self.losses).sum()) / self.m

    def close(self, join: bool = True) -> None:
        self.completer.close(join)


def _sum_in_place(tensors: list[torch.Tensor], group, divide: int = 1) -> None:
    """Sum `tensors` over `group` (None: none) in one flat all-reduce and divide them by `divide`, in place."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if group is not None:
        dist.all_reduce(flat, group=group)
    if divide != 1:
        flat.div_(divide)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class _TimedCollective:
    """FSDP2's collective as torch runs it, waited for and recorded as a row (zero > 0; the engine's context
    names the step it ran in); buffers allocated as FSDP2's default does."""

    def __init__(self, engine: PipelineEngine):
        self.engine = engine

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def _timed(self, kind: str, run: Callable[[], Any]):
        start = self.engine.now()
        work = run()
        if work is not None:
            work.wait()
        self.engine._record_zero(kind, start, self.engine.now())
        return work


class _TimedAllGather(_TimedCollective, AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self._timed("allgather", lambda: gather(output_tensor, input_tensor, group=group, async_op=async_op))


class _TimedReduceScatter(_TimedCollective, ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return self._timed("reducescatter", lambda: scatter(output_tensor, input_tensor, group=group, op=op,
                                                            async_op=async_op))
