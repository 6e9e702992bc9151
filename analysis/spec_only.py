"""A spec in place of a profile: what the analysis commands take as their input file (a TOML job spec or a
profile.h5), and the empty profile that a spec-only prediction costs through the same chain, so that every
event comes from the device and network models (docs/analysis.md, "A spec alone").
"""
from __future__ import annotations

from pathlib import Path

from analysis.profile_reader import Profile, load_profile
from harness.common.errors import UserError
from harness.plan.device import shipped_devices
from harness.plan.events import COMM_KINDS, EventPlan
from harness.plan.spec import JobSpec, load_spec
from harness.store.hdf5_schema import PROFILE_SCHEMA_VERSION

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
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


def load_input(path: str | Path, profile: str | Path | None = None) -> tuple[JobSpec, Profile]:
    """The commands' input: a profile (its spec), or a spec with `profile` beside it (--profile) or alone (the
    empty profile). UserError on a missing or bad file, or --profile beside a profile."""
    if is_spec_file(path):
        spec = load_spec(path, import_factory=False)
        return spec, load_profile(profile) if profile is not None else spec_profile(spec, path)
    if profile is not None:
        raise UserError(f"--profile {profile}: {path} is a profile already; --profile goes beside a spec "
                        "(SPEC.toml --profile PROFILE.h5), or give another spec with --spec")
    loaded = load_profile(path)
    return loaded.spec, loaded


def check_spec_only(plan: EventPlan, source: str, network_given: bool = False) -> None:
    """UserError, before costing, where a spec alone cannot cost `plan`: compute without `[cluster] device`, or
    communication without `[[cluster.network]]` (`network_given`: a what-if --network supplies one)."""
    spec = plan.spec
    compute = sum(e.kind == "compute" for e in plan.events.values())
    if compute and not spec.cluster.device:
        raise UserError(f"{source}: no profile and no [cluster] device to cost its {compute} compute events from; "
                        f"add device = \"NAME\" to [cluster] (shipped: {', '.join(shipped_devices())}) or a "
                        "description's path (docs/devices.md), or give a profile beside the spec (--profile "
                        "PROFILE.h5)")
    comm = sorted({e.kind for e in plan.events.values() if e.kind in COMM_KINDS})
    if comm and not spec.cluster.network and not network_given:
        count = sum(e.kind in COMM_KINDS for e in plan.events.values())
        raise UserError(f"{source}: no profile and no [[cluster.network]] to cost its {count} communication events "
                        f"({', '.join(comm)}) from; describe the network's tiers in the spec (docs/spec.md, "
                        "[[cluster.network]]), give --network OTHER_SPEC.toml, or give a profile beside the spec "
                        "(--profile PROFILE.h5)")
