"""The target cluster's network as data: `[[cluster.network]]` tiers, innermost first (docs/spec.md, "Network").

Pure Python: the spec reads it, the analysis costs collectives over it (analysis.network). Ranks fill the tiers in
order: a rank's domain at a tier is rank // size, so the innermost tier's domains are the scale-up domains
(NVLink) and each outer tier joins whole domains of the tier inside it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.common.errors import SpecError
from harness.plan.device import FIGURE_RANGE

TIER_FIELDS = ("name", "size", "bandwidth_gbs", "latency_us", "efficiency", "nvls", "rails", "oversubscription",
               "memory_gbs")
NUMBER_FIELDS = ("bandwidth_gbs", "latency_us", "efficiency", "oversubscription", "memory_gbs")


@dataclass(frozen=True)
class NetworkTier:
    """One tier: `size` GPUs share one domain of it; each GPU reaches the tier at `bandwidth_gbs` (one direction,
    GB = 1e9 bytes) times `efficiency`, divided by `oversubscription`, and a hop through it costs `latency_us`
    (None: NCCL's own per-hop latency for the tier's class, analysis.network)."""

    name: str
    size: int
    bandwidth_gbs: float
    latency_us: float | None = None
    efficiency: float = 1.0  # the share of the line rate that transfers reach
    nvls: bool = False  # the switch reduces (NVLink SHARP): NCCL's NVLS algorithms inside a domain
    rails: bool = False  # rail-optimized: GPU i of every domain below on switch i (off-rail traffic hops first)
    oversubscription: float = 1.0  # taper: crossing this tier divides its bandwidth by it
    # innermost tier only: each GPU's device-memory bandwidth (GB/s); a collective's pass of its buffer in and out of
    # device memory is costed at it (analysis.network); None: not costed
    memory_gbs: float | None = None

    @property
    def bytes_per_s(self) -> float:
        """What one GPU moves through this tier per second, one direction."""
        return self.bandwidth_gbs * 1e9 * self.efficiency / self.oversubscription

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in TIER_FIELDS}
        for optional in ("latency_us", "memory_gbs"):
            if out[optional] is None:
                del out[optional]
        return out


def parse_network(value: Any, devices: int, where: str = "cluster.network") -> tuple[NetworkTier, ...]:
    """`[[cluster.network]]` tables into tiers; SpecError (one message naming the tier and field) when a field is
    unknown or out of range, the sizes do not nest, an inner tier does not divide the cluster's devices, or the
    outermost tier does not hold them all."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise SpecError("must be an array of tables ([[cluster.network]]), innermost tier first", field=where)
    if not value:
        raise SpecError("has no tier; give at least one [[cluster.network]] table or leave the section out",
                        field=where)
    tiers = [_parse_tier(table, f"{where}[{i}]") for i, table in enumerate(value)]
    check_tiers(tiers, devices, where)
    return tuple(tiers)


def _parse_tier(table: dict, where: str) -> NetworkTier:
    unknown = sorted(set(table) - set(TIER_FIELDS))
    if unknown:
        raise SpecError(f"unknown field {unknown[0]!r}; a tier has {', '.join(TIER_FIELDS)}", field=where)
    name = table.get("name")
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise SpecError(f"name must be a word (letters, digits, - or _), got {name!r}", field=f"{where}.name")
    size = table.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SpecError(f"must be a whole number of GPUs >= 1, got {size!r}", field=f"{where}.size")
    numbers: dict[str, float | None] = {}
    for key in NUMBER_FIELDS:
        raw = table.get(key)
        if raw is None:
            if key == "bandwidth_gbs":
                raise SpecError("is required (GB/s per GPU, one direction)", field=f"{where}.{key}")
            continue
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
            raise SpecError(f"must be a finite number, got {raw!r}", field=f"{where}.{key}")
        if key == "latency_us" and raw < 0:
            raise SpecError(f"must be >= 0 microseconds, got {raw!r}", field=f"{where}.{key}")
        if key != "latency_us" and raw <= 0:
            raise SpecError(f"must be positive, got {raw!r}", field=f"{where}.{key}")
        if key == "efficiency" and raw > 1:
            raise SpecError(f"is the share of the line rate reached, at most 1, got {raw!r}", field=f"{where}.{key}")
        if key == "oversubscription" and raw < 1:
            raise SpecError(f"is a taper, at least 1 (1: full bisection), got {raw!r}", field=f"{where}.{key}")
        low, high = FIGURE_RANGE  # a time divides by every field but the latency: none so small it makes one inf
        if raw > high or (key != "latency_us" and raw < low):
            span = f"at most {high:g}" if key == "latency_us" else f"from {low:g} to {high:g}"
            raise SpecError(f"{raw!r} is beyond any network's figure in the field's unit (docs/spec.md): give one "
                            f"{span}; check the unit", field=f"{where}.{key}")
        numbers[key] = float(raw)
    flags = {}
    for key in ("nvls", "rails"):
        raw = table.get(key, False)
        if not isinstance(raw, bool):
            raise SpecError(f"must be true or false, got {raw!r}", field=f"{where}.{key}")
        flags[key] = raw
    return NetworkTier(name=name, size=size, bandwidth_gbs=float(numbers["bandwidth_gbs"]),
                       latency_us=numbers.get("latency_us"), memory_gbs=numbers.get("memory_gbs"),
                       efficiency=numbers.get("efficiency") or 1.0,
                       oversubscription=numbers.get("oversubscription") or 1.0, **flags)


