"""Communication in flight: works launched in the background (P2P sends, data-parallel buckets) and the small
watcher threads that note when each completed.

One thread per channel blocks in `Work.wait()` (gloo: a send's `is_completed()` stays False until someone
waits on it) or polls `is_completed()` (NCCL), and notes when the work completed; the main thread records the
interval when it reaps it (`Completer.wait`), with how long it had to block for it.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# the interpreter's switch interval while watchers run (sys.setswitchinterval): a watcher notes a completion within
# this of the work's end, where the default 5 ms would make the main thread's next Python code hold it off
SWITCH_INTERVAL_S = 2e-4


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


def post_send(tensor: torch.Tensor, peer: int, channel: dict[str, Any], completer: Completer, memory: Any,
              start_ns: int, meta: tuple = ()) -> Pending:
    """Post `tensor` to `peer` as a pipeline step of `harness train` does, the send left to complete in the
    background: held in `memory` (a harness.profile.memory.LiveStorages) until it has, handed to `completer`'s
    watcher. The profile times its P2P posts through this too (harness.profile.comm), so a timeline's post is
    the run's."""
    tensor = tensor.detach().contiguous()
    work = dist.isend(tensor, dst=peer, **channel)
    memory.hold_while(tensor, tensor, "pipeline")  # until the send completes and lets it go
    return completer.submit(("p2p", peer), work, start_ns, keep=tensor, meta=meta)
