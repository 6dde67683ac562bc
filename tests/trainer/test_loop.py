"""The RL loop on fakes at its edges: the order of a step's effects, and where it stops."""

from forge_stream.scheduler.consumer import Batch
from forge_stream.topics import TOPICS
from forge_stream.trainer.loop import rl_loop

METRICS = {"loss_name": "ppo", "loss": 0.5, "outcome_reward": 1.0, "mean_reward": 0.25, "mismatch_mean": 0.01,
           "clip_fraction": 0.1, "tree_ratio": 2.0}


class Source:
    def __init__(self, batches, log):
        self.batches, self.log = list(batches), log

    def next_batch(self, trainer_version):
        self.log.append(("next_batch", trainer_version))
        return self.batches.pop(0) if self.batches else None

    def ack(self, batch, metrics):
        self.log.append(("ack", batch.group_ids))
        return {**metrics, "step": len([e for e in self.log if e[0] == "ack"]) - 1, "groups": len(batch.samples),
                "staleness_max": batch.staleness_max}


class Learner:
    run = "r"

    def __init__(self, log):
        self.policy_version, self.log = 0, log

    def step(self, batch):
        self.log.append(("step", batch.group_ids))
        return dict(METRICS)

    def checkpoint(self):
        self.policy_version += 1
        self.log.append(("checkpoint", self.policy_version))
        return {"version": self.policy_version}


def batch(*groups):
    return Batch([{"group_id": g} for g in groups], [0] * len(groups), 0, 0)


def test_each_step_trains_checkpoints_publishes_then_acks_until_the_source_ends():
    log, lines = [], []
    publish = lambda topic, key, record: log.append(("publish", topic.name, key, record["version"]))
    records = rl_loop(Source([batch("a", "b"), batch("c")], log), Learner(log), publish, progress=lines.append)
    assert log == [
        ("next_batch", 0), ("step", ["a", "b"]), ("checkpoint", 1), ("publish", TOPICS.policy.name, "r", 1),
        ("ack", ["a", "b"]),
        ("next_batch", 1), ("step", ["c"]), ("checkpoint", 2), ("publish", TOPICS.policy.name, "r", 2), ("ack", ["c"]),
        ("next_batch", 2),
    ]
    assert [r["step"] for r in records] == [0, 1]
    assert lines[1] == ("step 1: policy v2, 1 groups, ppo loss 0.5000, outcome 1.000, reward 0.250, "
                        "mismatch 0.0100, clip 0.100, T/U 2.00, staleness max 0")


def test_steps_bounds_the_loop():
    log = []
    records = rl_loop(Source([batch("a"), batch("b"), batch("c")], log), Learner(log), lambda *a: None, steps=2,
                      progress=lambda line: None)
    assert len(records) == 2 and log.count(("next_batch", 2)) == 0
