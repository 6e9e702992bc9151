"""The timeline model on hand-made profiles whose iteration time is known in closed form."""
from __future__ import annotations

import pytest

from analysis.predict import predict
from tests.test_analysis_helpers import by_name, make_spec, write_handmade_profile

T_F, T_B = 1.25, 2.5  # per block, per micro-batch


def uniform(extra: dict[str, float] | None = None) -> dict[str, float]:
    """Blocks take T_F / T_B; embedding, head, optimizer and communication are free unless `extra` says."""
    return {"gpt2.block.fwd": T_F, "gpt2.block.bwd": T_B, **(extra or {})}


def simulated(tmp_path, spec, durations, **kwargs):
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name(durations))
    return predict(path, **kwargs).timeline


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,micro_batches", [(2, 4), (4, 8), (3, 1), (1, 5)])
def test_uniform_pipeline_time_and_bubble(tmp_path, schedule, pp, micro_batches):
    timeline = simulated(tmp_path, make_spec(pp=pp, micro_batches=micro_batches, schedule=schedule), uniform())
    steps = micro_batches + pp - 1
    assert timeline.batch_time_s == pytest.approx(steps * (T_F + T_B), rel=1e-12)
    assert timeline.bubble_fraction == pytest.approx((pp - 1) / steps, rel=1e-12, abs=1e-15)
    for device in timeline.pipeline:
        assert device.usage.compute_s == pytest.approx(micro_batches * (T_F + T_B))
        assert device.usage.comm_s == 0


@pytest.mark.parametrize("pp,micro_batches,chunks", [(2, 4, 2), (4, 8, 2), (2, 2, 3)])
def test_interleaved_bubble_shrinks_by_the_chunk_count(tmp_path, pp, micro_batches, chunks):
    spec = make_spec(pp=pp, micro_batches=micro_batches, schedule="interleaved-1f1b", chunks=chunks)
    timeline = simulated(tmp_path, spec, uniform())
    per_device = chunks * (T_F + T_B)  # one micro-batch's forward and backward over a device's chunks
    assert timeline.batch_time_s == pytest.approx(micro_batches * per_device + (pp - 1) * per_device / chunks)


def test_p2p_delays_shift_dependent_steps_by_exactly_their_time(tmp_path):
    times = {"gpt2.embedding.fwd": 0.5, "gpt2.block.fwd": 1.0, "gpt2.head.fwd": 0.25,
             "gpt2.head.bwd": 0.75, "gpt2.block.bwd": 2.0, "gpt2.embedding.bwd": 0.125, "p2p": 0.3}
    timeline = simulated(tmp_path, make_spec(pp=2, micro_batches=1), times)
    t_f0, t_f1 = 0.5 + 1.0, 1.0 + 0.25
    t_b1, t_b0 = 0.75 + 2.0, 2.0 + 0.125
    assert timeline.batch_time_s == pytest.approx(t_f0 + 0.3 + t_f1 + t_b1 + 0.3 + t_b0, rel=1e-12)
    first, last = timeline.pipeline
    assert last.steps[0].start_s == pytest.approx(t_f0 + 0.3)
    assert first.steps[1].start_s == pytest.approx(t_f0 + 0.3 + t_f1 + t_b1 + 0.3)
    # The transfers are communication on both devices: exposed, since nothing computes meanwhile.
    assert first.usage.comm_s == pytest.approx(0.6)
    assert last.usage.comm_s == pytest.approx(0.6)


