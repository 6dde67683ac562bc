"""The trainer on the real broker: windowed batches of TrainSamples -> steps -> checkpoints -> PolicyVersion,
picked up by an engine following the run; then a replay of the same history as its own run."""

import json
import subprocess
import sys
import time

import httpx
import pytest
from confluent_kafka import Consumer, TopicPartition

from forge_stream.engine.shared.process import EngineProcess
from forge_stream.events import now_ms
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.kafka.producer import EventProducer
from forge_stream.processors.fold import fold
from forge_stream.processors.settings import ProcessorSettings
from forge_stream.processors.synthetic import group_events
from forge_stream.scheduler.consumer import SchedulerSettings, start_at_end
from forge_stream.topics import TOPICS


def _publish_groups(bootstrap, run_id, n):
    """Task + TrainSample of n synthetic groups, computed by the processors' pure fold."""
    producer = EventProducer(bootstrap)
    groups = []
    for i in range(n):
        gid = f"{run_id}-g{i}"
        state, sample = None, None
        events = group_events(gid, seq=now_ms() * 1000 + i, group_size=3, turns=2, start_ms=now_ms())
        for schema, record in events:
            if schema == "Task":
                producer.send_sync(TOPICS.tasks, gid, record)
            state, emits = fold(state, schema, record, ProcessorSettings())
            sample = next((e.record for e in emits if e.schema == "TrainSample"), sample)
        producer.send_sync(TOPICS.samples, gid, sample)
        groups.append(gid)
    producer.close()
    return groups


def _cli(*args, timeout=300):
    try:
        out = subprocess.run([sys.executable, "-m", "forge_stream", *args], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"forge-stream {args[0]} timed out; it printed:\n{(exc.stderr or b'').decode()[-4000:]}")
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _committed(bootstrap, group):
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        parts = [TopicPartition(t.name, p) for t in (TOPICS.tasks, TOPICS.samples) for p in range(t.partitions)]
        return {(tp.topic, tp.partition): tp.offset for tp in consumer.committed(parts, timeout=10)}
    finally:
        consumer.close()


@pytest.mark.slow
def test_train_publishes_versions_the_engine_serves_then_replay(kafka_bootstrap, tiny_model_dir, tmp_path, run_id):
    run = f"run-{run_id}"
    start_at_end(SchedulerSettings(bootstrap=kafka_bootstrap, run=run))
    since = now_ms() - 1
    groups = _publish_groups(kafka_bootstrap, run_id, 4)
    with EngineProcess(str(tiny_model_dir), extra_args=("--bootstrap-servers", kafka_bootstrap, "--policy-run", run,
                                                          "--checkpoint-dir", str(tmp_path)),
                       log_path=tmp_path / "engine.log") as engine:
        _cli("train", "--bootstrap-servers", kafka_bootstrap, "--run", run, "--model", str(tiny_model_dir),
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "2", "--batch-size", "2", "--wait-s", "2",
             "--lr", "1e-3", timeout=60)
        deadline = time.monotonic() + 60
        while httpx.get(f"{engine.url}/health").json()["policy_version"] != 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        health = httpx.get(f"{engine.url}/health").json()
        assert health["policy_version"] == 2

    steps = [e.record for e in read_slice(kafka_bootstrap, TOPICS.train_metrics, Slice()) if e.key == run]
    assert [s["step"] for s in steps] == [0, 1] and [s["policy_version"] for s in steps] == [0, 1]
    assert sorted(g for s in steps for g in s["group_ids"]) == sorted(groups)
    assert all(s["tree_ratio"] > 1.0 and s["unique_tokens"] < s["total_tokens"] for s in steps)
    assert sorted(p.name[:7] for p in (tmp_path / "ckpt").iterdir()) == ["v000001", "v000002"]
    live_offsets = _committed(kafka_bootstrap, f"scheduler:{run}")

    out = _cli("replay", "--bootstrap-servers", kafka_bootstrap, "--run", f"{run}-replay", "--from", str(since),
               "--model", str(tiny_model_dir), "--checkpoint-dir", str(tmp_path / "replay"), "--batch-size", "2",
               "--json")
    result = json.loads(out.stdout)
    assert result["samples"] >= 4 and result["final_policy_version"] == len(result["steps"])
    replayed = {g for s in result["steps"] for g in s["group_ids"]}
    assert set(groups) <= replayed
    assert _committed(kafka_bootstrap, f"scheduler:{run}") == live_offsets  # live offsets untouched


