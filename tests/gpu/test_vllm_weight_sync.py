"""Real `vllm serve` on the tiny model follows forge.policy through vllm-sync: the served weights and version move.

Run on a GPU machine with vllm==0.32.0 (about 2-5 minutes, most of it vLLM start-up):
    PYTHONPATH=$PWD python -m pytest tests/gpu/test_vllm_weight_sync.py -q -s
It checks what tests/engine/test_vllm_sync.py takes from the fake: the control routes exist with those bodies
(VLLM_SERVER_DEV_MODE=1), collective_rpc update_config + reload_weights loads a checkpoint directory in place,
and /weight_info reports the version set by /update_weight_version.
"""

import asyncio
import contextlib
import os
import sys

import httpx
import pytest

from forge_stream.engine.vllm_sync import SyncSettings, follow_policy
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS
from helpers import http_process

MESSAGES = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def vllm_url(tiny_model_dir, tmp_path_factory):
    port = free_port()
    with open(tmp_path_factory.mktemp("vllm_sync_log") / "vllm.log", "wb") as log, http_process(
            [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(tiny_model_dir), "--port", str(port),
             "--dtype", "float32", "--max-model-len", "1024", "--gpu-memory-utilization", "0.2", "--enforce-eager"],
            port, timeout=600, log=log, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}) as url:
        yield url


def _logprobs(url, model):
    body = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True,
        "return_token_ids": True, "ignore_eos": True}).json()
    return [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]]


def test_sync_moves_weights_and_version(vllm_url, tiny_model_dir, tiny_model_dir_v1, kafka_bootstrap, run_id):
    base, perturbed = tiny_model_dir, tiny_model_dir_v1
    before = _logprobs(vllm_url, str(base))
    run = f"gpu-{run_id}"
    producer = EventProducer(kafka_bootstrap)
    producer.send_sync(TOPICS.policy, run, {"event_id": run_id, "event_time": 0, "version": 1, "step": 1,
                                            "checkpoint_uri": str(perturbed), "base_model": str(base)})
    producer.close()
    reports = []

    async def sync():
        task = asyncio.create_task(follow_policy(kafka_bootstrap, SyncSettings(workers=(vllm_url,), run=run),
                                                 reports.append))
        try:
            while not reports:
                await asyncio.sleep(0.2)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(sync(), 300))
    assert reports[0].updated == [vllm_url], reports[0].failed
    assert httpx.get(f"{vllm_url}/weight_info", timeout=10).json() == {"weight_version": "1"}
    assert httpx.get(f"{vllm_url}/is_paused", timeout=10).json() == {"is_paused": False}
    after = _logprobs(vllm_url, str(base))
    print("logprobs before:", before, "\nafter:", after)
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-3
