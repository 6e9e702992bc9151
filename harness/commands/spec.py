"""`python -m harness spec --from-megatron SCRIPT_OR_ARGS | --from-hf config.json [-o job.toml]`: a job spec from
a Megatron launch or a Hugging Face config (docs/spec.md, "Importing a job"), with what was not modelled, ignored
or unknown said in a line each."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.common.errors import SpecError, UserError
from harness.common.output import SPEC_NAMES, named, writable
from harness.plan.device import is_device_path, load_device
from harness.plan.importers.hf import from_hf
from harness.plan.importers.megatron import from_megatron
from harness.plan.spec import JobSpec, load_spec, parse_strategy_overrides, vocab_padding_note

NAME = "spec"
HELP = "write a job spec (TOML) from a Megatron launch's arguments or a Hugging Face config.json"
OUTPUTS = {"output": "-o"}
INPUTS = ("from_megatron", "from_hf", "device", "network")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-megatron", metavar="SCRIPT_OR_ARGS",
                        help="a Megatron-LM / Megatron-DeepSpeed launch script, or its arguments in quotes")
    source.add_argument("--from-hf", metavar="CONFIG_JSON", help="a Hugging Face model's config.json")
    parser.add_argument("-o", "--output", metavar="JOB.toml", type=named(SPEC_NAMES),
                        help="write the spec here (default: print it)")
    parser.add_argument("--gpus", type=int, metavar="N", help="the job's GPUs (Megatron: instead of the launcher's; "
                        "Hugging Face: data-parallel over them, default 1)")
    parser.add_argument("--gpus-per-node", type=int, metavar="N", help="GPUs a node (default: the launcher's, or 8)")
    parser.add_argument("--seq-len", type=int, metavar="N", help="Hugging Face: the training sequence length "
                        "(default: the config's maximum positions)")
    parser.add_argument("--micro", type=int, metavar="N", help="Hugging Face: the micro-batch (default 1)")
    parser.add_argument("--global", dest="global_batch", type=int, metavar="N",
                        help="Hugging Face: the global batch (default micro x dp)")
    parser.add_argument("--strategy", metavar="K=V,...", help="then change strategy, batch or cluster fields, e.g. "
                        "'tp=8,pp=2,dp=4' (as analysis simulate --strategy)")
    parser.add_argument("--device", metavar="NAME|FILE.toml", help="the target's device, [cluster] device: a shipped "
                        "description (a100-40gb, a100-80gb, h100-sxm, h200, b200) or a file (docs/devices.md)")
    parser.add_argument("--network", metavar="SPEC.toml", help="the target's network: another spec's "
                        "[[cluster.network]] tiers (e.g. harness/jobs/dgx-h100.toml); with --device the spec alone is "
                        "enough for analysis simulate and search")


def run(args: argparse.Namespace) -> int:
    for name in ("gpus", "gpus_per_node", "seq_len", "micro", "global_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-').replace('global-batch', 'global')} must be at least 1, "
                            f"got {value}")
    if args.from_megatron is not None:
        given = [f"--{name}" for name, value in (("seq-len", args.seq_len), ("micro", args.micro),
                                                  ("global", args.global_batch)) if value is not None]
        if given:
            raise UserError(f"{', '.join(given)}: for --from-hf only; a Megatron launch states them (--seq-length, "
                            "--micro-batch-size, --global-batch-size): change them there, or the batch after with "
                            "--strategy micro=N,global=N")
        imported = from_megatron(args.from_megatron, gpus=args.gpus, gpus_per_node=args.gpus_per_node)
        origin = f"harness spec --from-megatron {imported.source}"
    else:
        imported = from_hf(args.from_hf, gpus=args.gpus or 1, gpus_per_node=args.gpus_per_node,
                           micro=args.micro or 1, global_batch=args.global_batch, seq_len=args.seq_len)
        origin = f"harness spec --from-hf {imported.source}"
    spec = imported.spec
    if args.strategy:
        changes = parse_strategy_overrides(args.strategy)
        if args.gpus is not None:
            changes = _on_the_gpus(spec, changes, args.gpus)
        spec = spec.with_changes(**changes)
    spec, target_notes = _on_the_target(spec, args.device, args.network)
    lines = imported.report() + [f"note: {note}" for note in target_notes]
    padding = vocab_padding_note(spec)
    if padding:
        lines.append(padding)
    text = spec.to_toml(header="\n".join([f"written by {origin}", *lines]))
    if args.output:
        writable(args.output, lambda: Path(args.output).write_text(text))
        s = spec.strategy
        print(f"wrote {args.output}: {spec.model.name} {spec.model.layers} layers x {spec.model.hidden}, "
              f"{s.layout} on {spec.cluster.nodes} x {spec.cluster.gpus_per_node} GPUs, "
              f"{spec.micro_batches} micro-batches of {spec.batch.micro}")
        for line in lines:
            print(line)
    else:
        sys.stdout.write(text)
        for line in lines:
            print(line, file=sys.stderr)
    return 0


def _on_the_target(spec: JobSpec, device: str | None, network: str | None) -> tuple[JobSpec, list[str]]:
    """The spec on --device (its description loaded, so a bad one is refused here) and --network (the tiers of
    another spec, held to the job's GPU count); with both, the innermost tier's memory bandwidth (memory_gbs,
    where the tiers give one) is the device's, said in a note."""
    changes: dict = {}
    notes: list[str] = []
    description = None
    if device is not None:
        try:
            description = load_device(device)
        except UserError as exc:
            raise UserError(f"--device {device}: {exc}") from None
        changes["device"] = str(Path(device).resolve()) if is_device_path(device) else device  # from anywhere
    if network is not None:
        try:
            tiers = load_spec(network, import_factory=False).cluster.network
        except UserError as exc:
            raise UserError(f"--network {network}: {exc}") from None
        if not tiers:
            raise UserError(f"--network {network}: that spec has no [[cluster.network]] to take the tiers from")
        tiers = [tier.to_dict() for tier in tiers]
        hbm = description.memory_bandwidth / 1e9 if description is not None else None
        if hbm is not None and tiers[0].get("memory_gbs") and tiers[0]["memory_gbs"] != hbm:
            notes.append(f"the {tiers[0]['name']} tier's memory_gbs is {device}'s {hbm:,.0f} GB/s "
                         f"({network} says {tiers[0]['memory_gbs']:,.0f})")
            tiers[0] = {**tiers[0], "memory_gbs": hbm}
        changes["network"] = tiers
    if not changes:
        return spec, notes
    try:
        return spec.with_changes(**changes), notes
    except SpecError as exc:  # the tiers against this job's GPUs
        if network is None:
            raise
        detail = str(exc).removeprefix(f"{exc.source}: ") if exc.source else str(exc)
        raise UserError(f"--network {network}: its tiers do not hold this job's {spec.cluster.devices:,} GPUs: "
                        f"{detail}") from None


def _on_the_gpus(spec, changes: dict, gpus: int) -> dict:
    """--strategy's changes on the GPU count --gpus fixed: dp follows the other degrees where not given; a dp that
    is given must make the count."""
    degrees = {key: changes.get(key, getattr(spec.strategy, key)) for key in ("tp", "pp", "cp")}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in degrees.values()):
        return changes  # parse_spec names the degree that is not a positive whole number
    replica = degrees["tp"] * degrees["pp"] * degrees["cp"]
    if "dp" not in changes:
        if gpus % replica:
            raise UserError(f"--strategy: tp x pp x cp = {replica} does not divide the --gpus {gpus}; give degrees "
                            "whose product divides it")
        return {**changes, "dp": gpus // replica}
    dp = changes["dp"]
    if isinstance(dp, int) and dp * replica != gpus:
        raise UserError(f"--strategy: dp x tp x pp x cp = {dp} x {replica} is {dp * replica} GPUs, not the --gpus "
                        f"{gpus}; drop dp (it follows) or give degrees that make {gpus}")
    return changes
