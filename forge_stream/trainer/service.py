"""The trainer process: windowed-FIFO batches from Kafka -> tree-packed CISPO step -> checkpoint -> PolicyVersion.

`run_trainer` runs the RL loop (forge_stream.trainer.loop.rl_loop) over the windowed FIFO consumer. One step:
1. `WindowedConsumer.next_batch` hands over up to `batch_size` finished groups (TrainSamples) inside the window;
2. `PolicyTrainer.step` (`train_step`) runs one tree-packed forward/backward per micro-batch forest and one AdamW
   step;
3. `PolicyTrainer.checkpoint` writes the new weights as a HuggingFace checkpoint (safetensors, tokenizer,
   optimizer state; after a step whose batch had no signal, hard links to the last checkpoint's files) and the
   loop publishes its PolicyVersion on forge.policy (the engines load it);
   with `lora_rank` the model trains a LoRA adapter (forge_stream.lora) on every linear layer but the LM head,
   the optimizer holds the adapter's parameters only, and a checkpoint is the adapter (peft's
   adapter_config.json + adapter_model.safetensors, megabytes instead of the model's size) plus its optimizer
   state; its PolicyVersion carries `lora_rank`, and `base_model` names the model the adapter applies to;
4. the scheduler publishes the TrainStep (the step's commit point: which groups were trained) and commits offsets.

A restart resumes from the checkpoint of the last committed step, so a step that crashed before its TrainStep
is trained again from the same weights and nothing is trained twice. Checkpoint folders carry a per-attempt
suffix so a re-trained version never overwrites weights an engine may already serve.

Under torchrun (`forge-stream train --nproc N`, forge_stream.trainer.distributed) rank 0 alone does all of the
above that touches Kafka or the checkpoint folder; the other ranks `follow`: they receive each batch from rank 0,
take the same step on their share of it, and stop when rank 0 sends None.
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
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream import lora
from forge_stream.events import deterministic_id, now_ms
from forge_stream.files import link_tree
from forge_stream.kafka.producer import EventProducer
from forge_stream.kafka.consumer import has_committed_offsets
from forge_stream.scheduler.consumer import Batch, SchedulerSettings, WindowedConsumer, recover, start_at_end
from forge_stream.topics import TOPICS
from forge_stream.trainer.distributed import DataParallel, shard_model
from forge_stream.trainer.loop import rl_loop
from forge_stream.trainer.step import StepConfig, build_optimizer, sample_tree, train_step

log = logging.getLogger(__name__)
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # an FSDP model's whole state, on rank 0's CPU


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
    lora_rank: int = 0  # > 0: train a LoRA adapter of this rank on base_model (forge_stream.lora); 0: every weight
    lora_alpha: float | None = None  # the adapter's alpha (its scale is alpha / rank); None: lora.default_alpha


def checkpoint_name(version: int) -> str:
    return f"v{version:06d}-{uuid.uuid4().hex[:8]}"


def find_checkpoint(checkpoint_dir: Path, version: int) -> Path | None:
    """The newest checkpoint folder written for `version`, if any."""
    found = sorted(checkpoint_dir.glob(f"v{version:06d}-*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def rotate_checkpoints(checkpoint_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest attempt of each of the `keep` highest versions; return what was deleted.

    A version has several folders when the trainer re-ran its step after a crash (the first attempt was written,
    its TrainStep was not): the newest one is the one a resume loads (`find_checkpoint`) and the one re-published,
    so superseded attempts go first, whatever their random suffixes sort like.
    """
    newest: dict[int, Path] = {}
    doomed: list[Path] = []
    for path in sorted(checkpoint_dir.glob("v*-*"), key=lambda p: p.stat().st_mtime):
        try:
            version = int(path.name[1:].split("-", 1)[0])
        except ValueError:
            continue  # not a checkpoint folder of ours
        if version in newest:
            doomed.append(newest[version])
        newest[version] = path
    doomed += [newest[v] for v in sorted(newest)[:-keep]] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


