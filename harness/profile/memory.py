"""Counting the bytes a device holds, by what holds them: every distinct tensor storage once, however many
tensors view it (a parameter that autograd saves for a backward is still a weight; a received activation
that a layer saves is one activation).

The same meter measures a layer's saved activations when profiling (`activation_bytes`) and a device's
peak in `harness train` (LiveStorages over a whole iteration), so that the memory model (analysis.memory)
and the run count alike: weights, gradients, optimizer state, activations autograd saves for the backward
(through torch.autograd.graph.saved_tensors_hooks), and buffers the pipeline holds (a stage's output until
its gradient returns, received and sent gradients). What a backward makes and frees within itself
(temporaries) it leaves out, as the model's metered peak does; a profile measures them per layer on their own
(`backward_temporaries`, every storage an operator makes), and PyTorch's own accounting, which sees them, runs
through `pytorch_tracker` to check the model's whole peak. A weight a layer holds but does not own (a buffer
that takes a gradient: a tied head's projection) is a weight, never a saved activation.
"""
from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness.plan.activations import BackwardTemporaries

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "pipeline")
TEMPORARIES = "temporaries"  # what a backward makes (backward_temporaries' meter only)


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of a tensor's storage; None for tensors without one of their own."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_sparse or tensor.device.type == "meta":
        return None
    try:  # a DTensor (FSDP2's sharded parameters) has no storage of its own to read
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        return (storage.data_ptr(), nbytes) if nbytes else None
    except (RuntimeError, NotImplementedError):
        return None


class LiveStorages:
    """The distinct storages alive, the bytes they make and the peak of that sum, with each category's share
    at the peak. A storage counts in the category that first held it. Thread-safe: a release runs in whichever
    thread drops the last reference (a communication watcher, the garbage collector)."""

    def __init__(self, categories: tuple[str, ...] = CATEGORIES) -> None:
        self._lock = threading.RLock()  # re-entrant: the garbage collector may run a release inside a hold
        self._held: dict[int, list] = {}  # address -> [holders, bytes, category]
        self.live = {c: 0 for c in categories}
        self.total = 0
        self.peak = 0
        self.at_peak = dict(self.live)

    def hold(self, tensor: torch.Tensor, category: str) -> Callable[[], None] | None:
        """Count `tensor`'s storage as held (once per storage); returns the release (None if not counted)."""
        found = _storage(tensor)
        if found is None:
            return None
        address, nbytes = found
        with self._lock:
            entry = self._held.get(address)
            if entry is None:
                entry = self._held[address] = [0, nbytes, category]
                self.live[category] += nbytes
                self.total += nbytes
                if self.total > self.peak:
                    self.peak, self.at_peak = self.total, dict(self.live)
            entry[0] += 1
        released = []

        def release() -> None:
            with self._lock:
                if released:
                    return
                released.append(True)
                entry[0] -= 1
                if entry[0] == 0 and self._held.get(address) is entry:
                    del self._held[address]
                    self.live[entry[2]] -= entry[1]
                    self.total -= entry[1]
        return release

    def hold_while(self, owner: object, tensor: torch.Tensor, category: str) -> None:
        """Count `tensor` until `owner` is garbage (a saved-tensor record, a pending send)."""
        release = self.hold(tensor, category)
        if release is not None:
            weakref.finalize(owner, release)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now (after warm-up)."""
        with self._lock:
            self.peak, self.at_peak = self.total, dict(self.live)


class _Saved:
    """What autograd keeps for a saved tensor: the tensor, counted while this record lives. The tensor is kept
    detached (the same storage and version counter, no grad_fn): a node that saves its own output would
    otherwise hold itself through the record, a cycle through C++ that Python's collector cannot see, freed
    only when a backward that runs the node releases it. A split backward's weight step never runs the
    nodes only its input step ran: with the output kept whole, their saved tensors stayed alive for good."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


