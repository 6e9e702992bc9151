"""Communication events: P2P pairs, all-reduce groups (max over the group), and the all-gathers and
reduce-scatters of sharded data parallelism.

A P2P pair is measured twice: by ping-pong (half the round trip: both sides waiting, as when the receiver
posted its receive first), and with the sender busy computing when the receiver posts (as in a pipeline's
steady state, where the data waits for the receiver while the sender has gone on to its next step). The
second matters where the transfer needs the sender's CPU: gloo's (or MPI's) progress thread has to preempt
the compute thread, which costs milliseconds on a fully used core; on a GPU with NCCL it costs nothing.

Backends: torch.distributed (gloo on CPU, NCCL on GPU; the default, as training uses it) or mpi4py.
Every rank of the world calls `measure_comm` for every task in the same order (group creation is
collective); ranks outside a task's group wait at the barrier that separates tasks.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from harness.models import TORCH_DTYPES
from harness.plan.events import SHARDED_KINDS
from harness.profile.timer import synchronize
from harness.runtime.mpi_errors import yielding_barrier
from launcher.placement import CommTask

# timed as the collective benchmark times them (harness.profile.collectives): a sample is the slowest member's;
# an all-to-all (expert parallelism's) moves its size's even shares between every pair
BENCHED_KINDS = (*SHARDED_KINDS, "alltoall")

SENDER_BUSY_S = 0.015  # how long the sender computes after posting its send
RECEIVER_DELAY_S = 0.002  # the receiver posts this long after the send, so the sender is computing by then
POST_DELAY_S = 0.001  # in the ping-pong the sender starts this long after the barrier: the receiver waits by then
# the stream of late receives (CommProfiler._p2p_late): its steps (each LATE_STEP_S of compute, a send each way),
# run with and without the sends in each of LATE_ROUNDS rounds; a rank leaves at most LATE_IN_FLIGHT sends in flight
LATE_STREAM_STEPS = 60
LATE_STEP_S = 1e-3
LATE_IN_FLIGHT = 3
LATE_ROUNDS = 5
WAIT_POLL_S = 0.001  # how often a rank outside a task's group looks whether the task is done


class CommSamples(NamedTuple):
    """One communication task's samples (seconds); `sender_busy_s` and `send_post_s` only for P2P (the latter:
    the sender's time in the call that posts its send), `late_s` only for a CPU's P2P of the job (_p2p_late);
    `divide_s` and `zero_s` only for all-reduces (the in-place division by the group size before each all-reduce,
    and the buffer's zeroing after it), empty otherwise."""

    samples_s: np.ndarray
    sender_busy_s: np.ndarray
    divide_s: np.ndarray = np.empty(0)
    zero_s: np.ndarray = np.empty(0)
    send_post_s: np.ndarray = np.empty(0)
    late_s: np.ndarray = np.empty(0)


def thread_run_queue_wait_s() -> float | None:
    """The calling thread's seconds runnable but not running so far (Linux's schedstat: its wait on the run queue,
    what other threads on its core took from it); None where the system does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class CommProfiler:
    """Measures communication tasks on the world; caches one group per rank set."""

    def __init__(self, comm, backend: str, device: torch.device):
        self.comm = comm  # mpi4py world communicator
        self.backend = backend  # torch | mpi4py
        self.device = device
        self.rank = comm.Get_rank()
        self._torch_groups: dict[tuple[int, ...], object] = {}

    def _torch_group(self, ranks: tuple[int, ...]):
        if ranks not in self._torch_groups:
            self._torch_groups[ranks] = dist.new_group(list(ranks))  # collective over the whole world
        return self._torch_groups[ranks]

    def measure_composite(self, task: CommTask, spec, warmup: int, repeats: int) -> np.ndarray | None:
        """A tensor-parallel layer with its all-reduces on the task's real group: per repeat, barrier, then the
        layer's forward (or backward) timed on every member. A sample runs from when the last member started
        to when the last one finished (composite_samples). Collective over the world (the group is created
        by all ranks); samples on the task's first rank, None elsewhere."""
        from harness.profile.compute import ComputeRunner

        members = task.ranks
        group = self._torch_group(members)
        samples = None
        if self.rank in members:
            runner = ComputeRunner(spec, {**task.content, "kind": "compute"}, self.device, group=group)
            starts = np.empty(repeats, dtype=np.float64)
            ends = np.empty(repeats, dtype=np.float64)
            for i in range(warmup + repeats):
                dist.barrier(group=group)
                start = time.perf_counter()
                seconds = runner.sample()
                if i >= warmup:
                    starts[i - warmup], ends[i - warmup] = start, start + seconds
            last = torch.from_numpy(np.stack([starts, ends])).to(self.device)
            dist.all_reduce(last, op=dist.ReduceOp.MAX, group=group)
            samples = composite_samples(*last.cpu().numpy())
        yielding_barrier(self.comm, WAIT_POLL_S)  # the ranks outside the group leave the cores to it
        return samples if self.rank == members[0] else None

    def _buffer(self, task: CommTask) -> torch.Tensor:
        dtype = TORCH_DTYPES[task.content["dtype"]]
        elements = max(1, task.content["bytes"] // torch.tensor([], dtype=dtype).element_size())
        return torch.ones(elements, dtype=dtype, device=self.device)

    def measure(self, task: CommTask, warmup: int, repeats: int, spec=None) -> CommSamples | None:
        """Samples (seconds) on the task's first rank, None elsewhere. Collective over the world. `spec` (the
        job's) builds the layer whose parameters an FSDP2 collective moves (zero > 0)."""
        members = task.ranks
        group = self._torch_group(members) if self.backend == "torch" else None
        mpi_group = None
        if self.backend == "mpi4py" or task.kind in BENCHED_KINDS:
            from mpi4py import MPI

            member = self.rank in members
            mpi_group = self.comm.Split(0 if member else MPI.UNDEFINED, key=members.index(self.rank) if member else 0)
            if mpi_group == MPI.COMM_NULL:
                mpi_group = None
        samples = None
        if self.rank in members:
            buffer = self._buffer(task) if task.kind not in BENCHED_KINDS else None
            if task.kind in SHARDED_KINDS and task.content.get("fsdp") and group is not None and spec is not None:
                samples = self._fsdp(task, spec, group, mpi_group, warmup, repeats)
            elif task.kind in BENCHED_KINDS:
                samples = self._sharded(task, members, group, mpi_group, warmup, repeats)
            elif task.kind == "p2p":
                round_trips, posts = self._p2p(buffer, members, group, mpi_group, warmup, repeats)
                if mpi_group is None:  # the run's P2P is torch.distributed's, posted through its own path
                    posts = self._p2p_posts_as_run(buffer, members, group, repeats)
                late = (self._p2p_late(buffer, members, group, LATE_ROUNDS)
                        if mpi_group is None and self.device.type == "cpu" and task.needed else np.empty(0))
                samples = CommSamples(round_trips,
                                      self._p2p_sender_busy(buffer, members, group, mpi_group, warmup, repeats),
                                      send_post_s=posts, late_s=late)
            else:
                samples = self._allreduce(buffer, group, mpi_group, warmup, repeats)
        if mpi_group is not None:
            mpi_group.Free()
        yielding_barrier(self.comm, WAIT_POLL_S)  # the ranks outside the group leave the cores to it
        return samples if self.rank == members[0] else None

    def _sharded(self, task: CommTask, members, group, mpi_group, warmup: int, repeats: int) -> CommSamples:
        """An all-gather, reduce-scatter or all-to-all of the task's size (the whole array, harness.plan.collectives),
        timed as the collective benchmark times it (harness.profile.collectives): a sample is its slowest member's."""
        from harness.profile.collectives import CollectiveBench

        backend = "mpi4py" if self.backend == "mpi4py" else "torch"
        bench = CollectiveBench(mpi_group, members, backend, task.content["dtype"], self.device, group)
        result = bench.measure(task.kind, task.content["bytes"], warmup, repeats)
        if result.wrong:  # a backend that computes wrong results has no time worth keeping
            raise RuntimeError(f"{task.kind} of {task.content['bytes']} B on ranks {members} gave {result.wrong} "
                               "wrong output element(s); check the communication backend with harness collectives")
        return CommSamples(result.samples_s, np.empty(0))

    def _fsdp(self, task: CommTask, spec, group, mpi_group, warmup: int, repeats: int) -> CommSamples:
        """zero > 0: the collective as FSDP2 runs it for a unit holding the layer's parameters (their shapes,
        `fully_shard` over the task's group; FSDP2's work is per parameter): an all-gather is `unshard()`
        (the shards copied in, gathered, copied out into freshly allocated whole weights), timed to its end,
        then `reshard()` untimed; a reduce-scatter is the backward of a trivial use of the weights, whose
        post-backward hook copies the whole gradients in, reduce-scatters and averages them and accumulates
        the shards, less that backward's own time without FSDP2 (its median: the gradients it writes are the
        layer's backward's, profiled with the layer), in the event's dtype (FSDP2's reduce_dtype where it is not
        the weights'). A sample is the slowest member's. FSDP2 shards every
        parameter of a unit, frozen ones too."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from harness.profile.compute import parameter_shapes

        shapes = parameter_shapes(spec, [[task.content["fsdp"], 1]], self.device, trainable=False)
        one = torch.ones((), dtype=shapes[0][1], device=self.device)
        own = 0.0
        if task.kind == "reducescatter":
            plain, times = TrivialUnit(shapes, self.device), []
            for _ in range(warmup + max(3, min(repeats, 10))):
                loss = plain(one)
                synchronize(self.device)
                t0 = time.perf_counter_ns()
                loss.backward()
                synchronize(self.device)
                times.append((time.perf_counter_ns() - t0) / 1e9)
                plain.zero_grad(set_to_none=True)
            own = float(np.median(times[warmup:]))
        mesh = DeviceMesh.from_group(group, device_type=self.device.type)
        unit = TrivialUnit(shapes, self.device)
        # a reduce-scatter in another dtype than the weights' ([optimizer] reduce_dtype: Megatron's fp32 main
        # gradients of 16-bit weights) is FSDP2's reduce_dtype: the gradients cast and reduced in it
        reduce_dtype = TORCH_DTYPES[task.content["dtype"]]
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype if reduce_dtype != shapes[0][1] else None)
        fully_shard(unit, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        local = np.empty(repeats, dtype=np.float64)
        for i in range(warmup + repeats):
            if task.kind == "reducescatter":
                loss = unit(one)  # gathers (untimed): the backward then finds whole weights
            mpi_group.Barrier()
            synchronize(self.device)
            t0 = time.perf_counter_ns()
            if task.kind == "allgather":
                unit.unshard()
            else:
                loss.backward()
            synchronize(self.device)
            if i >= warmup:
                local[i - warmup] = max(0.0, (time.perf_counter_ns() - t0) / 1e9 - own)
            unit.reshard()
            unit.zero_grad(set_to_none=True)
        worst = np.empty_like(local)
        mpi_group.Allreduce(local, worst, op=_mpi_max())
        return CommSamples(worst, np.empty(0))

    def _p2p(self, buffer, members, group, mpi_group, warmup, repeats) -> tuple[np.ndarray, np.ndarray]:
        """Ping-pong between the pair: a sample is half the round trip (send and receive timed together), the
        sender starting POST_DELAY_S after the barrier, once the receiver waits in its receive. Also, on the
        sender, the time its call that posts the first send took (the receiver waiting for it, as a pipeline's
        receiver mostly is): the host time a training step that sends pays before its device goes on (gloo on
        a CPU writes the data in that call). (round trips, posts), NaN posts on the receiver."""
        sender, receiver = members
        samples = np.empty(repeats, dtype=np.float64)
        posts = np.full(repeats, np.nan)
        host = buffer.cpu().numpy() if mpi_group is not None else None
        for i in range(warmup + repeats):
            post_ns = 0
            if mpi_group is not None:
                mpi_group.Barrier()
                if self.rank == sender:
                    time.sleep(POST_DELAY_S)
                t0 = time.perf_counter_ns()
                if self.rank == sender:
                    request = mpi_group.Isend(host, dest=1)
                    post_ns = time.perf_counter_ns() - t0
                    request.Wait()
                    mpi_group.Recv(host, source=1)
                else:
                    mpi_group.Recv(host, source=0)
                    mpi_group.Send(host, dest=0)
            else:
                dist.barrier(group=group)
                synchronize(self.device)
                if self.rank == sender:
                    time.sleep(POST_DELAY_S)
                t0 = time.perf_counter_ns()
                if self.rank == sender:
                    work = dist.isend(buffer, receiver, group=group)
                    post_ns = time.perf_counter_ns() - t0
                    work.wait()
                    dist.recv(buffer, receiver, group=group)
                else:
                    dist.recv(buffer, sender, group=group)
                    dist.send(buffer, sender, group=group)
                synchronize(self.device)
            elapsed = (time.perf_counter_ns() - t0) / 2e9
            if i >= warmup:
                samples[i - warmup] = elapsed
                if self.rank == sender:
                    posts[i - warmup] = post_ns / 1e9
        return samples, posts

    def _p2p_posts_as_run(self, buffer, members, group, repeats: int) -> np.ndarray:
        """The sender's host time to post a send as a training step posts it (harness.runtime.inflight.post_send: the
        send left to a watcher thread, its tensor held by the memory count), the receiver waiting in its receive:
        what the run's step that sends pays before its device goes on (on gloo 1.8-2.0x the bare isend's call,
        bench/p2p_host_cost.py). Per repeat; NaN on the receiver."""
        from harness.profile.memory import LiveStorages
        from harness.runtime.inflight import Completer, post_send

        sender, receiver = members
        completer, meter = Completer(poll=self.device.type == "cuda", timeout_s=600.0), LiveStorages()
        posts = np.full(repeats, np.nan)
        try:
            for i in range(1 + repeats):  # the first starts the watcher thread: left out
                dist.barrier(group=group)
                synchronize(self.device)
                if self.rank == sender:
                    time.sleep(POST_DELAY_S)
                    start = time.perf_counter_ns()
                    pending = post_send(buffer, receiver, {"group": group}, completer, meter, start)
                    posted = time.perf_counter_ns()
                    completer.wait(pending)
                    if i:
                        posts[i - 1] = (posted - start) / 1e9
                else:
                    dist.recv(buffer, sender, group=group)
        finally:
            completer.close()
        return posts

    def _p2p_sender_busy(self, buffer, members, group, mpi_group, warmup, repeats) -> np.ndarray:
        """Per repeat: barrier; the sender posts its send and computes for SENDER_BUSY_S; the receiver posts its
        receive RECEIVER_DELAY_S later and times it until the data is there. Samples on both members (the
        receiver's, sent to the sender) so that the task's first rank holds them."""
        sender, receiver = members
        samples = np.empty(repeats, dtype=np.float64)
        host = buffer.cpu().numpy() if mpi_group is not None else None
        # the sender's load: products of a few ms each on a CPU core, like a layer's, not a tight loop of tiny ones
        work_a = torch.ones(512, 512, device=self.device)
        work_b = torch.ones(512, 512, device=self.device)
        for i in range(warmup + repeats):
            if mpi_group is not None:
                mpi_group.Barrier()
            else:
                dist.barrier(group=group)
                synchronize(self.device)
            if self.rank == sender:
                if mpi_group is not None:
                    request = mpi_group.Isend(host, dest=1)
                    complete = request.Wait
                else:
                    complete = dist.isend(buffer, receiver, group=group).wait
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < SENDER_BUSY_S:
                    torch.mm(work_a, work_b)
                synchronize(self.device)
                complete()
            else:
                time.sleep(RECEIVER_DELAY_S)
                t0 = time.perf_counter_ns()
                if mpi_group is not None:
                    mpi_group.Recv(host, source=0)
                else:
                    dist.recv(buffer, sender, group=group)
                synchronize(self.device)
                if i >= warmup:
                    samples[i - warmup] = (time.perf_counter_ns() - t0) / 1e9
        # the receiver timed it; the sender (the task's first rank) stores it
        if mpi_group is not None:
            return mpi_group.bcast(samples if self.rank == receiver else None, root=1)
        shared = torch.from_numpy(samples).to(self.device)
        dist.broadcast(shared, receiver, group=group)
        return shared.cpu().numpy()

    def _p2p_late(self, buffer, members, group, rounds: int) -> np.ndarray:
        """What a send received late takes from each end's compute on a CPU, where a rank's core runs its library's
        threads too: both members run LATE_STREAM_STEPS steps of LATE_STEP_S of matrix products, after each posting
        a send of the buffer to the other as a training step does (harness.runtime.inflight.post_send, at most
        LATE_IN_FLIGHT in flight), then receiving the other's send of the step before (posted after that send, as a
        pipeline stage reaches its step later; a pipeline's activations and gradients go both ways), with harness
        train's switch interval (SWITCH_INTERVAL_S). Per round, the steps with the sends and without, each member's
        main thread's run-queue wait (thread_run_queue_wait_s: its library's threads' time on its core) over them:
        the difference over the steps' two sends, the members' mean. On both members; empty where either cannot
        read its run-queue wait (not Linux)."""
        import sys

        from harness.profile.memory import LiveStorages
        from harness.runtime.inflight import SWITCH_INTERVAL_S, Completer, post_send

        peer = members[1] if self.rank == members[0] else members[0]
        readable = torch.tensor([0.0 if thread_run_queue_wait_s() is None else 1.0])
        dist.all_reduce(readable, op=dist.ReduceOp.MIN, group=group)
        if not readable.item():
            return np.empty(0)
        work = torch.ones(192, 192, device=self.device)
        received = torch.empty_like(buffer)
        completer, meter = Completer(poll=self.device.type == "cuda", timeout_s=600.0), LiveStorages()
        waits = np.zeros((rounds, 2))
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            for r in range(rounds):
                for sending in (0, 1):
                    dist.barrier(group=group)
                    before = thread_run_queue_wait_s()
                    in_flight = []
                    for step in range(LATE_STREAM_STEPS):
                        started = time.perf_counter()
                        while time.perf_counter() - started < LATE_STEP_S:
                            torch.mm(work, work)
                        synchronize(self.device)
                        if not sending:
                            continue
                        in_flight.append(post_send(buffer, peer, {"group": group, "tag": step}, completer, meter,
                                                   time.perf_counter_ns()))
                        if step:
                            dist.irecv(received, src=peer, group=group, tag=step - 1).wait()
                        while len(in_flight) > LATE_IN_FLIGHT:
                            completer.wait(in_flight.pop(0))
                    if sending:
                        dist.irecv(received, src=peer, group=group, tag=LATE_STREAM_STEPS - 1).wait()
                    for pending in in_flight:
                        completer.wait(pending)
                    waits[r, sending] = thread_run_queue_wait_s() - before
        finally:
            completer.close()
            sys.setswitchinterval(switch)
        mine = torch.from_numpy((waits[:, 1] - waits[:, 0]) / (2 * LATE_STREAM_STEPS))
        dist.all_reduce(mine, group=group)
        return mine.numpy() / 2

    def _allreduce(self, buffer, group, mpi_group, warmup, repeats) -> CommSamples:
        """Per repeat: barrier, the buffer divided in place by the group size, the all-reduce (a sum, which
        restores the values), then the buffer zeroed, each timed on every member; a sample is the max over
        the group, of each. The buffer holds ones (`_buffer`), and holds them again after every repeat.

        The division is how a data-parallel replica averages its gradient bucket before the all-reduce (as
        DDP does with gradients as bucket views, and `harness train`): a pass over the bucket on the
        replica's device, about 2 ms for 16 MiB on the 2-core CPU machine (docs/benchmarks.md). The zeroing
        is how the replica clears the bucket for the next iteration's gradients (Megatron-LM zeroes its
        gradient buffer each step, `harness train` after the optimizer step): one more pass, about 2 ms
        there (2.2-3.0 ms timed here, on a buffer the all-reduce has just written; 1.7-2.5 ms in the runs,
        after Adam has swept the parameters)."""
        local = np.empty((3, repeats), dtype=np.float64)  # all-reduce, division, zeroing
        size = mpi_group.Get_size() if mpi_group is not None else dist.get_world_size(group)
        if mpi_group is not None:
            from mpi4py import MPI

            host = buffer.cpu().numpy()
            for i in range(warmup + repeats):
                mpi_group.Barrier()
                t0 = time.perf_counter_ns()
                np.divide(host, size, out=host)
                t1 = time.perf_counter_ns()
                mpi_group.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
                t2 = time.perf_counter_ns()
                host.fill(0)
                t3 = time.perf_counter_ns()
                host.fill(1)
                if i >= warmup:
                    local[:, i - warmup] = (t2 - t1) / 1e9, (t1 - t0) / 1e9, (t3 - t2) / 1e9
            worst = np.empty_like(local)
            mpi_group.Allreduce(local, worst, op=MPI.MAX)
            return CommSamples(worst[0], np.empty(0), worst[1], worst[2])
        for i in range(warmup + repeats):
            dist.barrier(group=group)
            synchronize(self.device)
            t0 = time.perf_counter_ns()
            buffer.div_(size)
            synchronize(self.device)
            t1 = time.perf_counter_ns()
            dist.all_reduce(buffer, group=group)
            synchronize(self.device)
            t2 = time.perf_counter_ns()
            buffer.zero_()
            synchronize(self.device)
            t3 = time.perf_counter_ns()
            buffer.fill_(1)
            if i >= warmup:
                local[:, i - warmup] = (t2 - t1) / 1e9, (t1 - t0) / 1e9, (t3 - t2) / 1e9
        worst = torch.from_numpy(local).to(self.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        worst = worst.cpu().numpy()
        return CommSamples(worst[0], np.empty(0), worst[1], worst[2])


# how a composite's sample is taken (stored as its attribute `composite_sample`; docs/hdf5.md)
COMPOSITE_SAMPLE = "last_start_to_last_end"


def composite_samples(last_start_s: np.ndarray, last_end_s: np.ndarray) -> np.ndarray:
    """A composite's samples from the group's latest start and latest end per repeat (the members' clock:
    the group is on one node, where time.perf_counter is one clock for all processes).

    The members leave the barrier before a sample at different moments; the first one out waits for the
    others at the layer's first all-reduce, and its own time counts that wait. In a training step the
    layer follows the previous layer's all-reduces, which have just brought the members together. So the
    sample starts when the last member started; it ends when the last one is done, which keeps the waits
    for the slower member at the later all-reduces and the slower tail (the max over the members' own times
    would count the barrier's skew too)."""
    return np.asarray(last_end_s, dtype=np.float64) - np.asarray(last_start_s, dtype=np.float64)


class TrivialUnit(torch.nn.Module):
    """An FSDP2 unit of a layer's parameter shapes, used trivially (what FSDP's collectives cost is the point)."""

    def __init__(self, shapes, device: torch.device):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
                                              for shape, dtype in shapes)

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return sum((weight * scale).sum() for weight in self.weights)


def _mpi_max():
    from mpi4py import MPI

    return MPI.MAX
