"""Small helpers shared by tests: tiny specs written as TOML."""
from __future__ import annotations

from pathlib import Path

import numpy as np

TINY_MODEL = """
[model]
name = "{name}"
layers = {layers}
hidden = {hidden}
heads = {heads}
ffn = {ffn}
seq_len = {seq}
vocab = {vocab}
dtype = "float32"
"""


def tiny_spec_text(*, name="gpt2-small", layers=4, hidden=32, heads=4, ffn=64, seq=16, vocab=128, global_batch=8,
                   micro=2, dp=1, tp=1, pp=1, schedule="1f1b", chunks=None, nodes=1, gpus_per_node=None,
                   warmup=1, repeats=3, precision=0.5, budget_s=0.001, recompute="none", zero=0, cp=1,
                   cp_comm="ring", model=None, extra="") -> str:
    """A small, valid spec as TOML text (the cluster defaults to one node holding the whole job); `model`: more
    [model] fields (name -> a string value). Its profile takes exactly `repeats` samples by default: a budget spent
    by the repeats leaves nothing for precision."""
    gpus_per_node = gpus_per_node or dp * tp * cp * pp // nodes
    chunk_line = f"chunks = {chunks}\n" if chunks else ""
    chunk_line += f"recompute = \"{recompute}\"\n" if recompute != "none" else ""
    chunk_line += f"zero = {zero}\n" if zero else ""
    chunk_line += f"cp = {cp}\ncp_comm = \"{cp_comm}\"\n" if cp > 1 else ""
    return (TINY_MODEL.format(name=name, layers=layers, hidden=hidden, heads=heads, ffn=ffn, seq=seq, vocab=vocab)
            + "".join(f'{key} = "{value}"\n' for key, value in (model or {}).items())
            + f"[batch]\nglobal = {global_batch}\nmicro = {micro}\n"
            + f"[strategy]\ndp = {dp}\ntp = {tp}\npp = {pp}\nschedule = \"{schedule}\"\n{chunk_line}"
            + f"[cluster]\nnodes = {nodes}\ngpus_per_node = {gpus_per_node}\n"
            + f"[profile]\nwarmup = {warmup}\nrepeats = {repeats}\nprecision = {precision}\nbudget_s = {budget_s}\n"
            + extra)


def write_spec(path: Path, **kwargs) -> Path:
    path.write_text(tiny_spec_text(**kwargs))
    return path


def check_layer_rows(spec, trace, slack_s: float = 1e-4) -> None:
    """What a trace of `harness train --layer-times` must hold: for every compute step, one interval per module
    of its stage, inside the step, named by the plan's event of that module and phase, back to back in the
    stage's order (a backward's in reverse)."""
    from harness.plan.events import build_plan

    plan = build_plan(spec)
    for rank, device in trace.devices.items():
        assert device.layers is not None, f"rank {rank} has no layer intervals"
        layers = device.layers
        steps = device.select(kind="compute")
        assert len(steps["start_s"]) > 0
        for start, end, phase, vs, micro, iteration in zip(steps["start_s"], steps["end_s"], steps["phase"],
                                                           steps["virtual_stage"], steps["micro"],
                                                           steps["iteration"]):
            mine = ((layers["iteration"] == iteration) & (layers["virtual_stage"] == vs) & (layers["micro"] == micro)
                    & (layers["phase"] == phase))
            program = plan.stages[int(vs)]
            positions = program.forward_layers if phase == "F" else program.backward_layers
            events = program.forward if phase == "F" else program.backward
            expected = {p: events[positions.index(p)] for p in program.layers}
            assert int(mine.sum()) == len(program.layers), (rank, phase, int(vs), int(micro), int(iteration))
            got = dict(zip(layers["layer"][mine].tolist(), layers["event_id"][mine].tolist()))
            assert got == expected, (rank, phase, int(vs), int(micro), int(iteration))
            assert np.all(layers["start_s"][mine] >= start - slack_s) and np.all(layers["end_s"][mine] <= end + slack_s)
            assert np.all(layers["end_s"][mine] >= layers["start_s"][mine])
            # back to back: forwards in the stage's order, backwards in reverse
            by_start = np.argsort(layers["start_s"][mine], kind="stable")
            order = list(program.layers) if phase == "F" else list(reversed(program.layers))
            assert layers["layer"][mine][by_start].tolist() == order
            np.testing.assert_allclose(layers["start_s"][mine][by_start][1:], layers["end_s"][mine][by_start][:-1])


def mpirun_harness(n: int, args: list[str], env: dict, timeout: float = 240, cwd: Path | None = None):
    """`mpirun -n N python -m mpi4py -m harness ARGS` with the MPI the suite runs on (DISTSIM_MPIRUN, else the
    venv's), from the project's root (or `cwd`)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    launcher = os.environ.get("DISTSIM_MPIRUN") or str(Path(sys.executable).parent / "mpirun")
    command = [launcher, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "harness", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd or ROOT)
