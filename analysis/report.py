"""The simulation's summary: a JSON-ready dict (schema in docs/analysis.md) and a terminal report."""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from analysis.costs import Costs
from analysis.costs.device_source import DEVICE, source_counts, sources_line
from analysis.memory import GB, MemoryEstimate
from analysis.simulate import Timeline, drifting_replicas
from analysis.uncertainty import BatchTimeInterval, IntervalExplanation, has_samples
from harness.common.output import byte_unit, format_bytes, format_seconds, format_table
from harness.plan.events import human_bytes

RANK_SPEED_ROWS = 16  # beyond this many profiling ranks, the table shows the fastest and slowest half each

REPORT_SCHEMA_VERSION = 1
REPORT_KIND = "distsim-simulation"


def strategy_label(timeline: Timeline) -> str:
    """'dp=2 tp=2 pp=2 1f1b m=8' (plus chunks for interleaved schedules, sp, recompute and zero when on)."""
    s = timeline.spec.strategy
    chunks = f" chunks={s.chunks}" if s.chunks > 1 else ""
    extra = (f" recompute={s.recompute}" if s.recompute != "none" else "") + (f" zero={s.zero}" if s.zero else "")
    sp = " sp" if s.sp else ""
    cp = f" cp={s.cp}" + (" allgather" if s.cp_comm == "allgather" else "") if s.cp > 1 else ""
    return f"dp={s.dp} tp={s.tp}{sp}{cp} pp={s.pp} {s.schedule}{chunks} m={timeline.spec.micro_batches}{extra}"


def stage_rows(timeline: Timeline) -> list[dict[str, Any]]:
    """Per pipeline stage: its usage (the same on all its dp x tp devices)."""
    s = timeline.spec.strategy
    rows = []
    for device in timeline.pipeline:
        u = device.usage
        rows.append({"stage": device.stage, "devices": s.dp * s.tp * s.cp,
                     "virtual_stages": [c * s.pp + device.stage for c in range(s.chunks)],
                     "compute_s": u.compute_s, "comm_s": u.comm_s, "overlapped_comm_s": u.overlapped_comm_s,
                     "idle_s": u.idle_s, "end_s": device.end_s})
    return rows


