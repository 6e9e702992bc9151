"""Event costs: the alpha-beta fit, extrapolation and its flags, what a profile lacks, refused files."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from analysis.cli import main
from analysis.costs import INTERPOLATED, MODELLED, UNAVAILABLE, comm_curves, estimate_costs, fit_alpha_beta
from analysis.predict import predict
from analysis.profile_reader import load_profile
from harness.plan.events import build_plan
from harness.store.hdf5_schema import DIVIDE_SERIES, LATE_SERIES, SEND_POST_SERIES, SENDER_BUSY_SERIES, ZERO_SERIES
from harness.store.profile_store import Measurement
from tests.test_analysis_helpers import by_name, comm_point, make_spec, write_handmade_profile

ALPHA, BETA = 5e-6, 1e-10  # 10 GB/s links
SIZES = (2**10, 2**16, 2**20, 2**24)


def allreduce_s(nbytes, group, alpha=ALPHA, beta=BETA):
    return 2 * (group - 1) * alpha + 2 * (group - 1) / group * nbytes * beta


def p2p_s(nbytes, alpha=ALPHA, beta=BETA):
    return alpha + nbytes * beta


def test_fit_recovers_alpha_and_beta():
    points = [(n, g, allreduce_s(n, g)) for n in SIZES for g in (2, 4, 8)]
    fit = fit_alpha_beta("allreduce", "intra", points)
    assert fit.form == "alpha-beta" and fit.points == len(points)
    assert fit.alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(BETA, rel=1e-9)
    assert fit.max_rel_error < 1e-9
    assert fit.predict("allreduce", 2**30, 256) == pytest.approx(allreduce_s(2**30, 256), rel=1e-9)
    p2p = fit_alpha_beta("p2p", "inter", [(n, 2, p2p_s(n)) for n in SIZES])
    assert (p2p.alpha_s, p2p.beta_s_per_byte) == pytest.approx((ALPHA, BETA), rel=1e-9)


def test_fit_reports_its_error_and_keeps_alpha_beta_nonnegative():
    rng = np.random.default_rng(1)
    noisy = [(n, 2, p2p_s(n) * rng.uniform(0.9, 1.1)) for n in SIZES for _ in range(3)]
    fit = fit_alpha_beta("p2p", "intra", noisy)
    assert 0 < fit.mean_rel_error <= fit.max_rel_error < 0.2
    assert fit.alpha_s >= 0 and fit.beta_s_per_byte >= 0
    # time falling with size cannot be fitted with a positive beta: the best one-parameter form
    falling = fit_alpha_beta("p2p", "intra", [(2**10, 2, 2e-3), (2**20, 2, 1e-3)])
    assert falling.alpha_s >= 0 and falling.beta_s_per_byte >= 0 and falling.form != "alpha-beta"


def test_fit_of_one_point_is_bandwidth_only_and_zero_times_give_a_zero_fit():
    fit = fit_alpha_beta("allreduce", "inter", [(2**20, 2, 1e-3)])
    assert fit.form == "bandwidth-only" and fit.alpha_s == 0
    assert fit.predict("allreduce", 2**20, 2) == pytest.approx(1e-3)
    zero = fit_alpha_beta("allreduce", "inter", [(2**20, 2, 0.0)])
    assert zero.form == "zero" and zero.predict("allreduce", 2**30, 64) == 0


def dp_profile(tmp_path, extra):
    """A dp=2 job on one node whose data-parallel all-reduces are left unmeasured."""
    spec = make_spec(dp=2, micro_batches=2)
    return write_handmade_profile(tmp_path / "profile.h5", spec,
                                  by_name({"gpt2.block.fwd": 1.0, "allreduce": None}, default=0.5), extra)


def test_unmeasured_allreduce_is_extrapolated_and_flagged(tmp_path):
    """Measured on groups of 4 only: the group of 2 the job needs comes from the network calibrated by the fit."""
    extra = [comm_point("allreduce", n, "intra", allreduce_s(n, 4), group=4) for n in SIZES]
    prediction = predict(dp_profile(tmp_path, extra))
    plan, costs = prediction.plan, prediction.costs
    (bucket,) = plan.stages[0].buckets
    cost = costs.events[bucket.event]
    assert cost.source == MODELLED and cost.extrapolated and cost.fit == ("allreduce", "intra")
    assert cost.seconds == pytest.approx(allreduce_s(bucket.nbytes, 2), rel=1e-9)
    assert [c.id for c in costs.extrapolated] == [bucket.event]
    assert costs.unmeasured == [{"id": bucket.event, "name": plan.events[bucket.event].name, "kind": "allreduce",
                                 "reason": "left out of this hand-made profile"}]
    # measured events are not extrapolated, even though a fit exists for their kind
    assert all(c.source == "measured" for eid, c in costs.events.items() if eid != bucket.event)


def test_a_size_between_measured_sizes_is_interpolated_not_extrapolated(tmp_path):
    """Times that grow as a power of the size between two sweep points are interpolated exactly; beyond
    the points the fit takes over."""
    prediction = predict(dp_profile(tmp_path, []))
    (bucket,) = prediction.plan.stages[0].buckets
    low, high = bucket.nbytes // 3, bucket.nbytes * 5

    def power_law(n):
        return 1e-4 * (n / low) ** 0.7

    extra = [comm_point("allreduce", n, "intra", power_law(n)) for n in (low, high)]
    costs = predict(dp_profile(tmp_path / "a", extra)).costs
    cost = costs.events[bucket.event]
    assert cost.source == INTERPOLATED and not cost.extrapolated and cost.fit is None
    assert cost.seconds == pytest.approx(power_law(bucket.nbytes), rel=1e-12)
    assert costs.interpolated == [cost] and costs.extrapolated == [] and costs.unmeasured == []
    # both points below the bucket's size: the network model, flagged as extrapolated
    below = [comm_point("allreduce", n, "intra", power_law(n)) for n in (low // 4, low)]
    cost = predict(dp_profile(tmp_path / "b", below)).costs.events[bucket.event]
    assert cost.source == MODELLED and cost.extrapolated


def test_curve_keeps_one_time_per_size_and_knows_its_range():
    points = {("allreduce", "intra"): [(1024, 2, 1e-4), (1024, 2, 4e-4), (4096, 2, 8e-4), (4096, 4, 1.0)]}
    curves = comm_curves(points)
    assert set(curves) == {("allreduce", "intra", 2), ("allreduce", "intra", 4)}
    two = curves[("allreduce", "intra", 2)]
    assert two.seconds[0] == pytest.approx(2e-4)  # the geometric mean of two points at one size
    assert two.covers(2048) and not two.covers(512) and not two.covers(8192)
    assert two.interpolate(2048) == pytest.approx(4e-4)  # halfway on log-log axes: sqrt(2e-4 * 8e-4)
    assert not curves[("allreduce", "intra", 4)].covers(4096)  # one size is not a curve


def test_other_placement_then_other_kind_stand_in_and_say_so(tmp_path):
    inter_only = [comm_point("allreduce", n, "inter", allreduce_s(n, 2, alpha=2e-5)) for n in SIZES]
    costs = predict(dp_profile(tmp_path / "a", inter_only)).costs
    (cost,) = costs.extrapolated
    assert cost.fit == ("allreduce", "inter") and "no allreduce measured intra" in cost.note
    p2p_only = [comm_point("p2p", n, "intra", p2p_s(n)) for n in SIZES]
    prediction = predict(dp_profile(tmp_path / "b", p2p_only))
    (cost,) = prediction.costs.extrapolated
    bucket = prediction.plan.stages[0].buckets[0]
    assert cost.fit == ("p2p", "intra") and "same link alpha and beta" in cost.note
    assert cost.seconds == pytest.approx(allreduce_s(bucket.nbytes, 2), rel=1e-9)


def test_profile_without_communication_costs_it_zero_and_says_so_loudly(tmp_path, capsys):
    path = dp_profile(tmp_path, extra=[])
    costs = predict(path).costs
    (cost,) = costs.extrapolated
    assert cost.source == UNAVAILABLE and cost.seconds == 0
    assert any("NO COMMUNICATION WAS MEASURED" in w for w in costs.warnings)
    assert main(["simulate", str(path)]) == 0
    assert "WARNING: NO COMMUNICATION WAS MEASURED" in capsys.readouterr().out


def test_other_strategy_extrapolates_its_larger_groups(tmp_path):
    extra = [comm_point("allreduce", n, "intra", allreduce_s(n, 2)) for n in SIZES]
    prediction = predict(dp_profile(tmp_path, extra), strategy="dp=4")
    # 4 devices on nodes of 2: the data-parallel group now spans nodes
    assert prediction.spec.strategy.dp == 4 and prediction.spec.cluster.nodes == 2
    bucket = prediction.plan.stages[0].buckets[0]
    cost = prediction.costs.events[bucket.event]
    assert cost.extrapolated and cost.seconds == pytest.approx(allreduce_s(bucket.nbytes, 4), rel=1e-9)
    assert cost.fit == ("allreduce", "intra") and "no allreduce measured inter" in cost.note
    assert "differs" in prediction.costs.unmeasured[0]["reason"]


def test_missing_compute_exits_2_with_the_list_and_the_profile_command(tmp_path, capsys):
    spec = make_spec(pp=2, micro_batches=2)
    path = write_handmade_profile(tmp_path / "profile.h5", spec,
                                  lambda e: None if e.name in ("gpt2.block.bwd", "gpt2.head.fwd") else 0.1)
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "lacks 2 compute event(s)" in err
    assert "gpt2.block.bwd" in err and "gpt2.head.fwd" in err
    assert "mpirun -n 2 python -m mpi4py -m harness profile SPEC -o OUTDIR" in err
    assert "Traceback" not in err
    # a changed strategy needs new compute events (tp=2 shards the blocks): same error
    assert main(["simulate", str(path), "--strategy", "tp=2"]) == 2
    assert "gpt2.block.fwd" in capsys.readouterr().err


def test_missing_compute_is_a_user_error_in_the_api(tmp_path):
    spec = make_spec(micro_batches=2)
    path = write_handmade_profile(tmp_path / "profile.h5", spec, lambda e: None if e.kind == "compute" else 0.0)
    plan = build_plan(spec)
    with pytest.raises(Exception) as info:
        estimate_costs(plan, load_profile(path), spec_hint="job.toml")
    assert info.value.exit_status == 2 and "profile job.toml -o OUTDIR" in str(info.value)


def test_sender_busy_extra_is_the_mean_excess_and_unmeasured_p2p_take_the_largest_at_their_placement(tmp_path):
    spec = make_spec(pp=2, micro_batches=2)  # one node: the stage-to-stage P2P is intra
    points = []
    for nbytes, busy in ((2**10, [0.001, 0.003]), (2**12, [0.004, 0.006])):
        point = comm_point("p2p", nbytes, "intra", 0.001)
        point.series[SENDER_BUSY_SERIES] = np.array(busy)
        points.append(point)
    inter = comm_point("p2p", 2**14, "inter", 0.001)
    inter.series[SENDER_BUSY_SERIES] = np.array([0.101])
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({"p2p": None}, default=0.5),
                                  points + [inter])
    plan = build_plan(spec)
    costs = estimate_costs(plan, load_profile(path))
    p2p = [eid for eid, e in plan.events.items() if e.kind == "p2p"]
    # the largest mean excess measured intra: (0.004 + 0.006) / 2 - 0.001, not the inter one
    assert p2p and all(costs.sender_busy_extra[eid] == pytest.approx(0.004) for eid in p2p)
    # measured with its own samples: mean 0.02 over a P2P of 0.5 s gives no extra
    measured = write_handmade_profile(tmp_path / "measured.h5", spec, by_name({"p2p": 0.5}, default=0.5),
                                      sender_busy=[0.01, 0.03])
    assert estimate_costs(plan, load_profile(measured)).sender_busy_extra == {}


def test_send_post_is_the_mean_and_unmeasured_p2p_take_the_nearest_size_at_their_placement(tmp_path):
    spec = make_spec(pp=2, micro_batches=2)  # one node: the stage-to-stage P2P is intra
    plan = build_plan(spec)
    p2p = [eid for eid, e in plan.events.items() if e.kind == "p2p"]
    measured = write_handmade_profile(tmp_path / "measured.h5", spec, by_name({"p2p": 0.5}, default=0.5),
                                      send_post=[0.001, 0.003])
    assert estimate_costs(plan, load_profile(measured)).send_post == {eid: pytest.approx(0.002) for eid in p2p}
    nbytes = plan.events[p2p[0]].bytes
    points = []
    for size, post in ((nbytes // 8, 0.001), (nbytes * 2, 0.004), (nbytes * 64, 0.05)):
        point = comm_point("p2p", size, "intra", 0.001)
        point.series[SEND_POST_SERIES] = np.array([post])
        points.append(point)
    inter = comm_point("p2p", nbytes, "inter", 0.001)
    inter.series[SEND_POST_SERIES] = np.array([0.5])
    swept = write_handmade_profile(tmp_path / "swept.h5", spec, by_name({"p2p": None}, default=0.5),
                                   points + [inter])
    # twice its size is nearer than an eighth of it; the inter point, of its very size, is at another placement
    assert estimate_costs(plan, load_profile(swept)).send_post == {eid: pytest.approx(0.004) for eid in p2p}
    # a profile from before the post was measured
    older = write_handmade_profile(tmp_path / "older.h5", spec, by_name({"p2p": 0.5}, default=0.5))
    assert estimate_costs(plan, load_profile(older)).send_post == {}


def test_a_late_transfers_compute_is_its_rounds_median_and_unmeasured_p2p_take_the_nearest_size(tmp_path):
    """late_cpu_samples_s (a CPU profile's stream of late receives): the median of a P2P's rounds, not below 0 (a
    run-queue wait a plain step drew more of); an unmeasured P2P takes the nearest size's at its placement; none
    from a profile without the rounds (a GPU's, an older one)."""
    spec = make_spec(pp=2, micro_batches=2)  # one node: the stage-to-stage P2P is intra
    plan = build_plan(spec)
    p2p = [eid for eid, e in plan.events.items() if e.kind == "p2p"]
    nbytes = plan.events[p2p[0]].bytes
    points = []
    for size, rounds in ((nbytes // 8, [1e-4, 2e-4, 9e-4]), (nbytes * 2, [3e-4, 2e-4, 2.5e-4]),
                         (nbytes * 64, [-1e-4, -2e-4, 5e-4])):
        point = comm_point("p2p", size, "intra", 0.001)
        point.series[LATE_SERIES] = np.array(rounds)
        points.append(point)
    swept = write_handmade_profile(tmp_path / "swept.h5", spec, by_name({"p2p": None}, default=0.5), points)
    # twice its size is nearer than an eighth of it: that point's median
    assert estimate_costs(plan, load_profile(swept)).late_transfer_cpu == {eid: pytest.approx(2.5e-4) for eid in p2p}
    widest = write_handmade_profile(tmp_path / "widest.h5", spec, by_name({"p2p": None}, default=0.5), points[2:])
    assert estimate_costs(plan, load_profile(widest)).late_transfer_cpu == dict.fromkeys(p2p, 0.0)
    older = write_handmade_profile(tmp_path / "older.h5", spec, by_name({"p2p": 0.5}, default=0.5))
    assert estimate_costs(plan, load_profile(older)).late_transfer_cpu == {}


def test_gpu_host_issue_times_are_read_with_the_compute_statistic(tmp_path):
    spec = make_spec(micro_batches=2)
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({}, default=1e-3),
                                  host_issue={"gpt2.block.bwd": [2e-3, 4e-3, 9e-3], "gpt2.block.fwd": [1e-4]})
    plan = build_plan(spec)
    for stat, bwd in (("mean", 5e-3), ("median", 4e-3)):
        costs = estimate_costs(plan, load_profile(path), compute_stat=stat)
        names = {plan.events[eid].name: host for eid, host in costs.host_issue.items()}
        assert names == {"gpt2.block.bwd": pytest.approx(bwd), "gpt2.block.fwd": pytest.approx(1e-4)}
    assert all(costs.seconds(eid) == pytest.approx(1e-3) for eid in costs.host_issue)  # device time unchanged
    cpu = write_handmade_profile(tmp_path / "cpu.h5", spec, by_name({}, default=1e-3))
    assert estimate_costs(plan, load_profile(cpu)).host_issue == {}


def test_a_backward_call_is_read_for_backwards_only_and_old_profiles_have_none(tmp_path):
    spec = make_spec(micro_batches=2)
    plan = build_plan(spec)
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({}, default=1e-3), backward_call_s=2e-4)
    costs = estimate_costs(plan, load_profile(path))
    backwards = {eid for eid, e in plan.events.items() if e.kind == "compute" and e.content["phase"] == "bwd"}
    assert backwards and costs.backward_call == {eid: pytest.approx(2e-4) for eid in backwards}
    old = write_handmade_profile(tmp_path / "old.h5", spec, by_name({}, default=1e-3))
    assert estimate_costs(plan, load_profile(old)).backward_call == {}


def test_a_gradient_bucket_is_divided_and_zeroed_and_old_profiles_have_neither(tmp_path):
    spec = make_spec(dp=2, micro_batches=2, bucket_mb=1000)
    plan = build_plan(spec)
    bucket = plan.stages[0].buckets[0].event
    path = write_handmade_profile(tmp_path / "profile.h5", spec, by_name({}, default=1e-3),
                                  divide=[1e-4, 1e-4, 4e-4], zero=[3e-4, 3e-4, 6e-4])
    mean, median = estimate_costs(plan, load_profile(path)), estimate_costs(plan, load_profile(path),
                                                                            compute_stat="median")
    assert mean.bucket_divide == {bucket: pytest.approx(2e-4)} and mean.bucket_zero == {bucket: pytest.approx(4e-4)}
    assert median.bucket_divide == {bucket: pytest.approx(1e-4)}
    assert median.bucket_zero == {bucket: pytest.approx(3e-4)}
    # a bucket the profile did not measure takes the rate of the largest all-reduce that was
    points = [comm_point("allreduce", nbytes, "intra", 1e-3) for nbytes in (1000, 4000)]
    for point, seconds in zip(points, (5e-6, 8e-6)):
        point.series[DIVIDE_SERIES] = np.full(3, seconds)
        point.series[ZERO_SERIES] = np.full(3, seconds / 2)
    unmeasured = estimate_costs(plan, load_profile(write_handmade_profile(
        tmp_path / "unmeasured.h5", spec, by_name({"allreduce": None}, default=1e-3), extra=points)))
    assert unmeasured.bucket_divide == {bucket: pytest.approx(8e-6 / 4000 * plan.events[bucket].bytes)}
    assert unmeasured.bucket_zero == {bucket: pytest.approx(4e-6 / 4000 * plan.events[bucket].bytes)}
    old = estimate_costs(plan, load_profile(write_handmade_profile(tmp_path / "old.h5", spec,
                                                                   by_name({}, default=1e-3))))
    assert old.bucket_divide == {} and old.bucket_zero == {}
    assert sum("gradient bucket's" in w for w in old.warnings) == 2  # the division and the zeroing left out
    assert not any("gradient bucket's" in w for w in mean.warnings + unmeasured.warnings)
    no_dp = make_spec(micro_batches=2)
    no_dp_costs = estimate_costs(build_plan(no_dp), load_profile(write_handmade_profile(
        tmp_path / "no_dp.h5", no_dp, by_name({}, default=1e-3), divide=[1e-4], zero=[1e-4])))
    assert no_dp_costs.bucket_divide == {} and no_dp_costs.bucket_zero == {}


def test_compute_takes_the_mean_of_its_samples_or_the_median_and_communication_keeps_its_rule(tmp_path):
    spec = make_spec(dp=2, micro_batches=2)
    plan = build_plan(spec)
    block = next(e for e in plan.events.values() if e.name == "gpt2.block.fwd")
    skewed = Measurement(block.id, "compute", block.content, np.array([1e-3, 1e-3, 1e-3, 5e-3]), [0], "test")
    path = write_handmade_profile(tmp_path / "profile.h5", spec,
                                  lambda e: None if e.id == block.id else (2e-3 if e.kind == "allreduce" else 1e-3),
                                  extra=[skewed])
    profile = load_profile(path)
    mean = estimate_costs(plan, profile)
    median = estimate_costs(plan, profile, compute_stat="median")
    assert mean.compute_stat == "mean" and median.compute_stat == "median"
    assert mean.seconds(block.id) == pytest.approx(2e-3)
    assert median.seconds(block.id) == pytest.approx(1e-3)
    for eid in plan.events:
        if eid != block.id:
            assert mean.seconds(eid) == median.seconds(eid)
    with pytest.raises(ValueError, match="unknown compute statistic"):
        estimate_costs(plan, profile, compute_stat="mode")


def test_compute_events_stand_for_the_profiling_ranks_mean_speed(tmp_path, capsys):
    spec = make_spec(pp=2, micro_batches=2, layers=2)
    plan = build_plan(spec)
    # rank 1 measured the blocks' forward; its probe took 1.5 ms against rank 0's 1.0 ms (mean 1.25 ms)
    path = write_handmade_profile(tmp_path / "p.h5", spec, by_name({"p2p": 2e-4}, default=1e-3),
                                  measuring_rank={"gpt2.block.fwd": 1}, speed_probe=[1.0e-3, 1.5e-3],
                                  backward_call_s=1e-4)
    profile = load_profile(path)
    costs = estimate_costs(plan, profile)
    (factors,) = costs.rank_speed.values()
    assert factors == pytest.approx([0.8, 1.2])
    # a backward's call was part of every sample, taken at the same speed
    assert all(call == pytest.approx(1e-4 / 0.8) for call in costs.backward_call.values())
    for eid, event in plan.events.items():
        if event.kind == "compute":
            expected = 1e-3 / (1.2 if event.name == "gpt2.block.fwd" else 0.8)
            assert costs.seconds(eid) == pytest.approx(expected), event.name
        else:
            assert costs.seconds(eid) == pytest.approx(2e-4)  # communication is not a rank's compute speed
    raw = estimate_costs(plan, profile, rank_speed=False)
    assert raw.rank_speed == {}
    assert all(raw.seconds(eid) == pytest.approx(1e-3) for eid, e in plan.events.items() if e.kind == "compute")
    assert main(["simulate", str(path), "--details"]) == 0
    assert "probe / ranks' mean" in capsys.readouterr().out
    assert main(["simulate", str(path), "--json", "--no-rank-speed"]) == 0
    assert '"rank_speed": {}' in capsys.readouterr().out


@pytest.mark.parametrize("probe", [None, [1.0e-3], [1.0e-3, float("nan")], [1.0e-3, None]])
def test_without_two_usable_probes_the_samples_stay_as_taken(tmp_path, probe):
    """None: a profile from before the probe; one rank; a rank whose probe is unusable or that had no share."""
    spec = make_spec(pp=2, micro_batches=2, layers=2)
    plan = build_plan(spec)
    path = write_handmade_profile(tmp_path / "p.h5", spec, by_name({}, default=1e-3),
                                  measuring_rank={"gpt2.block.fwd": 1}, speed_probe=probe)
    costs = estimate_costs(plan, load_profile(path))
    assert costs.rank_speed == {}
    assert all(costs.seconds(eid) == pytest.approx(1e-3) for eid, e in plan.events.items() if e.kind == "compute")


def test_a_rank_without_a_share_is_left_out_of_the_mean(tmp_path):
    spec = make_spec(pp=2, micro_batches=2, layers=2)
    plan = build_plan(spec)
    # rank 2 had no compute share (no probe); ranks 0 and 1 make the mean
    path = write_handmade_profile(tmp_path / "p.h5", spec, by_name({}, default=1e-3), world_size=3,
                                  measuring_rank={"gpt2.block.fwd": 1}, speed_probe=[1.0e-3, 1.5e-3, None])
    costs = estimate_costs(plan, load_profile(path))
    (factors,) = costs.rank_speed.values()
    assert factors == pytest.approx([0.8, 1.2, 1.0])


def test_events_of_a_run_without_a_probe_stay_as_taken_and_say_so(tmp_path):
    spec = make_spec(pp=2, micro_batches=2, layers=2)
    plan = build_plan(spec)
    path = write_handmade_profile(tmp_path / "p.h5", spec, by_name({}, default=1e-3),
                                  measuring_rank={"gpt2.block.fwd": 1}, speed_probe=[1.0e-3, 1.5e-3])
    with h5py.File(path, "r+") as f:  # the block's forward came from an earlier run that left no probe
        block_fwd = next(eid for eid, e in plan.events.items() if e.name == "gpt2.block.fwd")
        f["measurements"][block_fwd].attrs["compute_phase"] = 1.6e9
    costs = estimate_costs(plan, load_profile(path))
    assert costs.seconds(block_fwd) == pytest.approx(1e-3)
    assert any("gpt2.block.fwd" in w and "--force" in w for w in costs.warnings)
    others = [eid for eid, e in plan.events.items() if e.kind == "compute" and eid != block_fwd]
    assert all(costs.seconds(eid) == pytest.approx(1e-3 / 0.8) for eid in others)


def test_a_tensor_parallel_shard_with_its_composite_is_left_as_taken(tmp_path):
    from harness.plan.events import composite_content, event_id

    spec = make_spec(tp=2, micro_batches=2, layers=1)
    plan = build_plan(spec)
    shard = next(e for e in plan.events.values() if e.kind == "compute" and e.name == "gpt2.block.fwd")
    composite = Measurement(event_id(composite_content(shard.content)), "composite", composite_content(shard.content),
                            np.full(3, 3e-3), [0, 1], "test", {"group_size": 2})
    path = write_handmade_profile(tmp_path / "p.h5", spec, by_name({}, default=1e-3), extra=[composite],
                                  measuring_rank={"gpt2.block.fwd": 1}, speed_probe=[1.0e-3, 1.5e-3])
    costs = estimate_costs(plan, load_profile(path))
    # the composite splits into the shard and its all-reduces: correcting the shard alone would move its
    # rank's slowness into the all-reduces
    assert costs.seconds(shard.id) == pytest.approx(1e-3)
    assert costs.composites[shard.id] == pytest.approx(3e-3)
    head = next(eid for eid, e in plan.events.items() if e.name == "gpt2.head.fwd")
    assert costs.seconds(head) == pytest.approx(1e-3 / 0.8)  # rank 0's other events are corrected
