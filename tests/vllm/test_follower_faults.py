"""Versions real vLLM cannot serve, each failing at its own place in a load (forge_stream.engine.vllm_front.load): a
weight file cut short (safetensors' error in the probe's reference, before the drain), a config without `vocab_size` (a
KeyError parsing it), and a config the reload cannot apply (vLLM reloads weights only: with another RoPE base its
log-probs differ from transformers', so the probe rolls the version back after the drain). Through all three the
engine serves its version, awake, /health ok, one log line each; then it loads the next good version.
tests/engine/test_follower.py runs the same through the torch engine, in seconds."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest

from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

from helpers import until

pytestmark = pytest.mark.slow


def _broken_versions(checkpoints: list[Path], root: Path) -> dict[str, Path]:
    truncated, no_vocab, other_rope = (shutil.copytree(c, root / name) for c, name in
                                       zip(checkpoints, ("truncated", "no-vocab", "other-rope")))
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    config = json.loads((no_vocab / "config.json").read_text())
    del config["vocab_size"]
    (no_vocab / "config.json").write_text(json.dumps(config))
    config = json.loads((other_rope / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 100.0
    (other_rope / "config.json").write_text(json.dumps(config))
    return {"SafetensorError": truncated, "KeyError 'vocab_size'": no_vocab,
            "it was not proven (WorkerError: probe log-probs differ from the checkpoint's": other_rope}


def _answer(url: str) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "m", "prompt": "Count with me:", "max_tokens": 4, "temperature": 1.0})
    assert response.status_code == 200, response.text
    return response.json()


def test_vllm_serves_on_through_versions_it_cannot_load_and_loads_the_next_good_one(vllm_engine, checkpoints,
                                                                                   tmp_path):
    broken = _broken_versions(checkpoints, tmp_path)
    before = vllm_engine.health()
    log_start = len(vllm_engine.log.read_text())
    version = before["policy_version"] + 1
    producer = EventProducer(vllm_engine.bootstrap)
    for failed, (why, folder) in enumerate(broken.items(), start=1):
        producer.send_sync(TOPICS.policy, vllm_engine.run, {
            "event_id": uuid.uuid4().hex, "event_time": int(time.time() * 1000), "version": version, "step": version,
            "checkpoint_uri": str(folder), "base_model": str(folder)})
        until(lambda: vllm_engine.health()["failed_loads"] == before["failed_loads"] + failed, 300,
              lambda: f"{why}: {vllm_engine.health()}; see {vllm_engine.log}")
        now = vllm_engine.health()
        assert now["status"] == "ok" and (now["policy_version"], now["checkpoint"], now["loads"]) == (
            before["policy_version"], before["checkpoint"], before["loads"]), now
        assert _answer(vllm_engine.url)["policy_version"] == before["policy_version"]  # awake, behind an open gate
    producer.close()
    log = vllm_engine.log.read_text()[log_start:]
    refused = [line for line in log.splitlines() if f"policy version {version} at " in line]
    assert len(refused) == len(broken), refused  # one line each
    for (why, folder), line in zip(broken.items(), refused):
        assert f"at {folder} is not served: " in line and why in line, line
    assert "loaded back" in refused[-1] and "starts afresh" not in log, log[-3000:]

    assert vllm_engine.push_version(checkpoints[1]) == version  # the next good version loads, proven
    now = vllm_engine.health()
    assert now["checkpoint"] == str(checkpoints[1]) and now["probe_mismatch"] < 1e-3
    assert _answer(vllm_engine.url)["policy_version"] == version
