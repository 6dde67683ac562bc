"""Which policy versions `engine vllm` loads, and when, following forge.policy on the real broker: the newest
published, and with --load-interval no sooner than that after the last load. The load itself is stood in for here
(it takes a fixed time); against real vLLM it is tested in tests/vllm/."""

import asyncio
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

from forge_stream.engine import vllm_load
from forge_stream.engine.vllm_engine import EngineState, VersionGate
from forge_stream.engine.vllm_load import follow_policy
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

LOAD_S = 0.5  # what a stood-in load takes


def _publish(bootstrap: str, run: str, versions: range) -> None:
    producer = EventProducer(bootstrap)
    for version in versions:
        producer.send_sync(TOPICS.policy, run, {
            "event_id": uuid.uuid4().hex, "event_time": int(time.time() * 1000), "version": version,
            "step": version, "checkpoint_uri": f"/checkpoints/v{version}", "base_model": "/model"})
    producer.close()


async def _loads(bootstrap: str, interval: float, monkeypatch) -> list[tuple[int, float, float]]:
    """Follow a fresh run while v1 is published, then v2-v4 back to back as soon as v1's load has started; the
    (version, start, end) of each load until the engine serves v4."""
    run = f"follow-{uuid.uuid4().hex[:8]}"
    settings = SimpleNamespace(bootstrap=bootstrap, policy_run=run, load_interval_s=interval)
    state = EngineState(settings, VersionGate(0), holds=Path(), checkpoint="/model", serving="/model")
    loads: list[tuple[int, float, float]] = []

    async def load(state: EngineState, checkpoint: str, version: int) -> bool:
        began = time.monotonic()
        if version == 1:
            await asyncio.to_thread(_publish, bootstrap, run, range(2, 5))
        await asyncio.sleep(max(0.0, LOAD_S - (time.monotonic() - began)))
        state.checkpoint, state.loads = checkpoint, state.loads + 1
        state.gate.reopen(version)
        loads.append((version, began, time.monotonic()))
        return True

    monkeypatch.setattr(vllm_load, "load_version", load)
    await asyncio.to_thread(_publish, bootstrap, run, range(1, 2))
    follower = asyncio.create_task(follow_policy(state))
    try:
        deadline = time.monotonic() + 60
        while state.gate.version < 4:
            assert time.monotonic() < deadline, f"v4 not served; loads: {loads}"
            await asyncio.sleep(0.05)
    finally:
        follower.cancel()
    return loads


def test_the_newest_version_is_loaded_next_and_the_ones_between_are_skipped(kafka_bootstrap, monkeypatch):
    loads = asyncio.run(_loads(kafka_bootstrap, 0.0, monkeypatch))
    assert [v for v, _, _ in loads] == [1, 4]
    assert loads[1][1] - loads[0][2] < 5.0  # no interval: as soon as v1's load ended (a broker poll or two)


def test_a_load_interval_spaces_the_loads(kafka_bootstrap, monkeypatch):
    loads = asyncio.run(_loads(kafka_bootstrap, 3.0, monkeypatch))
    assert [v for v, _, _ in loads] == [1, 4]
    assert loads[1][1] - loads[0][2] >= 3.0
