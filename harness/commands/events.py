"""`python -m harness events SPEC`: the unique events of one iteration and how far they de-duplicate."""
from __future__ import annotations

import argparse
import itertools
import json
import sys

from harness.commands.cli import default_spec_path
from harness.common.errors import UserError
from harness.common.output import format_table, write_csv
from harness.plan.candidates import candidate_label, rejected_by_reason
from harness.plan.events import EVENTS_VERSION, build_plan, events_to_profile, human_bytes
from harness.plan.spec import load_spec, vocab_padding_note

NAME = "events"
HELP = "list the unique events of one training iteration (table, or --json)"
OUTPUTS = {"csv": "--csv"}
INPUTS = ("spec",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", nargs="?", default=None, help="TOML job spec (default: the built-in demo job)")
    parser.add_argument("--json", action="store_true", help="print a JSON object (docs/events.md)")
    parser.add_argument("--list", action="store_true", help="also list every unique event")
    parser.add_argument("--device", type=int, metavar="RANK", help="materialise one device's event flow in order")
    parser.add_argument("--csv", metavar="FILE.csv", help="write every unique event as CSV (docs/events.md)")


MAX_FLOW_EVENTS = 1_000_000  # a device's flow listed at most (--device)


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec or default_spec_path())
    padding = vocab_padding_note(spec)
    if padding:
        print(padding, file=sys.stderr)  # stderr: --json's stdout stays one JSON object
    if spec.search:
        return _run_search(spec, args)
    plan = build_plan(spec, _factory_layers(spec))
    summary = plan.summary()
    if args.device is not None and not 0 <= args.device < spec.strategy.world:
        raise UserError(f"--device {args.device} is outside the job's ranks 0..{spec.strategy.world - 1}")
    flow = None
    if args.device is not None:
        flow = list(itertools.islice(plan.device_flow(args.device), MAX_FLOW_EVENTS + 1))
        if len(flow) > MAX_FLOW_EVENTS:
            raise UserError(f"--device {args.device}: the device runs more than {MAX_FLOW_EVENTS:,} events an "
                            "iteration, too many to list; give a spec with fewer micro-batches or layers a stage to "
                            "see its flow")
    if args.csv:
        _write_events_csv(args.csv, plan.table())
    if args.json:
        if args.list:
            summary["events"] = plan.table()
        if flow is not None:
            summary["device_flow"] = [{"event": e, "phase": ph, "virtual_stage": vs, "micro": mb}
                                      for e, ph, vs, mb in flow]
        print(json.dumps(summary, indent=2))
        return 0
    s = spec.strategy
    context = f" x {s.cp} cp" if s.cp > 1 else ""
    print(f"{spec.model.name}: {s.dp} dp x {s.tp} tp{' (sp)' if s.sp else ''}{context} x {s.pp} pp = "
          f"{s.world} devices, {spec.micro_batches} micro-batches of {spec.batch.micro}, schedule {s.schedule}")
    rows = [(kind, c["unique"], c["total"]) for kind, c in summary["by_kind"].items()]
    rows.append(("all", summary["unique_events"], summary["total_events"]))
    print(format_table(("kind", "unique", "total"), rows))
    print(f"de-duplication ratio: {summary['dedup_ratio']:,.1f} events per unique event")
    for what in summary["placement_mixed"]:
        print(f"note: {what} straddle nodes unevenly; the simulated replica uses the inter-node variant")
    if args.list:
        print()
        rows = [(r["id"], r["kind"], r["name"], r["multiplicity"],
                 human_bytes(r["cost"]) if r["kind"] != "compute" else f"{r['cost']:.3g} FLOP") for r in plan.table()]
        print(format_table(("id", "kind", "name", "multiplicity", "cost"), rows))
    if flow is not None:
        print(f"\nevent flow of device {args.device} ({len(flow)} events):")
        names = {e.id: e.name for e in plan.events.values()}
        print(format_table(("#", "phase", "virtual stage", "micro-batch", "event"),
                           [(i, ph, vs, mb if mb >= 0 else "-", names[e]) for i, (e, ph, vs, mb) in enumerate(flow)]))
    return 0


def _run_search(spec, args: argparse.Namespace) -> int:
    """A spec with a [search] grid: the union of every candidate's events, measured once by `harness profile`."""
    if args.device is not None:
        raise UserError("--device shows one job's flow; a spec with [search] has many (drop --device, or the "
                        "[search] section)")
    unique, grid = events_to_profile(spec, _factory_layers(spec))
    summary = {"events_version": EVENTS_VERSION, "model": spec.model.name, "candidates": len(grid),
               "rejected": len(grid.rejected), **unique.summary(),
               "separate_unique_events": unique.separate,
               "cross_candidate_ratio": unique.separate / max(1, len(unique)),
               "rejected_reasons": {reason: len(group) for reason, group in rejected_by_reason(grid.rejected)}}
    if args.csv:
        _write_events_csv(args.csv, unique.table())
    if args.json:
        if args.list:
            summary["events"] = unique.table()
            summary["candidate_strategies"] = [candidate_label(c) for c in grid.candidates]
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{spec.model.name}: a search of {len(grid)} candidate strategies ({len(grid.rejected)} combinations "
          "rejected)")
    rows = [(kind, c["unique"], c["total"]) for kind, c in summary["by_kind"].items()]
    rows.append(("all", summary["unique_events"], summary["total_events"]))
    print(format_table(("kind", "unique", "total over candidates"), rows))
    print(f"de-duplication: {summary['dedup_ratio']:,.1f} events per unique event; across candidates "
          f"{unique.separate:,} unique events of the candidates one by one are {len(unique):,} "
          f"({summary['cross_candidate_ratio']:,.1f}x fewer to profile)")
    for reason, count in list(summary["rejected_reasons"].items())[:5]:
        print(f"rejected {count}: {reason}")
    if args.list:
        print()
        print(format_table(("candidate",), [(candidate_label(c),) for c in grid.candidates]))
    return 0


def _write_events_csv(path: str, table: list[dict]) -> None:
    columns = ("id", "kind", "name", "multiplicity", "cost")
    write_csv(path, (*columns, "content_json"),
              [[r[c] for c in columns] + [json.dumps(r["content"], sort_keys=True)] for r in table])


def _factory_layers(spec):
    """A factory model's layer descriptions (torch is loaded only for one)."""
    if spec.model.family != "user":
        return None
    from harness.models.user import factory_layers

    return factory_layers(spec)
