"""A spec in place of a profile: what the analysis commands take as their input file (a TOML job spec or a
profile.h5), and the empty profile that a spec-only prediction costs through the same chain, so that every
event comes from the device and network models (docs/analysis.md, "A spec alone").
"""
from __future__ import annotations

from pathlib import Path

from analysis.profile_reader import Profile, load_profile, resolve_spec
from harness.common.errors import UserError
from harness.plan.device import shipped_devices
from harness.plan.events import COMM_KINDS, EventPlan
from harness.plan.spec import JobSpec, load_spec, parse_strategy_overrides
from harness.store.hdf5_schema import HDF5_SIGNATURE, PROFILE_SCHEMA_VERSION

NO_PROFILE = "no profile: costed from the spec's device and network"


def is_spec_file(path: str | Path) -> bool:
    """Whether the commands' input is a job spec rather than a profile: a .toml, or a file that is not HDF5
    (its first bytes; an OUTDIR of `harness profile` is a profile)."""
    path = Path(path)
    if path.suffix.lower() == ".toml":
        return True
    if path.suffix.lower() in (".h5", ".hdf5") or not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            return f.read(len(HDF5_SIGNATURE)) != HDF5_SIGNATURE
    except OSError:
        return False


def spec_profile(spec: JobSpec, path: str | Path = "SPEC") -> Profile:
    """A profile that measured nothing, for `spec` (read from `path`): what a spec-only prediction is costed
    from (every compute event by the device model, every communication event by the network model)."""
    return Profile(path=Path(path), schema_version=PROFILE_SCHEMA_VERSION, spec=spec, spec_json=spec.to_json(),
                   layers=[], events={}, measurements={}, unmeasured={}, environment={}, placement={})


def is_spec_only(profile: Profile) -> bool:
    """Whether `profile` is spec_profile's (it measured nothing)."""
    return not profile.measurements and not profile.environment


def command_input(path: str | Path, profile: str | Path | None = None, spec_path: str | Path | None = None,
                  strategy: str | None = None) -> tuple[JobSpec, Profile | None, str | None]:
    """What simulate and search predict, from their input file: (spec, profile, the spec's file for messages).
    A profile: its spec, or --spec's, with --strategy. A spec (is_spec_file): with --strategy, costed from the
    profile --profile names beside it, else from its device and network alone (profile None).
    UserError on a missing or bad file, --profile beside a profile, or --spec beside a spec."""
    if is_spec_file(path):
        if spec_path is not None:
            raise UserError(f"--spec {spec_path}: {path} is a spec already; give one spec (and a profile beside it "
                            "with --profile PROFILE.h5)")
        if not Path(path).is_file():
            raise UserError(f"{path}: no such spec; give a job spec (.toml, docs/spec.md) or a profile.h5")
        spec = load_spec(path, import_factory=False)
        if strategy:
            spec = spec.with_changes(**parse_strategy_overrides(strategy))
        return spec, load_profile(profile) if profile is not None else None, str(path)
    if profile is not None:
        raise UserError(f"--profile {profile}: {path} is a profile already; --profile goes beside a spec "
                        "(SPEC.toml --profile PROFILE.h5), or give another spec with --spec")
    loaded = load_profile(path)
    return resolve_spec(loaded, spec_path, strategy), loaded, str(spec_path) if spec_path else None


def check_spec_only(spec: JobSpec, source: str, communication: dict[str, int], network_given: bool = False) -> None:
    """UserError, before costing, where a spec alone cannot cost a job: compute without `[cluster] device`, or
    `communication` (kind -> events; empty: none) without `[[cluster.network]]` (`network_given`: a what-if
    --network or collective benchmarks, --collectives, supply one), or a factory model (its layers are code the
    analysis does not run)."""
    if spec.model.family == "user":
        raise UserError(f"{source}: a factory model's layers are its own code, which the analysis does not run; "
                        "profile the job (python -m harness profile) and give the profile beside the spec "
                        "(--profile PROFILE.h5)")
    if not spec.cluster.device:
        raise UserError(f"{source}: no profile and no [cluster] device to cost its compute from; add "
                        f"device = \"NAME\" to [cluster] (shipped: {', '.join(shipped_devices())}) or a "
                        "description's path (docs/devices.md), or give a profile beside the spec (--profile "
                        "PROFILE.h5)")
    if communication and not spec.cluster.network and not network_given:
        count = sum(communication.values())
        kinds = ", ".join(sorted(kind for kind in communication if kind))
        raise UserError(f"{source}: no profile and no [[cluster.network]] to cost its "
                        + (f"{count} communication events ({kinds})" if kinds else "communication")
                        + " from; describe the network's tiers in the spec (docs/spec.md, [[cluster.network]]), "
                        "give --network OTHER_SPEC.toml or --collectives FILE.h5 (harness collectives -o), or give "
                        "a profile beside the spec (--profile PROFILE.h5)")


def plan_communication(plan: EventPlan) -> dict[str, int]:
    """Kind -> the plan's unique communication events of that kind."""
    out: dict[str, int] = {}
    for event in plan.events.values():
        if event.kind in COMM_KINDS:
            out[event.kind] = out.get(event.kind, 0) + 1
    return out
