"""Reward curves: the series built from TrainStep and EvalResult records, and `forge-stream plot rewards` on the
real broker (the PNG is written, the printed series equal the published records)."""

import json

from train_records import eval_result, train_step
from typer.testing import CliRunner

from forge_stream.analytics.curves import build_curves, smooth
from forge_stream.cli import app
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS


def test_series_deduplicate_and_place_evaluations_on_the_step_axis():
    steps = [train_step("r", s) for s in (2, 0, 1, 0)] + [train_step("r", 1)]  # out of order, step 0 redelivered
    steps[-1] = steps[-1] | {"event_id": "retrained", "event_time": steps[-1]["event_time"] + 1, "outcome_reward": 0.9}
    evals = [eval_result("r", 0, "qa", 0.1), eval_result("r", 3, "qa", 0.7), eval_result("r", 1, "agent", 0.4),
             eval_result("r", 1, "qa", 0.2) | {"split": "train"}]
    curves = build_curves("r", steps, evals)  # step 1 recorded twice
    assert curves.train.step == [0, 1, 2]
    assert curves.train.outcome_reward == [0.0, 0.9, 0.4]  # the later record of step 1 wins
    assert curves.train.outcome_reward_smoothed == smooth([0.0, 0.9, 0.4])
    assert curves.train.mean_reward == [0.0, 0.1, 0.2]
    assert curves.evals["qa"].x == [0, 3]  # version 3 was published by the last step (2)
    assert curves.evals["qa"].ci_low == [0.1 - 0.1, 0.7 - 0.1]
    assert curves.evals["agent"].x == [1] and list(curves.evals) == ["agent", "qa"]  # the train split is left out


def test_plot_rewards_from_the_broker(kafka_bootstrap, run_id, tmp_path):
    producer = EventProducer(kafka_bootstrap)
    for step in range(6):
        producer.send_sync(TOPICS.train_metrics, run_id, train_step(run_id, step))
    producer.send_sync(TOPICS.train_metrics, f"{run_id}-other", train_step(f"{run_id}-other", 9))
    evals = [(0, "qa", 0.2), (3, "qa", 0.5), (6, "qa", 0.8), (3, "reasoning", 0.3)]
    for version, domain, mean in evals:
        producer.send_sync(TOPICS.evals, run_id, eval_result(run_id, version, domain, mean))
    producer.close()

    out = tmp_path / "plots" / "rewards.png"
    result = CliRunner().invoke(app, ["plot", "rewards", "--out", str(out), "--run", run_id, "--title", "test",
                                      "--json", "-b", kafka_bootstrap])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    series = json.loads(result.stdout)
    assert series["run"] == run_id
    assert series["train"]["step"] == list(range(6))
    assert series["train"]["outcome_reward"] == [train_step(run_id, s)["outcome_reward"] for s in range(6)]
    assert series["train"]["mean_reward"] == [train_step(run_id, s)["mean_reward"] for s in range(6)]
    qa = series["evals"]["qa"]
    assert qa["x"] == qa["policy_version"] == [0, 3, 6]
    assert qa["mean_reward"] == [0.2, 0.5, 0.8]
    assert qa["ci_low"] == [eval_result(run_id, v, "qa", m)["ci_low"] for v, _, m in evals[:3]]
    assert qa["ci_high"] == [eval_result(run_id, v, "qa", m)["ci_high"] for v, _, m in evals[:3]]
    assert series["evals"]["reasoning"]["mean_reward"] == [0.3]
    said = CliRunner().invoke(app, ["plot", "rewards", "--out", str(out), "--run", run_id, "-b", kafka_bootstrap])
    assert said.stdout.strip() == f"run {run_id}: 6 steps, 3 held-out evaluations (qa, reasoning) -> {out}"


def test_a_perfect_score_whose_bound_rounds_below_it_still_plots(tmp_path):
    """Float rounding can put a Wilson upper bound below the score it bounds: lookup 1.000, bound 0.9999999999999999."""
    from forge_stream.analytics.curves import plot_curves

    perfect = eval_result("r", 0, "lookup", 1.0) | {"ci_low": 0.72, "ci_high": 0.9999999999999999}
    plot_curves(build_curves("r", [train_step("r", 0)], [perfect]), tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0
