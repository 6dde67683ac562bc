"""vllm-sync follows forge.policy on the real broker and drives fake `vllm serve` workers through the update plan."""

import asyncio
import contextlib

import httpx
import pytest

from forge_stream.engine.vllm_sync import (SyncSettings, VllmWorkerClient, WorkerError, backoff_delays,
                                           follow_policy, update_plan, update_worker)
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS
from helpers import fake_vllm


def _expected_calls(path: str, version: int) -> list:
    return [
        ["GET", "/is_sleeping", {}, None],
        ["POST", "/pause", {"mode": "wait"}, None],
        ["POST", "/collective_rpc", {}, {"method": "update_config", "args": [{"model_config": {"model": path}}]}],
        ["POST", "/collective_rpc", {}, {"method": "reload_weights"}],
        ["POST", "/update_weight_version", {}, {"new_version": str(version)}],
        ["POST", "/reset_prefix_cache", {"reset_external": "true"}, None],
        ["POST", "/resume", {}, None],
    ]


def test_plan_and_backoff():
    plan = update_plan("/ckpt/v7", 7)
    assert [(c.method, c.path) for c in plan][0] == ("GET", "/is_sleeping")
    assert [c.path for c in plan].index("/pause") < [c.path for c in plan].index("/resume")
    assert plan[-1].path == "/resume"
    assert backoff_delays(4, 0.5) == [0.5, 1.0, 2.0]


def _state(url):
    return httpx.get(f"{url}/fake/state", timeout=5).json()


def _publish(producer, run, version, path, event_id):
    producer.send_sync(TOPICS.policy, run, {"event_id": event_id, "event_time": 0, "version": version, "step": version,
                                            "checkpoint_uri": str(path), "base_model": "tiny"})


@pytest.mark.kafka
def test_sync_follows_one_run_and_retries(kafka_bootstrap, tiny_model_dir, tmp_path, run_id):
    run = f"run-{run_id}"
    ckpt = {v: tmp_path / f"v{v}" for v in (1, 2, 3, 9)}
    producer = EventProducer(kafka_bootstrap)
    _publish(producer, run, 1, ckpt[1], run_id + "1")
    _publish(producer, f"other-{run_id}", 9, ckpt[9], run_id + "9")
    _publish(producer, run, 2, ckpt[2], run_id + "2")
    reports = []

    async def scenario(w1, w2, w3):
        settings = SyncSettings(workers=(w1, w2, w3), run=run, attempts=2, backoff_s=0.05, poll_ms=100)
        task = asyncio.create_task(follow_policy(kafka_bootstrap, settings, reports.append))
        try:
            while not reports:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(_publish, producer, run, 3, ckpt[3], run_id + "3")
            while len(reports) < 2:
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    with fake_vllm(tiny_model_dir) as w1, fake_vllm(tiny_model_dir, "--fail-first", "1") as w2, \
            fake_vllm(tiny_model_dir) as w3:
        httpx.post(f"{w3}/sleep", params={"level": 1}, timeout=5).raise_for_status()
        asyncio.run(asyncio.wait_for(scenario(w1, w2, w3), 25))
        s1, s2, s3 = _state(w1), _state(w2), _state(w3)
    producer.close()

    # the backlog (v1, another run's v9, v2) applies only v2; then v3 arrives live
    assert [(r.version, r.updated, list(r.failed)) for r in reports] == [(2, [w1, w2], [w3]), (3, [w1, w2], [w3])]
    assert s1["calls"] == _expected_calls(str(ckpt[2]), 2) + _expected_calls(str(ckpt[3]), 3)
    # the first request failed (500), the whole plan was retried
    assert s2["calls"] == ([["GET", "/is_sleeping", {}, None]] + _expected_calls(str(ckpt[2]), 2)
                           + _expected_calls(str(ckpt[3]), 3))
    for state in (s1, s2):
        assert state["model"] == str(ckpt[3]) and state["weight_version"] == "3"
        assert state["paused"] is False and state["prefix_cache_resets"] == 2
    # a sleeping worker is never paused nor reloaded: it keeps its weights, reported failed each time
    assert s3["calls"] == [["POST", "/sleep", {"level": "1"}, None]] + [["GET", "/is_sleeping", {}, None]] * 4
    assert s3["model"] == str(tiny_model_dir) and s3["weight_version"] is None
    assert "is_sleeping" in reports[0].failed[w3]


def test_failure_after_pause_resumes_the_worker(tiny_model_dir, tmp_path):
    async def scenario(url):
        async with httpx.AsyncClient(timeout=10) as client:
            # asleep, and the check skipped: the reload after the pause is refused with a 500
            await client.post(f"{url}/sleep")
            plan = [c for c in update_plan(str(tmp_path), 4) if c.path != "/is_sleeping"]
            with pytest.raises(WorkerError, match="collective_rpc: HTTP 500"):
                await update_worker(VllmWorkerClient(url, client), plan, SyncSettings(workers=(url,), attempts=1))

    with fake_vllm(tiny_model_dir) as url:
        asyncio.run(scenario(url))
        state = _state(url)
    assert [c[:2] for c in state["calls"]] == [["POST", "/sleep"], ["POST", "/pause"], ["POST", "/collective_rpc"],
                                              ["POST", "/resume"]]
    assert state["paused"] is False and state["model"] == str(tiny_model_dir) and state["weight_version"] is None
