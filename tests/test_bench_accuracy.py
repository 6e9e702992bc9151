"""bench/accuracy.py pools its trials right: the figures recorded in docs/benchmarks.md come from here."""
from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT


def _accuracy_module():
    spec = importlib.util.spec_from_file_location("bench_accuracy", ROOT / "bench" / "accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trial(iterations, predicted, busy):
    """A validate --json result with what pooled() reads: per-device (measured, predicted) busy seconds."""
    measured = sorted(iterations)[len(iterations) // 2]
    return {"measured_iteration_s": iterations, "measured_batch_time_s": measured,
            "predicted_batch_time_s": predicted, "batch_time_error_pct": (predicted - measured) / measured * 100,
            "devices": [{"measured_busy_s": m, "predicted_busy_s": p} for m, p in busy]}


def test_pooled_compares_all_measured_iterations_with_the_median_prediction():
    pooled = _accuracy_module().pooled
    trials = [_trial([1.0, 1.1, 1.2], 0.9, [(0.8, 0.8), (0.5, 0.6)]),
              _trial([1.3, 1.4, 1.5], 1.0, [(1.0, 0.9), (0.5, 0.5)]),
              _trial([0.9, 1.25, 1.6], 1.3, [(0.9, 1.0), (0.5, 0.4)])]
    row = pooled(trials)
    # iterations pooled: median of the nine is 1.25; predictions 0.9, 1.0, 1.3: median 1.0
    assert row["measured_s"] == pytest.approx(1.25)
    assert row["predicted_s"] == pytest.approx(1.0)
    assert row["batch_error_pct"] == pytest.approx(-20.0)
    # device 0: measured medians 0.8, 1.0, 0.9 -> 0.9; predicted 0.8, 0.9, 1.0 -> 0.9: 0%;
    # device 1: measured 0.5 and predicted 0.5: 0% as well, although every trial was off by 20%
    assert row["device_error_pct"] == pytest.approx(0.0)
    assert row["trial_errors_pct"] == pytest.approx([(0.9 - 1.1) / 1.1 * 100, (1.0 - 1.4) / 1.4 * 100,
                                                     (1.3 - 1.25) / 1.25 * 100])
    # the trials' own medians 1.1, 1.4, 1.25 spread by 0.3 over the pooled 1.25
    assert row["run_spread_pct"] == pytest.approx(24.0)
    assert "replica_lag_measured_s" not in row  # no data parallelism


def test_run_vs_run_takes_one_half_of_the_trials_runs_as_the_others_prediction():
    accuracy = _accuracy_module()
    # halves in pairs: trials 0, 1, 4 (A) against 2, 3 (B), so each half holds both orders; the predictions
    # (9.9) play no part. A's iterations pool to a median of 1.0 while its trials' own medians are 0.9, 0.9
    # and 1.2; B's pool to 1.5 (medians 1.4 and 1.6)
    trials = [_trial([0.8, 0.9, 1.0], 9.9, [(0.8, 9.9), (0.50, 9.9)]),
              _trial([0.9, 0.9, 1.0], 9.9, [(0.9, 9.9), (0.40, 9.9)]),
              _trial([1.4, 1.4, 1.5], 9.9, [(1.2, 9.9), (0.60, 9.9)]),
              _trial([1.5, 1.6, 1.6], 9.9, [(1.4, 9.9), (0.60, 9.9)]),
              _trial([1.0, 1.2, 1.3], 9.9, [(1.0, 9.9), (0.45, 9.9)])]
    floor = accuracy.run_vs_run(trials)
    # A predicting B: A's median run 0.9 against B's pooled 1.5, -40%; B predicting A: 1.5 against A's pooled
    # 1.0, +50%: the larger in size is kept, here the second direction
    assert floor["batch_error_pct"] == pytest.approx(50.0)
    # device 0: A's medians over trials 0.9, B's 1.3: 30.8% one way, 44.4% the other; device 1: A 0.45, B 0.6:
    # 25% and 33.3%
    assert floor["device_error_pct"] == pytest.approx(0.4 / 0.9 * 100)
    assert accuracy.pooled(trials)["run_vs_run"] == floor
    assert accuracy.run_vs_run(trials[:2]) is None  # two trials: the second half would be empty


def test_run_vs_run_keeps_the_sign_of_the_larger_error():
    run_vs_run = _accuracy_module().run_vs_run
    # A (trials 0, 1, 4): median runs 0.5, 0.5, 2.0 -> 0.5, but its iterations pool to 2.0; B: 1.1 either way
    trials = [_trial([0.4, 0.5, 2.0], 9.9, [(1.0, 9.9)]), _trial([0.4, 0.5, 2.0], 9.9, [(1.0, 9.9)]),
              _trial([1.1, 1.1, 1.1], 9.9, [(1.0, 9.9)]), _trial([1.1, 1.1, 1.1], 9.9, [(1.0, 9.9)]),
              _trial([2.0, 2.0, 2.0], 9.9, [(1.0, 9.9)])]
    # A predicting B: 0.5 against 1.1, -54.5%; B predicting A: 1.1 against 2.0, -45%
    assert run_vs_run(trials)["batch_error_pct"] == pytest.approx((0.5 - 1.1) / 1.1 * 100)
    assert run_vs_run(trials)["device_error_pct"] == pytest.approx(0.0)


def test_within_goal_needs_both_errors_within_five_percent():
    within_goal = _accuracy_module().within_goal
    assert within_goal({"batch_error_pct": -4.9, "device_error_pct": 5.0})
    assert not within_goal({"batch_error_pct": -5.1, "device_error_pct": 1.0})
    assert not within_goal({"batch_error_pct": 0.0, "device_error_pct": 5.2})
    assert not within_goal(None)


def test_pooled_reports_the_replica_lag_of_data_parallel_trials():
    pooled = _accuracy_module().pooled
    trials = [_trial([1.0], 1.0, [(0.8, 0.8)]) for _ in range(3)]
    for trial, (measured, predicted) in zip(trials, [(0.01, 0.03), (0.04, 0.02), (0.02, 0.05)]):
        trial["replica_lag"] = [{"stage": 0, "measured_s": measured, "predicted_s": predicted}]
    row = pooled(trials)
    assert row["replica_lag_measured_s"] == pytest.approx(0.02)
    assert row["replica_lag_predicted_s"] == pytest.approx(0.03)


def test_pooled_rows_give_each_stages_median_error():
    pooled = _accuracy_module().pooled
    trials = [_trial([1.0], 1.0, [(0.8, 0.8)]) for _ in range(3)]
    for trial, errors in zip(trials, [(-4.0, 2.0), (-6.0, 1.0), (-5.0, None)]):
        trial["stages"] = [{"virtual_stage": 0, "phase": "F", "error_pct": errors[0]},
                           {"virtual_stage": 1, "phase": "B", "error_pct": errors[1]}]
    assert pooled(trials)["stage_error_pct"] == {"0F": pytest.approx(-5.0), "1B": pytest.approx(1.5)}


def test_pooled_rows_say_how_the_trials_ranks_were_bound():
    pooled = _accuracy_module().pooled
    trials = [_trial([1.0], 1.0, [(0.8, 0.8)]) for _ in range(3)]
    trials[0]["cpu_binding"] = {"profile": "bound", "run": "bound"}
    trials[1]["cpu_binding"] = {"profile": "bound", "run": "shared"}
    # trials[2]: validated by an analysis from before the binding was reported
    row = pooled(trials)
    assert row["cpu_binding"] == {"profile": ["bound", "unknown"], "run": ["bound", "shared", "unknown"]}


def test_trials_alternate_which_command_runs_first(tmp_path, monkeypatch):
    accuracy = _accuracy_module()
    order = []
    monkeypatch.setattr(accuracy, "measure", lambda config, args, env, workdir, run_first: order.append(run_first)
                        or {})
    args = type("Args", (), {"keep": str(tmp_path), "trials": 4})()
    accuracy.measure_trials("dp=2", accuracy.CONFIGS["dp=2"], args, {})
    assert order == [False, True, False, True]


@pytest.mark.parametrize("bind, expected", [("core", ["--bind-to", "core"]), ("none", ["--bind-to", "none"]),
                                            ("launcher", [])])
def test_profile_and_run_launch_with_the_same_core_binding(tmp_path, monkeypatch, bind, expected):
    accuracy = _accuracy_module()
    launched = []
    monkeypatch.setattr(accuracy, "run", lambda command, env: launched.append(command))
    validated = []
    monkeypatch.setattr(accuracy, "validate", lambda workdir, env, no_rank_speed: validated.append(no_rank_speed)
                        or {})
    monkeypatch.setenv("DISTSIM_MPIRUN", "mpirun")
    args = type("Args", (), {"repeats": 10, "iterations": 4, "bind": bind, "no_rank_speed": False,
                             "no_layer_times": bind == "none", "budget_s": 5.0 if bind == "core" else None,
                             "no_tracker": bind == "none"})()
    accuracy.measure(accuracy.CONFIGS["pp=2 gpipe m=4"], args, {}, tmp_path, run_first=False)
    for command in launched:
        assert command[0] == "mpirun"
        assert command[1:command.index("-n")] == expected
    assert [command[command.index("harness") + 1] for command in launched[:2]] == ["profile", "train"]
    # then the job again under MemTracker, unless --no-tracker
    assert [command[command.index("--tracked-run") + 1:] for command in launched[2:]] == \
        ([] if bind == "none" else [[str(tmp_path / "job.toml"), str(tmp_path / "tracked")]])
    # --budget-s reaches the profile when given, else the spec's budget holds
    assert ("--budget-s" in launched[0]) == (bind == "core") and "--budget-s" not in launched[1]
    assert validated == [False]  # validated with the rank-speed correction unless --no-rank-speed
    # the run traces its layers unless --no-layer-times
    assert ("--layer-times" in launched[1]) == (bind != "none")


def test_the_bootstrap_interval_brackets_the_pooled_error_and_narrows_with_agreeing_trials():
    accuracy = _accuracy_module()
    agreeing = [_trial([1.0, 1.0, 1.0], 0.95, [(0.8, 0.8)]) for _ in range(6)]
    assert accuracy.bootstrap_interval(agreeing) == pytest.approx((-5.0, -5.0))
    # trials whose runs disagree: the interval is wide, holds the pooled error, and repeats exactly
    spread = [_trial([m, m, m], 1.0, [(0.8, 0.8)]) for m in (0.8, 0.9, 1.0, 1.1, 1.2, 1.3)]
    row = accuracy.pooled(spread)
    low, high = row["batch_error_interval_pct"]
    assert low < row["batch_error_pct"] < high and high - low > 10.0
    assert accuracy.bootstrap_interval(spread) == (low, high)


def test_reuse_finds_the_kept_trials_of_one_configuration_in_trial_order(tmp_path):
    accuracy = _accuracy_module()
    for name in ("pp2_gpipe_m4-t0", "pp2_gpipe_m4-t10", "pp2_gpipe_m4-t2", "pp2_gpipe_m8-t0", "dp2-t0"):
        for part in ("run", "prof"):
            (tmp_path / name / part).mkdir(parents=True)
    (tmp_path / "pp2_gpipe_m4-t3").mkdir()  # a trial that never ran: no run, no profile
    for part in ("run", "prof"):  # not a trial folder
        (tmp_path / "pp2_gpipe_m4-tmp" / part).mkdir(parents=True)
    found = accuracy.kept_trials(tmp_path, "pp=2 gpipe m=4")
    assert [p.name for p in found] == ["pp2_gpipe_m4-t0", "pp2_gpipe_m4-t2", "pp2_gpipe_m4-t10"]


def test_pooled_rows_give_each_layer_events_median_error():
    pooled = _accuracy_module().pooled
    trials = [_trial([1.0], 1.0, [(0.8, 0.8)]) for _ in range(3)]
    for trial, errors in zip(trials, [(-10.0, 3.0), (-12.0, 5.0), (-14.0, None)]):
        trial["layers"] = [{"virtual_stage": 0, "phase": "B", "name": "gpt2.block.bwd", "error_pct": errors[0]},
                           {"virtual_stage": 1, "phase": "F", "name": "gpt2.head.fwd", "error_pct": errors[1]}]
    assert pooled(trials)["layer_error_pct"] == {"0B gpt2.block.bwd": pytest.approx(-12.0),
                                                 "1F gpt2.head.fwd": pytest.approx(4.0)}
    assert pooled([_trial([1.0], 1.0, [(0.8, 0.8)])])["layer_error_pct"] == {}  # a run without --layer-times


def test_pooled_rows_give_the_median_replay_error_of_the_trials_that_have_one():
    pooled = _accuracy_module().pooled
    trials = [_trial([1.0], 1.0, [(0.8, 0.8)]) for _ in range(4)]
    for trial, (replay, cost) in zip(trials, [(-2.0, 5.0), (1.0, -3.0), (-1.0, 2.0), (None, None)]):
        trial["replay_error_pct"], trial["compute_cost_error_pct"] = replay, cost
    row = pooled(trials)
    assert row["replay_error_pct"] == pytest.approx(-1.0)
    assert row["compute_cost_error_pct"] == pytest.approx(2.0)
    # trials validated before the replay existed
    assert pooled([_trial([1.0], 1.0, [(0.8, 0.8)])])["replay_error_pct"] is None
