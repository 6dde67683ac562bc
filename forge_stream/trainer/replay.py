"""Replay: re-train from the TrainSamples already on forge.samples, between two timestamps or offsets.

History is read with `assign()` and no commits (forge_stream.kafka.history), so live consumer groups and their
offsets are untouched. Every replayed group is finished, so the windowed FIFO reduces to submission order:
samples are de-duplicated by event id, sorted by `task_seq` and trained in batches. The replay is its own run:
its checkpoints, PolicyVersions and TrainSteps carry its run name, which engines following the live run ignore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from forge_stream.kafka.history import Slice, read_slice
from forge_stream.kafka.producer import EventProducer
from forge_stream.scheduler.consumer import Batch, SchedulerSettings, step_record
from forge_stream.topics import TOPICS
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
    """The slice's TrainSamples, once each, in submission order."""
    unique = {e.record["event_id"]: e.record for e in read_slice(settings.bootstrap, TOPICS.samples, settings.where,
                                                                  errors)}
    return sorted(unique.values(), key=lambda r: (r["task_seq"], r["group_id"]))


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
        producer, resume_version=0)
    settings.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    steps = []
    for step, start in enumerate(range(0, len(samples), settings.batch_size)):
        chunk = samples[start:start + settings.batch_size]
        batch = Batch(chunk, [trainer.policy_version - s["policy_version"] for s in chunk], trainer.policy_version, 0)
        record = step_record(settings.run, step, batch, trainer.train(batch))
        producer.send_sync(TOPICS.train_metrics, settings.run, record)
        steps.append(record)
        progress(f"replay step {step + 1}/{-(-len(samples) // settings.batch_size)}: {len(chunk)} groups, "
                 f"loss {record['loss']:.4f}, T/U {record['tree_ratio']:.2f}")
    producer.close()
    return {"run": settings.run, "samples": len(samples), "steps": steps, "undecodable": len(errors),
            "final_policy_version": trainer.policy_version}
