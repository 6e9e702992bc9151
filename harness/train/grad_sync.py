"""Gradient synchronisation of one device of `harness train`: what makes every replica's gradients the same
before the optimizer steps.

- Data-parallel buckets (DDP's way, `BucketedAllReduce`): the gradients of each bucket of
  `plan.stages[vs].buckets` are views into one flat buffer; during the last micro-batch's backward of a chunk,
  once a bucket's last gradient is accumulated, the buffer is divided by dp and all-reduced in the background
  (in bucket order), through torch.distributed or MPI (`dp_comm`); all are waited for before the optimizer, and
  zeroed after it.
- ZeRO (`ShardedReplicas`): every layer with weights an FSDP2 unit over the data-parallel group, whose own
  all-gathers and reduce-scatters are timed and recorded.
- After the data-parallel reduction, the sums of some gradients of a stage over another group (`StageGradSum`,
  one mechanism for three uses, `stage_grad_sums`): a MoE block's experts over the ranks holding the same
  experts, sequence parallelism's replicated parameters over the tp group, a tied embedding's two copies over
  the first and last stage.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:  # what FSDPModule.set_custom_all_gather and set_custom_reduce_scatter take (torch 2.8 on; private module)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # zero > 0 then stops in ShardedReplicas with a message
    AllGather = ReduceScatter = object

from harness.common.errors import UserError
from harness.models.flat_collectives import all_gather_single, reduce_scatter_single
from harness.plan.events import EventPlan
from harness.plan.spec import JobSpec
from harness.runtime.inflight import Completer, Pending
from harness.train.model import replicated
from harness.train.recorder import DeviceClock, Recorder

MPI_POLL_S = 150e-6  # MPICH's blocking Wait spins a core; a watcher that sleeps between Tests leaves it to compute


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


def bucket_parameters(plan: EventPlan, vs: int, modules: dict[int, nn.Module], split: bool,
                      leave_out: set[int], seen: set[int]) -> list[list[nn.Parameter]]:
    """The parameters of each bucket of virtual stage vs, in the order their gradients are made: a bucket takes
    the layers the backward (a split backward's W) has run by its `ready_after`, less parameters without a
    gradient, in `leave_out` (by id: the experts) or already in an earlier bucket (`seen`, updated)."""
    program = plan.stages[vs]
    made_by = program.weight_layers if split else program.backward_layers
    previous = -1
    out = []
    for bucket in program.buckets:
        positions = [made_by[i] for i in range(previous + 1, bucket.ready_after + 1) if made_by[i] >= 0]
        previous = bucket.ready_after
        params = []
        for position in positions:
            for param in modules[position].parameters():
                if param.requires_grad and id(param) not in seen and id(param) not in leave_out:
                    seen.add(id(param))
                    params.append(param)
        out.append(params)
    return out


class BucketedAllReduce:
    """The data-parallel buckets of a device's virtual stages and their all-reduces (module docstring)."""

    def __init__(self, *, plan: EventPlan, local_vs: list[int], modules: dict[int, nn.Module], split: bool,
                 overlap: bool, dp: int, m: int, device: torch.device, clock: DeviceClock, recorder: Recorder,
                 completer: Completer, dp_group=None, dp_comm=None, leave_out: set[int] = frozenset()):
        self.dp, self.m, self.overlap = dp, m, overlap
        self.clock, self.rec, self.completer = clock, recorder, completer
        self.dp_group, self.dp_comm = dp_group, dp_comm
        self.local_vs = local_vs
        self.armed: int | None = None  # the virtual stage whose last micro-batch's backward runs (its hooks count)
        self.finished: list[int] = []  # virtual stages whose last micro-batch's gradients are made, in that order
        self.buckets: dict[int, list[BucketState]] = {vs: [] for vs in local_vs}
        seen: set[int] = set()
        for vs in local_vs:
            for index, (bucket, params) in enumerate(zip(plan.stages[vs].buckets, bucket_parameters(
                    plan, vs, modules, split, leave_out, seen))):
                dtype = params[0].dtype if params else torch.float32
                buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
                state = BucketState(vs, index, bucket.event, bucket.nbytes, params, buffer)
                offset = 0
                for param in params:
                    param.grad = buffer[offset:offset + param.numel()].view_as(param)
                    offset += param.numel()
                    param.register_post_accumulate_grad_hook(lambda _p, b=state: self._grad_ready(b))
                self.buckets[vs].append(state)

    def all(self) -> list[BucketState]:
        return [bucket for vs in self.local_vs for bucket in self.buckets[vs]]

    def info(self) -> list[dict[str, Any]]:
        return [{"virtual_stage": b.vs, "index": b.index, "event_id": b.event_id, "plan_bytes": b.plan_bytes,
                 "bytes": b.nbytes, "params": len(b.params)} for b in self.all()]

    def start_iteration(self) -> None:
        """A bucket's buffer was zeroed at the end of the last iteration (`zero`) or was allocated zeroed."""
        for bucket in self.all():
            bucket.remaining = len(bucket.params)
            bucket.ready = bucket.launched = False
            bucket.pending = None
        self.finished = []

    def _grad_ready(self, bucket: BucketState) -> None:
        if not self.overlap or self.armed != bucket.vs:
            return
        bucket.remaining -= 1
        if bucket.remaining == 0:
            bucket.ready = True
            self._launch_ready(bucket.vs)

    def stage_done(self, vs: int) -> None:
        """vs's last micro-batch has made its gradients: with overlap, every bucket still waiting goes now (its
        parameters got no gradient this iteration, or a split backward's W assigned them, firing no hook)."""
        self.finished.append(vs)
        if self.overlap:
            for bucket in self.buckets[vs]:
                bucket.ready = True
            self._launch_ready(vs)

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
        start = self.clock.now()
        if self.dp_comm is not None:
            if self.clock.cuda and bucket.host is None:
                bucket.host = torch.empty(bucket.buffer.shape, dtype=bucket.buffer.dtype, pin_memory=True)
            work = MpiAllreduce(self.dp_comm, bucket.buffer, bucket.host if self.clock.cuda else None)
        else:
            work = dist.all_reduce(bucket.buffer, group=self.dp_group, async_op=True)
        bucket.launched = True
        bucket.pending = self.completer.submit(("dp", bucket.vs), work, start, keep=bucket.buffer,
                                               meta=("dp bucket", bucket.vs, bucket.index))

    def finish(self) -> None:
        """Launch what has not gone (all of them without overlap) and wait for every bucket, recording each."""
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

    def zero(self) -> None:
        """After the optimizer step: clear the buffers for the next iteration's gradients (Megatron-LM)."""
        for bucket in self.all():
            start = self.clock.now()
            with self.clock.annotated("zero"):
                bucket.buffer.zero_()
            end = self.clock.now()
            self.rec.add(start, end, 0, "optimizer", f"zero.bucket{bucket.index}", "opt", "", bucket.vs, -1)


class ShardedReplicas:
    """zero > 0: every layer with parameters becomes an FSDP2 unit over the data-parallel group (torch's
    fully_shard), which gathers its weights before it and reduce-scatters its gradients after it. zero 1
    and 2 keep the weights whole from the first forward to the last backward; zero 1 also keeps whole
    gradients until the last backward; zero 3 reshards after every forward and backward."""

    def __init__(self, *, zero: int, m: int, stage_modules: dict[int, list[nn.Module]], dp_group,
                 device: torch.device, clock: DeviceClock, recorder: Recorder):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if AllGather is object or not hasattr(FSDPModule, "set_custom_all_gather"):
            raise UserError(f"zero = {zero} needs torch 2.8 or later (FSDP2's custom collectives, which "
                            f"time its all-gathers and reduce-scatters); this is torch {torch.__version__}")
        self.zero, self.m = zero, m
        mesh = DeviceMesh.from_group(dp_group, device_type=device.type)
        gather, scatter = _TimedAllGather(clock, recorder), _TimedReduceScatter(clock, recorder)
        self.units: dict[int, list[nn.Module]] = {vs: [] for vs in stage_modules}
        for vs, modules in stage_modules.items():
            for module in modules:
                if not any(True for _ in module.parameters()):  # as the plan: a layer with parameters is a unit
                    continue
                fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3)
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(scatter)
                self.units[vs].append(module)

    def before_backward(self, vs: int, micro: int) -> None:
        """Which units reduce-scatter and reshard after this backward (the class docstring)."""
        last = micro == self.m - 1
        for module in self.units[vs]:
            module.set_requires_gradient_sync(last or self.zero >= 2)
            module.set_reshard_after_backward(last or self.zero == 3)