class PolicyTrainer:
    """The loop's learner (forge_stream.trainer.loop): owns the model, the optimizer and the policy version."""

    def __init__(self, settings: TrainerSettings, resume_version: int, ranks: DataParallel | None = None):
        self.settings = settings
        self.ranks = ranks
        source = find_checkpoint(settings.checkpoint_dir, resume_version) if resume_version else None
        if resume_version and source is None:
            raise FileNotFoundError(
                f"forge.train_metrics says policy version {resume_version} was committed, but no checkpoint "
                f"v{resume_version:06d}-* is in {settings.checkpoint_dir}: point --checkpoint-dir at the run's "
                "checkpoints, or start a new run name")
        path = source or settings.base_model
        self.adapter = None  # with LoRA: the peft model, whose `save_pretrained` writes the adapter alone
        if settings.lora_rank:
            if ranks is not None and ranks.fsdp:
                raise ValueError("LoRA (--lora-rank) is not supported with --fsdp: drop one of them")
            base = AutoModelForCausalLM.from_pretrained(settings.base_model)
            self.adapter = (lora.load_adapter(base, source, trainable=True) if source is not None
                            else lora.wrap(base, settings.lora_rank, settings.lora_alpha))
            self.model = self.adapter.base_model.model  # the model itself, its linear layers adapted in place
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path)
        self.model.train()
        if ranks is not None:
            self.model.to(ranks.device)
            if ranks.fsdp:
                shard_model(self.model)
            else:
                ranks.sync_parameters(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.base_model if settings.lora_rank else path)
        self.optimizer = build_optimizer(self.model, settings.step)
        if source is not None and (source / "optimizer.pt").exists():
            state = torch.load(source / "optimizer.pt", map_location="cpu")
            if ranks is not None and ranks.fsdp:
                set_optimizer_state_dict(self.model, self.optimizer, state, options=_FULL)
            else:
                self.optimizer.load_state_dict(state)
        self.policy_version = resume_version
        self.saved = source  # the checkpoint folder holding the current weights and optimizer state, once one does
        self.unchanged = False  # the last step changed no weight and no optimizer state (its batch had no signal)
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
        stats = train_step(self.model, self.optimizer, batch.samples, self.settings.step, self.policy_version,
                           self.ranks, progress=_slow_progress(started))
        elapsed = time.perf_counter() - started
        # no group with a signal: no forward pass ran, no parameter got a gradient, AdamW skipped every one
        self.unchanged = self.ranks is None and stats.groups_without_signal == len(batch.samples)
        metrics = {key: getattr(stats, key) for key in (
            "loss_name", "loss", "mean_reward", "outcome_reward", "rollouts", "total_tokens", "unique_tokens",
            "tree_ratio", "grad_norm", "clip_fraction", "ratio_mean", "ratio_max", "mismatch_mean",
            "mismatch_max", "per_update", "groups_without_signal")}
        return metrics | {"tokens_per_s": stats.total_tokens / elapsed, "lr": self.settings.step.lr}

    def checkpoint(self) -> dict:
        """Save the weights as the next policy version; returns its PolicyVersion record (None on ranks other
        than 0, which only count the version)."""
        bad = [name for name, p in self.model.named_parameters() if not torch.isfinite(_local(p)).all()]
        if bad if self.ranks is None else not self.ranks.agree(not bad):
            raise FloatingPointError(f"refusing to publish non-finite weights ({', '.join(bad[:3])}...); "
                                     "the last good checkpoint stays the served policy")
        self.policy_version += 1
        model_state = optimizer_state = None
        if self.ranks is not None and self.ranks.fsdp:  # collectives: every rank gathers, rank 0 keeps the result
            model_state = get_model_state_dict(self.model, options=_FULL)
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)
        if self.ranks is not None and not self.ranks.is_main:
            return None
        if self.unchanged and self.saved is not None and self.saved.is_dir():
            path = self._link(self.policy_version)
        else:
            path = self._save(self.policy_version, model_state, optimizer_state)
        self.saved, self.unchanged = path, False
        return {"event_id": deterministic_id("policy", self.run, path.name), "event_time": now_ms(),
                "version": self.policy_version, "step": self.policy_version, "checkpoint_uri": str(path),
                "base_model": str(self.settings.base_model), "lora_rank": self.settings.lora_rank,
                "size_bytes": lora.weight_bytes(path)}

    def _link(self, version: int) -> Path:
        """The next version's checkpoint as hard links to the current one's files (copies across file systems): a
        step without signal changed nothing, and writing the same weights and optimizer state again costs seconds
        of a real model's step (SmolLM2-135M: 0.5 GB of weights, 1 GB of AdamW state). The bytes are the same, so
        a vLLM engine renames the version rather than reloading it."""
        root = self.settings.checkpoint_dir
        path = root / checkpoint_name(version)
        tmp = root / f".tmp-{path.name}"
        link_tree(self.saved, tmp)
        tmp.rename(path)  # a checkpoint folder exists only once complete
        rotate_checkpoints(root, self.settings.keep_checkpoints)
        return path

    def _save(self, version: int, model_state: dict | None = None, optimizer_state: dict | None = None) -> Path:
        root = self.settings.checkpoint_dir
        path = root / checkpoint_name(version)
        tmp = root / f".tmp-{path.name}"
        if self.adapter is not None:
            self.adapter.save_pretrained(tmp, safe_serialization=True)
        else:
            self.model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
            self.tokenizer.save_pretrained(tmp)
        torch.save(optimizer_state or self.optimizer.state_dict(), tmp / "optimizer.pt")
        tmp.rename(path)  # a checkpoint folder exists only once complete
        rotate_checkpoints(root, self.settings.keep_checkpoints)
        return path