@contextmanager
def saving_into(meter: LiveStorages, category: str = "activations") -> Iterator[None]:
    """Within the block, every tensor autograd saves for a backward is counted in `meter` until autograd
    frees it (with the graph, or as the backward consumes it)."""
    def pack(tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor.detach())
        meter.hold_while(saved, tensor, category)
        return saved

    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def held_weights(layer: torch.nn.Module) -> list[torch.Tensor]:
    """What a layer holds as weights: its parameters and every buffer that takes a gradient (a weight it holds
    but does not own: a tied head's projection, the embedding's token table in a run, its stand-in profiled
    alone). Counted as weights, never as what a forward saves, however often autograd saves them."""
    return [*layer.parameters(), *(b for b in layer.buffers() if b.requires_grad)]


def _hold_weights(meter: LiveStorages, layer: torch.nn.Module) -> list[Callable[[], None]]:
    return [release for release in (meter.hold(w, "weights") for w in held_weights(layer)) if release is not None]


def activation_bytes(layer: torch.nn.Module, make_input: Callable[[], torch.Tensor],
                     forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> int:
    """Bytes one forward of `layer` saves for its backward: the distinct storages autograd saves, not its
    weights (`held_weights`: counted as weights), its input included where the layer saves it."""
    meter = LiveStorages()
    releases = _hold_weights(meter, layer)
    with saving_into(meter):
        out = forward(layer, make_input())
    saved = meter.live["activations"]
    del out
    for release in releases:
        release()
    return int(saved)


class _CountingMade(TorchDispatchMode):
    """Within the block, every storage an operator returns counts in `meter` as temporaries (once per storage,
    nothing where another category holds it already) until it is freed; `after_each()` runs after every
    operator."""

    def __init__(self, meter: LiveStorages, after_each: Callable[[], None]):
        super().__init__()
        self.meter, self.after_each = meter, after_each

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                release = self.meter.hold(tensor, TEMPORARIES)
                if release is not None:  # with the storage, not the tensor: a view may outlive its first tensor
                    weakref.finalize(tensor.untyped_storage(), release).atexit = False
        self.after_each()
        return out


def backward_temporaries(layer: torch.nn.Module, make_input: Callable[[], torch.Tensor],
                         forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> BackwardTemporaries:
    """One backward of `layer` (and of what `forward` adds after it: the loss) at its worst moments: the bytes of
    the storages its operators have made and not freed (its input's gradient included; the gradient at its
    output, which the layer after it made, not), and of its saved activations those it has let go of by then.
    A worst moment is the one where temporaries less freed is largest ((0, 0): none above the start), taken
    apart before the gradient reaches the layer's own output (the loss's backward, with the layer's weights not
    yet in use: ZeRO-3 gathers them then) and after. Its weights' gradients exist before it (as every
    micro-batch's after the first and data parallelism's buckets find them), so a weight's gradient counts as
    the temporary it is until it is added in; gradients given for the measurement are taken back after."""
    meter = LiveStorages(CATEGORIES + (TEMPORARIES,))
    releases = _hold_weights(meter, layer)
    reached = []  # the gradient has reached the layer's output

    def output_hook(_module, _args, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda _grad: reached.append(True))

    handle = layer.register_forward_hook(output_hook)
    x = make_input()
    try:
        with saving_into(meter):
            out = forward(layer, x)
    finally:
        handle.remove()
    weights = [w for w in held_weights(layer) if w.requires_grad]
    made = [w for w in weights if w.grad is None]
    for weight in made:
        weight.grad = torch.zeros_like(weight)
    releases += [meter.hold(weight.grad, "gradients") for weight in weights]
    grad = None if out.dim() == 0 else torch.randn_like(out)
    if grad is not None:
        releases.append(meter.hold(grad, "pipeline"))
    saved = meter.live["activations"]
    worst = {False: (0, 0), True: (0, 0)}  # before and after the gradient reached the output

    def moment() -> None:
        temporaries, freed = meter.live[TEMPORARIES], saved - meter.live["activations"]
        before = worst[bool(reached)]
        if temporaries - freed > before[0] - before[1]:
            worst[bool(reached)] = (temporaries, freed)

    with _CountingMade(meter, moment):
        out.backward(grad)
    del out, grad, x
    for weight in made:
        weight.grad = None
    for release in releases:
        if release is not None:
            release()
    return BackwardTemporaries(*worst[True], *worst[False])


def kept_gradients(param_groups: list[dict]) -> Iterator[torch.Tensor]:
    """The gradients stage_backward_input captured at the weights' part of the graph, which its
    stage_backward_weight will use (every tensor of every group's "grads")."""
    for group in param_groups:
        for grads in group.get("grads") or ():
            yield from (tensor for tensor in grads or () if tensor is not None)


def kept_for_weights(layer: torch.nn.Module, make_input: Callable[[], torch.Tensor],
                     forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> tuple[int, int]:
    """(kept, released): the bytes a split backward's input-gradient step (torch.distributed.pipelining's
    stage_backward_input) keeps for the weight-gradient step beside the forward's saved activations (the
    distinct storages of the gradients it captures at the weights' part of the graph), and the saved
    activations it lets go of once its output is dropped, which only the weights' part of the graph holds
    then (a head's log-probabilities: the loss above its last weight; in a stage only its last layer's
    output has nothing after it to hold that part)."""
    from harness.models import split_backward

    stage_backward_input, _ = split_backward()
    saved = LiveStorages()
    releases = _hold_weights(saved, layer)
    x = make_input()
    with saving_into(saved):
        out = forward(layer, x)
    before = saved.live["activations"]
    grad = None if out.dim() == 0 else [torch.randn_like(out)]
    _, param_groups = stage_backward_input([out], grad, [x], layer.parameters())
    del out, grad
    gc.collect()
    released = before - saved.live["activations"]
    meter = LiveStorages()
    for tensor in kept_gradients(param_groups):
        meter.hold(tensor, "activations")
    for release in releases:
        release()
    return int(meter.live["activations"]), int(released)


class _NoHandle:
    def remove(self) -> None:
        pass


@contextmanager
def pytorch_tracker() -> Iterator[torch.distributed._tools.mem_tracker.MemTracker]:
    """torch's own accounting over the block (torch.distributed._tools.mem_tracker.MemTracker, which sees
    every storage an operator makes: parameters, gradients, optimizer states, activations and the backward's
    temporaries). MemTracker refuses a top-level module called again outside a backward: each time one is (a
    new micro-batch's forward), its per-module statistics are cleared first, which leaves its peak whole. Its
    module tracker's backward hooks are not registered: hooked on a stage's input, a leaf, they form a cycle
    through autograd that Python cannot collect and keep every micro-batch's input alive; they only feed the
    per-module backward snapshots, while the peak and its categories come from the operators alone."""
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    modules = tracker._mod_tracker  # noqa: SLF001 (the tracker's module stack)

    def new_forward(module: torch.nn.Module, _args) -> None:
        if module in tracker.memory_tracking and not modules.is_bw and modules.parents == {"Global"}:
            tracker.reset_mod_stats()

    # registered before the tracker's own global hooks (its __enter__), so it runs first
    handle = torch.nn.modules.module.register_module_forward_pre_hook(new_forward)
    hooks = mod_tracker.register_multi_grad_hook
    mod_tracker.register_multi_grad_hook = lambda *args, **kwargs: _NoHandle()
    try:
        with tracker:
            yield tracker
    finally:
        mod_tracker.register_multi_grad_hook = hooks
        handle.remove()


def tracker_peak(tracker) -> dict[str, int]:
    """A MemTracker's peak: bytes by its categories (lower-case: parameter, buffer, gradient, activation, temp,
    optstate, other) and `total`, summed over devices but the meta device, which holds no memory (MemTracker
    counts its tensors: a factory model is described by tracing it there)."""
    out: dict[str, int] = {}
    for device, snapshot in tracker.get_tracker_snapshot("peak").items():
        if torch.device(device).type == "meta":
            continue
        for key, value in snapshot.items():
            name = getattr(key, "value", str(key)).lower()
            out[name] = out.get(name, 0) + int(value)
    return out