def test_trainer_rejects_samples_it_cannot_train_on(tiny_model_dir, tmp_path, run_id):
    from forge_stream.trainer.service import PolicyTrainer, TrainerSettings

    trainer = PolicyTrainer(TrainerSettings(bootstrap="unused:9092", base_model=tiny_model_dir,
                                            checkpoint_dir=tmp_path,
                                            scheduler=SchedulerSettings(bootstrap="unused:9092", run=run_id)),
                            resume_version=0)
    state, good = None, None
    for schema, record in group_events(run_id, group_size=2, turns=2):
        state, emits = fold(state, schema, record, ProcessorSettings())
        good = next((e.record for e in emits if e.schema == "TrainSample"), good)
    trainer.validate(good)
    too_big = {**good, "token_ids": [50_000] + list(good["token_ids"][1:])}
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        trainer.validate(too_big)
    with pytest.raises(ValueError, match="at least one sequence"):
        trainer.validate({**good, "sequences": []})
    with pytest.raises(ValueError, match="negative"):
        trainer.validate({**good, "token_ids": [-3] + list(good["token_ids"][1:])})
    nan_advantage = {**good, "sequences": [{**good["sequences"][0], "advantage": float("nan")},
                                           *good["sequences"][1:]]}
    with pytest.raises(ValueError, match="non-finite"):
        trainer.validate(nan_advantage)
    for name, param in trainer.model.named_parameters():  # never published: the last good policy stays served
        param.data[0] = float("nan")
        break
    with pytest.raises(FloatingPointError, match="non-finite weights"):
        trainer.checkpoint()
    assert trainer.policy_version == 0 and not list(tmp_path.glob("v*"))


def test_a_train_step_reports_every_update_of_its_batch(tiny_model_dir, tmp_path, run_id):
    """With 3 updates per batch the TrainStep (encoded as Avro and read back) carries each update's loss, grad
    norm, clip fraction, ratio and mismatch; its own fields stay the first update's. An older TrainStep reads with
    no updates listed."""
    from forge_stream.events import decode, default_registry, encode
    from forge_stream.scheduler.consumer import Batch, step_record
    from forge_stream.trainer.service import PolicyTrainer, TrainerSettings
    from forge_stream.trainer.step import StepConfig

    trainer = PolicyTrainer(TrainerSettings(bootstrap="unused:9092", base_model=tiny_model_dir,
                                            checkpoint_dir=tmp_path,
                                            scheduler=SchedulerSettings(bootstrap="unused:9092", run=run_id),
                                            step=StepConfig(lr=3e-2, updates=3)),
                            resume_version=0)
    state, sample = None, None
    for schema, record in group_events(run_id, group_size=3, turns=2):
        state, emits = fold(state, schema, record, ProcessorSettings())
        sample = next((e.record for e in emits if e.schema == "TrainSample"), sample)
    batch = Batch([sample], [0], 0, 0)
    _, step = decode(encode("TrainStep", step_record(run_id, 0, batch, trainer.step(batch))))
    updates = step["per_update"]
    assert len(updates) == 3
    first = {key: step[key] for key in ("loss", "grad_norm", "clip_fraction", "ratio_mean", "ratio_max",
                                        "mismatch_mean", "mismatch_max")}
    assert updates[0] == first
    assert updates[1]["mismatch_mean"] != first["mismatch_mean"]  # the later updates drift from the sampler
    assert updates[2]["mismatch_mean"] != updates[1]["mismatch_mean"]
    old = default_registry().versions["forge.events.TrainStep"][1]
    assert old.version == 2 and "per_update" not in {f["name"] for f in old.parsed["fields"]}
    import io
    import struct

    from fastavro import schemaless_writer

    buf = io.BytesIO()
    buf.write(struct.pack(">bI", 0, old.id))
    schemaless_writer(buf, old.parsed, {k: v for k, v in step.items() if k != "per_update"})
    assert decode(buf.getvalue())[1]["per_update"] == []


