"""The scheduler simulation: seeded, and its staleness stays within the bounds the window promises."""

import pytest

from forge_stream.bench.scheduler import FIFO, GREEDY, Policy, SimSettings, run, simulate
from forge_stream.scheduler.window import WindowSpec, staleness_bound

SMALL = SimSettings(slots=64, tasks=512, batch=8, buffer=32)


def test_same_seed_same_result_other_seed_differs():
    policy = Policy("w", WindowSpec(fraction=0.3))
    assert simulate(SMALL, 1.0, policy) == simulate(SMALL, 1.0, policy)
    other = SimSettings(slots=64, tasks=512, batch=8, buffer=32, seed=1)
    assert simulate(other, 1.0, policy)["makespan"] != simulate(SMALL, 1.0, policy)["makespan"]


@pytest.mark.parametrize("sigma", [0.5, 1.0])
@pytest.mark.parametrize("spec", [WindowSpec(count=1), WindowSpec(fraction=0.1), WindowSpec(fraction=0.5)])
def test_bounded_run_ahead_keeps_staleness_within_the_window_bound(sigma, spec):
    result = simulate(SMALL, sigma, Policy("w", spec))
    window = spec.resolve(SMALL.slots)
    assert result["staleness_bound"] == staleness_bound(SMALL.slots + SMALL.buffer, window, SMALL.batch)
    assert result["max_staleness"] <= result["staleness_bound"]
    assert result["batches"] == SMALL.tasks // SMALL.batch


def test_strict_fifo_has_no_drift_and_greedy_drifts():
    assert simulate(SMALL, 1.0, FIFO)["drift"] == 0.0
    assert simulate(SMALL, 1.0, GREEDY)["drift"] > 0.0


@pytest.mark.parametrize("eta", [0, 2, 5])
def test_eta_policy_bounds_staleness_by_eta_plus_the_in_order_bound(eta):
    result = simulate(SMALL, 1.0, Policy("greedy_eta", WindowSpec(greedy=True), eta=eta))
    assert result["max_staleness"] <= eta + staleness_bound(SMALL.slots + SMALL.buffer, 1, SMALL.batch)
    assert result["max_staleness"] < simulate(SMALL, 1.0, GREEDY)["max_staleness"]
    assert result["window_fraction"] is None


def test_run_reports_every_policy_on_every_workload():
    out = run(SimSettings(slots=32, tasks=256, batch=8, buffer=16))
    keys = {(r["workload"], r["policy"]) for r in out["results"]}
    policies = {"fifo", "window_0.1", "window_0.3", "window_0.5", "greedy", "greedy_eta"}
    assert keys == {(w, p) for w in ("mild", "heavy") for p in policies}
    for row in out["results"]:
        assert {"window_fraction", "throughput_vs_greedy", "drift", "max_staleness"} <= row.keys()
        assert row["trainer_idle_share"] >= 0.0
    greedy = [r for r in out["results"] if r["policy"] == "greedy"]
    assert all(r["window_fraction"] == 1.0 and r["throughput_vs_greedy"] == 1.0 for r in greedy)
