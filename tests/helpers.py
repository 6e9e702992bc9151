"""Small helpers shared by tests: tiny specs written as TOML."""
from __future__ import annotations

from pathlib import Path

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
                   warmup=1, repeats=3, extra="") -> str:
    """A small, valid spec as TOML text (the cluster defaults to one node holding the whole job)."""
    gpus_per_node = gpus_per_node or dp * tp * pp // nodes
    chunk_line = f"chunks = {chunks}\n" if chunks else ""
    return (TINY_MODEL.format(name=name, layers=layers, hidden=hidden, heads=heads, ffn=ffn, seq=seq, vocab=vocab)
            + f"[batch]\nglobal = {global_batch}\nmicro = {micro}\n"
            + f"[strategy]\ndp = {dp}\ntp = {tp}\npp = {pp}\nschedule = \"{schedule}\"\n{chunk_line}"
            + f"[cluster]\nnodes = {nodes}\ngpus_per_node = {gpus_per_node}\n"
            + f"[profile]\nwarmup = {warmup}\nrepeats = {repeats}\n" + extra)


def write_spec(path: Path, **kwargs) -> Path:
    path.write_text(tiny_spec_text(**kwargs))
    return path