def test_rotation_keeps_the_newest_attempt_of_the_newest_versions(tmp_path):
    """Version 5 was written three times (steps re-run after crashes): the newest attempt is what a resume loads,
    so rotation drops the superseded attempts before any version, whatever their random suffixes sort like."""
    import os

    from forge_stream.trainer.service import find_checkpoint, rotate_checkpoints

    folders = ["v000003-cccc", "v000004-bbbb", "v000005-ffff", "v000005-eeee", "v000005-0000", "v000006-9999"]
    for age, name in enumerate(folders):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1_000_000 + age, 1_000_000 + age))  # written in this order
    (tmp_path / ".tmp-v000007-aaaa").mkdir()  # a save in progress is not a checkpoint
    deleted = rotate_checkpoints(tmp_path, keep=3)
    assert sorted(p.name for p in deleted) == ["v000003-cccc", "v000005-eeee", "v000005-ffff"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-v000007-aaaa", "v000004-bbbb", "v000005-0000",
                                                          "v000006-9999"]
    assert find_checkpoint(tmp_path, 5).name == "v000005-0000"


def test_a_step_without_signal_links_the_last_checkpoint_instead_of_writing_it(tiny_model_dir, tmp_path, run_id):
    """A batch whose every advantage is 0 changes no weight and no optimizer state: its version's checkpoint is hard
    links to the last one's files (the same bytes, no write); a step with a signal writes new files, and a trainer
    resumes from a linked checkpoint as from any other."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from forge_stream.scheduler.consumer import Batch
    from forge_stream.trainer.service import PolicyTrainer, TrainerSettings, find_checkpoint
    from forge_stream.trainer.step import StepConfig

    settings = TrainerSettings(bootstrap="unused:9092", base_model=tiny_model_dir, checkpoint_dir=tmp_path,
                               scheduler=SchedulerSettings(bootstrap="unused:9092", run=run_id),
                               step=StepConfig(lr=3e-2), keep_checkpoints=2)
    trainer = PolicyTrainer(settings, resume_version=0)
    state, sample = None, None
    for schema, record in group_events(run_id, group_size=3, turns=2):
        state, emits = fold(state, schema, record, ProcessorSettings())
        sample = next((e.record for e in emits if e.schema == "TrainSample"), sample)
    flat = {**sample, "sequences": [{**ref, "advantage": 0.0} for ref in sample["sequences"]]}

    def step(s: dict) -> Path:
        batch = Batch([s], [0], trainer.policy_version, 0)
        trainer.step(batch)
        return Path(trainer.checkpoint()["checkpoint_uri"])

    def inodes(folder: Path) -> dict[str, int]:
        return {f.name: f.stat().st_ino for f in folder.iterdir()}

    written = inodes(step(sample))  # a signal: written
    v2 = step(flat)  # none: linked
    assert inodes(v2) == written and (v2 / "optimizer.pt").exists()
    v3 = step(flat)
    assert inodes(v3) == written
    v4 = step(sample)  # a signal again: new weights, new files
    assert not set(inodes(v4).values()) & set(inodes(v3).values())
    before, after = load_file(v3 / "model.safetensors"), load_file(v4 / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name[:7] for p in tmp_path.glob("v*")) == ["v000003", "v000004"]  # rotation as usual
    assert (v3 / "model.safetensors").exists()  # v1 and v2 deleted under it: its links hold the bytes
    resumed = PolicyTrainer(settings, resume_version=3)
    assert find_checkpoint(tmp_path, 3) == v3
    weights = dict(resumed.model.named_parameters())
    assert all(torch.equal(weights[k].detach(), v) for k, v in before.items() if k in weights)
    assert resumed.saved == v3