def test_a_send_does_not_block_the_sender_and_a_transfer_starts_when_both_sides_are_ready(tmp_path):
    timeline = simulated(tmp_path, make_spec(pp=2, micro_batches=4, schedule="gpipe"), uniform({"p2p": 0.5}))
    first, last = timeline.pipeline
    forwards = [s for s in first.steps if s.phase == "F"]
    assert [s.start_s for s in forwards] == pytest.approx([i * T_F for i in range(4)])
    # The last stage posts its first receive at once: the data arrives 0.5 after it was sent. It reaches every
    # later forward after the data was sent: that transfer starts then (rendezvous), 0.5 after its last step.
    last_forwards = [s for s in last.steps if s.phase == "F"]
    assert last_forwards[0].start_s == pytest.approx(T_F + 0.5)
    for before, after in zip(last_forwards, last_forwards[1:]):
        assert after.start_s == pytest.approx(before.end_s + 0.5)
    # likewise the first stage's backwards: the critical path is F0, the last stage's 4 forwards and its first
    # backward, the first stage's 4 backwards: 5 (T_F + T_B), and 8 transfers of 0.5
    assert timeline.batch_time_s == pytest.approx(5 * (T_F + T_B) + 8 * 0.5)
    # Activations 0 and 1 travel while the first stage computes, 2 half of it; the rest is exposed.
    assert first.usage.overlapped_comm_s == pytest.approx(0.5 + 0.5 + 0.25)
    assert first.usage.comm_s == pytest.approx(8 * 0.5 - 1.25)


def test_a_step_that_sends_holds_its_device_for_the_sends_post(tmp_path):
    spec = make_spec(pp=2, micro_batches=4, schedule="gpipe")
    plain = predict(write_handmade_profile(tmp_path / "plain.h5", spec, by_name(uniform({"p2p": 0.5})))).timeline
    path = write_handmade_profile(tmp_path / "posted.h5", spec, by_name(uniform({"p2p": 0.5})),
                                  send_post=[0.1, 0.2, 0.6])
    timeline = predict(path).timeline
    assert list(timeline.costs.send_post.values()) == pytest.approx([0.2])  # the median (the mean would be 0.3)
    first, last = timeline.pipeline
    # the first stage's forwards send: each starts 0.2 after the one before ended; its transfer at that end
    forwards = [s for s in first.steps if s.phase == "F"]
    assert [s.start_s for s in forwards] == pytest.approx([i * (T_F + 0.2) for i in range(4)])
    assert last.steps[0].start_s == pytest.approx(T_F + 0.5)  # the receiver waited: the data left at T_F
    # the last stage's forwards send nothing (its backwards follow on the device): each step starts when the one
    # before ended or its input arrived, with no post between
    assert all(b.start_s == pytest.approx(max(a.end_s, b.ready_s)) for a, b in zip(last.steps, last.steps[1:])
               if a.phase == "F")
    assert [(p.virtual_stage, p.micro) for p in first.posts] == [(0, i) for i in range(4)]
    assert all(p.end_s - p.start_s == pytest.approx(0.2) for p in first.posts + last.posts)
    # its backwards send gradients: one post after each, and none after the first stage's (nothing to send)
    last_backwards = [s for s in last.steps if s.phase == "B"]
    assert all(b.start_s == pytest.approx(a.end_s + 0.2) for a, b in zip(last_backwards, last_backwards[1:]))
    first_backwards = [s for s in first.steps if s.phase == "B"]
    assert first.optimizer_start_s == pytest.approx(first_backwards[-1].end_s)
    assert last.optimizer_start_s == pytest.approx(last_backwards[-1].end_s + 0.2)
    # the steps themselves, and so the devices' busy time, are as without posts
    assert [s.end_s - s.start_s for s in first.steps] == pytest.approx(
        [s.end_s - s.start_s for s in plain.pipeline[0].steps])
    # here every post hides behind a transfer that its receiver waits for anyway; with instant transfers the
    # last stage waits for the first stage's forwards, which the posts delay
    assert timeline.batch_time_s == pytest.approx(plain.batch_time_s)
    instant = write_handmade_profile(tmp_path / "instant.h5", spec, by_name(uniform({"p2p": 0.0})),
                                     send_post=[0.2])
    unposted = write_handmade_profile(tmp_path / "unposted.h5", spec, by_name(uniform({"p2p": 0.0})))
    assert predict(instant).timeline.batch_time_s > predict(unposted).timeline.batch_time_s + 0.2


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_engines_gaps_between_steps_wait_on_every_device(tmp_path, capsys, schedule):
    """The engine's gaps (ENGINE_GAPS_ENV, as harness profile measures them): one device, m = 3: its start gap
    before the first step, one gap of its kind between each two steps, one before the optimizer and one after it
    (GPipe: F->F twice, F->B once, B->B twice; 1F1B: F->B three times, B->F twice); a profile without them
    predicts as before. Two devices: each waits out its own gaps, and a step waiting for its input hides them."""
    from harness.store.hdf5_schema import ENGINE_GAPS_ENV

    gaps = {"F->B": 0.01, "B->F": 0.02, "F->F": 0.04, "B->B": 0.08, "B->opt": 0.16, "start": 0.32, "end": 0.64}
    spec = make_spec(pp=1, micro_batches=3, schedule=schedule)
    plain = simulated(tmp_path / "plain", spec, uniform())
    path = write_handmade_profile(tmp_path / "gaps" / "profile.h5", spec, by_name(uniform()),
                                  environment={ENGINE_GAPS_ENV: gaps})
    timeline = predict(path).timeline
    assert timeline.costs.engine_gaps == gaps
    between = 2 * 0.04 + 0.01 + 2 * 0.08 if schedule == "gpipe" else 3 * 0.01 + 2 * 0.02
    assert timeline.batch_time_s == pytest.approx(plain.batch_time_s + 0.32 + between + 0.16 + 0.64, rel=1e-12)
    (device,) = timeline.pipeline
    assert device.steps[0].start_s == pytest.approx(0.32)
    assert device.optimizer_start_s == pytest.approx(device.steps[-1].end_s + 0.16)
    assert device.usage.compute_s == pytest.approx(plain.pipeline[0].usage.compute_s)
    if schedule == "1f1b":  # the report shows them: its JSON and --details
        import json

        from analysis.__main__ import main as analysis_main

        assert analysis_main(["simulate", str(path), "--json", "--resamples", "0"]) == 0
        assert json.loads(capsys.readouterr().out)["engine_gaps_s"] == gaps
        assert analysis_main(["simulate", str(path), "--details", "--resamples", "0"]) == 0
        details = capsys.readouterr().out.splitlines()
        title = details.index("the training engine's host time between steps, which each device waits out:")
        assert details[title + 3].split() == ["B->B", "80.0"] and details[title + 9].split() == ["start", "320.0"]
    two = make_spec(pp=2, micro_batches=4, schedule="gpipe")
    path = write_handmade_profile(tmp_path / "two" / "profile.h5", two, by_name(uniform()),
                                  environment={ENGINE_GAPS_ENV: gaps})
    first, last = predict(path).timeline.pipeline
    forwards = [s for s in first.steps if s.phase == "F"]
    assert [s.start_s for s in forwards] == pytest.approx([0.32 + i * (T_F + 0.04) for i in range(4)])
    # the last stage's forwards wait for their inputs, which come no earlier than its gaps end
    assert [s.start_s for s in last.steps if s.phase == "F"] == pytest.approx([s.end_s for s in forwards])


