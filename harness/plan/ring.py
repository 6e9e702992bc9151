"""A context-parallel ring's geometry, without torch: which chunks a rank holds, what each step computes and the
blocks it runs them as (harness.models.context runs them; harness.plan.kernels lists their kernels).

Layout (zigzag): the sequence is cut into 2 * cp equal chunks and rank r holds chunks r and 2 * cp - 1 - r, in that
order. At step i rank r holds the keys and values that started on rank (r - i) mod cp. Per pair of (query chunk,
key chunk) a causal mask makes the pair "full" (every query sees every key), "diagonal" (a lower-triangular mask:
the same chunk) or "skip" (no query sees any key). A step runs a block per query chunk that sees any key, over its
kept key chunks (contiguous in the rank's layout), masked where one of them is diagonal; without a causal mask (or
at cp = 1) one block over the whole local sequence.
"""
from __future__ import annotations

from typing import NamedTuple

FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"
PAIR_COST = {FULL: 1.0, DIAGONAL: 0.5, SKIP: 0.0}
"""The cost of a chunk pair's attention in units of a full pair's (what a planner multiplies FLOPs by)."""


def check_rank(cp: int, rank: int) -> None:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"rank must be an integer in [0, {cp}) for cp = {cp}, got {rank!r}")


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of the sequence's 2 * cp chunks rank holds: r and 2 * cp - 1 - r."""
    check_rank(cp, rank)
    return rank, 2 * cp - 1 - rank


def pair_kind(q_chunk: int, kv_chunk: int, causal: bool) -> str:
    """"full", "diagonal" or "skip": what the queries of q_chunk see of kv_chunk's keys."""
    if q_chunk < 0 or kv_chunk < 0:
        raise ValueError(f"chunk indices must be non-negative, got {q_chunk} and {kv_chunk}")
    if not causal or q_chunk > kv_chunk:
        return FULL
    return DIAGONAL if q_chunk == kv_chunk else SKIP


class RingStep(NamedTuple):
    """One rank at one step: whose keys and values it computes with (their chunks), and where they go next
    (None at the last step, which sends nothing forward)."""
    kv_owner: int
    kv_chunks: tuple[int, int]
    send_to: int | None
    recv_from: int | None


def ring_steps(cp: int) -> list[list[RingStep]]:
    """The forward ring, [step][rank]: at step i rank r holds rank (r - i) mod cp's keys and values and, but at
    the last step, sends them to r + 1 while receiving the next ones from r - 1. The backward runs the same
    ring, the gradients one step behind the keys and values, plus a final hop to r + 1 bringing them home."""
    check_rank(cp, 0)
    steps = []
    for step in range(cp):
        last = step == cp - 1
        steps.append([RingStep((r - step) % cp, zigzag_chunks(cp, (r - step) % cp),
                               None if last else (r + 1) % cp, None if last else (r - 1) % cp)
                      for r in range(cp)])
    return steps


def step_pairs(cp: int, rank: int, step: int, causal: bool) -> list[tuple[int, int, str]]:
    """The four (query chunk, key chunk, kind) pairs rank computes at step."""
    check_rank(cp, rank)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < cp:
        raise ValueError(f"step must be an integer in [0, {cp}) for cp = {cp}, got {step!r}")
    kv_chunks = zigzag_chunks(cp, (rank - step) % cp)
    return [(q, kv, pair_kind(q, kv, causal)) for q in zigzag_chunks(cp, rank) for kv in kv_chunks]


def rank_work(cp: int, rank: int, causal: bool) -> float:
    """Rank's attention work over all steps, in full chunk pairs (under zigzag the same on every rank)."""
    return sum(PAIR_COST[kind] for step in range(cp) for _, _, kind in step_pairs(cp, rank, step, causal))


class RingBlock(NamedTuple):
    """One block a step computes, in local chunks (a chunk is s_local / 2 tokens; at cp = 1 or without a causal
    mask the whole local sequence is one block of 2 chunks each way): its queries from `q_chunk` (`q_chunks` of
    them), its keys from `kv_chunk` (`kv_chunks`), and the kinds of its key chunks' pairs (DIAGONAL among them: the
    block is masked)."""
    q_chunk: int
    q_chunks: int
    kv_chunk: int
    kv_chunks: int
    kinds: tuple[str, ...]

    @property
    def masked(self) -> bool:
        return DIAGONAL in self.kinds


def step_blocks(cp: int, rank: int, step: int, causal: bool) -> list[RingBlock]:
    """The blocks rank computes at step (module docstring): skipped pairs left out."""
    if cp == 1 or not causal:
        step_pairs(cp, rank, step, causal)  # its checks
        return [RingBlock(0, 2, 0, 2, (DIAGONAL,) if causal else (FULL, FULL))]
    pairs = step_pairs(cp, rank, step, causal)
    blocks = []
    for a in range(2):
        kinds = [pairs[2 * a + b][2] for b in range(2)]
        keep = [b for b in range(2) if kinds[b] != SKIP]
        if keep:
            blocks.append(RingBlock(a, 1, keep[0], keep[-1] + 1 - keep[0], tuple(kinds[b] for b in keep)))
    return blocks


def ring_blocks(cp: int, causal: bool) -> tuple[int, list[list[RingBlock]]]:
    """The rank whose ring runs the most blocks (the ring's steps wait on their slowest rank) and its blocks, a
    list a step."""
    by_rank = [[step_blocks(cp, rank, step, causal) for step in range(cp)] for rank in range(cp)]
    rank = max(range(cp), key=lambda r: sum(len(blocks) for blocks in by_rank[r]))
    return rank, by_rank[rank]
