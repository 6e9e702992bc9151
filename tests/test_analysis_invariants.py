"""Invariants of the timeline model under random small jobs and random event durations (hypothesis)."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.costs import Costs
from analysis.simulate import COMM_TRACK, COMPUTE_TRACK, DP_ALLREDUCE, OPTIMIZER, simulate
from harness.plan.events import build_plan
from tests.test_analysis_helpers import make_spec

EPS = 1e-9


@st.composite
def jobs(draw):
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    pp = draw(st.integers(1, 4))
    chunks = draw(st.integers(2, 3)) if schedule == "interleaved-1f1b" else 1
    micro_batches = draw(st.integers(1, 3)) * pp if schedule == "interleaved-1f1b" else draw(st.integers(1, 6))
    dp, tp = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    zero = draw(st.integers(0, 3)) if dp > 1 and tp == 1 else 0
    spec = make_spec(pp=pp, dp=dp, tp=tp, micro_batches=micro_batches, schedule=schedule, chunks=chunks,
                     layers=pp * chunks * draw(st.integers(1, 2)), dp_overlap=draw(st.booleans()),
                     bucket_mb=draw(st.sampled_from([1e-6, 0.01, 25.0])),
                     nodes=2 if (dp * tp * pp) % 2 == 0 and draw(st.booleans()) else 1,
                     recompute=draw(st.sampled_from(["none", "full"])), zero=zero)
    plan = build_plan(spec)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    free_comm = draw(st.booleans())
    seconds = {eid: 0.0 if free_comm and e.kind != "compute" else float(rng.uniform(0.0, 1.0))
               for eid, e in plan.events.items()}
    costs = Costs.from_seconds(plan, seconds)
    if draw(st.booleans()):  # P2P transfers that wait on a computing sender take longer (several passes)
        costs.sender_busy_extra.update({eid: float(rng.uniform(0.0, 1.0)) for eid, e in plan.events.items()
                                        if e.kind == "p2p"})
    if draw(st.booleans()):  # a step that sends holds its device to post the send
        costs.send_post.update({eid: float(rng.uniform(0.0, 0.5)) for eid, e in plan.events.items()
                                if e.kind == "p2p"})
    return plan, costs


def covered(intervals, start, end):
    """Length of [start, end] covered by the union of intervals."""
    total, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_timeline_invariants(job):
    plan, costs = job
    timeline = simulate(plan, costs)
    s, m = plan.spec.strategy, plan.spec.micro_batches
    T = timeline.batch_time_s
    forward_end, backward_end, forward_start, backward_start = {}, {}, {}, {}
    for device in timeline.pipeline:
        details = timeline.intervals(device.stage)
        compute = sorted((iv.start_s, iv.end_s) for iv in details if iv.track == COMPUTE_TRACK)
        # no device runs two compute events at once
        for (_, end), (start, _) in zip(compute, compute[1:]):
            assert start >= end - EPS
        assert all(0 <= a <= b <= T + EPS for a, b in compute)
        for r in device.steps:
            table_start, table_end = (forward_start, forward_end) if r.phase == "F" else (backward_start, backward_end)
            table_start[r.virtual_stage, r.micro] = r.start_s
            table_end[r.virtual_stage, r.micro] = r.end_s
        # every step is there once, and each chunk's micro-batches run in order
        assert len(device.steps) == 2 * m * s.chunks
        # buckets: after their gradients are ready, one at a time; the optimizer after all of it
        buckets = sorted(device.buckets, key=lambda b: b.start_s)
        for b in buckets:
            assert b.start_s >= b.ready_s - EPS
        for earlier, later in zip(buckets, buckets[1:]):
            assert later.start_s >= earlier.end_s - EPS
        last_step = max(r.end_s for r in device.steps)
        if not timeline.dp_overlap:
            assert all(b.start_s >= last_step - EPS for b in buckets)
        optimizer = [iv for iv in details if iv.category == OPTIMIZER]
        assert all(iv.start_s >= max([last_step] + [b.end_s for b in buckets]) - EPS for iv in optimizer)
        assert len([iv for iv in details if iv.category == DP_ALLREDUCE]) == (
            sum(len(plan.stages[c * s.pp + device.stage].buckets) for c in range(s.chunks)))
        # a step that sends holds its device for the send's post: the next step, or the optimizer, starts after it
        for post in device.posts:
            assert abs(post.end_s - post.start_s - costs.send_post[post.event]) <= EPS
            later = [r.start_s for r in device.steps if r.start_s >= post.start_s - EPS]
            assert all(start >= post.end_s - EPS for start in later)
            assert device.optimizer_start_s >= post.end_s - EPS
        # compute + exposed comm + idle = batch time, and each part matches the intervals
        u = device.usage
        assert abs(u.compute_s + u.comm_s + u.idle_s - T) <= EPS * max(1.0, T)
        compute_busy = [(iv.start_s, iv.end_s) for iv in details
                        if iv.track == COMPUTE_TRACK and plan.events[iv.event_id].kind == "compute"]
        comm = [(iv.start_s, iv.end_s) for iv in details
                if iv.track == COMM_TRACK or iv.category in ("tp-allreduce", "p2p-post", "zero-allgather",
                                                             "zero-reducescatter")]
        busy = covered(compute_busy + comm, 0.0, T)
        assert abs(u.compute_s - covered(compute_busy, 0.0, T)) <= 1e-7
        assert abs(u.idle_s - (T - busy)) <= 1e-7
        assert u.idle_s >= -1e-7 and u.comm_s >= -1e-7 and u.overlapped_comm_s >= -1e-7
    V = s.virtual_stages
    for vs in range(V):
        program = plan.stages[vs]
        for i in range(m):
            if vs > 0:  # forward after the previous stage's forward plus the P2P
                p2p = costs.seconds(plan.stages[vs - 1].send_forward)
                assert forward_start[vs, i] >= forward_end[vs - 1, i] + p2p - EPS
            if vs < V - 1:  # backward after the next stage's backward plus the P2P
                p2p = costs.seconds(plan.stages[vs + 1].send_backward)
                assert backward_start[vs, i] >= backward_end[vs + 1, i] + p2p - EPS
            assert backward_start[vs, i] >= forward_end[vs, i] - EPS
            forward_items = program.forward_of(i)[0]  # zero 1 and 2 gather the weights in the first one
            assert abs(forward_end[vs, i] - forward_start[vs, i] - sum(costs.seconds(e) for e in forward_items)) < 1e-9
            backward_items = program.backward_of(i, m)[0]
            assert abs(backward_end[vs, i] - backward_start[vs, i] - sum(costs.seconds(e) for e in backward_items)) \
                < 1e-9
    # a transfer leaves after its step, takes its P2P time (plus at most the sender-busy extra), and the
    # step that needs it starts after it arrives
    for device in timeline.pipeline:
        for t in device.sends:
            table_end, table_start = (forward_end, forward_start) if t.direction == "activation" else (
                backward_end, backward_start)
            assert t.start_s >= table_end[t.src_stage, t.micro] - EPS
            assert table_start[t.dst_stage, t.micro] >= t.end_s - EPS
            duration = t.end_s - t.start_s
            p2p, extra = costs.seconds(t.event), costs.sender_busy_extra.get(t.event, 0.0)
            assert abs(duration - p2p) <= EPS or abs(duration - p2p - extra) <= EPS
    # the iteration ends when the last device does
    assert abs(T - max(d.end_s for d in timeline.pipeline)) <= EPS
    assert 0 <= timeline.bubble_fraction < 1 or T == 0