def test_a_transfer_received_late_takes_its_cpu_from_both_ends(tmp_path):
    """Costs.late_transfer_cpu: a transfer whose receive is posted after its send (GPipe's forwards after the first:
    the last stage reaches its next forward after the first stage sent it) lengthens the receiving step by the
    figure and the sender's post of that send; one received by a waiting receiver (the first forward) neither."""
    from analysis.simulate import simulate

    spec = make_spec(pp=2, micro_batches=4, schedule="gpipe")
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name(uniform({"p2p": 0.5})))
    plain = predict(path).timeline
    costs = plain.costs
    sends = {eid for eid, e in plain.plan.events.items() if e.kind == "p2p"}
    assert sends and not costs.late_transfer_cpu
    costs.late_transfer_cpu.update(dict.fromkeys(sends, 0.125))
    late = simulate(plain.plan, costs)
    first, last = late.pipeline
    forwards = [s for s in last.steps if s.phase == "F"]
    assert [s.end_s - s.start_s for s in forwards] == pytest.approx([T_F, T_F + 0.125, T_F + 0.125, T_F + 0.125])
    def posts(device) -> dict[int, float]:  # the first stage's activation posts by micro-batch
        return {p.micro: p.end_s - p.start_s for p in device.posts if p.virtual_stage == 0}

    before, after = posts(plain.pipeline[0]), posts(first)
    assert [after.get(m, 0.0) - before.get(m, 0.0) for m in range(4)] == pytest.approx([0.0, 0.125, 0.125, 0.125])
    assert late.batch_time_s > plain.batch_time_s


