"""Where a real run's time went: per rank, per time window and per training phase, and who held the others back
at the collectives (docs/runs.md).

From a RunActivity (analysis.activity), one precedence makes the categories, which add up to each rank's span:
compute is time under any compute; communication, time communicating while not computing; memory, time in
memory operations while doing neither; idle, the rest. Overlap is the share of the rank's communication time
during which it also computed (HolisticTraceAnalysis: time computing while communicating / time
communicating).

Windows are fixed slices of the run's whole time (the earliest rank's start to the latest rank's end), the same
for every rank; time of a window outside a rank's span is idle for it. A phase's row holds, per rank, the time
under that phase and the categories within it (phases overlap: a gradient all-reduce runs during the backward).

Stragglers: every collective is matched across the ranks that joined it (analysis.activity keys it); the rank
that arrived last is the one the others waited for, each for its arrival minus theirs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from analysis.activity import PHASE_NAMES, RankActivity, RunActivity
from analysis.intervals import EMPTY, Spans, coverage, spans, window_edges
from harness.common.errors import UserError

CATEGORIES = ("compute", "communication", "memory", "idle")
MAX_WINDOWS = 100_000  # windows a breakdown divides a run into at most
DEFAULT_WINDOWS = 20
TOP_WAITS = 5  # collectives listed in the terminal, costliest first
SCHEMA_VERSION = 1  # of the JSON (docs/runs.md)


@dataclass
class RankBreakdown:
    rank: int
    start_s: float  # relative to the run's start
    span_s: float
    compute_s: float
    communication_s: float
    memory_s: float
    idle_s: float
    overlap_pct: float | None  # None: the rank did not communicate
    communicating_s: float = 0.0  # all its communication time, under compute or not
    overlap_s: float = 0.0  # of that, the time it also computed

    def share(self, category: str) -> float:
        return 100.0 * getattr(self, f"{category}_s") / self.span_s if self.span_s > 0 else 0.0


@dataclass
class CollectiveWait:
    """One collective instance: who arrived last, and how long the others waited for that rank."""

    collective: str
    ranks: int
    last_rank: int
    waited_s: float  # summed over the other ranks
    max_wait_s: float  # of the rank that arrived first


@dataclass
class Straggler:
    rank: int
    last: int  # collectives at which it arrived last
    joined: int  # collectives it joined with others
    cost_s: float  # what the others waited for it, in all


@dataclass
class Breakdown:
    run: RunActivity
    ranks: list[RankBreakdown]
    edges: np.ndarray  # window edges, relative to the run's start
    windows: np.ndarray  # ranks x windows x CATEGORIES, seconds
    phases: list[dict[str, Any]]
    collectives: list[CollectiveWait]
    stragglers: list[Straggler]
    notes: list[str] = field(default_factory=list)

    def mean_share(self, category: str) -> float:
        """The category's share of the ranks' spans, their times pooled."""
        total = sum(r.span_s for r in self.ranks)
        return 100.0 * sum(getattr(r, f"{category}_s") for r in self.ranks) / total if total > 0 else 0.0

    @property
    def overlap_pct(self) -> float | None:
        """Time computing while communicating over time communicating, the ranks' times pooled."""
        communicating = sum(r.communicating_s for r in self.ranks)
        return 100.0 * sum(r.overlap_s for r in self.ranks) / communicating if communicating > 0 else None


def categories(activity: RankActivity) -> dict[str, Spans]:
    """The rank's span cut into the four categories, by precedence (they are disjoint and cover the span)."""
    whole = spans([activity.span[0]], [activity.span[1]])
    compute = activity.compute & whole
    communication = (activity.communication & whole) - compute
    memory = (activity.memory & whole) - compute - activity.communication
    idle = whole - (compute | communication | memory)
    return {"compute": compute, "communication": communication, "memory": memory, "idle": idle}


def rank_breakdown(activity: RankActivity, zero: float) -> tuple[RankBreakdown, dict[str, Spans]]:
    sets = categories(activity)
    whole = spans([activity.span[0]], [activity.span[1]])
    communicating = (activity.communication & whole).length
    overlapped = (activity.compute & activity.communication & whole).length
    row = RankBreakdown(activity.rank, activity.span[0] - zero, activity.span[1] - activity.span[0],
                        *(sets[c].length for c in CATEGORIES),
                        100.0 * overlapped / communicating if communicating > 0 else None, communicating, overlapped)
    return row, sets


def _phase_rows(activity: RankActivity, sets: dict[str, Spans]) -> list[dict[str, Any]]:
    whole = spans([activity.span[0]], [activity.span[1]])
    rows = []
    for phase in PHASE_NAMES:
        under = activity.phases.get(phase, EMPTY) & whole
        if not len(under):
            continue
        row = {"phase": phase, "rank": activity.rank, "time_s": under.length}
        row |= {f"{c}_s": (under & sets[c]).length for c in CATEGORIES}
        rows.append(row)
    return rows