def summary(timeline: Timeline, ranks: Sequence[int], selection: str, profile_path: str | Path | None = None,
            memory: MemoryEstimate | None = None, interval: BatchTimeInterval | None = None,
            explanation: IntervalExplanation | None = None) -> dict[str, Any]:
    """The JSON document of `simulate --json` (schema_version 1, docs/analysis.md); `explanation`: what makes
    the interval as wide as it is (analysis.uncertainty.explain_interval), null without one."""
    spec, s, costs = timeline.spec, timeline.spec.strategy, timeline.costs
    finite = lambda x: x if math.isfinite(x) else None  # noqa: E731 (JSON has no NaN or infinity)
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "kind": REPORT_KIND,
        "profile": str(profile_path) if profile_path is not None else None,
        "model": spec.model.name,
        "strategy": {"dp": s.dp, "tp": s.tp, "pp": s.pp, "sp": s.sp, "cp": s.cp, "cp_comm": s.cp_comm, "ep": s.ep,
                     "schedule": s.schedule, "chunks": s.chunks,
                     "dp_overlap": timeline.dp_overlap, "bucket_mb": s.bucket_mb},
        "world": s.world,
        "micro_batches": spec.micro_batches,
        "micro_batch_size": spec.batch.micro,
        "global_batch": spec.batch.global_size,
        "seq_len": spec.model.seq_len,
        "batch_time_s": timeline.batch_time_s,
        **(interval.to_dict() if interval is not None else
           {"batch_time_p5_s": None, "batch_time_p50_s": None, "batch_time_p95_s": None, "interval_resamples": 0,
            "interval_sampling_p5_s": None, "interval_sampling_p95_s": None, "interval_drift_sigma": None,
            "interval_model_residuals": None}),
        "interval_explanation": explanation.to_dict() if explanation is not None else None,
        "compute_statistic": costs.compute_stat,
        "rank_speed": costs.rank_speed,
        "throughput_samples_s": finite(timeline.throughput_samples_s),
        "throughput_tokens_s": finite(timeline.throughput_tokens_s),
        "bubble_fraction": timeline.bubble_fraction,
        "events": {"unique": timeline.plan.unique_events, "total": timeline.plan.total_events},
        "stages": stage_rows(timeline),
        "layer_passes": timeline.layer_passes(),
        "devices_selection": selection,
        "devices": [d.to_dict() for d in timeline.devices(ranks)],
        "extrapolated": [c.to_dict() for c in costs.extrapolated],
        "interpolated": [c.to_dict() for c in costs.interpolated],
        "comm_held_out": [c.to_dict() for c in costs.held_out],
        "unmeasured": list(costs.unmeasured),
        **device_model_summary(costs),
        "network": costs.network.to_dict() if costs.network is not None else None,
        "fits": [{**fit.to_dict(), "mean_rel_error": finite(fit.mean_rel_error),
                  "max_rel_error": finite(fit.max_rel_error)} for fit in costs.fits.values()],
        "p2p_sender_busy_extra": [{"id": eid, "name": timeline.plan.events[eid].name, "extra_s": extra}
                                  for eid, extra in sorted(costs.sender_busy_extra.items())],
        "p2p_send_post": [{"id": eid, "name": timeline.plan.events[eid].name, "post_s": post}
                          for eid, post in sorted(costs.send_post.items())],
        "p2p_late_transfer_cpu": [{"id": eid, "name": timeline.plan.events[eid].name, "cpu_s": cpu}
                                  for eid, cpu in sorted(costs.late_transfer_cpu.items())],
        "engine_gaps_s": dict(sorted(costs.engine_gaps.items())),
        "compute_host_issue": [{"id": eid, "name": timeline.plan.events[eid].name,
                                "device_s": costs.seconds(eid), "host_issue_s": host}
                               for eid, host in sorted(costs.host_issue.items())],
        "compute_backward_call": [{"id": eid, "name": timeline.plan.events[eid].name, "call_s": call}
                                  for eid, call in sorted(costs.backward_call.items())],
        "dp_bucket_divide": [{"id": eid, "name": timeline.plan.events[eid].name, "divide_s": divide}
                             for eid, divide in sorted(costs.bucket_divide.items())],
        "dp_bucket_zero": [{"id": eid, "name": timeline.plan.events[eid].name, "zero_s": zero}
                           for eid, zero in sorted(costs.bucket_zero.items())],
        "replica_skew": replica_skew_summary(timeline),
        "memory": memory.to_dict() if memory is not None else None,
        "warnings": list(costs.warnings),
    }


def device_model_summary(costs: Costs) -> dict[str, Any]:
    """Where the unique events' durations came from: `sources` (per kind of event, compute or communication,
    each source's count), `event_sources` (each unique event's), and `device_model` (null without [cluster]
    device): the device and every event it costed, with its source, note and kernels (docs/analysis.md)."""
    device = costs.device_model
    events = [{**costs.events[eid].to_dict(), "kernels": costing.breakdown()}
              for eid, costing in sorted(costs.device_kernels.items()) if costs.events[eid].source == DEVICE]
    return {"sources": source_counts(costs),
            "event_sources": [{"id": c.id, "name": c.name, "kind": c.kind, "seconds": c.seconds, "source": c.source}
                              for c in sorted(costs.events.values(), key=lambda c: (c.kind, c.name, c.id))],
            "device_model": {"device": device.name, "title": device.description.title,
                             "fitted": device.description.fitted, "events": events} if device is not None else None}


