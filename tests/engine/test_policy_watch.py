"""An engine started with --bootstrap-servers loads each newer PolicyVersion published on forge.policy."""

import time

import httpx
import pytest

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


@pytest.mark.slow
def test_engine_follows_forge_policy(kafka_bootstrap, tiny_model_dir, tiny_model_dir_v1, tmp_path, run_id):
    producer = EventProducer(kafka_bootstrap)
    # whatever earlier tests published, publish a version above it
    version = 1000 + int(time.time()) % 100000
    with EngineProcess(str(tiny_model_dir), extra_args=("--bootstrap-servers", kafka_bootstrap,
                                                        "--policy-version", str(version - 1)),
                       log_path=tmp_path / "engine.log") as engine:
        assert _version(engine.url) == version - 1
        producer.send_sync(TOPICS.policy, "another-run", {
            "event_id": run_id + "x", "event_time": 0, "version": version + 5, "step": 1,
            "checkpoint_uri": str(tiny_model_dir_v1), "base_model": "tiny"})
        # a version whose checkpoint is gone (rotated away by the trainer) is skipped, the follower lives on
        producer.send_sync(TOPICS.policy, "default", {
            "event_id": run_id + "gone", "event_time": 0, "version": version, "step": 1,
            "checkpoint_uri": str(tmp_path / "rotated-away"), "base_model": "tiny"})
        time.sleep(2)
        assert _version(engine.url) == version - 1
        producer.send_sync(TOPICS.policy, "default", {
            "event_id": run_id, "event_time": 0, "version": version, "step": 1,
            "checkpoint_uri": str(tiny_model_dir_v1), "base_model": "tiny"})
        deadline = time.monotonic() + 60
        while _version(engine.url) != version and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _version(engine.url) == version  # not version + 5: that was another run's
        reply = httpx.post(f"{engine.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}, timeout=30).json()
        assert reply["policy_version"] == version
    producer.close()
    # its log says what it serves and follows, and each version it loaded or could not load, dated
    lines = (tmp_path / "engine.log").read_text().splitlines()
    ready = [line for line in lines if "INFO forge_stream.engine.api: engine ready (pid " in line]
    assert len(ready) == 1 and f"at policy version {version - 1} (cpu, float32); loads each new version of run " \
        f"'default' from {TOPICS.policy.name} at {kafka_bootstrap}" in ready[0], lines
    assert any(f"WARNING forge_stream.engine.policy_watch: cannot load policy version {version} " in line
               for line in lines), lines
    assert any(f"INFO forge_stream.engine.policy_watch: loaded policy version {version} from {tiny_model_dir_v1} in "
               in line for line in lines), lines