def stragglers(run: RunActivity) -> tuple[list[CollectiveWait], list[Straggler]]:
    """Every collective joined by two or more ranks, and per rank how often it arrived last and what it cost."""
    joined: dict[tuple, dict[int, float]] = {}
    labels: dict[tuple, str] = {}
    for rank, activity in run.ranks.items():
        for arrival in activity.arrivals:
            joined.setdefault(arrival.key, {})[rank] = arrival.start_s
            labels.setdefault(arrival.key, arrival.label or " ".join(str(part) for part in arrival.key))
    waits = []
    per_rank = {rank: Straggler(rank, 0, 0, 0.0) for rank in run.ranks}
    for key, starts in joined.items():
        if len(starts) < 2:
            continue
        last = max(starts, key=lambda r: (starts[r], r))
        others = [starts[last] - t for r, t in starts.items() if r != last]
        waits.append(CollectiveWait(labels[key], len(starts), last, float(sum(others)), float(max(others))))
        per_rank[last].last += 1
        per_rank[last].cost_s += float(sum(others))
        for rank in starts:
            per_rank[rank].joined += 1
    ranking = sorted((s for s in per_rank.values() if s.joined), key=lambda s: (-s.cost_s, s.rank))
    return waits, ranking


def breakdown(run: RunActivity, *, windows: int | None = None, window_s: float | None = None) -> Breakdown:
    """The breakdown of one run; `windows` equal windows over its time, or windows of `window_s` seconds
    (default DEFAULT_WINDOWS windows)."""
    if windows is None and window_s is None:
        windows = DEFAULT_WINDOWS
    zero, end = run.start, run.end
    count = windows if windows is not None else (end - zero) / window_s  # a width's may overflow: not rounded
    if not count <= MAX_WINDOWS:
        asked = f"--windows {windows}" if windows is not None else f"--window-ms {window_s * 1e3:g}"
        raise UserError(f"{asked}: {count:,.3g} windows over the run's {end - zero:.3g} s, more than {MAX_WINDOWS:,} "
                        "(a row per rank and window); give fewer or wider windows")
    edges = window_edges(zero, end, count=windows, width=window_s)
    ranks, phases, per_window = [], [], []
    for activity in run.ranks.values():
        row, sets = rank_breakdown(activity, zero)
        ranks.append(row)
        phases.extend(_phase_rows(activity, sets))
        busy = np.stack([coverage(sets[c], edges) for c in CATEGORIES[:-1]])
        idle = np.diff(edges) - busy.sum(axis=0)
        per_window.append(np.vstack([busy, np.maximum(idle, 0.0)]).T)
    waits, ranking = stragglers(run)
    return Breakdown(run, ranks, edges - zero, np.stack(per_window), phases, waits, ranking, list(run.notes))


# ---- output -------------------------------------------------------------------------------------------------
def window_rows(result: Breakdown) -> list[dict[str, Any]]:
    rows = []
    for r, rank in enumerate(result.ranks):
        for w in range(len(result.edges) - 1):
            row = {"rank": rank.rank, "window": w, "start_s": float(result.edges[w]),
                   "end_s": float(result.edges[w + 1])}
            row |= {f"{c}_s": float(result.windows[r, w, k]) for k, c in enumerate(CATEGORIES)}
            rows.append(row)
    return rows


def phase_summary(result: Breakdown) -> list[dict[str, Any]]:
    """Per phase, all ranks together: ranks that had it, time per rank and the categories' shares of it."""
    out = []
    for phase in PHASE_NAMES:
        rows = [row for row in result.phases if row["phase"] == phase]
        if not rows:
            continue
        total = sum(row["time_s"] for row in rows)
        summary = {"phase": phase, "ranks": len(rows), "time_per_rank_s": total / len(rows)}
        summary |= {f"{c}_pct": 100.0 * sum(row[f"{c}_s"] for row in rows) / total if total else 0.0
                    for c in CATEGORIES}
        out.append(summary)
    return out


def run_description(run: RunActivity) -> str:
    parts = [f"{len(run.ranks)} ranks", run.kind if run.span == "trace" else f"{run.kind} (HTA's span)"]
    if run.backend:
        parts.append(run.backend)
    if run.model:
        parts.append(run.model)
    return ", ".join(parts)


def to_json(result: Breakdown) -> dict[str, Any]:
    run = result.run
    return {
        "schema_version": SCHEMA_VERSION, "kind": "distsim-breakdown", "source": str(run.source), "trace": run.kind,
        "span": run.span, "backend": run.backend, "model": run.model,
        "world_size": run.world_size, "iterations": len(run.iteration_s),
        "iteration_s": [float(t) for t in run.iteration_s],
        "summary": {**{f"{c}_pct": result.mean_share(c) for c in CATEGORIES}, "overlap_pct": result.overlap_pct},
        "ranks": [{**asdict(r), **{f"{c}_pct": r.share(c) for c in CATEGORIES}} for r in result.ranks],
        "windows": window_rows(result),
        "phases": result.phases,
        "phase_summary": phase_summary(result),
        "stragglers": [asdict(s) for s in result.stragglers],
        "collectives": [asdict(c) for c in result.collectives],
        "notes": result.notes,
    }


