"""A spec's `[search]` grid expanded into candidate strategies: every combination of its fields, each one
validated by the spec's own rules (harness.plan.spec), the rejected ones with their reasons. Pure Python.

Rules (docs/spec.md, "[search]"):
- a field the grid does not list keeps the spec's value; `micro` is the micro-batch size at the spec's
  global batch;
- the device count is fixed: `gpus` (or `--gpus`) when given, else the spec's cluster; without `dp` in the
  grid, dp is the device count over tp x cp x pp; with it, a combination that uses another count is rejected;
- `chunks` applies to the interleaved schedules only (interleaved-1f1b, interleaved-zb; the others run one
  chunk per device): the grid's chunks give interleaved candidates, the spec's own chunks when the grid has
  none (2 by default);
- the node size stays the spec's (`gpus_per_node`); a device count that does not fill whole nodes runs on
  one node if it is smaller than one, else is rejected;
- identical candidates are one;
- `auto` (`[search] auto = true` or `analysis search --auto`): every field the grid does not list takes every
  value that can make a job of the device count: each factorization of the count into dp x tp x cp x pp, each
  micro-batch size that divides the global batch over dp, every schedule (interleaved ones with the grid's
  chunks, else 2), every recompute mode (none, selective, full; full with the spec's recompute_layers and
  recompute_method), every ZeRO stage, with tp > 1 sequence parallelism on and off, and for a Mixture-of-Experts
  model every ep dividing the experts and dp; the spec's rules then reject what the model cannot run (heads not
  divisible by tp, layers by pp, ...), as for any grid.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from harness.common.errors import SpecError, UserError
from harness.plan.schedules import INTERLEAVED, SCHEDULES
from harness.plan.spec import RECOMPUTE, ZERO_STAGES, JobSpec, StrategySpec, check_strategy

GRID_FIELDS = ("gpus", "dp", "tp", "cp", "pp", "micro", "schedule", "chunks", "recompute", "zero", "sp", "ep")


@dataclass(frozen=True)
class Rejected:
    """A combination of the grid that is not a valid job, and why."""

    values: tuple  # the combination's value of each of GRID_FIELDS (dp None: from the device count)
    reason: str
    shown: frozenset[str]  # the fields its grid varies (the others are the spec's)

    @property
    def choice(self) -> tuple[tuple[str, Any], ...]:
        """(field, value) as the grid gave them: the fields it varies, chunks for an interleaved schedule only, dp
        unless left to the device count."""
        schedule = self.values[GRID_FIELDS.index("schedule")]
        return tuple((name, value) for name, value in zip(GRID_FIELDS, self.values)
                     if name in self.shown and value is not None and (name != "chunks" or schedule in INTERLEAVED))

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.choice)


@dataclass
class Grid:
    """The valid candidates of a search (in grid order) and the rejected combinations."""

    candidates: list[JobSpec]
    rejected: list[Rejected]

    def __len__(self) -> int:
        return len(self.candidates)


def rejected_by_reason(rejected: list[Rejected]) -> list[tuple[str, list[Rejected]]]:
    """The rejected combinations grouped by the rule they broke, the most common first (then in grid order)."""
    groups: dict[str, list[Rejected]] = {}
    for r in rejected:
        groups.setdefault(r.reason, []).append(r)
    return sorted(groups.items(), key=lambda item: -len(item[1]))


def strategy_key(spec: JobSpec) -> tuple:
    """What tells two candidates apart."""
    s = spec.strategy
    return (spec.strategy.world, s.dp, s.tp, s.cp, s.pp, spec.batch.micro, s.schedule, s.chunks, s.recompute, s.zero,
            s.sp, s.ep)


def candidate_label(spec: JobSpec) -> str:
    """'dp=2 tp=2 pp=2 1f1b micro=2 m=8' (chunks for interleaved schedules, recompute when on)."""
    s = spec.strategy
    chunks = f" chunks={s.chunks}" if s.chunks > 1 else ""
    recompute = f" recompute={s.recompute}" if s.recompute != "none" else ""
    if s.recompute == "full" and (s.recompute_layers, s.recompute_method) != (1, "uniform"):
        recompute += f" {s.recompute_method}:{s.recompute_layers}"
    zero = f" zero={s.zero}" if s.zero else ""
    sp = " sp" if s.sp else ""
    cp = f" cp={s.cp}" + (" allgather" if s.cp_comm == "allgather" else "") if s.cp > 1 else ""
    cp += f" ep={s.ep}" if s.ep > 1 else ""
    return (f"dp={s.dp} tp={s.tp}{sp}{cp} pp={s.pp} {s.schedule}{chunks} micro={spec.batch.micro} "
            f"m={spec.micro_batches}{recompute}{zero}")


def _values(spec: JobSpec, field: str, gpus: int | None) -> tuple:
    grid = spec.search
    if field == "gpus":
        return (gpus,) if gpus is not None else (grid.gpus or (spec.cluster.devices,))
    if field == "micro":
        return grid.micro or (spec.batch.micro,)
    if field == "dp":
        return grid.dp or (None,)  # None: derived from the device count
    return getattr(grid, field) or (getattr(spec.strategy, field),)


def divisors(n: int) -> tuple[int, ...]:
    """n's divisors, smallest first (pairs up to its square root: fast for any n a spec allows)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def _auto_combinations(spec: JobSpec, fields: dict[str, tuple]) -> list[tuple]:
    """(world, dp, tp, cp, pp, micro) of every factorization and micro-batch size the grid leaves open (`auto`)."""
    grid, global_size = spec.search, spec.batch.global_size
    out = []
    for world in fields["gpus"]:
        for tp in grid.tp or divisors(world):
            rest = world // tp if world % tp == 0 else 1
            for cp in grid.cp or divisors(rest):
                for pp in grid.pp or divisors(rest // cp if rest % cp == 0 else 1):
                    dp = world // (tp * cp * pp) if world % (tp * cp * pp) == 0 else None
                    if dp is None or (grid.dp and dp not in grid.dp):
                        continue
                    micros = grid.micro or (divisors(global_size // dp) if global_size % dp == 0 else (1,))
                    out += [(world, dp, tp, cp, pp, micro) for micro in micros]
    return out


def expand(spec: JobSpec, gpus: int | None = None, auto: bool | None = None) -> Grid:
    """Every candidate of `spec`'s [search] grid (the spec itself when it has none); `gpus` replaces the grid's
    device counts; `auto` (default: the grid's own) fills the fields it does not list with every value (module
    docstring). UserError if no combination is a valid job (naming the first reasons)."""
    if gpus is not None and gpus < 1:
        raise UserError(f"--gpus {gpus}: give a device count of 1 or more")
    auto = spec.search.auto if auto is None else auto
    fields = {f: _values(spec, f, gpus) for f in GRID_FIELDS}
    if auto:
        grid = spec.search
        fields.update(schedule=grid.schedule or SCHEDULES, recompute=grid.recompute or RECOMPUTE,
                      zero=grid.zero or ZERO_STAGES, sp=grid.sp or (False, True),
                      ep=grid.ep or (divisors(spec.model.experts) if spec.model.moe else (1,)))
        shapes = _auto_combinations(spec, fields)
    else:
        shapes = list(itertools.product(fields["gpus"], fields["dp"], fields["tp"], fields["cp"], fields["pp"],
                                        fields["micro"]))
    schedules = fields["schedule"]
    if spec.search.chunks and not any(schedule in INTERLEAVED for schedule in schedules):
        raise UserError(f"{spec.source}: [search] chunks = {list(spec.search.chunks)} applies to the interleaved "
                        f"schedules only ({', '.join(INTERLEAVED)}), and the grid's schedules are "
                        f"{', '.join(schedules)}; add one of them to [search] schedule, or leave chunks out")
    interleaved_chunks = spec.search.chunks or (spec.strategy.chunks if spec.strategy.chunks > 1 else 2,)
    grid = spec.search
    shown = frozenset(("gpus", "dp", "tp", "pp", "micro", "schedule", "chunks")) | {
        name for name, varied in (("cp", grid.cp or auto), ("recompute", grid.recompute or auto),
                                  ("zero", grid.zero or auto), ("sp", grid.sp or auto),
                                  ("ep", grid.ep or (auto and spec.model.moe))) if varied}
    offline = dataclasses.replace(spec, import_factory=False)  # the candidates check a factory, never import it
    seen: dict[tuple, JobSpec] = {}
    rejected: list[Rejected] = []
    broken: dict[tuple, str | None] = {}
    kept = {f.name: getattr(spec.strategy, f.name) for f in dataclasses.fields(StrategySpec)}
    for (world, dp, tp, cp, pp, micro), schedule, recompute, zero, sp, ep in itertools.product(
            shapes, schedules, fields["recompute"], fields["zero"], fields["sp"], fields["ep"]):
        if sp and tp == 1 and auto and not spec.search.sp:
            continue  # the same job as sp = false: auto offers sp where there is a tensor-parallel group
        if auto and not spec.search.ep and dp is not None and dp % ep:
            continue  # auto offers the ep that divide dp
        for chunks in (interleaved_chunks if schedule in INTERLEAVED else (1,)):
            candidate = _candidate(offline, world, dp, tp, cp, pp, micro, schedule, chunks, recompute, zero, sp, ep,
                                   kept, broken)
            if isinstance(candidate, str):
                rejected.append(Rejected((world, dp, tp, cp, pp, micro, schedule, chunks, recompute, zero, sp, ep),
                                         candidate, shown))
                continue
            seen.setdefault(strategy_key(candidate), candidate)
    if not seen:
        reasons = "; ".join(f"{r.label()}: {r.reason}" for r in rejected[:3])
        raise UserError(f"{spec.source}: no combination of the [search] grid is a valid job ({len(rejected)} "
                        f"tried), e.g. {reasons}")
    return Grid(list(seen.values()), rejected)


def _candidate(spec: JobSpec, world: int, dp: int | None, tp: int, cp: int, pp: int, micro: int, schedule: str,
               chunks: int, recompute: str, zero: int, sp: bool, ep: int, kept: dict[str, Any],
               broken: dict[tuple, str | None]) -> JobSpec | str:
    """The combination as a spec, or the rule it broke (without the spec's path); `kept`: the spec's strategy
    fields, the base of every candidate's; `broken`: the rule each strategy of the search broke (check_strategy),
    kept across calls, since most combinations differ from another only where it does not read (most break one:
    no exception raised for them)."""
    layout = "tp x cp x pp" if cp > 1 else "tp x pp"
    if dp is None:
        if world % (tp * cp * pp):
            return f"{world} devices are not a multiple of {layout} = {tp * cp * pp}"
        dp = world // (tp * cp * pp)
    elif dp * tp * cp * pp != world:
        return (f"dp x {layout} = {dp * tp * cp * pp} devices, not the {world} of the search (list gpus in [search] "
                "to vary the device count)")
    key = (dp, tp, pp, schedule, chunks, recompute, zero, sp)  # all that check_strategy reads of a strategy
    if broken.get(key):
        return broken[key]
    strategy = StrategySpec(**{**kept, "dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "chunks": chunks,
                               "recompute": recompute, "zero": zero, "sp": sp, "cp": cp, "ep": ep,
                               # which blocks full recompute runs again (the spec's) is for full recompute alone
                               **({} if recompute == "full" else {"recompute_layers": 1,
                                                                  "recompute_method": "uniform"})})
    try:
        if key not in broken:
            broken[key] = None
            check_strategy(spec.model, strategy)
        return spec.with_strategy(strategy, micro, source=f"{spec.source} [search]")
    except SpecError as exc:
        if broken[key] is None and exc.source is None:  # check_strategy's (with_strategy's name the spec)
            broken[key] = str(exc)
        return _reason(exc)


def _reason(exc: SpecError) -> str:
    """The rule a combination broke, without the spec's path."""
    text = str(exc)
    return text.split(": ", 1)[1] if exc.source and text.startswith(exc.source) else text
