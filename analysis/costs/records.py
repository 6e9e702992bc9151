"""What costing a plan gives: each event's duration and where it came from (`EventCost`), and every table the
timeline reads beside them (`Costs`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from harness.plan.events import EventPlan

if TYPE_CHECKING:
    from analysis.costs.device_source import DeviceCosting
    from analysis.costs.fits import CommFit
    from analysis.costs.interpolated import CommCurve, HeldOutCheck
    from analysis.device_model import DeviceModel
    from analysis.network import NetworkModel
    from analysis.skew import MachineDrift, ReplicaSkew

# where an event's duration came from (EventCost.source)
MEASURED, INTERPOLATED, FITTED, UNAVAILABLE, GIVEN = "measured", "interpolated", "fit", "unavailable", "given"
MODELLED = "network"  # costed by the network model (analysis.network)


class SampleSet(NamedTuple):
    """Samples, as the statistic takes them (divided by their rank's speed factor), and the statistic that
    makes one duration of them: what analysis.uncertainty resamples."""

    values: np.ndarray
    statistic: str  # mean | median | min


@dataclass(frozen=True)
class EventCost:
    """One event's duration and where it came from."""

    id: str
    name: str
    kind: str
    seconds: float
    source: str  # measured | interpolated | device | network | fit | unavailable (costed 0) | given
    fit: tuple[str, str] | None = None  # (kind, placement) of the fit used
    note: str = ""

    @property
    def extrapolated(self) -> bool:
        return self.source in (FITTED, MODELLED, UNAVAILABLE)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "kind": self.kind, "seconds": self.seconds, "source": self.source,
                "fit": "/".join(self.fit) if self.fit else None, "note": self.note}


