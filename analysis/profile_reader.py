"""The profile as the analysis uses it: harness.store.profile_reader's `Profile` (read whole, checked and verified),
the spec to simulate and the layers to plan it with.

The analysis runs offline: it never imports torch, MPI or the profilers, and it does not import a user
model's factory module either (only its "module:function" form is checked).
"""
from __future__ import annotations

from pathlib import Path

from harness.common.errors import UserError
from harness.plan.layers import LayerDesc
from harness.plan.spec import JobSpec, load_spec, parse_strategy_overrides
from harness.store.profile_reader import MeasuredEvent, Profile, load_profile, parse_spec_offline

__all__ = ["MeasuredEvent", "Profile", "layers_for", "load_profile", "parse_spec_offline", "resolve_spec"]


def resolve_spec(profile: Profile, spec_path: str | Path | None = None, strategy: str | None = None) -> JobSpec:
    """The spec to simulate: the profile's own, or `spec_path`'s, with `strategy` ("dp=4,pp=2") applied."""
    spec = load_spec(spec_path, import_factory=False) if spec_path else profile.spec
    if strategy:
        spec = spec.with_changes(**parse_strategy_overrides(strategy))
    return spec


def layers_for(profile: Profile, spec: JobSpec) -> list[LayerDesc] | None:
    """Layer descriptions for build_plan: None for built-in families (re-described for the spec's tp),
    the profile's stored descriptions for a user model (its code is not needed offline)."""
    if spec.model.family != "user":
        return None
    stored = profile.spec.model
    if stored.factory != spec.model.factory or stored.layers != spec.model.layers:
        raise UserError(f"{profile.path} profiles {stored.factory or stored.name!r} ({stored.layers} layers), not "
                        f"{spec.model.factory!r} ({spec.model.layers} layers): a user model's layers come from its "
                        "own profile; profile this spec")
    if not profile.layers:
        raise UserError(f"{profile.path}: the profile stores no layer descriptions (layers_json) for the user "
                        f"model {spec.model.name!r}; profile it again with the current harness")
    return profile.layers
