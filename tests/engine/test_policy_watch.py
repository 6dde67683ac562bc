"""An engine started with --bootstrap-servers loads each newer PolicyVersion published on forge.policy whose checkpoint
lies in its checkpoint store (--checkpoint-dir)."""

import shutil
import time
from pathlib import Path

import httpx
from helpers import until

from forge_stream.engine.policy_watch import newest
from forge_stream.engine.process import EngineProcess
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS


def test_newest_picks_the_highest_version_ahead():
    records = [{"version": 3, "checkpoint_uri": "a"}, {"version": 5, "checkpoint_uri": "b"},
               {"version": 4, "checkpoint_uri": "c"}, {"version": 5, "checkpoint_uri": "d"}]
    assert newest(records, 2)["checkpoint_uri"] == "d"
    assert newest(records, 5, "d") is None
    assert newest(records, 5, "b")["checkpoint_uri"] == "d"  # re-published after a trainer crash
    assert newest(records, 6, "x") is None
    assert newest([], 0) is None


def _version(url):
    return httpx.get(f"{url}/health", timeout=5).json()["policy_version"]


def _logged(log: Path, text: str) -> None:
    until(lambda: text in log.read_text(), 60, lambda: f"{text!r} not in the engine's log:\n{log.read_text()}")


def test_engine_follows_forge_policy_from_its_checkpoint_store(kafka_bootstrap, tiny_model_dir, tiny_model_dir_v1,
                                                               tmp_path, run_id):
    producer = EventProducer(kafka_bootstrap)
    store, log = tmp_path / "checkpoints", tmp_path / "engine.log"
    inside = shutil.copytree(tiny_model_dir_v1, store / "v1")
    # whatever earlier tests published, publish a version above it
    version = 1000 + int(time.time()) % 100000

    def publish(run: str, key: str, version: int, checkpoint) -> None:
        producer.send_sync(TOPICS.policy, run, {"event_id": run_id + key, "event_time": 0, "version": version,
                                                "step": 1, "checkpoint_uri": str(checkpoint), "base_model": "tiny"})

    with EngineProcess(str(tiny_model_dir), log_path=log, extra_args=(
            "--bootstrap-servers", kafka_bootstrap, "--policy-version", str(version - 1),
            "--checkpoint-dir", str(store))) as engine:
        assert _version(engine.url) == version - 1
        publish("another-run", "x", version + 5, inside)
        # a checkpoint outside the store is refused by the rule of /v1/admin/load_weights: logged, not loaded
        publish("default", "outside", version, tiny_model_dir_v1)
        _logged(log, f"cannot load policy version {version} (The path is outside the engine's checkpoint directory")
        # a version whose checkpoint is gone (rotated away by the trainer) is skipped, the follower lives on
        publish("default", "gone", version, store / "rotated-away")
        _logged(log, f"cannot load policy version {version} (No checkpoint directory at")
        assert _version(engine.url) == version - 1
        publish("default", "", version, inside)
        until(lambda: _version(engine.url) == version, 60, "the version inside the store was not loaded")
        reply = httpx.post(f"{engine.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}, timeout=30).json()
        assert reply["policy_version"] == version  # not version + 5: that was another run's
    producer.close()
    # its log says what it serves and follows, and each version it loaded or could not load, dated
    lines = log.read_text().splitlines()
    ready = [line for line in lines if "INFO forge_stream.engine.api: engine ready (pid " in line]
    assert len(ready) == 1 and f"at policy version {version - 1} (cpu, float32); loads each new version of run " \
        f"'default' from {TOPICS.policy.name} at {kafka_bootstrap}" in ready[0], lines
    refused = [line for line in lines if f"WARNING forge_stream.engine.policy_watch: cannot load policy version "
               f"{version} " in line]
    assert any("outside the engine's checkpoint directory" in line for line in refused), refused
    assert not any(f"loaded policy version {version} from {tiny_model_dir_v1}" in line for line in lines), lines
    assert any(f"INFO forge_stream.engine.policy_watch: loaded policy version {version} from {inside} in "
               in line for line in lines), lines