def test_a_transfer_waiting_on_a_computing_sender_pays_the_sender_busy_extra(tmp_path):
    # samples with the sender busy: mean 0.5 + 0.25 -> an extra 0.25 over the P2P's 0.5
    spec = make_spec(pp=2, micro_batches=4, schedule="gpipe")
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name(uniform({"p2p": 0.5})),
                                  sender_busy=[0.5, 0.75, 1.0])
    timeline = predict(path).timeline
    assert list(timeline.costs.sender_busy_extra.values()) == pytest.approx([0.25])
    first, last = timeline.pipeline
    last_forwards = [s for s in last.steps if s.phase == "F"]
    # the first stage computes until 4 T_F = 5.0: receives the last stage posts before then wait 0.75
    gaps = [after.start_s - before.end_s for before, after in zip(last_forwards, last_forwards[1:])]
    posts = [before.end_s for before in last_forwards[:-1]]
    assert gaps == pytest.approx([0.75 if post < 4 * T_F else 0.5 for post in posts])
    assert posts[0] < 4 * T_F <= posts[-1]  # both cases occur
    # the first stage's backwards wait on a last stage that computes its next backward: 0.75 each but the last
    first_backwards = [s for s in first.steps if s.phase == "B"]
    busy = [s for s in last.steps if s.phase == "B"]
    computing = [any(b.start_s <= before.end_s < b.end_s for b in busy) for before in first_backwards[:-1]]
    gaps = [after.start_s - before.end_s for before, after in zip(first_backwards, first_backwards[1:])]
    assert gaps == pytest.approx([0.75 if c else 0.5 for c in computing])
    assert True in computing and False in computing


@pytest.mark.parametrize("pp", [1, 2])
def test_data_parallel_allreduce_after_backward_adds_exactly_its_time(tmp_path, pp):
    spec = make_spec(pp=pp, dp=2, micro_batches=4, dp_overlap=False, bucket_mb=1000)
    free = simulated(tmp_path / "free", spec, uniform({"allreduce": 0.0}))
    paid = simulated(tmp_path / "paid", spec, uniform({"allreduce": 0.7}))
    assert all(len(plan.buckets) == 1 for plan in paid.plan.stages)
    assert paid.batch_time_s - free.batch_time_s == pytest.approx(0.7, rel=1e-12)
    assert free.batch_time_s == pytest.approx((4 + pp - 1) * (T_F + T_B))


def bucket_pass_timelines(tmp_path, **passes):
    """dp=2 with one bucket whose all-reduce takes 0.7 s: the timeline without the bucket's division and
    zeroing, and the one with `passes` (divide=[...] and/or zero=[...] samples) in its profile."""
    spec = make_spec(dp=2, micro_batches=4, dp_overlap=False, bucket_mb=1000)
    times = uniform({"allreduce": 0.7})
    plain = simulated(tmp_path / "plain", spec, times)
    path = write_handmade_profile(tmp_path / "passes" / "profile.h5", spec, by_name(times), **passes)
    return plain, predict(path).timeline


def test_a_gradient_bucket_is_averaged_before_its_all_reduce(tmp_path):
    plain, divided = bucket_pass_timelines(tmp_path, divide=[0.125])
    assert divided.batch_time_s - plain.batch_time_s == pytest.approx(0.125, rel=1e-12)
    bucket = divided.pipeline[0].buckets[0]
    assert bucket.end_s - bucket.start_s == pytest.approx(0.7 + 0.125)


def test_a_gradient_bucket_is_zeroed_at_the_end_of_the_optimizer_phase(tmp_path):
    plain, zeroed = bucket_pass_timelines(tmp_path, zero=[0.25])
    assert zeroed.batch_time_s - plain.batch_time_s == pytest.approx(0.25, rel=1e-12)
    device = zeroed.pipeline[0]
    assert device.optimizer_end_s - device.optimizer_start_s == pytest.approx(
        plain.pipeline[0].optimizer_end_s - plain.pipeline[0].optimizer_start_s + 0.25)
    last = max(zeroed.intervals(0), key=lambda iv: iv.end_s)
    assert last.name == "zero bucket 0 s0" and last.category == "optimizer"
    assert (last.start_s, last.end_s) == (pytest.approx(device.optimizer_end_s - 0.25),
                                          pytest.approx(device.optimizer_end_s))


