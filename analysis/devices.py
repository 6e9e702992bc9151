"""Which devices to report, trace, draw or store: all, one representative per pipeline stage, or a list."""
from __future__ import annotations

from harness.common.errors import UserError
from harness.plan.spec import JobSpec

ALL_DEVICES_LIMIT = 1024  # larger worlds default to one representative per stage
PLOT_ROWS = 16  # default rows of a Gantt chart
PLOT_ROWS_MAX = 64


def rank_of_stage(spec: JobSpec, stage: int, dp_i: int = 0, tp_i: int = 0, cp_i: int = 0) -> int:
    """Global rank of (pipeline stage, dp index, tp index, cp index): ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
    (harness.plan.events.EventPlan.rank_of)."""
    s = spec.strategy
    return ((stage * s.dp + dp_i) * s.cp + cp_i) * s.tp + tp_i


def representatives(spec: JobSpec) -> list[int]:
    """One device per pipeline stage (dp index 0, tp index 0): replicas are identical."""
    return [rank_of_stage(spec, stage) for stage in range(spec.strategy.pp)]


def select_devices(spec: JobSpec, text: str | None, limit: int = ALL_DEVICES_LIMIT) -> tuple[list[int], str]:
    """Parse --devices: "all", "stages", or ranks like "0,3,8-11"; None means all up to `limit` devices,
    else stages. Returns (sorted ranks, what was chosen: all | stages | ranks)."""
    world = spec.strategy.world
    if text is None:
        text = "all" if world <= limit else "stages"
    text = text.strip()
    if text == "all":
        return list(range(world)), "all"
    if text == "stages":
        return representatives(spec), "stages"
    ranks: set[int] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        low, sep, high = item.partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise UserError(f"--devices: expected all, stages or ranks like 0,3,8-11; got {item!r}") from None
        if first > last:
            raise UserError(f"--devices: {item} runs backwards; write the range low-high, e.g. {last}-{first}")
        if not 0 <= first <= last < world:
            raise UserError(f"--devices: {item} is outside the job's ranks 0..{world - 1}")
        ranks.update(range(first, last + 1))
    if not ranks:
        raise UserError("--devices: no ranks given")
    return sorted(ranks), "ranks"


def plot_devices(spec: JobSpec, chosen: list[int] | None) -> tuple[list[int], str | None]:
    """Rows of a Gantt chart: the chosen ranks (at most PLOT_ROWS_MAX), else all devices when there are at
    most PLOT_ROWS, else representatives of at most PLOT_ROWS evenly spread stages. Returns the ranks and a
    note when rows were left out."""
    if chosen is not None:
        if len(chosen) > PLOT_ROWS_MAX:
            return chosen[:PLOT_ROWS_MAX], f"the chart shows the first {PLOT_ROWS_MAX} of {len(chosen)} devices"
        return chosen, None
    if spec.strategy.world <= PLOT_ROWS:
        return list(range(spec.strategy.world)), None
    pp = spec.strategy.pp
    if pp <= PLOT_ROWS:
        return representatives(spec), None
    stages = sorted({round(i * (pp - 1) / (PLOT_ROWS - 1)) for i in range(PLOT_ROWS)})
    return [rank_of_stage(spec, stage) for stage in stages], f"the chart shows {len(stages)} of {pp} pipeline stages"
