"""`python -m harness show OUTDIR/profile.h5`: what a profile holds (table, or --json)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import h5py

from harness.errors import UserError
from harness.events import human_bytes
from harness.hdf5_schema import PROFILE_KIND, PROFILE_SCHEMA_VERSION as SCHEMA_VERSION, read_environment
from harness.profile_store import read_measurements, read_unmeasured
from harness.output import format_seconds, format_table

NAME = "show"
HELP = "summarise a profile.h5: environment, measured events with statistics, what is unmeasured"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", help="a profile.h5 written by `harness profile` (or its folder)")
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def load_summary(path: Path) -> dict:
    """The profile as plain data: schema version, environment, measurements with statistics, unmeasured."""
    if path.is_dir():
        path = path / "profile.h5"
    if not path.exists():
        raise UserError(f"{path}: no such profile; run `python -m harness profile SPEC -o OUTDIR` first")
    try:
        with h5py.File(path, "r") as f:
            kind, version = f.attrs.get("kind"), f.attrs.get("schema_version")
            if kind != PROFILE_KIND:
                raise UserError(f"{path}: not a distsim profile (kind={kind!r})")
            if version != SCHEMA_VERSION:
                raise UserError(f"{path}: schema_version {version} is not supported (this harness reads "
                                f"{SCHEMA_VERSION})")
            environment = read_environment(f)
            spec = json.loads(f.attrs["spec_json"])
            names = dict(zip(f["events/id"].asstr()[()], f["events/name"].asstr()[()]))
    except OSError as exc:
        raise UserError(f"{path}: cannot read as HDF5 ({exc})")
    measurements = read_measurements(path)
    rows = []
    for eid, m in sorted(measurements.items(), key=lambda item: (item[1].kind, item[0])):
        stats = m.stats()
        rows.append({"id": eid, "kind": m.kind, "name": names.get(eid, _describe(m.content)),
                     "needed": eid in names, "ranks": m.ranks, **stats})
    return {"schema_version": int(version), "path": str(path), "spec": spec, "environment": environment,
            "measurements": rows, "unmeasured": [{"id": k, "name": names.get(k, k), "reason": v}
                                                 for k, v in read_unmeasured(path).items()]}


def _describe(content: dict) -> str:
    if content["kind"] == "composite":
        sig = content["signature"]
        return f"{sig.get('family')}.{content['layer']}.{content['phase']} composite on tp={sig.get('tp')}"
    extra = f" x{content['group']}" if "group" in content else ""
    return f"{content['kind']} {human_bytes(content.get('bytes', 0))}{extra} {content.get('placement', '')} (fit point)"


def run(args: argparse.Namespace) -> int:
    summary = load_summary(Path(args.profile))
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    env = summary["environment"]
    print(f"{summary['path']} (schema {summary['schema_version']}): {summary['spec']['model']['name']}, "
          f"{env.get('world_size')} ranks on {env.get('nodes')} node(s), {env.get('device')}, {env.get('backend')}"
          + (f", cpu binding {env['cpu_binding']}" if "cpu_binding" in env else ""))
    rows = [(r["name"], r["kind"], ",".join(map(str, r["ranks"])), format_seconds(r["median_s"]),
             format_seconds(r["p5_s"]), format_seconds(r["p95_s"]), r["count"]) for r in summary["measurements"]]
    print(format_table(("event", "kind", "ranks", "median", "p5", "p95", "n"), rows))
    for item in summary["unmeasured"]:
        print(f"unmeasured: {item['name']}: {item['reason']}")
    return 0
