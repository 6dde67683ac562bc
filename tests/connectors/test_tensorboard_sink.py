"""The TensorBoard sink turns TrainStep, EvalResult and Trajectory records from the real broker into scalars."""

import threading
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_records import eval_result, train_step, trajectory
from typer.testing import CliRunner

from connectors.tensorboard_sink import TensorBoardSink, TensorBoardSinkSettings
from forge_stream.cli import app
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS


def raw_scalars(logdir, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a tag; none while the tag is not written yet."""
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


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

    cli = ["sink", "tensorboard", "--logdir", str(tmp_path), "--run", run_id, "-b", kafka_bootstrap]
    again = CliRunner().invoke(app, cli)  # the logdir's position was committed: nothing left to read
    assert again.exit_code == 0 and "wrote 0 scalars" in again.output, again.output
    replayed = CliRunner().invoke(app, cli + ["--from-beginning"])
    assert replayed.exit_code == 0 and int(replayed.output.split()[1]) >= written, replayed.output


def test_follow_writes_records_as_they_arrive(kafka_bootstrap, run_id, tmp_path):
    sink = TensorBoardSink(TensorBoardSinkSettings(kafka_bootstrap, tmp_path, run=run_id, follow=True,
                                                   flush_seconds=0.2))
    worker = threading.Thread(target=sink.run)
    worker.start()
    try:
        producer = EventProducer(kafka_bootstrap)
        for step in range(3):
            producer.send_sync(TOPICS.train_metrics, run_id, train_step(run_id, step))
        producer.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                (tmp_path / run_id).exists() and len(raw_scalars(tmp_path / run_id, "train/loss")) == 3):
            time.sleep(0.5)
    finally:
        sink.stop()
        worker.join(30)
    assert not worker.is_alive()
    assert scalars(tmp_path / run_id, "train/loss") == [(s, 1.0 / (s + 1)) for s in range(3)]
