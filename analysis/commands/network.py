"""`python -m analysis network SPEC|PROFILE.h5`: the network model's collectives in nccl-tests' columns, a block
per node count, to set beside a real nccl-tests run (docs/analysis.md, "The network model")."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from analysis.network import OPS, NetworkModel, nccl_tests_rows, spec_network
from harness.common.errors import SpecError, UserError
from harness.common.output import PNG_NAMES, format_table, named, writable, write_csv
from harness.common.subcommands import non_empty
from harness.plan.collectives import parse_size, sweep_sizes
from harness.plan.network import check_tiers, parse_overrides
from harness.plan.spec import MAX_DEVICES, load_spec

NAME = "network"
HELP = "the network model's collectives (spec's [[cluster.network]] or calibrated from a profile) as nccl-tests prints"
COLUMNS = ("op", "nodes", "ranks", "size_bytes", "time_s", "algbw_gbs", "busbw_gbs", "algorithm")
OUTPUTS = {"csv": "--csv", "png": "--png"}
INPUTS = ("source",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SPEC|PROFILE.h5",
                        help="a spec with [[cluster.network]], or a profile to calibrate the tiers from")
    parser.add_argument("--op", choices=OPS, default="allreduce", help="the collective (default allreduce)")
    parser.add_argument("--nodes", metavar="N,N,...",
                        help="node counts, a block each (default 1, 2, 4, ... up to the spec's nodes)")
    parser.add_argument("-b", "--minbytes", default="8", help="smallest size (default 8)")
    parser.add_argument("-e", "--maxbytes", default="8G", help="largest size (default 8G)")
    parser.add_argument("-f", "--stepfactor", type=float, default=2.0, help="factor between sizes (default 2)")
    parser.add_argument("--network", metavar="TIER.FIELD=VALUE,...", type=non_empty,
                        help="what-if: change tiers' fields, e.g. ib.bandwidth_gbs=100,nvlink.latency_us=0.5")
    parser.add_argument("--json", action="store_true", help="print JSON (docs/analysis.md)")
    parser.add_argument("--csv", metavar="FILE.csv", help="write the rows as CSV")
    parser.add_argument("--png", metavar="FILE.png", type=named(PNG_NAMES),
                        help="draw bus bandwidth against size, a line per node count")


def load_network(source: str) -> tuple[NetworkModel, int, int]:
    """The model, the GPUs per node and the nodes of a spec (its [[cluster.network]]) or a profile (its spec's,
    else calibrated from its communication)."""
    path = Path(source)
    if path.suffix in (".h5", ".hdf5"):
        from analysis.costs import network_for
        from analysis.profile_reader import load_profile, resolve_spec

        profile = load_profile(path)
        spec = resolve_spec(profile, None, None)
        model = network_for(spec, profile)
        if model is None:
            raise UserError(f"{path}: the profile measured no communication, so no network can be calibrated from "
                            "it; profile on 2 or more ranks, or give a spec with [[cluster.network]]")
        return model, spec.cluster.gpus_per_node, spec.cluster.nodes
    spec = load_spec(path, import_factory=False)
    if not spec.cluster.network:
        raise UserError(f"{path}: the spec has no [[cluster.network]]; describe the target's tiers there "
                        "(docs/spec.md, \"Network\"), or give a profile (PROFILE.h5) to calibrate them from")
    from analysis.costs import collective_library

    return (spec_network(spec.cluster.network, collective_library(spec)), spec.cluster.gpus_per_node,
            spec.cluster.nodes)


def _node_counts(text: str | None, nodes: int) -> list[int]:
    if text is None:
        counts = [1]
        while counts[-1] * 2 <= nodes:
            counts.append(counts[-1] * 2)
        return counts + ([nodes] if counts[-1] != nodes else [])
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UserError(f"--nodes {text!r}: give node counts >= 1 separated by commas, e.g. 1,2,4")
    return counts


def run(args: argparse.Namespace) -> int:
    model, per_node, nodes = load_network(args.source)
    counts = _node_counts(args.nodes, nodes)
    if args.network:
        model = model.with_overrides(parse_overrides(args.network), max(counts) * per_node)
    for count in counts:
        try:
            check_tiers(model.tiers, count * per_node)
        except SpecError as exc:
            why = str(exc).split("] ", 1)[-1].split("; give")[0]  # the rule broken, without its place and advice
            raise UserError(f"--nodes {count} ({count} x {per_node} GPUs): {why}; give node counts the network's "
                            "tiers hold, or change the tiers (--network)") from None
    sizes = sweep_sizes(parse_size(args.minbytes, "-b"), parse_size(args.maxbytes, "-e"), args.stepfactor)
    rows = []
    for count in counts:
        rows += [{**row, "nodes": count} for row in nccl_tests_rows(model, args.op, count * per_node, sizes)]
    written = []
    if args.png:
        written.append(("chart", writable(args.png, lambda: write_png(args.png, rows, args.op, model))))
    if args.csv:
        written.append(("CSV", write_csv(args.csv, COLUMNS, [[row[c] for c in COLUMNS] for row in rows])))
    if args.json:
        print(json.dumps({"network": model.to_dict(), "rows": [{c: row[c] for c in COLUMNS} for row in rows]},
                         indent=1))
    else:
        print(report(model, rows, args.op, per_node))
    for what, path in written:
        print(f"wrote {path}: {what}", file=sys.stderr if args.json else sys.stdout)
    return 0


def describe(model: NetworkModel) -> str:
    """One line: the tiers, innermost first, and whose algorithms."""
    parts = []
    for tier in model.to_dict()["tiers"]:
        flags = [flag for flag in ("nvls", "rails") if tier[flag]]
        taper = f", 1:{tier['oversubscription']:g}" if tier["oversubscription"] != 1 else ""
        taper += f", memory {tier['memory_gbs']:,g} GB/s" if tier.get("memory_gbs") else ""
        size = "any number of" if tier["size"] >= MAX_DEVICES else f"{tier['size']:,}"
        parts.append(f"{tier['name']} ({size} GPUs, {tier['bytes_per_s'] / 1e9:.3g} GB/s, "
                     f"{tier['latency_us']:.3g} us{taper}{''.join(', ' + f for f in flags)})")
    algorithms = (f"NCCL {model.to_dict()['nccl_version']}'s algorithms" if model.algorithms == "nccl"
                  else "the calibrated fits' own ring and pairwise form")
    return f"network ({model.origin}): {' < '.join(parts)}; {algorithms}"


def report(model: NetworkModel, rows: list[dict], op: str, per_node: int) -> str:
    lines = [describe(model), *[f"  note: {note}" for note in model.notes]]
    for count in dict.fromkeys(row["nodes"] for row in rows):
        block = [row for row in rows if row["nodes"] == count]
        table = [[row["size_bytes"], row["time_s"] * 1e6, row["algbw_gbs"], row["busbw_gbs"], row["algorithm"]]
                 for row in block]
        title = f"{op}, {count} node(s) x {per_node} = {block[0]['ranks']} ranks (model)"
        lines += ["", format_table(["size (B)", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "algorithm"], table,
                                   title=title),
                  f"# Avg bus bandwidth    : {sum(r['busbw_gbs'] for r in block) / len(block):.3f}"]
    return "\n".join(lines)


def write_png(path: str, rows: list[dict], op: str, model: NetworkModel):
    from analysis.plot import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for count in dict.fromkeys(row["nodes"] for row in rows):
        block = [row for row in rows if row["nodes"] == count]
        ax.plot([r["size_bytes"] for r in block], [max(r["busbw_gbs"], 1e-6) for r in block], marker=".",
                label=f"{count} node(s), {block[0]['ranks']} ranks")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{op}: the network model ({model.origin})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, path)
