"""The TensorBoard sink turns TrainStep, EvalResult and Trajectory records from the real broker into scalars."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from connectors.tensorboard_sink import TensorBoardSink, TensorBoardSinkSettings
from forge_stream.events import deterministic_id
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

T0 = 1_764_000_000_000


def train_step(run: str, step: int) -> dict:
    return {
        "event_id": deterministic_id("train_step", run, step), "event_time": T0 + step * 1000, "step": step,
        "policy_version": step, "loss": 1.0 / (step + 1), "mean_reward": 0.1 * step, "groups": 2, "sequences": 8,
        "total_tokens": 400, "unique_tokens": 100, "tree_ratio": 4.0, "tokens_per_s": 50.0 + step,
        "staleness_mean": 0.5, "staleness_max": 1, "grad_norm": 0.3, "lr": 1e-5, "group_ids": [f"g{step}"],
        "outcome_reward": 0.2 * step, "rollouts": 8, "mismatch_mean": 0.01, "mismatch_max": 0.02,
        "ratio_mean": 1.0, "ratio_max": 1.1, "clip_fraction": 0.05,
    }


def eval_result(run: str, version: int, domain: str, mean: float) -> dict:
    return {
        "event_id": deterministic_id("eval", run, version, domain), "event_time": T0 + version * 1000 + 500,
        "eval_id": f"{run}-e{version}", "run": run, "policy_version": version, "domain": domain,
        "split": "heldout", "episodes": 16, "failed": 1, "mean_reward": mean, "ci_low": mean - 0.1,
        "ci_high": mean + 0.1, "agent": "", "metadata": {},
    }


def trajectory(run: str, i: int) -> dict:
    turn = {"completion_id": f"c{i}", "turn": 0, "agent": "a", "prompt_tokens": 10, "completion_tokens": 100_003 + i,
            "trainable": True, "outcome_reward": 0.0, "process_reward": 0.0, "time_reward": 0.0, "reward": 0.25,
            "reward_to_go": 0.25, "advantage": 0.0}
    return {"event_id": f"{run}-traj-{i}", "event_time": T0 + i, "group_id": f"{run}-g{i}", "task_id": f"t{i}",
            "task_seq": i, "session_id": f"s{i}", "status": "ok", "outcome_reward": float(i % 2),
            "wall_time_ms": 1500, "turns": [turn, {**turn, "turn": 1}], "group_complete": True,
            "missing_sessions": []}


def raw_scalars(logdir, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def scalars(logdir, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a tag, compared up to TensorBoard's float32."""
    return [(step, pytest.approx(value, rel=1e-6)) for step, value in raw_scalars(logdir, tag)]


def test_train_eval_and_rollout_scalars(kafka_bootstrap, run_id, tmp_path):
    other = f"{run_id}-other"
    producer = EventProducer(kafka_bootstrap)
    for step in range(4):
        producer.send_sync(TOPICS.train_metrics, run_id, train_step(run_id, step))
    producer.send_sync(TOPICS.train_metrics, other, train_step(other, 0) | {"loss": 99.0})
    for version, domain, mean in [(0, "qa", 0.2), (0, "reasoning", 0.1), (2, "qa", 0.6)]:
        producer.send_sync(TOPICS.evals, run_id, eval_result(run_id, version, domain, mean))
    producer.send_sync(TOPICS.evals, other, eval_result(other, 0, "qa", 0.9))
    for i in range(6):
        producer.send_sync(TOPICS.trajectories, f"{run_id}-g{i}", trajectory(run_id, i))
    producer.close()

    settings = TensorBoardSinkSettings(kafka_bootstrap, tmp_path, run=run_id)
    written = TensorBoardSink(settings).run()
    logdir = tmp_path / run_id
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_id]

    assert scalars(logdir, "train/loss") == [(s, 1.0 / (s + 1)) for s in range(4)]
    assert [v for _, v in scalars(logdir, "train/outcome_reward")] == [0.2 * s for s in range(4)]
    assert [v for _, v in scalars(logdir, "train/mean_reward")] == [0.1 * s for s in range(4)]
    assert scalars(logdir, "train/clip_fraction")[0][1] == 0.05
    assert scalars(logdir, "eval/qa/mean_reward") == [(0, 0.2), (2, 0.6)]
    assert scalars(logdir, "eval/qa/ci_high") == [(0, 0.3), (2, 0.7)]
    assert scalars(logdir, "eval/reasoning/mean_reward") == [(0, 0.1)]
    # the shared topic holds other tests' trajectories too: find ours by their completion tokens
    rollouts = dict(zip((v for _, v in raw_scalars(logdir, "rollout/completion_tokens")),
                        raw_scalars(logdir, "rollout/outcome_reward")))
    mine = [rollouts[2.0 * (100_003 + i)] for i in range(6)]
    assert [v for _, v in mine] == [float(i % 2) for i in range(6)]
    steps = [s for s, _ in raw_scalars(logdir, "rollout/outcome_reward")]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert {v for _, v in raw_scalars(logdir, "rollout/wall_time_s")} >= {1.5}
    assert written >= 4 * 17 + 3 * 4 + 6 * 5

    again = TensorBoardSink(settings)  # the logdir's position was committed: nothing left to read
    assert again.run() == 0