@dataclass
class Costs:
    """Durations of a plan's events, the communication fits and what the prediction lacks."""

    events: dict[str, EventCost]
    fits: dict[tuple[str, str], CommFit] = field(default_factory=dict)
    # (kind, placement, group size) -> the measured points a message between two of their sizes is costed from
    curves: dict[tuple[str, str, int], CommCurve] = field(default_factory=dict)
    # compute event id -> seconds of the layer with its tensor-parallel all-reduces, measured together
    composites: dict[str, float] = field(default_factory=dict)
    # compute event id -> its composite timed alone, where `composites` holds its figure inside its pairs' chains
    isolated_composites: dict[str, float] = field(default_factory=dict)
    # P2P event id -> extra seconds of a transfer that waits for its receiver while the sender computes
    sender_busy_extra: dict[str, float] = field(default_factory=dict)
    # P2P event id -> the sender's host seconds to post the send, before its device goes on
    send_post: dict[str, float] = field(default_factory=dict)
    # P2P event id -> the compute seconds a transfer whose receive is posted after its send takes from each of its
    # two devices (a CPU's library threads on the cores the ranks keep busy; a spec alone on a description with
    # [host] p2p_late_us)
    late_transfer_cpu: dict[str, float] = field(default_factory=dict)
    # GPU compute event id -> the host's seconds to issue it (its `seconds` are the device's alone)
    host_issue: dict[str, float] = field(default_factory=dict)
    # whether, in a step played against the host's issue times, the host waits for the device after each inline
    # collective (a tensor-parallel all-reduce, ZeRO's gathers): True for a profile's durations (harness train
    # times each collective between two synchronizations, and so ran the profiled job); False for a job costed
    # from a device description alone, as Megatron-LM runs it (its collectives enqueued on the stream, the host
    # issuing the next kernels at once; analysis.costs.device_source)
    host_waits_on_collectives: bool = True
    # the host's seconds to issue each inline collective of a step (a spec alone on a description with [host]
    # collective_issue_us; analysis.costs.device_source): played against the device's time as a compute event's
    # host_issue is
    collective_issue_s: float = 0.0
    # compute event id -> its samples' statistic alone (the layer in a loop), where the profile timed it in its
    # stages' chains too and `events` holds that in-context figure instead (harness.profile.in_context)
    isolated: dict[str, float] = field(default_factory=dict)
    # backward compute event id -> the host's seconds of one backward() call that its samples paid and a
    # step pays once per stage (profiles from before it was measured have none: 0)
    backward_call: dict[str, float] = field(default_factory=dict)
    # data-parallel bucket all-reduce event id -> seconds to divide the bucket by the replica count first
    bucket_divide: dict[str, float] = field(default_factory=dict)
    # data-parallel bucket all-reduce event id -> seconds to zero the bucket for the next iteration
    bucket_zero: dict[str, float] = field(default_factory=dict)
    # the training engine's host seconds between steps, by transition ("F->B", "B->F", "F->F", "B->B", "B->opt",
    # "start", "end"; harness.train.engine_gaps), or for a spec alone its description's [host] step_gap_us between
    # two steps (analysis.costs.device_source.run_as_described): the timeline waits them out (empty: profiles
    # before them, descriptions without one)
    engine_gaps: dict[str, float] = field(default_factory=dict)
    # the ranks' speed over time in the profile: how far the slowest data-parallel replica lags (analysis.skew)
    replica_skew: ReplicaSkew | None = None
    # per compute phase (profile.h5's key), every profiling rank's speed-probe time over the ranks' mean: the
    # factor its compute samples were divided by (empty: samples as taken)
    rank_speed: dict[str, list[float]] = field(default_factory=dict)
    compute_stat: str = "mean"  # the statistic of a compute event's samples that stands for it (or "given")
    # where durations above came from samples, the samples: event id -> SampleSet, for `events`, `host_issue`
    # and `composites` (what a prediction's interval resamples; analysis.uncertainty)
    sampled: dict[str, dict[str, SampleSet]] = field(
        default_factory=lambda: {"events": {}, "host_issue": {}, "composites": {}})
    warnings: list[str] = field(default_factory=list)
    unmeasured: list[dict[str, str]] = field(default_factory=list)  # needed events without a measurement
    # how well the communication curves hold between measured sizes (held_out_checks; filled by analysis.predict)
    held_out: list[HeldOutCheck] = field(default_factory=list)
    # what costs communication beyond the measured curves (the spec's network or one calibrated from the profile)
    network: NetworkModel | None = None
    # how the machine's speed moved over the profile (analysis.skew), and the kind of device it ran on ('cpu',
    # 'cuda'; '' for durations given by hand): what a prediction's interval adds to its sampling noise
    machine_drift: MachineDrift | None = None
    device: str = ""
    # the spec's device model ([cluster] device; analysis.costs.device_source), which costs the compute the
    # profile lacks, and each event it costed: its kernels and their times
    device_model: DeviceModel | None = None
    device_kernels: dict[str, DeviceCosting] = field(default_factory=dict)

    def seconds(self, eid: str) -> float:
        return self.events[eid].seconds

    @property
    def extrapolated(self) -> list[EventCost]:
        """Communication events whose duration came from a fit (or is missing altogether)."""
        return sorted((c for c in self.events.values() if c.extrapolated), key=lambda c: (c.kind, c.name, c.id))

    @property
    def interpolated(self) -> list[EventCost]:
        """Communication events costed between two measured sizes of their kind, placement and group."""
        return sorted((c for c in self.events.values() if c.source == INTERPOLATED),
                      key=lambda c: (c.kind, c.name, c.id))

    @classmethod
    def from_seconds(cls, plan: EventPlan, seconds: Mapping[str, float]) -> Costs:
        """Costs given directly (what-if studies, tests): every event of the plan needs a duration."""
        missing = [eid for eid in plan.events if eid not in seconds]
        if missing:
            raise ValueError(f"no duration for {len(missing)} events: {', '.join(missing[:5])}")
        return cls({eid: EventCost(eid, e.name, e.kind, float(seconds[eid]), GIVEN)
                    for eid, e in plan.events.items()}, compute_stat=GIVEN)
