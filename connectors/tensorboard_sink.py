"""A TensorBoard sink: training metrics, held-out evaluations and rollout statistics as TensorBoard scalars.

It reads three topics and writes one TensorBoard run per training run, under `<logdir>/<run>`:

- forge.train_metrics (TrainStep, keyed by run): `train/<field>` at x = `step`.
- forge.evals (EvalResult): `eval/<domain>/mean_reward`, `.../ci_low`, `.../ci_high`, `.../failed` at
  x = `policy_version` (a split other than `heldout` is spelled `eval-<split>/<domain>/...`).
- forge.trajectories (Trajectory): `rollout/outcome_reward`, `rollout/reward` (the sum of the turns' composite
  rewards), `rollout/turns`, `rollout/completion_tokens` and `rollout/wall_time_s`. A Trajectory names no run and no
  domain (its task_id prefix is not the domain), so rollout statistics are not split per domain: they go to the
  `--run` given, or to `<logdir>/rollouts` when none is. Their x axis is a running count of rollouts: the sum over
  partitions of the next offset to read, i.e. how many trajectories had been produced up to this one as far as the
  sink has read. It is derived from Kafka offsets, so it carries on across restarts of the sink.

Every scalar's wall time is the event's `event_time`, so TensorBoard's "wall" axis shows when things happened.

Offsets: partitions are assigned, not subscribed; the consumer group is named after the logdir (and the run
filter), so each logdir has its own position, and offsets are committed only after the writers flushed. A re-run
on the same logdir resumes where it stopped; `from_beginning` ignores the committed position. A record seen twice
(a crash between flush and commit) writes the same value at the same step again, which changes no curve. Without
`follow` the sink stops when it reached the end the topics had when it started. The sink only watches: a record it
cannot decode is counted, logged and skipped, and rejecting it to forge.dlq is left to the pipeline's own consumers.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from forge_stream.kafka.consumer import AssignedConsumer
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)

TRAIN_FIELDS = ("loss", "mean_reward", "outcome_reward", "mismatch_mean", "mismatch_max", "ratio_mean", "ratio_max",
                "clip_fraction", "grad_norm", "lr", "tree_ratio", "tokens_per_s", "staleness_mean", "staleness_max",
                "groups", "rollouts", "sequences")
EVAL_FIELDS = ("mean_reward", "ci_low", "ci_high", "failed")
ROLLOUTS_DIR = "rollouts"


def train_scalars(record: dict) -> dict[str, float]:
    """`train/<field>` of one TrainStep.

    >>> train_scalars({"loss": 0.5, "mean_reward": 1.0, "outcome_reward": 0.75, "grad_norm": 2.0, "lr": 1e-5,
    ...                "tree_ratio": 3.0, "tokens_per_s": 10.0, "staleness_mean": 0.5, "staleness_max": 1,
    ...                "groups": 2, "rollouts": 8, "sequences": 8, "mismatch_mean": 0.0, "mismatch_max": 0.0,
    ...                "ratio_mean": 1.0, "ratio_max": 1.0, "clip_fraction": 0.0})["train/outcome_reward"]
    0.75
    """
    return {f"train/{name}": float(record[name]) for name in TRAIN_FIELDS}


def eval_scalars(record: dict) -> dict[str, float]:
    """`eval/<domain>/<field>` of one EvalResult.

    >>> eval_scalars({"domain": "qa", "split": "heldout", "mean_reward": 0.5, "ci_low": 0.25, "ci_high": 0.75,
    ...               "failed": 0})["eval/qa/mean_reward"]
    0.5
    """
    prefix = "eval" if record["split"] == "heldout" else f"eval-{record['split']}"
    return {f"{prefix}/{record['domain']}/{name}": float(record[name]) for name in EVAL_FIELDS}


def rollout_scalars(record: dict) -> dict[str, float]:
    """`rollout/<statistic>` of one Trajectory (wall time only when it is known).

    >>> sorted(rollout_scalars({"outcome_reward": 1.0, "wall_time_ms": None,
    ...                         "turns": [{"reward": 0.5, "completion_tokens": 7}]}).items())
    [('rollout/completion_tokens', 7.0), ('rollout/outcome_reward', 1.0), ('rollout/reward', 0.5), ('rollout/turns', 1.0)]
    """
    turns = record["turns"]
    scalars = {"rollout/outcome_reward": float(record["outcome_reward"]),
               "rollout/reward": float(sum(t["reward"] for t in turns)),
               "rollout/turns": float(len(turns)),
               "rollout/completion_tokens": float(sum(t["completion_tokens"] for t in turns))}
    if record["wall_time_ms"] is not None:
        scalars["rollout/wall_time_s"] = record["wall_time_ms"] / 1000
    return scalars


@dataclass(frozen=True)
class TensorBoardSinkSettings:
    bootstrap: str
    logdir: Path
    run: str | None = None
    from_beginning: bool = False
    follow: bool = False
    flush_seconds: float = 5.0

    @property
    def group_id(self) -> str:
        """One consumer group per logdir and run filter."""
        where = f"{self.logdir.resolve()}\x1f{self.run or ''}"
        return f"forge-tensorboard-{hashlib.sha1(where.encode()).hexdigest()[:12]}"


class TensorBoardSink:
    def __init__(self, settings: TensorBoardSinkSettings):
        self.settings = settings
        self.topics = (TOPICS.train_metrics, TOPICS.evals, TOPICS.trajectories)
        self.scalars_written = 0
        self.undecodable = 0
        self.consumer = AssignedConsumer(settings.bootstrap, settings.group_id, list(self.topics),
                                         name="tensorboard-sink", from_beginning=settings.from_beginning,
                                         on_undecodable=self._undecodable)
        self.positions = self.consumer.marks.read  # per partition: the next offset to read
        self.writers: dict[str, SummaryWriter] = {}
        self._stop = threading.Event()

    def _undecodable(self, topic: str, partition: int, offset: int, error: str) -> None:
        self.undecodable += 1
        log.warning("%s[%d]@%d: %s", topic, partition, offset, error)

    def _writer(self, name: str) -> SummaryWriter:
        if name not in self.writers:
            self.writers[name] = SummaryWriter(str(self.settings.logdir / name), flush_secs=3600)
        return self.writers[name]

    def _write(self, writer: str, scalars: dict[str, float], step: int, event_time_ms: int) -> None:
        sink = self._writer(writer)
        for tag, value in scalars.items():
            sink.add_scalar(tag, value, global_step=step, walltime=event_time_ms / 1000)
        self.scalars_written += len(scalars)

    def handle(self, topic: str, key: str | None, record: dict) -> None:
        """Write one decoded record's scalars (after `positions` moved past it)."""
        run = self.settings.run
        if topic == TOPICS.train_metrics.name and run in (None, key):
            self._write(key or "default", train_scalars(record), record["step"], record["event_time"])
        elif topic == TOPICS.evals.name and run in (None, record["run"]):
            self._write(record["run"], eval_scalars(record), record["policy_version"], record["event_time"])
        elif topic == TOPICS.trajectories.name:
            count = sum(offset for (t, _), offset in self.positions.items() if t == topic)
            self._write(run or ROLLOUTS_DIR, rollout_scalars(record), count, record["event_time"])

    def flush(self) -> None:
        """Flush every writer, then commit what they hold."""
        for writer in self.writers.values():
            writer.flush()
        self.consumer.commit()

    def stop(self) -> None:
        """Make `run` flush, commit and return (from another thread)."""
        self._stop.set()

    def run(self) -> int:
        """Consume until the end (or, following, until stopped); returns the number of scalars written."""
        last_flush = time.monotonic()
        try:
            while not self._stop.is_set() and (self.settings.follow or not self.consumer.at_end()):
                event = self.consumer.poll(0.5)
                if event is not None:
                    self.handle(event.topic, event.key, event.record)
                if time.monotonic() - last_flush >= self.settings.flush_seconds:
                    self.flush()
                    last_flush = time.monotonic()
        finally:
            self.flush()
            for writer in self.writers.values():
                writer.close()
            self.consumer.close()
        return self.scalars_written