def test_overlapped_buckets_hide_all_but_the_last(tmp_path):
    layers, allreduce, optimizer, embedding = 3, 0.5, 0.0625, 0.75
    # The embedding's backward outlasts an all-reduce, so only the embedding's own bucket is left at the end.
    # one optimizer step over the device's parameters, as frameworks take it
    times = uniform({"allreduce": allreduce, "optimizer(gpt2.embedding, 3x gpt2.block, gpt2.head)": optimizer,
                     "gpt2.embedding.bwd": embedding})
    base = dict(dp=2, micro_batches=2, layers=layers, bucket_mb=1e-6)  # one bucket per layer
    overlapped = simulated(tmp_path / "ddp", make_spec(**base, dp_overlap=True), times)
    after = simulated(tmp_path / "distsim", make_spec(**base, dp_overlap=False), times)
    compute_end = 2 * (layers * (T_F + T_B) + embedding)
    buckets = len(overlapped.plan.stages[0].buckets)
    assert buckets == layers + 2  # embedding, blocks, head
    assert overlapped.batch_time_s == pytest.approx(compute_end + allreduce + optimizer)
    assert after.batch_time_s == pytest.approx(compute_end + buckets * allreduce + optimizer)
    device = overlapped.pipeline[0]
    assert [b.start_s for b in device.buckets] == sorted(b.start_s for b in device.buckets)
    assert all(b.start_s >= b.ready_s for b in device.buckets)
    assert device.usage.comm_s == pytest.approx(allreduce)
    assert device.usage.overlapped_comm_s == pytest.approx((buckets - 1) * allreduce)
    # --no-overlap on the same profile gives DistSim's model
    path = tmp_path / "ddp" / "profile.h5"
    assert predict(path, dp_overlap=False).timeline.batch_time_s == pytest.approx(after.batch_time_s)


def test_tensor_parallel_allreduces_run_inline(tmp_path):
    timeline = simulated(tmp_path, make_spec(tp=2, micro_batches=3), uniform({"allreduce": 0.2}))
    # two all-reduces forward, two backward per block; the vocabulary-parallel embedding's sum of its shards,
    # the loss's maximum and sums, and the head's input gradient
    per_micro = T_F + T_B + (4 + 4) * 0.2
    assert timeline.batch_time_s == pytest.approx(3 * per_micro)
    usage = timeline.pipeline[0].usage
    assert usage.compute_s == pytest.approx(3 * (T_F + T_B))
    assert usage.comm_s == pytest.approx(3 * 8 * 0.2)
    assert usage.idle_s == pytest.approx(0, abs=1e-12)


def test_strategy_override_changes_the_simulated_job(tmp_path):
    path = write_handmade_profile(tmp_path / "profile.h5", make_spec(pp=2, micro_batches=4), by_name(uniform()))
    prediction = predict(path, strategy="schedule=gpipe,micro=1")
    assert prediction.spec.strategy.schedule == "gpipe"
    assert prediction.timeline.batch_time_s == pytest.approx((4 + 1) * (T_F + T_B))
    gpipe = predict(path, strategy="schedule=gpipe").timeline
    assert gpipe.batch_time_s == pytest.approx(predict(path).timeline.batch_time_s)


def test_composite_replaces_a_tensor_parallel_layer_and_its_all_reduces():
    """A block measured as a composite takes the composite's time: its all-reduces share what the block's
    compute alone does not explain; other layers are untouched."""
    from analysis.costs import Costs
    from analysis.simulate import stage_costs
    from harness.plan.events import build_plan

    spec = make_spec(tp=2, micro_batches=1, layers=2)
    plan = build_plan(spec)
    seconds = {eid: (1e-3 if e.kind == "compute" else 5e-4) for eid, e in plan.events.items()}
    costs = Costs.from_seconds(plan, seconds)
    (block_fwd,) = [eid for eid, e in plan.events.items() if e.name == "gpt2.block.fwd"]
    before = stage_costs(plan, costs)[0].forward_s
    costs.composites[block_fwd] = 4e-3  # compute 1 ms + all-reduces 3 ms, measured together
    after = stage_costs(plan, costs)[0]
    # two blocks: each was 1 + 2 x 0.5 = 2 ms, now 4 ms
    assert after.forward_s == pytest.approx(before + 2 * 2e-3)
    # the vocabulary-parallel embedding's all-reduce and the loss's two, untouched
    assert after.forward_comm_s == pytest.approx(2 * 3e-3 + 3 * 5e-4)


