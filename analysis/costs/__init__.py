"""The duration of every event of a plan, from a profile's measurements: a chain of sources, each answering for
an event or passing it on (chain.py; the interface a source implements: source.py). The rules, one per kind of
event, with their reasons, are in docs/analysis.md ("Where durations come from").

- records.py: `EventCost` (a duration and its `source`) and `Costs` (every table the timeline reads)
- samples.py: the statistic that stands for a measurement; the profile's communication points
- measured.py: the profile's own measurements (compute referred to the ranks' mean speed); a missing compute
  event is a UserError listing it
- interpolated.py: communication between two measured sizes of its kind, placement and group size
- network_source.py: the network model beyond the measured points (the spec's tiers, costed by the library that
  runs the job's collectives, or tiers calibrated from the profile's fits; a what-if network, which costs all
  communication)
- fits.py: alpha-beta fits per kind and placement; the fit, then 0, where there is no network model
- corrections.py: a P2P's sender-busy extra and send post, a gradient bucket's averaging and zeroing, the
  data-parallel replicas' skew (analysis.skew)
"""
from analysis.costs.chain import UnmeasuredLedger, cost_chain, estimate_costs, first_answer
from analysis.costs.corrections import apply_corrections
from analysis.costs.fits import (
    CommFit,
    FitSource,
    UnavailableSource,
    choose_fit,
    comm_features,
    comm_fits,
    fit_alpha_beta,
)
from analysis.costs.interpolated import CommCurve, HeldOutCheck, InterpolatedSource, comm_curves, held_out_checks
from analysis.costs.measured import MeasuredSource, MissingComputeError, rank_speed_factors
from analysis.costs.network_source import (
    NetworkSource,
    collective_library,
    communication_by_tier,
    network_for,
    slowest_group,
    what_if_network,
)
from analysis.costs.records import (
    FITTED,
    GIVEN,
    INTERPOLATED,
    MEASURED,
    MODELLED,
    UNAVAILABLE,
    Costs,
    EventCost,
    SampleSet,
)
from analysis.costs.samples import (
    COMPUTE_STATS,
    PLACEMENTS,
    CommPoints,
    measured_comm_points,
    representative_seconds,
    statistic_of,
)
from analysis.costs.source import CostSource

__all__ = [
    "COMPUTE_STATS", "FITTED", "GIVEN", "INTERPOLATED", "MEASURED", "MODELLED", "PLACEMENTS", "UNAVAILABLE",
    "CommCurve", "CommFit", "CommPoints", "CostSource", "Costs", "EventCost", "FitSource", "HeldOutCheck",
    "InterpolatedSource", "MeasuredSource", "MissingComputeError", "NetworkSource", "SampleSet", "UnavailableSource",
    "UnmeasuredLedger", "apply_corrections", "choose_fit", "collective_library", "comm_curves", "comm_features",
    "comm_fits", "cost_chain", "communication_by_tier", "estimate_costs", "first_answer", "fit_alpha_beta",
    "held_out_checks", "measured_comm_points", "network_for", "rank_speed_factors", "representative_seconds",
    "slowest_group", "statistic_of", "what_if_network",
]