def replica_skew_summary(timeline: Timeline) -> dict[str, Any] | None:
    """dp > 1 with a skew in the profile: per stage, how far the slowest replica is expected to lag."""
    skew, replicas = timeline.costs.replica_skew, timeline.spec.strategy.gradient_replicas
    if skew is None or replicas <= 1:
        return None
    stages = []
    for device in timeline.pipeline:
        sigma, positions = skew.spread(device.replica_window_s)
        stages.append({"stage": device.stage, "drifting_replicas": drifting_replicas(timeline.plan, device.stage),
                       "window_s": device.replica_window_s, "sigma": sigma, "positions": positions,
                       "lag_s": device.replica_lag_s})
    return {"replicas": replicas, "profile_ranks": skew.ranks, "stages": stages}


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _ms_or_dash(seconds: float | None) -> float | str:
    return "-" if seconds is None else _ms(seconds)


def interval_text(interval: BatchTimeInterval | None) -> str:
    """' (90% interval 271 ms to 340 ms, 22.6% wide, with the model's error and the machine's drift)', or
    nothing without one."""
    if interval is None:
        return ""
    source = ("with the model's error beyond its held-out runs)" if interval.beyond_domain else
              "with the model's held-out error)" if interval.residuals else
              "with the machine's drift)" if interval.sampling else "from the profile's samples)")
    return (f" (90% interval {format_seconds(interval.p5_s)} to {format_seconds(interval.p95_s)}, "
            f"{interval.width:.1%} wide, " + source)


