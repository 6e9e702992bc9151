"""Replica skew (analysis.skew): the ranks' speeds over time in a profile, and the wait for the slowest
data-parallel replica that the timeline adds."""
from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.costs import Costs
from analysis.predict import predict
from analysis.profile_reader import load_profile
from analysis.simulate import drifting_replicas, simulate
from analysis.skew import RankSpeedSeries, ReplicaSkew, expected_max_of_normals, replica_skew
from harness.plan.events import build_plan
from harness.plan.spec import parse_spec
from harness.store.hdf5_schema import SAMPLE_END_SERIES
from harness.store.profile_store import Measurement
from tests.test_analysis_helpers import by_name, make_spec, write_handmade_profile

STEP = 0.01  # seconds between sample ends, and every event's median


def series(rank: int, speeds) -> RankSpeedSeries:
    """A rank whose n-th sample ended at n * STEP and took speeds[n] times its event's median STEP."""
    speeds = np.asarray(speeds, dtype=float)
    return RankSpeedSeries(rank, STEP * np.arange(1, speeds.size + 1), STEP * speeds, np.full(speeds.size, STEP))


def test_expected_maximum_of_standard_normals():
    assert expected_max_of_normals(1) == 0.0
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_of_normals(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_of_normals(4) == pytest.approx(1.029375, rel=1e-5)
    assert expected_max_of_normals(8) == pytest.approx(1.423600, rel=1e-5)


def test_spread_is_what_the_ranks_do_not_share():
    rng = np.random.default_rng(7)
    shared = 1.0 + 0.5 * np.sin(np.arange(1000) / 40.0)  # the whole machine slows and speeds up
    # rank 1 runs 0.2 slower than rank 0 throughout: the difference is sqrt(2) sigma at every position
    skew = ReplicaSkew([series(0, shared), series(1, shared + 0.2)])
    for window in (0.1, 1.0, 5.0):
        sigma, positions = skew.spread(window)
        assert sigma == pytest.approx(0.2 / math.sqrt(2), rel=1e-9)
        assert positions > 1
    assert skew.lag_fraction(2, 1.0) == pytest.approx(expected_max_of_normals(2) * 0.2 / math.sqrt(2), rel=1e-9)
    # both ranks alike, however noisy the machine: no skew
    assert ReplicaSkew([series(0, shared), series(1, shared)]).spread(1.0)[0] == 0.0
    # independent white noise averages out over longer windows (sigma / sqrt(samples in the window))
    noisy = ReplicaSkew([series(r, 1.0 + 0.3 * rng.standard_normal(20000)) for r in range(4)])
    for window, samples in ((0.1, 10), (1.0, 100)):
        assert noisy.spread(window)[0] == pytest.approx(0.3 / math.sqrt(samples), rel=0.15)


def test_windows_longer_than_the_phase_take_the_whole_phase_and_sparse_ranks_do_not_count():
    skew = ReplicaSkew([series(0, np.ones(100)), series(1, np.full(100, 1.5))])
    assert skew.span_s == pytest.approx(0.99)
    sigma, positions = skew.spread(60.0)
    assert positions == 1 and sigma == pytest.approx(0.5 / math.sqrt(2))
    # a rank whose samples cover under a quarter of a window is left out at that position
    sparse = RankSpeedSeries(2, np.array([0.5]), np.array([9 * STEP]), np.array([STEP]))
    assert ReplicaSkew([series(0, np.ones(100)), sparse]).spread(0.5) == (0.0, 0)


def skewed_profile(tmp_path, spec, seconds: float, speeds: dict[int, np.ndarray], phase: float = 1.0):
    """A profile of `spec` whose compute events are measured round-robin by the ranks of `speeds`, each
    sample taking `seconds` times that rank's speed at that round; communication is free."""
    plan = build_plan(spec)
    compute = [e for e in plan.events.values() if e.kind == "compute"]
    by_rank = {rank: compute[i::len(speeds)] for i, rank in enumerate(speeds)}
    extra = []
    for rank, events in by_rank.items():
        rounds = speeds[rank].size
        ends = np.cumsum(np.repeat(seconds * speeds[rank], len(events))).reshape(rounds, len(events))
        for k, event in enumerate(events):
            extra.append(Measurement(event.id, "compute", event.content, seconds * speeds[rank], [rank], "test",
                                     {"compute_phase": phase}, {SAMPLE_END_SERIES: ends[:, k]}))
    path = write_handmade_profile(tmp_path / "profile.h5", spec,
                                  lambda e: None if e.kind == "compute" else 0.0, extra=extra)
    return path


def test_a_profile_gives_each_rank_its_speed_series(tmp_path):
    spec = make_spec(dp=2, layers=4)
    t = np.arange(200)
    speeds = {0: 1.0 + 0.2 * (t % 20 < 10), 1: 1.0 + 0.2 * (t % 20 >= 10)}
    skew = replica_skew(load_profile(skewed_profile(tmp_path, spec, 1e-3, speeds)))
    assert skew is not None and skew.ranks == [0, 1]
    compute_events = sum(e.kind == "compute" for e in build_plan(spec).events.values())
    assert sum(s.sample_s.size for s in skew.series) == 200 * compute_events
    for s in skew.series:
        assert np.all(np.diff(s.end_s) >= 0)
    # over a few rounds the ranks run 0.2 apart half the time: sigma well above 0, below 0.2 / sqrt(2)
    sigma, _ = skew.spread(0.02)
    assert 0.02 < sigma < 0.2 / math.sqrt(2)


def test_a_profile_without_sample_times_or_with_one_rank_has_no_skew(tmp_path):
    spec = make_spec(dp=2, layers=4)
    plain = write_handmade_profile(tmp_path / "plain" / "profile.h5", spec, by_name({"compute": 1e-3}))
    assert replica_skew(load_profile(plain)) is None
    one = skewed_profile(tmp_path, spec, 1e-3, {0: np.linspace(1.0, 2.0, 50)})
    assert replica_skew(load_profile(one)) is None
    prediction = predict(one)
    assert prediction.timeline.pipeline[0].replica_lag_s == 0.0
    assert any("no wait for the slowest data-parallel replica" in w for w in prediction.costs.warnings)
    assert not any("slowest data-parallel" in w for w in predict(plain, strategy="dp=1").costs.warnings)


def test_ranks_that_never_measured_at_the_same_time_give_no_skew(tmp_path):
    spec = make_spec(dp=2, layers=4)
    compute = [e for e in build_plan(spec).events.values() if e.kind == "compute"]
    extra = []
    for i, event in enumerate(compute):  # rank 1 starts after rank 0 is done (a few repeats each)
        ends = (np.arange(1, 6) + 100.0 * (i % 2)) * 1e-3
        extra.append(Measurement(event.id, "compute", event.content, np.full(5, 1e-3), [i % 2], "test",
                                 {"compute_phase": 1.0}, {SAMPLE_END_SERIES: ends}))
    path = write_handmade_profile(tmp_path / "profile.h5", spec, lambda e: None if e.kind == "compute" else 0.0,
                                  extra=extra)
    assert replica_skew(load_profile(path)) is None


def test_two_profiling_runs_are_not_compared_with_each_other(tmp_path):
    spec = make_spec(dp=2, layers=4)
    plan = build_plan(spec)
    compute = [e for e in plan.events.values() if e.kind == "compute"]
    extra = []
    for i, event in enumerate(compute):  # rank 0 from one run, rank 1 from another (a resumed profile)
        extra.append(Measurement(event.id, "compute", event.content, np.full(10, 1e-3), [i % 2], "test",
                                 {"compute_phase": float(i % 2)}, {SAMPLE_END_SERIES: np.arange(1, 11) * 1e-3}))
    path = write_handmade_profile(tmp_path / "profile.h5", spec, lambda e: None if e.kind == "compute" else 0.0,
                                  extra=extra)
    assert replica_skew(load_profile(path)) is None


@pytest.mark.parametrize("overlap", [False, True])
def test_the_gradient_allreduce_waits_for_the_slowest_replica(overlap):
    spec = make_spec(dp=2, micro_batches=4, layers=2, dp_overlap=overlap, bucket_mb=1000)
    plan = build_plan(spec)
    seconds = {eid: {"compute": 1e-3, "allreduce": 5e-4}.get(e.kind, 0.0) for eid, e in plan.events.items()}
    costs = Costs.from_seconds(plan, seconds)
    alike = simulate(plan, costs)
    costs.replica_skew = ReplicaSkew([series(0, np.ones(5000)), series(1, np.full(5000, 1.2))])
    skewed = simulate(plan, costs)
    device = skewed.pipeline[0]
    compute_end = max(r.end_s for r in device.steps)
    fraction = expected_max_of_normals(2) * 0.2 / math.sqrt(2)
    assert device.replica_lag_s == pytest.approx(fraction * compute_end)  # no bubbles: all of it compute
    # one bucket, ready when the backward ends: the iteration is longer by exactly the lag
    assert skewed.batch_time_s - alike.batch_time_s == pytest.approx(fraction * compute_end)
    assert skewed.pipeline[0].usage.compute_s == pytest.approx(alike.pipeline[0].usage.compute_s)
    assert skewed.pipeline[0].usage.idle_s - alike.pipeline[0].usage.idle_s == pytest.approx(fraction * compute_end)


def test_the_lag_counts_compute_not_bubbles():
    spec = make_spec(dp=2, pp=2, micro_batches=4, dp_overlap=False, bucket_mb=1000)
    plan = build_plan(spec)
    # the head makes the last stage three times as slow: the first waits in between
    seconds = {eid: (3e-3 if e.name.startswith("gpt2.head") else 1e-3) if e.kind == "compute" else 0.0
               for eid, e in plan.events.items()}
    costs = Costs.from_seconds(plan, seconds)
    costs.replica_skew = ReplicaSkew([series(0, np.ones(5000)), series(1, np.full(5000, 1.2))])
    timeline = simulate(plan, costs)
    device = timeline.pipeline[0]
    busy = sum(r.end_s - r.start_s for r in device.steps)
    window = max(r.end_s for r in device.steps) - min(r.start_s for r in device.steps)
    assert busy < window  # the pipeline's bubbles
    assert device.replica_lag_s == pytest.approx(costs.replica_skew.lag_fraction(2, window) * busy)


def test_without_data_parallelism_there_is_no_lag():
    spec = make_spec(dp=1, pp=2, micro_batches=4)
    plan = build_plan(spec)
    costs = Costs.from_seconds(plan, {eid: 1e-3 for eid in plan.events})
    before = simulate(plan, costs).batch_time_s
    costs.replica_skew = ReplicaSkew([series(0, np.ones(500)), series(1, np.full(500, 1.2))])
    timeline = simulate(plan, costs)
    assert timeline.batch_time_s == before
    assert all(d.replica_lag_s == 0.0 for d in timeline.pipeline)


def _job(cp: int = 1, dp: int = 1, ep: int = 1):
    """A small job whose dp x cp ranks are gradient replicas; with ep > 1 its blocks hold 4 experts over ep ranks."""
    model = {"name": "gpt2-small", "layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "seq_len": 32, "vocab": 128}
    if ep > 1:
        model |= {"experts": 4, "top_k": 2, "expert_ffn": 128}
    data = {"model": model, "batch": {"global": 4 * dp, "micro": 1},
            "strategy": {"dp": dp, "cp": cp, "ep": ep, "bucket_mb": 1000},
            "cluster": {"nodes": 1, "gpus_per_node": dp * cp}}
    return build_plan(parse_spec(data, source="test"))


@pytest.mark.parametrize(("cp", "dp", "ep", "drifting"), [(1, 2, 1, 2), (2, 1, 1, 1), (2, 2, 1, 2), (1, 2, 2, 1),
                                                          (1, 4, 2, 2)])
def test_replicas_held_together_inside_their_layers_drift_as_one(cp, dp, ep, drifting):
    # cp's ring exchanges and ep's all-to-alls make those replicas wait for each other layer by layer (a cp = 2
    # run of the accuracy bench: 1-2 ms between its ranks' compute ends, where 2 drifting replicas would give 56-91)
    plan = _job(cp, dp, ep)
    assert drifting_replicas(plan, 0) == drifting
    costs = Costs.from_seconds(plan, {eid: 1e-3 for eid in plan.events})
    before = simulate(plan, costs).batch_time_s
    costs.replica_skew = ReplicaSkew([series(0, np.ones(5000)), series(1, np.full(5000, 1.2))])
    device = simulate(plan, costs).pipeline[0]
    window = max(r.end_s for r in device.steps) - min(r.start_s for r in device.steps)
    busy = sum(r.end_s - r.start_s for r in device.steps)
    assert device.replica_lag_s == pytest.approx(costs.replica_skew.lag_fraction(drifting, window) * busy)
    assert (device.replica_lag_s > 0) == (drifting > 1)
    assert device.replica_window_s == pytest.approx(window)  # the span --details shows, lag or none
    assert (simulate(plan, costs).batch_time_s > before) == (drifting > 1)
