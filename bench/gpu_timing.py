"""How one layer's time on a GPU depends on how it is timed (run on a CUDA machine; prints a table).

A training step keeps the GPU's queue full: the host issues a layer while the GPU still runs earlier ones.
A sample taken after a synchronize starts on an idle GPU, whose kernels then wait for their own launches.
Per compute event of a spec, medians over the repeats:
  isolated   CUDA events around one sample after a synchronize (harness.profile.timer.time_region)
  issued     the same with the GPU held busy while the host issues the sample: the device's time alone
             (harness.profile.timer.time_issued, what the profiler stores for forwards and backwards)
  host       the host's time to issue one sample while the GPU is held busy
  x4 device, x4 host
             the profiler's own samples (ComputeRunner): the mean of 4 issued back to back, as a stage
             issues its layers (forwards and backwards only)
A step whose host issues slower than its GPU runs (small layers, a backward's first layer) is host-bound;
the timeline composes both (docs/analysis.md).

    python bench/gpu_timing.py SPEC.toml [--repeats N]
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from harness.plan.events import build_plan
from harness.plan.spec import JobSpec, load_spec
from harness.profile.compute import ComputeRunner, _forward
from harness.profile.timer import time_issued, time_region

LEAD_S = 0.01  # longer than any layer here takes to issue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    spec = load_spec(args.spec)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    print(f"{spec.model.name} hidden {spec.model.hidden} seq {spec.model.seq_len} micro {spec.batch.micro} "
          f"{spec.model.dtype} on {torch.cuda.get_device_name(device)}")
    print(f"{'event':28s} {'isolated':>9s} {'issued':>9s} {'host':>9s} {'x4 device':>9s} {'x4 host':>9s}"
          f"  (median ms over {args.repeats})")
    for event in build_plan(spec).events.values():
        if event.kind != "compute":
            continue
        runner = ComputeRunner(spec, event.content, device)
        make = _sample_maker(spec, runner)
        for _ in range(3):
            time_region(make(), device)
        isolated = statistics.median(time_region(make(), device) * 1e3 for _ in range(args.repeats))
        issued = [time_issued(make(), device, LEAD_S) for _ in range(args.repeats)]
        device_ms = statistics.median(s.device_s * 1e3 for s in issued)
        host_ms = statistics.median(s.host_s * 1e3 for s in issued)
        late = sum(not s.ahead for s in issued)
        chained = "" if not runner.issued else _chained(runner, args.repeats)
        print(f"{event.name:28s} {isolated:9.3f} {device_ms:9.3f} {host_ms:9.3f} {chained}"
              + (f"  ({late} samples issued past the lead)" if late else ""))
        del runner, make  # this event's layers freed before the next event's are built


def _sample_maker(spec: JobSpec, runner: ComputeRunner) -> Callable[[], Callable[[], object]]:
    """A function that readies one sample of the runner's event (its input, a forward to run backward through)
    and returns the call to time."""
    layer = runner.layers[0]
    if runner.phase == "fwd":
        def make():
            x = runner.make_input()
            return lambda: _forward(spec, layer, x, runner.content)
    elif runner.phase == "bwd":
        def make():
            out = _forward(spec, layer, runner.make_input(), runner.content)
            grad = None if out.dim() == 0 else torch.randn_like(out)
            return lambda: out.backward(grad)
    else:
        def make():
            return runner.optimizers[0].step
    return make


def _chained(runner: ComputeRunner, repeats: int) -> str:
    for _ in range(3):
        runner.sample()
    taken = [(runner.sample(), runner.last_host_s) for _ in range(repeats)]
    return (f"{statistics.median(d for d, _ in taken) * 1e3:9.3f} "
            f"{statistics.median(h for _, h in taken) * 1e3:9.3f}")


if __name__ == "__main__":
    main()