def check_tiers(tiers: Sequence[NetworkTier], devices: int, where: str = "cluster.network") -> None:
    """The rules a network obeys (parse_network's docstring); SpecError naming the tier that breaks one."""
    names = [t.name for t in tiers]
    for i, tier in enumerate(tiers):
        if names.count(tier.name) > 1:
            raise SpecError(f"two tiers are named {tier.name!r}; each needs its own name", field=where)
        if i and tier.size % tiers[i - 1].size:
            raise SpecError(f"tier {tier.name!r} (size {tier.size}) does not nest: it must join whole domains of "
                            f"{tiers[i - 1].name!r} (size {tiers[i - 1].size}), a multiple of it",
                            field=f"{where}[{i}].size")
        if i and tier.size == tiers[i - 1].size:
            raise SpecError(f"tier {tier.name!r} has the size of {tiers[i - 1].name!r} ({tier.size}), so nothing "
                            "crosses it; give it a larger size or leave it out", field=f"{where}[{i}].size")
        if tier.nvls and i:
            raise SpecError(f"nvls (a reducing switch) is modelled in the innermost tier only, not {tier.name!r}",
                            field=f"{where}[{i}].nvls")
        if tier.memory_gbs is not None and i:
            raise SpecError(f"memory_gbs (the GPU's device memory) belongs to the innermost tier, not {tier.name!r}",
                            field=f"{where}[{i}].memory_gbs")
        if tier.size < devices and devices % tier.size:
            raise SpecError(f"tier {tier.name!r} (size {tier.size}) does not divide the cluster's {devices} GPUs "
                            "into whole domains; give a size that divides it", field=f"{where}[{i}].size")
    if tiers and tiers[-1].size < devices:
        raise SpecError(f"the cluster's {devices} GPUs do not fit in the outermost tier {tiers[-1].name!r} "
                        f"(size {tiers[-1].size}): raise its size or add a tier above it", field=where)


def with_overrides(tiers: Sequence[NetworkTier], overrides: Mapping[str, float | bool], devices: int,
                   where: str = "--network") -> tuple[NetworkTier, ...]:
    """The tiers with 'tier.field' values replaced (a what-if: {'ib.bandwidth_gbs': 100}), checked again."""
    by_name = {t.name: t for t in tiers}
    changes: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        name, _, field = key.partition(".")
        if name not in by_name:
            raise SpecError(f"no tier {name!r}; the network's tiers are {', '.join(by_name)}", source=where)
        if field not in TIER_FIELDS or field == "name":
            raise SpecError(f"{key!r}: a tier's field is one of {', '.join(TIER_FIELDS[1:])}", source=where)
        changes.setdefault(name, {})[field] = value
    tables = [{**t.to_dict(), **changes.get(t.name, {})} for t in tiers]
    return parse_network(tables, devices, where)


def parse_overrides(text: str) -> dict[str, float | bool]:
    """'ib.bandwidth_gbs=100,nvlink.latency_us=0.5' -> {'ib.bandwidth_gbs': 100.0, ...}; SpecError if malformed."""
    out: dict[str, float | bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise SpecError(f"{item!r} is not TIER.FIELD=VALUE (e.g. ib.bandwidth_gbs=100)", source="--network")
        raw = raw.strip().lower()
        if raw in ("true", "false"):
            out[key.strip()] = raw == "true"
            continue
        try:
            value = float(raw)
        except ValueError:
            raise SpecError(f"{item!r}: {raw!r} is not a number (nvls and rails take true or false)",
                            source="--network") from None
        out[key.strip()] = int(value) if key.strip().endswith(".size") and value.is_integer() else value
    if not out:
        raise SpecError("no change given; write TIER.FIELD=VALUE pairs separated by commas", source="--network")
    return out


@dataclass(frozen=True)
class GroupSpan:
    """How a group of ranks lies over the tiers: `ranks` in all, `domains` innermost domains holding them, at
    most `per_domain` in one, and `crossing`: the index of the outermost tier it crosses (0: one domain of the
    innermost tier holds it all)."""

    ranks: int
    domains: int
    per_domain: int
    crossing: int
    off_rail: bool = False  # a pair whose two GPUs sit at different places in their domains

    def describe(self, tiers: Sequence[NetworkTier]) -> str:
        if self.crossing == 0:
            return f"{self.ranks} in one {tiers[0].name} domain"
        return f"{self.domains} {tiers[0].name} domains of {self.per_domain} over {tiers[self.crossing].name}"


def group_span(ranks: Iterable[int], tiers: Sequence[NetworkTier]) -> GroupSpan:
    """Where `ranks` lie over `tiers` (rank r is in domain r // size of each tier)."""
    members = sorted(set(int(r) for r in ranks))
    inner = tiers[0].size
    counts: dict[int, int] = {}
    for r in members:
        counts[r // inner] = counts.get(r // inner, 0) + 1
    crossing = next((i for i, t in enumerate(tiers) if len({r // t.size for r in members}) == 1), len(tiers) - 1)
    off_rail = len(members) == 2 and crossing > 0 and members[0] % inner != members[1] % inner
    return GroupSpan(len(members), len(counts), max(counts.values(), default=0), crossing, off_rail)


def contiguous_span(ranks: int, tiers: Sequence[NetworkTier]) -> GroupSpan:
    """The span of ranks 0..ranks-1 (nccl-tests' layout: whole nodes in order)."""
    return group_span(range(ranks), tiers)
