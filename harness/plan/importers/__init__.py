"""Job specs from what users already have: a Megatron launch's arguments (megatron.py) or a Hugging Face
`config.json` (hf.py). Pure Python. Each importer says, besides the spec, what it mapped, what it read but the
spec cannot express ("not modelled"), what it ignored as having no bearing on the cost (data, paths, logging) and
what it did not know, so nothing is dropped silently (docs/spec.md, "Importing a job").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from harness.plan.spec import MODEL_PRESETS, JobSpec

# The model fields a preset's sizes are compared on (same_preset).
_SIZE_FIELDS = ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "seq_len", "vocab", "experts", "top_k",
                "expert_ffn", "shared_experts")


@dataclass
class ImportedSpec:
    """An importer's result: the validated spec and, in words, what became of what it read."""

    spec: JobSpec
    source: str
    not_modelled: list[str] = field(default_factory=list)  # read, but the spec cannot express it
    ignored: list[str] = field(default_factory=list)  # no bearing on an iteration's cost
    unknown: list[str] = field(default_factory=list)  # not known to the importer
    notes: list[str] = field(default_factory=list)  # choices the importer made that the user may want to change

    def report(self) -> list[str]:
        """One line per kind of outcome, the empty ones left out."""
        lines = [f"note: {note}" for note in self.notes]
        for title, items in (("read but not modelled", self.not_modelled), ("ignored (no cost)", self.ignored),
                             ("unknown, not used", self.unknown)):
            if items:
                lines.append(f"{title}: {'; '.join(items)}")
        return lines


def same_preset(model: dict) -> str | None:
    """The built-in preset whose sizes an imported [model] table has, if one has them all."""
    for name, preset in MODEL_PRESETS.items():
        full = {"kv_heads": preset["heads"], "experts": 0, "top_k": 0, "expert_ffn": 0, "shared_experts": 0,
                **preset}
        given = {"kv_heads": model.get("heads"), "experts": 0, "top_k": 0, "expert_ffn": 0, "shared_experts": 0,
                 "family": model.get("name"), **model}
        if all(full[key] == given.get(key) for key in _SIZE_FIELDS):
            return name
    return None