def _slow_progress(started: float, every_s: float = 30.0):
    """A step's micro-batch progress, logged only once the step has run `every_s` and then at most that often:
    quiet for the usual sub-second steps, a heartbeat for a long sample's step (minutes to an hour on a CPU)."""
    last = [started]

    def report(line: str) -> None:
        now = time.perf_counter()
        if now - last[0] >= every_s:
            last[0] = now
            log.info("step in progress: %s", line)

    return report


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP parameter (a DTensor), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


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


class SharedBatches:
    """Rank 0's BatchSource: each batch of `source` (None at its end) goes to every rank too; `stop` tells the
    other ranks that no batch will follow."""

    def __init__(self, source, ranks: DataParallel):
        self.source, self.ranks = source, ranks
        self.ack = source.ack
        self.stopped = False

    def next_batch(self, trainer_version: int) -> Batch | None:
        batch = self.ranks.broadcast(self.source.next_batch(trainer_version))
        self.stopped = batch is None
        return batch

    def stop(self) -> None:
        if not self.stopped:
            self.ranks.broadcast(None)
            self.stopped = True


def follow(settings: TrainerSettings, ranks: DataParallel) -> None:
    """A rank other than 0: the same steps as rank 0 on the batches it sends, until it sends None."""
    trainer = PolicyTrainer(settings, ranks.broadcast(), ranks)
    log.info("rank %d of %d follows rank 0 from policy version %d", ranks.rank, ranks.world_size,
             trainer.policy_version)
    while (batch := ranks.broadcast()) is not None:
        trainer.step(batch)
        trainer.checkpoint()


def run_trainer(settings: TrainerSettings, steps: int | None = None, progress=print,
                ranks: DataParallel | None = None) -> list[dict]:
    """Train until `steps` steps are done (forever if None); returns the TrainStep records (none on ranks other
    than 0)."""
    if ranks is not None and not ranks.is_main:
        follow(settings, ranks)
        return []
    settings.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if settings.from_now and not has_committed_offsets(settings.bootstrap, settings.scheduler.name,
                                                       [TOPICS.tasks, TOPICS.samples]):
        start_at_end(settings.scheduler)
    producer = EventProducer(settings.bootstrap, patient=True)  # a Kafka outage pauses training
    recovered = recover(settings.scheduler)
    resume = 0 if recovered.last_version is None else recovered.last_version + 1
    if ranks is not None:
        ranks.broadcast(resume)
    trainer = PolicyTrainer(settings, resume, ranks)
    consumer = WindowedConsumer(settings.scheduler, producer, recovered, validate=trainer.validate)
    source = LiveBatches(consumer, settings.wait_s)
    if ranks is not None:
        source = SharedBatches(source, ranks)
    try:
        done = rl_loop(source, trainer, producer.send_sync, steps, progress)
        if ranks is not None:
            source.stop()  # not after an error: the others may be inside a collective; torchrun stops them
        return done
    finally:
        consumer.close()