def csv_rows(result: Breakdown) -> tuple[list[str], list[list[Any]]]:
    """One row per rank (window "all") and per rank and window."""
    headers = ["rank", "window", "start_s", "end_s", *(f"{c}_s" for c in CATEGORIES)]
    rows = []
    for r in result.ranks:
        rows.append([r.rank, "all", r.start_s, r.start_s + r.span_s, *(getattr(r, f"{c}_s") for c in CATEGORIES)])
    for row in window_rows(result):
        rows.append([row[h] for h in headers])
    return headers, rows


def format_breakdown(result: Breakdown) -> str:
    from harness.common.output import format_seconds, format_table

    run = result.run
    lines = [f"breakdown of {run.source}: {run_description(run)}"]
    if len(run.iteration_s):
        lines[0] += (f"; {len(run.iteration_s)} measured iterations, median "
                     f"{format_seconds(float(np.median(run.iteration_s)))}")
    overlap = result.overlap_pct
    lines.append("all ranks: " + ", ".join(f"{c} {result.mean_share(c):.1f}%" for c in CATEGORIES)
                 + (f"; overlap {overlap:.1f}% of communication" if overlap is not None else ""))
    if result.stragglers and result.stragglers[0].last:
        top = result.stragglers[0]
        lines.append(f"most costly straggler: rank {top.rank}, last at {top.last} of {top.joined} collectives; "
                     f"the others waited {format_seconds(top.cost_s)} for it in all")
    rows = [(r.rank, format_seconds(r.span_s), *(f"{r.share(c):.1f}" for c in CATEGORIES),
             "-" if r.overlap_pct is None else f"{r.overlap_pct:.1f}") for r in result.ranks]
    lines += ["", format_table(("rank", "span", "compute %", "comm %", "memory %", "idle %", "overlap %"), rows)]
    phases = phase_summary(result)
    if phases:
        rows = [(p["phase"], p["ranks"], format_seconds(p["time_per_rank_s"]),
                 *(f"{p[f'{c}_pct']:.1f}" for c in CATEGORIES)) for p in phases]
        lines += ["", format_table(("phase", "ranks", "time/rank", "compute %", "comm %", "memory %", "idle %"), rows,
                                   title="phases (they overlap: time under each, and what the rank did then)")]
    if result.stragglers:
        rows = [(s.rank, s.last, s.joined, format_seconds(s.cost_s)) for s in result.stragglers]
        lines += ["", format_table(("rank", "last at", "of collectives", "others waited"), rows,
                                   title="stragglers (arrived last at a collective)")]
        costliest = sorted(result.collectives, key=lambda c: -c.waited_s)[:TOP_WAITS]
        rows = [(c.collective, c.ranks, c.last_rank, format_seconds(c.waited_s), format_seconds(c.max_wait_s))
                for c in costliest]
        lines += ["", format_table(("collective", "ranks", "last", "others waited", "longest wait"), rows,
                                   title=f"the {len(rows)} costliest waits (every collective: --json)")]
    lines += [f"NOTE: {note}" for note in result.notes]
    return "\n".join(lines)


def write_png(path, result: Breakdown):
    """The StarVZ view: ranks by time windows coloured by the compute share, and the categories' shares of
    all ranks over time."""
    from analysis.plot import pyplot, save

    plt = pyplot()
    width = np.diff(result.edges)
    share = result.windows / np.where(width > 0, width, 1.0)[None, :, None]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 2.5 + 0.3 * len(result.ranks)), sharex=True,
                                      layout="constrained",
                                      gridspec_kw={"height_ratios": [max(1, len(result.ranks)), 2]})
    image = top.pcolormesh(result.edges * 1e3, np.arange(len(result.ranks) + 1) - 0.5, share[:, :, 0] * 100,
                           cmap="viridis", vmin=0, vmax=100, shading="flat")
    top.set_yticks(range(len(result.ranks)), [f"rank {r.rank}" for r in result.ranks])
    top.invert_yaxis()
    top.set_title(f"compute share per window: {run_description(result.run)}")
    fig.colorbar(image, ax=[top, bottom], label="compute % (top)", fraction=0.04)
    mean = share.mean(axis=0) * 100
    middles = (result.edges[:-1] + result.edges[1:]) / 2 * 1e3
    colours = {"compute": "#2a9d8f", "communication": "#e76f51", "memory": "#e9c46a", "idle": "#d9d9d9"}
    bottom.stackplot(middles, *[mean[:, k] for k in range(len(CATEGORIES))], labels=CATEGORIES,
                     colors=[colours[c] for c in CATEGORIES], step="mid")
    bottom.set_ylim(0, 100)
    bottom.set_ylabel("share of ranks' time %")
    bottom.set_xlabel("time since the run's start (ms)")
    bottom.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(CATEGORIES), fontsize="small",
                  frameon=False)
    return save(fig, path)

