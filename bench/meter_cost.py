"""What `harness train`'s memory count costs a step (prints a table).

The run counts every tensor autograd saves through torch.autograd.graph.saved_tensors_hooks
(harness.profile.memory.saving_into): a Python call, a storage lookup and a finalizer per tensor, inside the
step. This bench times one built-in block's forward and backward with and without the count, interleaved
repeat by repeat so both see the same machine, on a few shapes (Llama blocks as the generalization suite
draws them, and a GPT-2 block), and prints the medians and their ratio. `harness train` runs the count in one
warm-up iteration only (docs/train.md, "Memory"); this is the cost it keeps out of the timed ones.

    python bench/meter_cost.py [--repeats N]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from harness.plan.spec import loads_spec
from harness.profile.memory import LiveStorages, saving_into
from harness.train.model import build_full_layer

SHAPES = (  # family, hidden, heads, ffn, seq, micro-batch
    ("llama", 64, 1, 192, 96, 1),
    ("llama", 128, 2, 384, 128, 1),
    ("gpt2", 256, 4, 1024, 128, 2),
)


def _spec(family: str, hidden: int, heads: int, ffn: int, seq: int, micro: int):
    return loads_spec(f"""spec_version = 1
[model]
name = "{"llama-1b" if family == "llama" else "gpt2-small"}"
family = "{family}"
layers = 1
hidden = {hidden}
heads = {heads}
ffn = {ffn}
seq_len = {seq}
vocab = 1024
dtype = "float32"
[batch]
global = {micro}
micro = {micro}
[strategy]
dp = 1
[cluster]
nodes = 1
gpus_per_node = 1
""")


def _step(layer: torch.nn.Module, x0: torch.Tensor, counted: bool) -> tuple[float, float]:
    """(forward s, backward s) of one step, with or without the count."""
    x = x0.clone().requires_grad_(True)
    start = time.perf_counter()
    if counted:
        with saving_into(LiveStorages()):
            out = layer(x)
    else:
        out = layer(x)
    middle = time.perf_counter()
    out.backward(torch.ones_like(out))
    end = time.perf_counter()
    return middle - start, end - middle


def _saved_count(layer: torch.nn.Module, x0: torch.Tensor) -> int:
    count = [0]

    def pack(tensor):
        count[0] += 1
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x0.clone().requires_grad_(True))
    return count[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| block | saved tensors | forward ms (counted / not) | backward ms (counted / not) | step counted / not |")
    print("|---|---|---|---|---|")
    for family, hidden, heads, ffn, seq, micro in SHAPES:
        model = _spec(family, hidden, heads, ffn, seq, micro).model
        layer = build_full_layer(model, "block", 0, 1)
        x0 = torch.randn(micro, seq, hidden)
        times = {True: [], False: []}
        for repeat in range(args.repeats + 20):
            for counted in ((True, False) if repeat % 2 else (False, True)):  # each first half the time
                forward, backward = _step(layer, x0, counted)
                if repeat >= 20:  # warm-up left out
                    times[counted].append((forward, backward))
        with_count, without = (np.median(np.array(times[c]), axis=0) * 1e3 for c in (True, False))
        print(f"| {family} h{hidden} s{seq} mb{micro} | {_saved_count(layer, x0)} | {with_count[0]:.2f} / "
              f"{without[0]:.2f} | {with_count[1]:.2f} / {without[1]:.2f} | {with_count.sum() / without.sum():.3f} |")


if __name__ == "__main__":
    main()
