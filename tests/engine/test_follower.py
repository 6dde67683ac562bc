"""An engine follows forge.policy (forge_stream.engine.shared.follower), on the real broker: it loads the newest version
published, never goes backwards, spaces its loads by the interval; a version it cannot serve (rotated away, a
truncated weight file, a config transformers refuses, weights whose probe log-probs are not finite) is logged in one
line and counted, the engine answers on under the last version it serves and loads the next good one; and once the
follower itself has stopped, /health is not ok and says why. The engine here is the torch engine, as a real server
process; tests/vllm/test_follower_faults.py runs the failures through real vLLM."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from forge_stream.engine.shared.follower import Applied, FollowerStatus, follow, newest
from forge_stream.engine.shared.process import EngineProcess
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

from helpers import until

LOAD_S = 0.5  # what a stood-in apply takes


def test_newest_picks_the_highest_version_ahead():
    records = [{"version": 3, "checkpoint_uri": "a"}, {"version": 5, "checkpoint_uri": "b"},
               {"version": 4, "checkpoint_uri": "c"}, {"version": 5, "checkpoint_uri": "d"}]
    assert newest(records, 2)["checkpoint_uri"] == "d"
    assert newest(records, 5, "d") is None
    assert newest(records, 5, "b")["checkpoint_uri"] == "d"  # re-published after a trainer crash
    assert newest(records, 6, "x") is None
    assert newest([], 0) is None


def _publish(producer: EventProducer, run: str, version: int, checkpoint: Path | str) -> None:
    producer.send_sync(TOPICS.policy, run, {
        "event_id": uuid.uuid4().hex, "event_time": int(time.time() * 1000), "version": version, "step": version,
        "checkpoint_uri": str(checkpoint), "base_model": "tiny"})


async def _loads(bootstrap: str, interval: float) -> list[tuple[int, float, float]]:
    """Follow a fresh run while v1 is published, then v2-v4 back to back as soon as v1's apply has started; the
    (version, start, end) of each apply until the engine serves v4 (the apply stands in for an engine's load)."""
    run = f"follow-{uuid.uuid4().hex[:8]}"
    serving = {"version": 0, "checkpoint": "/model"}
    loads: list[tuple[int, float, float]] = []
    producer = EventProducer(bootstrap)

    async def apply(checkpoint: str, version: int) -> Applied:
        began = time.monotonic()
        if version == 1:
            await asyncio.to_thread(lambda: [_publish(producer, run, v, f"/checkpoints/v{v}") for v in range(2, 5)])
        await asyncio.sleep(max(0.0, LOAD_S - (time.monotonic() - began)))
        serving.update(version=version, checkpoint=checkpoint)
        loads.append((version, began, time.monotonic()))
        return Applied(True, "stood in")

    await asyncio.to_thread(_publish, producer, run, 1, "/checkpoints/v1")
    follower = asyncio.create_task(follow(bootstrap, run, lambda: (serving["version"], serving["checkpoint"]), apply,
                                          FollowerStatus(), interval))
    try:
        deadline = time.monotonic() + 60
        while serving["version"] < 4:
            assert time.monotonic() < deadline, f"v4 not served; loads: {loads}"
            await asyncio.sleep(0.05)
    finally:
        follower.cancel()
        producer.close()
    return loads


def test_the_newest_version_is_loaded_next_and_the_ones_between_are_skipped(kafka_bootstrap):
    loads = asyncio.run(_loads(kafka_bootstrap, 0.0))
    assert [v for v, _, _ in loads] == [1, 4]
    assert loads[1][1] - loads[0][2] < 5.0  # no interval: as soon as v1's load ended (a broker poll or two)


def test_a_load_interval_spaces_the_loads(kafka_bootstrap):
    loads = asyncio.run(_loads(kafka_bootstrap, 3.0))
    assert [v for v, _, _ in loads] == [1, 4]
    assert loads[1][1] - loads[0][2] >= 3.0


def _health(url: str) -> dict:
    response = httpx.get(f"{url}/health", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def _answer_version(url: str) -> int:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["policy_version"]


def _broken_versions(good: Path, root: Path) -> dict[str, Path]:
    """Checkpoints the engine must refuse, each broken as a real one can be: a weight file cut short (a disk full,
    a copy interrupted), a config transformers refuses while parsing it, weights that hold NaN (a diverged step), a
    folder rotated away; and a good one outside the engine's checkpoint store (`root`), refused by the rule of
    /v1/admin/load_weights."""
    truncated, bad_config, nan = (shutil.copytree(good, root / name) for name in ("truncated", "bad-config", "nan"))
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    config = json.loads((bad_config / "config.json").read_text())
    (bad_config / "config.json").write_text(json.dumps({**config, "hidden_size": "wide"}))
    model = AutoModelForCausalLM.from_pretrained(nan)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(nan)
    return {"SafetensorError": truncated, "hidden_size": bad_config, "not finite": nan,
            "No checkpoint directory": root / "rotated-away", "outside the engine's checkpoint directory": good}


def test_the_engine_serves_on_through_versions_it_cannot_load_and_loads_the_next_good_one(
        kafka_bootstrap, tiny_model_dir, tiny_model_dir_v1, tmp_path, run_id):
    store = tmp_path / "checkpoints"
    broken = _broken_versions(tiny_model_dir_v1, store)
    good = shutil.copytree(tiny_model_dir_v1, store / "v1")
    producer = EventProducer(kafka_bootstrap)
    run = f"faults-{run_id}"
    with EngineProcess(str(tiny_model_dir), log_path=tmp_path / "engine.log", extra_args=(
            "--bootstrap-servers", kafka_bootstrap, "--policy-run", run, "--checkpoint-dir", str(store))) as engine:
        assert _health(engine.url)["failed_loads"] == 0
        _publish(producer, "another-run", 5, good)  # another run's: not this engine's
        for failed, (why, checkpoint) in enumerate(broken.items(), start=1):
            _publish(producer, run, 1, checkpoint)
            until(lambda: _health(engine.url)["failed_loads"] == failed, 60, lambda: f"{why}: {_health(engine.url)}")
            assert _health(engine.url)["policy_version"] == 0 and _answer_version(engine.url) == 0
        _publish(producer, run, 1, good)
        until(lambda: _health(engine.url)["policy_version"] == 1, 60, lambda: f"version 1: {_health(engine.url)}")
        health = _health(engine.url)
        assert (health["status"], health["loads"], health["failed_loads"]) == ("ok", 1, len(broken))
        assert health["switch_s"]["versions"] == 1 and 0 <= health["switch_s"]["median"] < 60, health
        assert _answer_version(engine.url) == 1
    producer.close()
    lines = (tmp_path / "engine.log").read_text().splitlines()
    ready = [line for line in lines if "INFO forge_stream.engine.torch_engine.api: engine ready (pid " in line]
    assert len(ready) == 1 and f"at policy version 0 (cpu, float32); loads each new version of run {run!r} from " \
        f"{TOPICS.policy.name} at {kafka_bootstrap}" in ready[0], lines
    refused = [line for line in lines if "WARNING forge_stream.engine.shared.follower: policy version 1 at " in line]
    assert len(refused) == len(broken), lines  # one line each
    for (why, checkpoint), line in zip(broken.items(), refused):
        assert f"at {checkpoint} is not served: " in line and why in line and "still serving version 0" in line, line
    assert any(f"INFO forge_stream.engine.shared.follower: serving policy version 1 from {good}: loaded in "
               in line and "s after it was published" in line for line in lines), lines
    assert "Traceback" not in "\n".join(lines)


def test_health_is_not_ok_once_the_follower_has_stopped(tiny_model_dir):
    """A bootstrap address aiokafka refuses (not one it cannot reach: that it retries) ends the follower; the engine
    still answers, and /health says it follows nothing."""
    from helpers import serving

    from forge_stream.engine.torch_engine.api import create_app
    from forge_stream.engine.torch_engine.serving import EngineService
    from forge_stream.engine.torch_engine.settings import EngineSettings

    app = create_app(EngineService.load(EngineSettings(model=str(tiny_model_dir))), policy_bootstrap="localhost:x")
    with serving(app) as url:
        response = until(lambda: (r := httpx.get(f"{url}/health", timeout=10)).status_code == 503 and r, 60)
        assert _answer_version(url) == 0
    body = response.json()
    assert body["status"] == "not following" and body["policy_version"] == 0, body
    assert "the policy follower stopped (ValueError: " in body["reason"] and "restart the engine" in body["reason"]