def test_a_gpu_step_runs_as_the_host_issues_its_layers():
    """Device time alone where the host runs ahead; where issuing takes longer (a backward's first layer,
    small layers), the device waits for it; an item never takes less than its device time."""
    from analysis.simulate import _issued

    # host 3 ms ahead of a 1 ms first layer: the device waits for the issue, then the host stays ahead
    assert _issued([1e-3, 4e-3, 4e-3], [3e-3, 1e-3, 1e-3]) == pytest.approx([3e-3, 4e-3, 4e-3])
    # a small last layer issued slower than it runs: covered by the slack the big layers left
    assert _issued([4e-3, 4e-3, 1e-4], [1e-3, 1e-3, 2e-3]) == pytest.approx([4e-3, 4e-3, 1e-4])
    # a host-bound step takes the host's total
    assert sum(_issued([1e-4] * 4, [1e-3] * 4)) == pytest.approx(4e-3)


def one_stage(seconds: float):
    """A 2-block, 1-stage plan with every event costed `seconds`: (plan, its first stage, costs)."""
    from analysis.costs import Costs
    from harness.plan.events import build_plan

    plan = build_plan(make_spec(micro_batches=1, layers=2))
    return plan, plan.stages[0], Costs.from_seconds(plan, {eid: seconds for eid in plan.events})


def test_gpu_profiles_compose_steps_from_device_and_host_times():
    from analysis.simulate import stage_costs

    plan, program, costs = one_stage(1e-3)
    before = stage_costs(plan, costs)[0]
    first, *rest = program.backward
    costs.host_issue.update({first: 2.5e-3, **{eid: 1e-4 for eid in rest}})  # a backward's slow start
    after = stage_costs(plan, costs)[0]
    assert after.forward_s == pytest.approx(before.forward_s)  # no host times: the plain sum
    assert after.backward_s == pytest.approx(before.backward_s + 1.5e-3)
    assert after.backward_offsets[1] == pytest.approx(2.5e-3)  # buckets see the later end of the first layer


def test_after_an_inline_collective_the_host_issues_from_where_the_device_is():
    from analysis.simulate import _issued

    # layer (host ahead by 2 ms), collective, layer: the second layer's issue starts after the collective
    device, host = [1e-3, 2e-3, 1e-3], [3e-3, 0.0, 1.5e-3]
    assert _issued(device, host) == pytest.approx([3e-3, 2e-3, 1e-3])  # host far ahead after the collective
    assert _issued(device, host, [False, True, False]) == pytest.approx([3e-3, 2e-3, 1.5e-3])


def test_a_backward_step_pays_one_backward_call_on_a_cpu():
    """Each profiled backward paid its own backward() call; a step's one call: all but the first shed it."""
    from analysis.simulate import stage_costs

    plan, program, costs = one_stage(1e-3)
    before = stage_costs(plan, costs)[0]
    computes = [eid for eid, layer in zip(program.backward, program.backward_layers) if layer != -1]
    costs.backward_call.update({eid: 2e-4 for eid in computes})
    after = stage_costs(plan, costs)[0]
    assert len(computes) >= 3
    assert after.backward_s == pytest.approx(before.backward_s - (len(computes) - 1) * 2e-4)
    assert after.backward_offsets[1] == pytest.approx(1e-3)  # the first keeps the call it pays
    assert after.forward_s == pytest.approx(before.forward_s)


