"""What one `backward()` call costs the host beyond its layers' own work (prints a table).

The profiler times each layer's backward with its own `backward()` call; a training step calls it once
for the whole stage. Every call pays the autograd engine's start (building the graph task, on a GPU
handing it to the device's worker thread and waiting for it), so the layers' host times summed count that
start once per layer. This bench measures, on the spec's layers (embedding, the blocks, the head with its
loss), medians over the repeats of the host's time:
  per layer   one backward() per layer (each on its own graph, as the profiler does), summed
  one call    one backward() over the same layers chained, as in a training step
The difference of the two over (layers - 1) is what the sum counts too often. Beside it, what the profiler
stores (harness.profile.compute.measure_backward_call: the same difference on tiny linear layers).

    python bench/backward_call.py SPEC.toml [--device cuda:0] [--repeats N]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from harness.models import build_layer
from harness.plan.spec import load_spec
from harness.profile.compute import backward_call_times, measure_backward_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    spec = load_spec(args.spec)
    model, device = spec.model, torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layers = ([build_layer(model, "embedding").to(device)]
              + [build_layer(model, "block").to(device) for _ in range(model.layers)]
              + [build_layer(model, "head").to(device)])
    shape = (spec.batch.micro, model.seq_len)

    def ids() -> torch.Tensor:
        return torch.randint(0, model.vocab, shape, device=device)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return layers[-1].loss(logits, ids())

    for _ in range(3):
        backward_call_times(layers, ids, device, loss)
    taken = [backward_call_times(layers, ids, device, loss) for _ in range(args.repeats)]
    summed = statistics.median(many for many, _ in taken)
    whole = statistics.median(one for _, one in taken)
    tiny = measure_backward_call(device, args.repeats)
    extra = (summed - whole) / (len(layers) - 1)
    print(f"{model.name} hidden {model.hidden} seq {model.seq_len} micro {spec.batch.micro} {model.dtype} "
          f"on {device}; {len(layers)} layers; host ms, median of {args.repeats}")
    print(f"per layer (summed) {summed * 1e3:8.3f}")
    print(f"one call           {whole * 1e3:8.3f}")
    print(f"extra per call     {extra * 1e3:8.3f}")
    print(f"profiler's measure {tiny * 1e3:8.3f}")


if __name__ == "__main__":
    main()
