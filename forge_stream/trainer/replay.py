"""Replay: re-train from the TrainSamples already on forge.samples, between two timestamps or offsets.

History is read with `assign()` and no commits (forge_stream.kafka.history), so live consumer groups and their
offsets are untouched. Every replayed group is finished, so the windowed FIFO reduces to submission order:
samples are de-duplicated by event id, sorted by `task_seq` and trained in batches by the same RL loop as live
training (forge_stream.trainer.loop.rl_loop); committing is a no-op. The replay is its own run:
its checkpoints, PolicyVersions and TrainSteps carry its run name, which engines following the live run ignore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from forge_stream.events.claims import redeem
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.kafka.producer import EventProducer
from forge_stream.scheduler.consumer import Batch, SchedulerSettings, step_record
from forge_stream.topics import TOPICS
from forge_stream.trainer.loop import Publish, rl_loop
from forge_stream.trainer.service import PolicyTrainer, TrainerSettings
from forge_stream.trainer.step import StepConfig


@dataclass(frozen=True)
class ReplaySettings:
    bootstrap: str
    base_model: Path
    checkpoint_dir: Path
    run: str  # must differ from the live run's name
    where: Slice = field(default_factory=Slice)
    batch_size: int = 8
    step: StepConfig = field(default_factory=StepConfig)


def replay_samples(settings: ReplaySettings, errors: list | None = None) -> list[dict]:
    """The slice's TrainSamples, once each, in submission order (a SampleClaim redeemed from its store)."""
    unique = {e.record["event_id"]: e for e in read_slice(settings.bootstrap, TOPICS.samples, settings.where, errors)
              if e.schema in ("TrainSample", "SampleClaim")}
    samples = [redeem(e.record) if e.schema == "SampleClaim" else e.record for e in unique.values()]
    return sorted(samples, key=lambda r: (r["task_seq"], r["group_id"]))


class HistoryBatches:
    """Historical samples in consecutive batches as the loop's BatchSource; `ack` publishes the TrainStep only."""

    def __init__(self, samples: list[dict], batch_size: int, run: str, publish: Publish):
        self.samples, self.batch_size, self.run, self.publish = samples, batch_size, run, publish
        self.step = 0

    def next_batch(self, trainer_version: int) -> Batch | None:
        chunk = self.samples[self.step * self.batch_size:(self.step + 1) * self.batch_size]
        if not chunk:
            return None
        return Batch(chunk, [trainer_version - s["policy_version"] for s in chunk], trainer_version, 0)

    def ack(self, batch: Batch, metrics: dict) -> dict:
        record = step_record(self.run, self.step, batch, metrics)
        self.publish(TOPICS.train_metrics, self.run, record)
        self.step += 1
        return record


def replay(settings: ReplaySettings, progress=print) -> dict:
    """Train on the slice; returns a summary with the TrainStep records."""
    if settings.run == "default":
        raise ValueError("a replay needs its own run name (--run), so engines following the live run ignore it")
    errors: list = []
    samples = replay_samples(settings, errors)
    if not samples:
        raise ValueError(f"no TrainSamples on {TOPICS.samples.name} in {settings.where}: check the range")
    producer = EventProducer(settings.bootstrap)
    trainer = PolicyTrainer(TrainerSettings(
        bootstrap=settings.bootstrap, base_model=settings.base_model, checkpoint_dir=settings.checkpoint_dir,
        scheduler=SchedulerSettings(bootstrap=settings.bootstrap, run=settings.run), step=settings.step),
        resume_version=0)
    settings.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    try:
        steps = rl_loop(HistoryBatches(samples, settings.batch_size, settings.run, producer.send_sync), trainer,
                        producer.send_sync, progress=progress)
    finally:
        producer.close()
    return {"run": settings.run, "samples": len(samples), "steps": steps, "undecodable": len(errors),
            "final_policy_version": trainer.policy_version}