def format_report(timeline: Timeline, ranks: Sequence[int] | None = None, details: bool = False,
                  memory: MemoryEstimate | None = None, interval: BatchTimeInterval | None = None,
                  explanation: IntervalExplanation | None = None) -> str:
    """The terminal report, the answer first: batch time (with `explanation`, a line on what makes its interval
    as wide as it is), throughput, bubble and the per-stage table; the
    per-device table for `ranks` (devices of one stage are alike, so only where asked); a line on what was
    extrapolated; warnings. With `details` also the model's corrections (rules in docs/analysis.md)."""
    spec, costs = timeline.spec, timeline.costs
    T = timeline.batch_time_s
    s = spec.strategy
    exposed = sum(d.usage.comm_s for d in timeline.pipeline) / (len(timeline.pipeline) * T) if T > 0 else 0.0
    out = [f"{spec.model.name}: {strategy_label(timeline)} on {timeline.world:,} devices "
           f"({spec.cluster.nodes:,} x {spec.cluster.gpus_per_node}), global batch {spec.batch.global_size:,}",
           f"batch time   {format_seconds(T)}{interval_text(interval)}"]
    if explanation is not None:
        out.append(f"interval     {explanation.text()}")
    if interval is None and not has_samples(costs):
        out.append("interval     none: no profile samples to resample (every duration from a model)")
    out += [f"throughput   {timeline.throughput_samples_s:,.2f} samples/s, "
            f"{timeline.throughput_tokens_s:,.0f} tokens/s",
            f"bubble       {timeline.bubble_fraction:.1%} of device time idle; {exposed:.1%} communicating while not "
            "computing", ""]
    if memory is not None:
        peak = memory.peak
        capacity = spec.cluster.device_memory_gb
        fits = "" if capacity is None else (f"; fits {capacity:g} GB" if memory.fits(capacity * GB)
                                            else f"; DOES NOT FIT {capacity:g} GB")
        out.insert(len(out) - 1,  # before the blank line that ends the summary
                   f"memory       {format_bytes(peak.total)} per device at most (stage {peak.stage}, "
                   f"{peak.dominant} {format_bytes(getattr(peak, peak.dominant))}){fits}")
    unit, scale = byte_unit([m.total for m in memory.stages] if memory is not None else [])
    rows = [(r["stage"], r["devices"], _ms(r["compute_s"]), _ms(r["comm_s"]), _ms(r["overlapped_comm_s"]),
             _ms(r["idle_s"]), 100.0 * r["idle_s"] / T if T > 0 else None)
            + ((memory.stages[r["stage"]].total / scale,) if memory is not None else ())
            for r in stage_rows(timeline)]
    headers = ("stage", "devices", "compute ms", "comm ms", "overlapped ms", "idle ms", "idle %") + (
        (f"memory {unit}",) if memory is not None else ())
    replicas = (f"{s.dp} x {s.tp} x {s.cp} dp x tp x cp" if s.cp > 1 else f"{s.dp} x {s.tp} dp x tp")
    sync = (f"ZeRO-{s.zero} through FSDP2, its collectives inline" if s.zero else
            f"data-parallel all-reduce {'during' if timeline.dp_overlap else 'after'} the backward")
    out.append(format_table(headers, rows,
                            title=f"per pipeline stage (its {replicas} devices alike; {sync}):"))
    if ranks:
        rows = [(d.rank, d.stage, d.dp, d.tp, _ms(d.compute_s), _ms(d.comm_s), _ms(d.overlapped_comm_s), _ms(d.idle_s))
                for d in timeline.devices(ranks)]
        out += ["", format_table(("rank", "stage", "dp", "tp", "compute ms", "comm ms", "overlapped ms", "idle ms"),
                                 rows, title="per device:")]
    if costs.device_kernels:  # where the device model costed events, where every event came from
        out += ["", f"sources      {sources_line(costs)}"]
    extrapolated, interpolated = costs.extrapolated, costs.interpolated
    if (extrapolated or interpolated) and not details:
        parts = [f"{len(interpolated)} interpolated between measured sizes"] if interpolated else []
        modelled = sum(c.source == "network" for c in extrapolated)
        parts += [f"{modelled} by the network model ({costs.network.origin})"] if modelled else []
        parts += [f"{len(extrapolated) - modelled} costed by a fit"] if len(extrapolated) > modelled else []
        out += ["", f"{len(extrapolated) + len(interpolated)} communication event(s) the profile did not measure "
                    f"at their size: {', '.join(parts)} (--details)"]
    if details:
        out += _details(timeline)
    warnings = list(costs.warnings)
    if memory is not None and memory.unmeasured:
        warnings.append(f"the profile does not say what {', '.join(memory.unmeasured)} save for their backward "
                        "(written before it was measured): the memory counts no activations for them; profile "
                        "again to include them")
    for warning in warnings:
        out += ["", f"WARNING: {warning}"]
    return "\n".join(out)


