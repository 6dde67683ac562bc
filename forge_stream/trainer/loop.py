"""The RL loop, one function for live training and replay: next batch, step, checkpoint, PolicyVersion,
TrainStep, commit.

Live training feeds it from the windowed FIFO consumer (forge_stream.scheduler.consumer.WindowedConsumer, whose
`ack` publishes the TrainStep and then commits the Kafka offsets of the trained groups); replay feeds it from
history (forge_stream.trainer.replay.HistoryBatches, whose commit is a no-op). `rl_loop` stops after `steps`
steps, or when the source has no batch left.
"""

from __future__ import annotations

from typing import Callable, Protocol

from forge_stream.scheduler.consumer import Batch
from forge_stream.topics import TOPICS, Topic


class BatchSource(Protocol):
    def next_batch(self, trainer_version: int) -> Batch | None:
        """The next batch for a trainer at `trainer_version`; None when there will be no more."""

    def ack(self, batch: Batch, metrics: dict) -> dict:
        """Publish the step's TrainStep (the durable record of what was trained), commit what the batch
        consumed, and return the TrainStep record."""


class Learner(Protocol):
    """The policy being trained (forge_stream.trainer.service.PolicyTrainer)."""

    policy_version: int
    run: str

    def step(self, batch: Batch) -> dict:
        """One optimizer step on the batch; returns the TrainStep metric fields it knows."""

    def checkpoint(self) -> dict:
        """Write the new weights, advance the policy version; returns its PolicyVersion record."""


Publish = Callable[[Topic, str, dict], object]


def rl_loop(source: BatchSource, trainer: Learner, publish: Publish, steps: int | None = None,
            progress: Callable[[str], None] = print) -> list[dict]:
    """Train until `steps` steps are done (None: as long as the source has batches); returns the TrainSteps."""
    done: list[dict] = []
    while steps is None or len(done) < steps:
        batch = source.next_batch(trainer.policy_version)
        if batch is None:
            break
        metrics = trainer.step(batch)
        publish(TOPICS.policy, trainer.run, trainer.checkpoint())
        record = source.ack(batch, metrics)
        done.append(record)
        progress(progress_line(record, trainer.policy_version))
    return done


def progress_line(record: dict, policy_version: int) -> str:
    """One line per step; a batch reused for several updates also shows how far the last one drifted.

    >>> record = {"step": 3, "groups": 8, "loss_name": "cispo", "loss": 0.12345, "outcome_reward": 0.5,
    ...           "mean_reward": 0.1, "mismatch_mean": 0.00123, "clip_fraction": 0.01, "tree_ratio": 2.5,
    ...           "staleness_max": 1}
    >>> progress_line(record, 4)
    'step 3: policy v4, 8 groups, cispo loss 0.1235, outcome 0.500, reward 0.100, mismatch 0.0012, clip 0.010, T/U 2.50, staleness max 1'
    >>> progress_line({**record, "groups_without_signal": 3}, 4)[:50]
    'step 3: policy v4, 8 groups (3 without signal), ci'
    >>> progress_line({**record, "groups_without_signal": 8}, 4)[:80]
    'step 3: policy v4, 8 groups, none with a signal (every advantage 0: nothing trai'
    >>> progress_line({**record, "per_update": [{"ratio_max": 1.0, "clip_fraction": 0.01},
    ...                                         {"ratio_max": 1.75, "clip_fraction": 0.125}]}, 4)[-59:]
    'staleness max 1; update 2 of 2: ratio max 1.750, clip 0.125'
    """
    idle = record.get("groups_without_signal") or 0
    head = f"step {record['step']}: policy v{policy_version}, {record['groups']} groups"
    if idle and idle == record["groups"]:  # nothing ran: no loss, mismatch or clip to report
        return (f"{head}, none with a signal (every advantage 0: nothing trained), outcome "
                f"{record['outcome_reward']:.3f}, reward {record['mean_reward']:.3f}, T/U {record['tree_ratio']:.2f}, "
                f"staleness max {record['staleness_max']}")
    line = (head + (f" ({idle} without signal), " if idle else ", ") +
            f"{record['loss_name']} loss {record['loss']:.4f}, outcome {record['outcome_reward']:.3f}, "
            f"reward {record['mean_reward']:.3f}, mismatch {record['mismatch_mean']:.4f}, "
            f"clip {record['clip_fraction']:.3f}, T/U {record['tree_ratio']:.2f}, "
            f"staleness max {record['staleness_max']}")
    updates = record.get("per_update") or []
    if len(updates) > 1:
        last = updates[-1]
        line += (f"; update {len(updates)} of {len(updates)}: ratio max {last['ratio_max']:.3f}, "
                 f"clip {last['clip_fraction']:.3f}")
    return line