class _TimedCollective:
    """FSDP2's collective as torch runs it, waited for and recorded as a row of the recorder's current step;
    buffers allocated as FSDP2's default does."""

    def __init__(self, clock: DeviceClock, recorder: Recorder):
        self.clock, self.rec = clock, recorder

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def _timed(self, kind: str, run: Callable[[], Any]):
        start = self.clock.now()
        work = run()
        if work is not None:
            work.wait()
        end = self.clock.now()
        _, vs, micro = self.rec.step
        self.rec.add(start, end, end - start, kind, self.rec.step_name(f"zero.{kind}"), "zero", "", vs, micro)
        return work


class _TimedAllGather(_TimedCollective, AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return self._timed("allgather", lambda: all_gather_single(output_tensor, input_tensor, group=group,
                                                                   async_op=async_op))


class _TimedReduceScatter(_TimedCollective, ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self._timed("reducescatter", lambda: reduce_scatter_single(output_tensor, input_tensor, group=group,
                                                                           op=op, async_op=async_op))


@dataclass(frozen=True)
class StageGradSum:
    """Some gradients of one virtual stage summed over `group` in one flat all-reduce (no group: none) and
    divided by `divide`, in place; a row `name` of phase `phase` when the plan has its `event`."""

    name: str
    phase: str
    annotation: str  # the kind of recorder.ANNOTATIONS
    vs: int
    event: str
    group: Any
    divide: int
    grads: tuple[torch.Tensor, ...]

    def run(self, clock: DeviceClock, recorder: Recorder) -> None:
        if not self.grads:
            return
        start = clock.now()
        with clock.annotated(self.annotation):
            sum_in_place(list(self.grads), self.group, self.divide)
        end = clock.now()
        if self.event:
            recorder.add(start, end, end - start, "allreduce", self.name, self.phase, self.event, self.vs, -1)


def stage_grad_sums(spec: JobSpec, plan: EventPlan, stage_modules: dict[int, list[nn.Module]], *, tp_group=None,
                    tie_group=None, expert_dp_group=None) -> list[StageGradSum]:
    """The sums after the data-parallel reduction, in the order they run, from the gradients the stages hold:

    - experts (dp x cp > 1): an expert's gradient holds the tokens every ep rank sent it; the dp / ep ranks
      holding the same experts sum theirs (where the plan has `expert_grads`) and all divide by dp x cp, as
      the buckets average the rest;
    - sequence parallelism (the plan's `sequence_grads`): each tp rank's gradients of the replicated
      parameters (norms, biases, positions) cover its own tokens; the tp group sums them, as Megatron-LM;
    - tied embeddings over stages (the plan's `tie`): the first stage's token table and the last stage's copy
      of it sum their gradients (each already averaged over dp), so that both take the same optimizer step."""
    dp = spec.strategy.gradient_replicas
    sums: list[StageGradSum] = []
    if dp > 1:
        for vs, modules in stage_modules.items():
            grads = tuple(p.grad for mod in modules if getattr(mod, "moe", None) is not None
                          for p in mod.moe.expert_parameters() if p.grad is not None)
            event = plan.stages[vs].expert_grads
            sums.append(StageGradSum("ep.expert_grads", "ep", "ep_grads", vs, event,
                                     expert_dp_group if event else None, dp, grads))
    for vs, modules in stage_modules.items():
        event = plan.stages[vs].sequence_grads
        if event:
            grads = tuple(p.grad for module in modules for name, p in module.named_parameters()
                          if p.grad is not None and replicated(name, spec.model))
            sums.append(StageGradSum("tp.sequence_grads", "tp", "tp", vs, event, tp_group, 1, grads))
    for vs, modules in stage_modules.items():
        event = plan.stages[vs].tie
        if event:
            weight = modules[0].tokens.weight if vs == 0 else modules[-1].out.weight
            grads = () if weight.grad is None else (weight.grad,)
            sums.append(StageGradSum("tie.allreduce", "tie", "tie", vs, event, tie_group, 1, grads))
    return sums


def sum_in_place(tensors: list[torch.Tensor], group, divide: int = 1) -> None:
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


class GradientSync:
    """A device's gradient synchronisation as the engine drives it: buckets or FSDP units over the data-parallel
    replicas, then the stage sums. `expert_params` are left out of the buckets (other ranks hold other
    experts)."""

    def __init__(self, *, spec: JobSpec, plan: EventPlan, stage_modules: dict[int, list[nn.Module]],
                 modules: dict[int, nn.Module], device: torch.device, clock: DeviceClock, recorder: Recorder,
                 completer: Completer, dp_group=None, tp_group=None, tie_group=None, expert_dp_group=None,
                 dp_comm=None):
        s = spec.strategy
        self.spec, self.plan, self.stage_modules = spec, plan, stage_modules
        self.clock, self.rec = clock, recorder
        self.dp, self.zero = s.gradient_replicas, s.zero
        self.tp_group, self.tie_group, self.expert_dp_group = tp_group, tie_group, expert_dp_group
        self.expert_params = [p for mods in stage_modules.values() for mod in mods
                              if getattr(mod, "moe", None) is not None for p in mod.moe.expert_parameters()]
        self._expert_ids = {id(p) for p in self.expert_params}
        self.shards = (ShardedReplicas(zero=s.zero, m=spec.micro_batches, stage_modules=stage_modules,
                                       dp_group=dp_group, device=device, clock=clock, recorder=recorder)
                       if s.zero else None)
        self.buckets = None
        if self.dp > 1 and not s.zero:
            self.buckets = BucketedAllReduce(
                plan=plan, local_vs=list(stage_modules), modules=modules, split=s.split_backward,
                overlap=s.dp_overlap, dp=self.dp, m=spec.micro_batches, device=device, clock=clock,
                recorder=recorder, completer=completer, dp_group=dp_group, dp_comm=dp_comm,
                leave_out=self._expert_ids)

    def outside_buckets(self, param: nn.Parameter) -> bool:
        """Whether `param`'s gradient is a tensor of its own that autograd makes each iteration: without data
        parallelism, or an expert's (no bucket's buffer holds it; FSDP2's, which the meter cannot follow, no)."""
        return self.dp == 1 or id(param) in self._expert_ids

    def bucket_buffers(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets.all()] if self.buckets else []

    def bucket_info(self) -> list[dict[str, Any]]:
        return self.buckets.info() if self.buckets else []

    def start_iteration(self) -> None:
        """Ready the gradients: a bucket's are zero already (`after_step`); the others are set to None. An
        iteration that raised before its optimizer step would leave its gradients in the buckets (the runner
        stops then)."""
        if self.buckets:
            self.buckets.start_iteration()
            for param in self.expert_params:
                param.grad = None
        else:
            for modules in self.stage_modules.values():
                for module in modules:
                    module.zero_grad(set_to_none=True)

    def before_backward(self, vs: int, micro: int, whole: bool) -> None:
        """A backward step of (vs, micro) starts: `whole` when it makes the weights' gradients through autograd
        (not a split backward's B), whose hooks then launch the buckets of the last micro-batch."""
        if self.buckets:
            self.buckets.armed = vs if whole and micro == self.spec.micro_batches - 1 else None
        if self.shards:
            self.shards.before_backward(vs, micro)

    def after_backward(self) -> None:
        if self.buckets:
            self.buckets.armed = None

    def stage_done(self, vs: int) -> None:
        """vs's last micro-batch has made all its weights' gradients."""
        if self.buckets:
            self.buckets.stage_done(vs)

    def finish(self) -> None:
        """Before the optimizer: wait for the buckets (FSDP reduce-scattered in the backward), then the sums."""
        if self.buckets:
            self.buckets.finish()
        for grad_sum in stage_grad_sums(self.spec, self.plan, self.stage_modules, tp_group=self.tp_group,
                                        tie_group=self.tie_group, expert_dp_group=self.expert_dp_group):
            grad_sum.run(self.clock, self.rec)

    def after_step(self) -> None:
        if self.buckets:
            self.buckets.zero()
