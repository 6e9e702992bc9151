"""Why a layer costs more inside a run than alone (issue 44): one block of a small model timed four ways, in
interleaved rounds so that the machine's slow and fast moments fall on every way alike; ratios to (a), not
absolute times, are the result.

  (a) alone: the block's forward, then its backward, in a tight loop (one copy: weights and activations warm);
  (b) interleaved: the block's forward and backward with its neighbours' (the stage's other layers) run alone
      between them, each its own graph and its own backward() call;
  (c) chain: inside the whole stage's forward and one backward() call over it (harness.profile.in_context);
  (d) flushed: as (a), with a buffer twice the last-level cache written between calls;
  (e) slept: as (a), with a 2 ms sleep before each call (a step that waited on a receive: the thread gave up
      its core, which the scheduler may hand back cold or at a lower clock).
(a) against (d) is the caches; (a) against (b) the neighbours (caches and the allocator); (b) against (c) what
autograd's engine over a whole stage adds to a layer, one graph and one call instead of several; (a) against (e)
the scheduling between steps.

    python bench/in_context.py [--rounds 30] [--hidden 256] [--layers 4] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.plan.events import build_plan  # noqa: E402
from harness.plan.spec import loads_spec  # noqa: E402
from harness.profile.compute import _forward, _make_layer, last_level_cache_bytes, runner_content  # noqa: E402
from harness.profile.in_context import ChainRunner, stage_chains  # noqa: E402

SPEC = """
[model]
name = "gpt2-small"
layers = {layers}
hidden = {hidden}
heads = 4
ffn = {ffn}
seq_len = 128
vocab = 2048
dtype = "float32"
[batch]
global = 4
micro = 4
[strategy]
dp = 1
tp = 1
pp = 1
[cluster]
nodes = 1
gpus_per_node = 1
"""


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Alone:
    """One layer's forward and backward (its own graph and call), optionally after flushing the caches."""

    def __init__(self, spec, content, flush: torch.Tensor | None = None, sleep_s: float = 0.0):
        self.spec, self.content = spec, runner_content(spec, content)
        self.layer, self.make_input = _make_layer(spec, self.content, torch.device("cpu"))
        self.flush, self.sleep_s = flush, sleep_s

    def _flush(self) -> None:
        if self.flush is not None:
            self.flush.add_(1.0)
        if self.sleep_s:
            time.sleep(self.sleep_s)

    def run(self) -> tuple[float, float]:
        self._flush()
        x = self.make_input()
        holder = {}
        fwd = _time(lambda: holder.__setitem__("out", _forward(self.spec, self.layer, x, self.content)))
        out = holder["out"]
        grad = None if out.dim() == 0 else torch.randn_like(out)
        self._flush()
        bwd = _time(lambda: out.backward(grad))
        return fwd, bwd


def measure(rounds: int, hidden: int, layers: int) -> dict:
    torch.manual_seed(0)
    plan = build_plan(loads_spec(SPEC.format(layers=layers, hidden=hidden, ffn=4 * hidden)))
    (chain,) = stage_chains([plan])
    contents = {eid: e.content for eid, e in plan.events.items()}
    block_fwd = next(eid for eid in chain.forward if plan.events[eid].name.endswith("block.fwd"))
    block_bwd = next(eid for eid in chain.backward if plan.events[eid].name.endswith("block.bwd"))
    flush = torch.zeros(2 * last_level_cache_bytes() // 4)
    alone = Alone(plan.spec, contents[block_fwd])
    flushed = Alone(plan.spec, contents[block_fwd], flush)
    slept = Alone(plan.spec, contents[block_fwd], sleep_s=2e-3)
    # (b): the stage's layers, each alone, in the order a step runs them; the block's first position measured
    neighbours = [Alone(plan.spec, contents[eid]) for eid in chain.forward]
    position = chain.forward.index(block_fwd)
    runner = ChainRunner(plan.spec, chain, contents, torch.device("cpu"))

    def interleaved() -> tuple[float, float]:
        outs = []
        for layer in neighbours:
            x = layer.make_input()
            holder = {}
            seconds = _time(lambda layer=layer, x=x, holder=holder: holder.__setitem__(
                "out", _forward(plan.spec, layer.layer, x, layer.content)))
            outs.append((holder["out"], seconds))
        fwd = outs[position][1]
        bwd = 0.0
        for i in reversed(range(len(outs))):
            out = outs[i][0]
            grad = None if out.dim() == 0 else torch.randn_like(out)
            seconds = _time(lambda out=out, grad=grad: out.backward(grad))
            bwd = seconds if i == position else bwd
        return fwd, bwd

    def in_chain() -> tuple[float, float]:
        times = runner.run()
        return times[block_fwd][0], times[block_bwd][0]  # the first block of the stage, as (b) takes it

    ways = {"a_alone": alone.run, "b_interleaved": interleaved, "c_chain": in_chain, "d_flushed": flushed.run,
            "e_slept": slept.run}
    for _ in range(3):  # warm-up
        for way in ways.values():
            way()
    samples = {name: [] for name in ways}
    order = list(ways)
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):  # alternate the order: no way always follows another
            samples[name].append(ways[name]())
    out = {"hidden": hidden, "layers": layers, "rounds": rounds, "torch_threads": torch.get_num_threads(),
           "llc_bytes": last_level_cache_bytes(), "ways": {}}
    base = np.asarray(samples["a_alone"])
    for name, values in samples.items():
        v = np.asarray(values)
        # per round, the way's time over (a)'s in the same round: the pairs share the machine's moment
        ratio_f, ratio_b = v[:, 0] / base[:, 0], v[:, 1] / base[:, 1]
        out["ways"][name] = {"fwd_median_ms": float(np.median(v[:, 0]) * 1e3),
                             "bwd_median_ms": float(np.median(v[:, 1]) * 1e3),
                             "fwd_ratio_median": float(np.median(ratio_f)),
                             "bwd_ratio_median": float(np.median(ratio_b)),
                             "fwd_ratio_iqr": [float(np.percentile(ratio_f, 25)), float(np.percentile(ratio_f, 75))],
                             "bwd_ratio_iqr": [float(np.percentile(ratio_b, 25)), float(np.percentile(ratio_b, 75))]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="OUT.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args.rounds, args.hidden, args.layers)
    print(f"block of hidden {args.hidden} in a {args.layers}-block stage, {args.rounds} interleaved rounds; "
          "ratios: per round over (a) alone, median [quartiles]")
    for name, w in result["ways"].items():
        print(f"  {name:14s} fwd {w['fwd_median_ms']:7.3f} ms  x{w['fwd_ratio_median']:.3f} "
              f"[{w['fwd_ratio_iqr'][0]:.2f}-{w['fwd_ratio_iqr'][1]:.2f}]   bwd {w['bwd_median_ms']:7.3f} ms  "
              f"x{w['bwd_ratio_median']:.3f} [{w['bwd_ratio_iqr'][0]:.2f}-{w['bwd_ratio_iqr'][1]:.2f}]")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
