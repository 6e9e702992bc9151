"""The interface of one link in the cost chain (analysis.costs.chain): what a new source of durations, such as
a device model, implements.

`estimate_costs` asks the chain's sources in turn for each event of the plan, in the plan's order: the first
that answers with an `EventCost` gives the event its duration, and its `source` label (records.py: measured,
interpolated, network, fit, unavailable, or the new source's own) is where the figure came from; a source that
returns None passes the event on. A source may also fill the tables of `Costs` beside the durations for an event
it answers (`host_issue`, `sampled`, ...). Once every event has its duration, each source's `finish` runs, in
the chain's order, for what needs them all: warnings, tables filled after the fact.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from analysis.costs.records import Costs, EventCost
from harness.plan.events import Event


class CostSource(ABC):
    """One source of event durations: answers for an event or passes it on."""

    @abstractmethod
    def cost(self, eid: str, event: Event, costs: Costs) -> EventCost | None:
        """`event`'s (id `eid`) cost from this source, or None to pass it to the next. `costs` is the costing
        so far: every earlier event's figure, and the tables a source may add to."""

    def finish(self, costs: Costs) -> None:
        """After every event has its cost: this source's warnings and late tables (nothing by default)."""
        return None