def test_on_a_gpu_the_backward_call_comes_off_the_hosts_issue_time():
    from analysis.simulate import stage_costs

    plan, program, costs = one_stage(1e-4)  # host-bound: device 0.1 ms
    costs.host_issue.update({eid: 1e-3 for eid in program.backward})
    before = stage_costs(plan, costs)[0]
    costs.backward_call.update({eid: 3e-4 for eid in program.backward})
    after = stage_costs(plan, costs)[0]
    layers = len(program.backward)
    assert before.backward_s == pytest.approx(layers * 1e-3)
    assert after.backward_s == pytest.approx(1e-3 + (layers - 1) * 7e-4)
    # a device-bound step is not shortened by the host's savings
    plan, program, costs = one_stage(2e-3)
    costs.host_issue.update({eid: 1e-3 for eid in program.backward})
    costs.backward_call.update({eid: 3e-4 for eid in program.backward})
    assert stage_costs(plan, costs)[0].backward_s == pytest.approx(layers * 2e-3)


def test_each_device_steps_one_optimizer_then_zeroes_every_chunks_buckets(tmp_path):
    spec = make_spec(dp=2, pp=2, chunks=2, schedule="interleaved-1f1b", micro_batches=4, bucket_mb=1000)
    times = uniform({"allreduce": 0.7, "optimizer(gpt2.embedding, 2x gpt2.block)": 0.5,
                     "optimizer(2x gpt2.block, gpt2.head)": 0.5})
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name(times), zero=[0.25])
    timeline = predict(path).timeline
    for stage in range(2):
        device = timeline.pipeline[stage]
        phase = [iv for iv in timeline.intervals(stage) if iv.category == "optimizer"]
        # one optimizer over the device's parameters (both chunks), then each chunk's bucket zeroed, back to back
        assert [iv.name.split(" ")[0] for iv in phase] == ["opt", "zero", "zero"]
        assert phase[0].virtual_stage == stage and phase[0].end_s - phase[0].start_s == pytest.approx(0.5)
        assert [iv.name for iv in phase[1:]] == [f"zero bucket 0 s{stage}", f"zero bucket 0 s{stage + 2}"]
        for before, after in zip(phase, phase[1:]):
            assert after.start_s == pytest.approx(before.end_s)
        assert all(iv.end_s - iv.start_s == pytest.approx(0.25) for iv in phase[1:])
        assert phase[-1].end_s == pytest.approx(device.optimizer_end_s)
        assert sum(iv.end_s - iv.start_s for iv in phase) == pytest.approx(
            device.optimizer_end_s - device.optimizer_start_s)


@pytest.mark.parametrize("schedule,pp,dp,chunks", [("1f1b", 2, 1, 1), ("zb-h1", 2, 1, 1), ("interleaved-1f1b", 2, 1, 2),
                                                   ("gpipe", 1, 2, 1), ("interleaved-zb", 2, 2, 2)])
def test_the_batch_time_alone_is_the_full_simulations(tmp_path, schedule, pp, dp, chunks):
    """simulate.batch_time (what the intervals' resamples run) skips the usage, never the batch time."""
    from analysis.simulate import batch_time, simulate

    spec = make_spec(pp=pp, dp=dp, micro_batches=4, schedule=schedule, chunks=chunks)
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name(uniform({"p2p": 0.5, "allreduce": 0.3})),
                                  sender_busy=[0.5, 0.75, 1.0], send_post=[0.1])
    timeline = predict(path).timeline
    for overlap in (True, False):
        full = simulate(timeline.plan, timeline.costs, overlap)
        assert batch_time(timeline.plan, timeline.costs, overlap) == full.batch_time_s
    assert full.pipeline[0].usage.compute_s > 0


