"""The trainer process: windowed-FIFO batches from Kafka -> tree-packed CISPO step -> checkpoint -> PolicyVersion.

`run_trainer` runs the RL loop (forge_stream.trainer.loop.rl_loop) over the windowed FIFO consumer. One step:
1. `WindowedConsumer.next_batch` hands over up to `batch_size` finished groups (TrainSamples) inside the window;
2. `PolicyTrainer.step` (`train_step`) runs one tree-packed forward/backward per micro-batch forest and one AdamW
   step;
3. `PolicyTrainer.checkpoint` writes the new weights as a HuggingFace checkpoint (safetensors, tokenizer,
   optimizer state) and the loop publishes its PolicyVersion on forge.policy (the engines load it);
4. the scheduler publishes the TrainStep (the step's commit point: which groups were trained) and commits offsets.

A restart resumes from the checkpoint of the last committed step, so a step that crashed before its TrainStep
is trained again from the same weights and nothing is trained twice. Checkpoint folders carry a per-attempt
suffix so a re-trained version never overwrites weights an engine may already serve.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from confluent_kafka import Consumer, TopicPartition
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.events import deterministic_id, now_ms
from forge_stream.kafka.producer import EventProducer
from forge_stream.kafka.consumer import consumer_config
from forge_stream.scheduler.consumer import Batch, SchedulerSettings, WindowedConsumer, recover, start_at_end
from forge_stream.topics import TOPICS
from forge_stream.trainer.loop import rl_loop
from forge_stream.trainer.step import StepConfig, build_optimizer, sample_tree, train_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerSettings:
    bootstrap: str
    base_model: Path  # the initial policy, a HuggingFace causal-LM directory
    checkpoint_dir: Path
    scheduler: SchedulerSettings
    step: StepConfig = field(default_factory=StepConfig)
    keep_checkpoints: int = 3
    wait_s: float = 5.0  # how long to wait for a full batch before training a partial one
    from_now: bool = False  # a new run's queue starts at the current end of forge.tasks / forge.samples


def checkpoint_name(version: int) -> str:
    return f"v{version:06d}-{uuid.uuid4().hex[:8]}"


def find_checkpoint(checkpoint_dir: Path, version: int) -> Path | None:
    """The newest checkpoint folder written for `version`, if any."""
    found = sorted(checkpoint_dir.glob(f"v{version:06d}-*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


class PolicyTrainer:
    """The loop's learner (forge_stream.trainer.loop): owns the model, the optimizer and the policy version."""

    def __init__(self, settings: TrainerSettings, resume_version: int):
        self.settings = settings
        source = find_checkpoint(settings.checkpoint_dir, resume_version) if resume_version else None
        if resume_version and source is None:
            raise FileNotFoundError(
                f"forge.train_metrics says policy version {resume_version} was committed, but no checkpoint "
                f"v{resume_version:06d}-* is in {settings.checkpoint_dir}: point --checkpoint-dir at the run's "
                "checkpoints, or start a new run name")
        path = source or settings.base_model
        self.model = AutoModelForCausalLM.from_pretrained(path)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.optimizer = build_optimizer(self.model, settings.step)
        if source is not None and (source / "optimizer.pt").exists():
            self.optimizer.load_state_dict(torch.load(source / "optimizer.pt"))
        self.policy_version = resume_version
        log.info("trainer starts at policy version %d from %s", resume_version, path)

    def validate(self, sample: dict) -> None:
        """ValueError for a sample this model cannot train on (inconsistent tree, token ids outside its vocabulary,
        non-finite advantages or log-probs)."""
        tree = sample_tree(sample)
        vocab = self.model.get_input_embeddings().num_embeddings
        if tree.num_rows and int(tree.token_ids.max()) >= vocab:
            raise ValueError(f"token id {int(tree.token_ids.max())} is outside the model's vocabulary of {vocab}: "
                             "was it rolled out with another tokenizer?")
        if tree.num_rows and int(tree.token_ids.min()) < 0:
            raise ValueError(f"token id {int(tree.token_ids.min())} is negative")
        for ref in sample["sequences"]:
            if not (math.isfinite(ref["advantage"]) and all(map(math.isfinite, ref["old_logprobs"]))):
                raise ValueError(f"sequence {ref['completion_id']} has a non-finite advantage or logprob")

    @property
    def run(self) -> str:
        return self.settings.scheduler.run

    def step(self, batch: Batch) -> dict:
        """One optimizer step; returns the TrainStep metric fields it knows."""
        started = time.perf_counter()
        stats = train_step(self.model, self.optimizer, batch.samples, self.settings.step, self.policy_version)
        elapsed = time.perf_counter() - started
        metrics = {key: getattr(stats, key) for key in (
            "loss_name", "loss", "mean_reward", "outcome_reward", "rollouts", "total_tokens", "unique_tokens",
            "tree_ratio", "grad_norm", "clip_fraction", "ratio_mean", "ratio_max", "mismatch_mean",
            "mismatch_max")}
        return metrics | {"tokens_per_s": stats.total_tokens / elapsed, "lr": self.settings.step.lr}

    def checkpoint(self) -> dict:
        """Save the weights as the next policy version; returns its PolicyVersion record."""
        bad = [name for name, p in self.model.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise FloatingPointError(f"refusing to publish non-finite weights ({', '.join(bad[:3])}...); "
                                     "the last good checkpoint stays the served policy")
        self.policy_version += 1
        path = self._save(self.policy_version)
        return {"event_id": deterministic_id("policy", self.run, path.name), "event_time": now_ms(),
                "version": self.policy_version, "step": self.policy_version, "checkpoint_uri": str(path),
                "base_model": str(self.settings.base_model)}

    def _save(self, version: int) -> Path:
        root = self.settings.checkpoint_dir
        path = root / checkpoint_name(version)
        tmp = root / f".tmp-{path.name}"
        self.model.save_pretrained(tmp, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        tmp.rename(path)  # a checkpoint folder exists only once complete
        for old in sorted(root.glob("v*-*"))[: -self.settings.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return path


def has_committed_offsets(settings: SchedulerSettings) -> bool:
    consumer = Consumer(consumer_config(settings.bootstrap, settings.name))
    try:
        partitions = [TopicPartition(t.name, p) for t in (TOPICS.tasks, TOPICS.samples) for p in range(t.partitions)]
        return any(tp.offset >= 0 for tp in consumer.committed(partitions, timeout=10))
    finally:
        consumer.close()


class LiveBatches:
    """The windowed FIFO consumer as the loop's BatchSource: a batch as soon as the window offers a full one, or
    what there is after `wait_s`, waiting as long as it takes; `ack` publishes the TrainStep and commits."""

    def __init__(self, consumer: WindowedConsumer, wait_s: float):
        self.consumer = consumer
        self.wait_s = wait_s
        self.ack = consumer.ack

    def next_batch(self, trainer_version: int) -> Batch:
        while (batch := self.consumer.next_batch(trainer_version, self.wait_s, partial=True)) is None:
            pass
        return batch


def run_trainer(settings: TrainerSettings, steps: int | None = None, progress=print) -> list[dict]:
    """Train until `steps` steps are done (forever if None); returns the TrainStep records."""
    settings.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if settings.from_now and not has_committed_offsets(settings.scheduler):
        start_at_end(settings.scheduler)
    producer = EventProducer(settings.bootstrap, patient=True)  # a Kafka outage pauses training
    recovered = recover(settings.scheduler)
    resume = 0 if recovered.last_version is None else recovered.last_version + 1
    trainer = PolicyTrainer(settings, resume)
    consumer = WindowedConsumer(settings.scheduler, producer, recovered, validate=trainer.validate)
    try:
        return rl_loop(LiveBatches(consumer, settings.wait_s), trainer, producer.send_sync, steps, progress)
    finally:
        consumer.close()
