"""Pipeline schedules: the order in which one pipeline device runs its forward and backward steps.

One source of truth for the event flow, the simulator and the real training runs. Pure Python.
Device `stage` of `pp` holds virtual stages stage, stage + pp, ... (Megatron's interleaving), so the
local chunk c of device s is virtual stage c * pp + s.

The zero-bubble schedules split a backward in two (Qi et al., "Zero Bubble Pipeline Parallelism", 2024):
"B" computes the gradient of the stage's input, which the previous stage waits for, and "W" that of its
weights, which nothing waits for and which fills the bubbles. Their order is that of torch.distributed.
pipelining's ScheduleInterleavedZeroBubble (ZB1P): with one chunk per device it is ZB-H1 (`zb-h1`), with
more the interleaved zero-bubble schedule (`interleaved-zb`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb")
INTERLEAVED = ("interleaved-1f1b", "interleaved-zb")  # schedules that run several chunks per device
SPLIT_BACKWARD = ("zb-h1", "interleaved-zb")  # schedules whose backward is split into B and W steps


def default_chunks(schedule: str) -> int:
    """Chunks per device when a spec names none: 2 for the interleaved schedules, else 1."""
    return 2 if schedule in INTERLEAVED else 1


def zero_bubble_rounds(micro_batches: int, pp: int) -> int:
    """The rounds the zero-bubble schedules run the micro-batches in (as torch): micro-batches // pp, at least
    1; the micro-batch count must be a multiple of it."""
    return max(1, micro_batches // pp)


class Step(NamedTuple):
    """One step of a pipeline device: phase "F", "B" or (zero-bubble schedules) "W" of local model chunk
    `chunk` for micro-batch `micro`."""

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


def _zero_bubble(stage: int, pp: int, micro_batches: int, chunks: int) -> list[Step]:
    """ZB1P as torch.distributed.pipelining builds it (ScheduleInterleavedZeroBubble, its bubbles left out:
    they only delay a step until its input is there). Micro-batches run in rounds of `per_round`, each round
    through every chunk in turn; after a warm-up of forwards (one less per device down the pipeline), each
    forward is followed by a B, and each B from the (stage + 1)-th on by the W of the oldest B not yet
    followed; the Ws left run at the end."""
    rounds = zero_bubble_rounds(micro_batches, pp)
    if micro_batches % rounds:
        raise ValueError(f"zero-bubble schedules need the micro-batch count ({micro_batches}) to be a multiple "
                         f"of micro-batches // pp ({rounds})")
    per_round = micro_batches // rounds
    total = micro_batches * chunks
    warmup = min((chunks - 1) * per_round + pp - 1 - stage, total)
    forwards, backwards, weights = [0] * chunks, [0] * chunks, [0] * chunks
    steps: list[Step] = []

    def take(phase: str, chunk: int, counter: list[int]) -> None:
        steps.append(Step(phase, chunk, counter[chunk]))
        counter[chunk] += 1

    backward_chunks: list[int] = []  # the chunk of every B so far, in order: their Ws follow in the same order
    for op in range(total + warmup):
        if op < total:
            take("F", (op // per_round) % chunks, forwards)
        if op >= warmup:
            chunk = chunks - 1 - ((op - warmup) // per_round) % chunks
            take("B", chunk, backwards)
            backward_chunks.append(chunk)
            if op - warmup >= stage:
                take("W", backward_chunks[sum(weights)], weights)
    while sum(weights) < len(backward_chunks):
        take("W", backward_chunks[sum(weights)], weights)
    return steps


def device_steps(schedule: str, stage: int, pp: int, micro_batches: int, chunks: int = 1) -> list[Step]:
    """The ordered steps of pipeline device `stage` in one iteration."""
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
    if schedule in SPLIT_BACKWARD:
        if schedule == "zb-h1" and chunks != 1:
            raise ValueError("zb-h1 runs one chunk per device; interleaved-zb runs several")
        return _zero_bubble(stage, pp, micro_batches, chunks)
    raise ValueError(f"unknown schedule {schedule!r}")


@functools.lru_cache(maxsize=1024)
def kept_device_steps(schedule: str, stage: int, pp: int, micro_batches: int, chunks: int = 1) -> tuple[Step, ...]:
    """device_steps as a tuple, kept: a search walks one layout's steps for many candidates (and their intervals)."""
    return tuple(device_steps(schedule, stage, pp, micro_batches, chunks))


@functools.lru_cache(maxsize=16384)  # an int per layout: a search's whole grid
def most_in_flight(schedule: str, stage: int, pp: int, micro_batches: int, chunks: int = 1) -> int:
    """The most micro-batches pipeline device `stage` has in flight at once in its first chunk: forwards run
    less backwards begun (a split backward's B begins one; its W does not end it). GPipe holds all, 1F1B its
    warm-up's pp - stage (at most all); the others are counted from their steps."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b" or (schedule == "interleaved-1f1b" and chunks == 1):
        return min(pp - stage, micro_batches)
    in_flight = most = 0
    for step in kept_device_steps(schedule, stage, pp, micro_batches, chunks):
        if step.chunk == 0 and step.phase != "W":
            in_flight += 1 if step.phase == "F" else -1
            most = max(most, in_flight)
    return most


def virtual_stage(chunk: int, stage: int, pp: int) -> int:
    """The virtual stage that local chunk `chunk` of pipeline device `stage` holds."""
    return chunk * pp + stage