def test_the_engines_gaps_are_read_off_a_trace_by_transition():
    """harness.train.engine_gaps.transitions on one rank's columns: two iterations, the first a warm-up; in the
    second F0 B0 F1 B1 and the optimizer, each gap the time from one interval's end to the next one's start, the
    iteration's start to its first step and its last interval (a bucket zeroing here) to its end."""
    import numpy as np

    from harness.train.engine_gaps import transitions

    rows = [  # (start, end, kind, phase, iteration)
        (0.0, 1.0, "compute", "F", 0), (1.5, 2.0, "compute", "B", 0),
        (10.1, 11.0, "compute", "F", 1), (11.2, 12.0, "compute", "B", 1), (12.5, 13.0, "compute", "F", 1),
        (13.1, 14.0, "compute", "B", 1), (14.4, 15.0, "optimizer", "opt", 1), (15.0, 15.25, "optimizer", "opt", 1)]
    columns = {name: np.array([row[i] for row in rows]) for i, name in
               enumerate(("start_s", "end_s", "kind", "phase", "iteration"))}
    gaps = transitions(columns, {"start_s": np.array([0.0, 10.0]), "end_s": np.array([3.0, 15.5])}, warmup=1)
    expected = {"start": [0.1], "F->B": [0.2, 0.1], "B->F": [0.5], "B->opt": [0.4], "end": [0.25]}
    assert {kind: [round(v, 9) for v in values] for kind, values in gaps.items() if values} == expected


@pytest.mark.parametrize("recompute,pp,chunks", [("none", 1, 1), ("full", 1, 1), ("full", 2, 2)])
def test_a_layers_passes_are_its_compute_and_collectives_in_one_micro_batch(recompute, pp, chunks):
    """Every compute event 1 ms, every collective 0.5 ms: a tp = 2 block's forward is its compute and its two
    all-reduces (2 ms, 1 of them communicating), its backward the same, with full recompute the forward again
    in it; per pipeline device, the median over its blocks, and every pass agrees with the timeline's own
    intervals of a steady micro-batch."""
    from analysis.costs import Costs
    from analysis.simulate import simulate
    from harness.plan.events import build_plan

    plan = build_plan(make_spec(tp=2, pp=pp, chunks=chunks, layers=4, micro_batches=4, recompute=recompute,
                                schedule="interleaved-1f1b" if chunks > 1 else "1f1b"))
    costs = Costs.from_seconds(plan, {eid: (1e-3 if e.kind == "compute" else 5e-4) for eid, e in plan.events.items()})
    timeline = simulate(plan, costs)
    rows = timeline.layer_passes()
    blocks = [r for r in rows if r["layer"] == "block"]
    assert [(r["stage"], r["layers"]) for r in blocks] == [(stage, 4 // pp) for stage in range(pp)]
    again = 2e-3 if recompute == "full" else 0.0
    for r in blocks:
        assert (r["forward_s"], r["forward_comm_s"]) == pytest.approx((2e-3, 1e-3))
        assert (r["backward_s"], r["backward_comm_s"], r["recompute_s"]) == pytest.approx(
            (2e-3 + again, 1e-3 + again / 2, again))
    assert {r["layer"] for r in rows} == {"embedding", "block", "head"}
    block = next(i for i, layer in enumerate(plan.layers) if layer.kind == "block")
    passes = {"F": 0.0, "B": 0.0}
    for interval in timeline.intervals(0):
        if interval.micro == 1 and interval.layer == block:
            passes["F" if interval.name.startswith("F ") else "B"] += interval.end_s - interval.start_s
    assert (passes["F"], passes["B"]) == pytest.approx((blocks[0]["forward_s"], blocks[0]["backward_s"]))


def test_a_zero_3_layers_passes_count_the_all_gather_it_waits_for():
    """ZeRO-3 gathers a layer's weights right before each of its passes and reduce-scatters its gradients after
    its backward: every compute event 1 ms and every collective 0.5 ms make a block's forward 1.5 ms (0.5 of it
    communicating) and its backward 2 ms (1 of it)."""
    from analysis.costs import Costs
    from analysis.simulate import simulate
    from harness.plan.events import build_plan

    plan = build_plan(make_spec(dp=2, layers=2, micro_batches=4, zero=3))
    costs = Costs.from_seconds(plan, {eid: (1e-3 if e.kind == "compute" else 5e-4) for eid, e in plan.events.items()})
    (block,) = [r for r in simulate(plan, costs).layer_passes() if r["layer"] == "block"]
    assert (block["forward_s"], block["forward_comm_s"]) == pytest.approx((1.5e-3, 5e-4))
    assert (block["backward_s"], block["backward_comm_s"], block["recompute_s"]) == pytest.approx((2e-3, 1e-3, 0.0))