def _details(timeline: Timeline) -> list[str]:
    """A layer's passes, the model's corrections and the communication fits, one table each (docs/analysis.md)."""
    costs = timeline.costs
    rows = [(r["stage"], r["layer"], r["layers"], _ms(r["forward_s"]), _ms(r["forward_comm_s"]), _ms(r["backward_s"]),
             _ms(r["backward_comm_s"]), _ms(r["recompute_s"])) for r in timeline.layer_passes()]
    out: list[str] = ["", format_table(
        ("stage", "layer", "layers", "forward ms", "of it comm", "backward ms", "of it comm", "of it full recompute"),
        rows, title="per layer, one micro-batch (the median over a pipeline device's layers of a kind; a backward "
                    "with its recompute):")]
    extrapolated = costs.extrapolated
    if extrapolated:
        plan = timeline.plan
        reasons = {u["id"]: u["reason"] for u in costs.unmeasured}
        rows = [(c.id, c.name, human_bytes(plan.events[c.id].bytes), _ms(c.seconds), c.note, reasons.get(c.id, ""))
                for c in extrapolated]
        out += ["", format_table(("id", "event", "bytes", "predicted ms", "how", "why unmeasured"), rows,
                                 title=f"extrapolated: {len(extrapolated)} events the profile did not measure")]
    interpolated = costs.interpolated
    if interpolated:
        plan = timeline.plan
        rows = [(c.id, c.name, human_bytes(plan.events[c.id].bytes), _ms(c.seconds), c.note) for c in interpolated]
        out += ["", format_table(("id", "event", "bytes", "predicted ms", "how"), rows,
                                 title=f"interpolated: {len(interpolated)} events costed between measured sizes of "
                                       "their kind, placement and group")]
    if costs.isolated or costs.isolated_composites:
        def name(eid: str) -> str:
            return timeline.plan.events[eid].name

        rows = [(eid, name(eid), _ms(alone), _ms(costs.seconds(eid)), costs.seconds(eid) / alone)
                for eid, alone in sorted(costs.isolated.items(), key=lambda kv: name(kv[0]))]
        rows += [(eid, f"{name(eid)} with its ring", _ms(alone), _ms(costs.composites[eid]),
                  costs.composites[eid] / alone)
                 for eid, alone in sorted(costs.isolated_composites.items(), key=lambda kv: name(kv[0]))]
        out += ["", format_table(("id", "event", "alone ms", "in context ms", "ratio"), rows,
                                 title="compute (and ZeRO's reduce-scatters, context-parallel blocks with their "
                                       "ring) timed alone and inside its stages' chains (the costs use the "
                                       "in-context figure; docs/profiling.md, \"In context\"):")]
    out += _device_details(costs)
    if costs.fits:
        rows = [(f.kind, f.placement, f.form, f.points, f.alpha_s * 1e6,
                 f.bandwidth_bytes_s / 1e9 if math.isfinite(f.bandwidth_bytes_s) else "-",
                 100.0 * f.mean_rel_error if f.points else "-", 100.0 * f.max_rel_error if f.points else "-")
                for f in costs.fits.values()]
        out += ["", format_table(("kind", "placement", "form", "points", "alpha us", "link GB/s", "mean err %",
                                  "max err %"), rows, title="communication fits (relative error on measured points):")]
    if costs.held_out:
        rows = [(c.kind, c.placement, c.group, human_bytes(c.nbytes), c.measured_s * 1e3, c.interpolated_s * 1e3,
                 100.0 * c.rel_error) for c in costs.held_out]
        out += ["", format_table(("kind", "placement", "group", "bytes", "measured ms", "from neighbours ms", "err %"),
                                 rows, title="how the curves hold: each measured message costed from the sizes "
                                             "around it, as if it had not been measured:")]
    if costs.sender_busy_extra:
        rows = [(eid, timeline.plan.events[eid].name, _ms(extra))
                for eid, extra in sorted(costs.sender_busy_extra.items())]
        out += ["", format_table(("id", "event", "extra ms"), rows,
                                 title="P2P that waits for its receiver while the sender computes takes longer by:")]
    if costs.send_post:
        rows = [(eid, timeline.plan.events[eid].name, _ms(post)) for eid, post in sorted(costs.send_post.items())]
        out += ["", format_table(("id", "event", "post ms"), rows,
                                 title="a step that sends holds its device to post the send for:")]
    if costs.late_transfer_cpu:
        rows = [(eid, timeline.plan.events[eid].name, _ms(cpu)) for eid, cpu in sorted(costs.late_transfer_cpu.items())]
        out += ["", format_table(("id", "event", "compute ms"), rows,
                                 title="P2P received late takes from the compute of each of its two devices:")]
    if costs.engine_gaps:
        rows = [(kind, _ms(seconds)) for kind, seconds in sorted(costs.engine_gaps.items())]
        out += ["", format_table(("between", "gap ms"), rows,
                                 title="the training engine's host time between steps, which each device waits out:")]
    if costs.host_issue:
        # the layers whose host issues them slower than the device runs them first (launch-bound), most so first
        by_excess = sorted(costs.host_issue.items(), key=lambda kv: (costs.seconds(kv[0]) - kv[1], kv[0]))
        rows = [(eid, timeline.plan.events[eid].name, _ms(costs.seconds(eid)), _ms(host),
                 "host" if host > costs.seconds(eid) else "device") for eid, host in by_excess]
        out += ["", format_table(("id", "event", "device ms", "host issue ms", "bound by"), rows,
                                 title="GPU compute: a step runs as its host issues these layers and its device "
                                       "runs them (device time alone, host issue time; launch-bound first):")]
    if costs.backward_call:
        calls = sorted(costs.backward_call.values())
        out += ["", f"a backward step is one backward() call: every backward but its first sheds the "
                    f"{_ms(calls[len(calls) // 2]):.3f} ms call its sample paid"
                    + (" (off the host's issue time)" if costs.host_issue else "")]
    if costs.bucket_divide or costs.bucket_zero:
        rows = [(eid, timeline.plan.events[eid].name, _ms_or_dash(costs.bucket_divide.get(eid)),
                 _ms_or_dash(costs.bucket_zero.get(eid)))
                for eid in sorted(set(costs.bucket_divide) | set(costs.bucket_zero))]
        out += ["", format_table(("id", "event", "divide ms", "zero ms"), rows,
                                 title="a data-parallel replica averages each gradient bucket (divides it by the "
                                       "replica count) before its all-reduce, and zeroes it after the optimizer "
                                       "step:")]
    for phase, factors in sorted(costs.rank_speed.items()):
        order = sorted(range(len(factors)), key=lambda r: factors[r])
        shown = order if len(order) <= RANK_SPEED_ROWS else order[:RANK_SPEED_ROWS // 2] + order[-RANK_SPEED_ROWS // 2:]
        rows = [(rank, factors[rank]) for rank in shown]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(phase)))
        out += ["", format_table(("profiling rank", "probe / ranks' mean"), rows,
                                 title=f"the profiling ranks' speeds in the compute phase of {when} UTC (speed probe, "
                                       "once per round; above 1: slower than the ranks' mean); each compute event "
                                       "is divided by its rank's factor"
                                       + (f"; the {len(shown)} fastest and slowest of {len(order)} ranks"
                                          if len(shown) < len(order) else ""))]
    skew = replica_skew_summary(timeline)
    if skew is not None:
        rows = [(r["stage"], r["drifting_replicas"], _ms(r["window_s"]), 100.0 * r["sigma"] if r["positions"] else "-",
                 r["positions"], _ms(r["lag_s"])) for r in skew["stages"]]
        out += ["", format_table(("stage", "drifting", "compute span ms", "sigma %", "windows", "lag ms"), rows,
                                 title=f"the slowest of {skew['replicas']} data-parallel replicas lags (drifting: the "
                                       "groups of them that drift apart, cp's ring and ep's all-to-alls holding theirs "
                                       "together; sigma: how the speeds of the profile's ranks "
                                       f"{','.join(map(str, skew['profile_ranks']))} differed over such a span):")]
    return out


def _device_details(costs: Costs) -> list[str]:
    """--details' device-model events: each with its kernels (type, GFLOPs, MB, time, bound), slowest first."""
    device = costs.device_model
    events = sorted(((eid, costing) for eid, costing in costs.device_kernels.items()
                     if costs.events[eid].source == DEVICE), key=lambda item: -item[1].seconds)
    if device is None or not events:
        return []
    rows = []
    for eid, costing in events:
        rows.append((eid, costs.events[eid].name, "", "", "", _ms(costing.seconds), ""))
        rows += [("", "", k["kernel"], k["flops"] / 1e9, k["bytes"] / 1e6, _ms(k["seconds"]), k["bound"])
                 for k in costing.breakdown()]
    return ["", format_table(("id", "event", "kernel", "GFLOP", "MB", "ms", "bound"), rows,
                             title=f"device model ({device.name}, {device.description.title}): {len(events)} compute "
                                   "events from their kernels on the device's roofline and efficiency curves:")]
