"""Pipeline schedules: the order in which one pipeline device runs its forward and backward steps.

One source of truth for the event flow, the simulator and the real training runs. Pure Python.
Device `stage` of `pp` holds virtual stages stage, stage + pp, ... (Megatron's interleaving), so the
local chunk c of device s is virtual stage c * pp + s.
"""
from __future__ import annotations

from typing import NamedTuple


class Step(NamedTuple):
    """One step of a pipeline device: phase "F" or "B" of local model chunk `chunk` for micro-batch `micro`."""

    phase: str
    chunk: int
    micro: int


def _gpipe(micro_batches: int) -> list[Step]:
    return [Step("F", 0, i) for i in range(micro_batches)] + [Step("B", 0, i) for i in range(micro_batches)]


def _one_f_one_b(stage: int, pp: int, micro_batches: int) -> list[Step]:
    warmup = min(pp - stage - 1, micro_batches)
    steps = [Step("F", 0, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        steps.append(Step("F", 0, warmup + i))
        steps.append(Step("B", 0, i))
    steps += [Step("B", 0, i) for i in range(micro_batches - warmup, micro_batches)]
    return steps


def _interleaved_step(k: int, pp: int, chunks: int, forward: bool, phase: str) -> Step:
    in_group = k % (pp * chunks)
    chunk = in_group // pp
    if not forward:
        chunk = chunks - chunk - 1
    micro = (k // (pp * chunks)) * pp + k % pp
    return Step(phase, chunk, micro)


def _interleaved(stage: int, pp: int, micro_batches: int, chunks: int) -> list[Step]:
    total = micro_batches * chunks
    warmup = min((pp - stage - 1) * 2 + (chunks - 1) * pp, total)
    steps = [_interleaved_step(k, pp, chunks, True, "F") for k in range(warmup)]
    for i in range(total - warmup):
        steps.append(_interleaved_step(warmup + i, pp, chunks, True, "F"))
        steps.append(_interleaved_step(i, pp, chunks, False, "B"))
    steps += [_interleaved_step(k, pp, chunks, False, "B") for k in range(total - warmup, total)]
    return steps


def device_steps(schedule: str, stage: int, pp: int, micro_batches: int, chunks: int = 1) -> list[Step]:
    """The ordered forward/backward steps of pipeline device `stage` in one iteration."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside 0..{pp - 1}")
    if schedule == "gpipe":
        return _gpipe(micro_batches)
    if schedule == "1f1b":
        return _one_f_one_b(stage, pp, micro_batches)
    if schedule == "interleaved-1f1b":
        if chunks == 1:
            return _one_f_one_b(stage, pp, micro_batches)
        if micro_batches % pp:
            raise ValueError("interleaved-1f1b needs micro-batches to be a multiple of pp")
        return _interleaved(stage, pp, micro_batches, chunks)
    raise ValueError(f"unknown schedule {schedule!r}")


def virtual_stage(chunk: int, stage: int, pp: int) -> int:
    """The virtual stage that local chunk `chunk` of pipeline device `stage` holds."""
    return chunk * pp + stage
