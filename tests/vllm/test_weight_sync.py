"""Policy versions reach real vLLM from forge.policy: each is proven before it is announced, every completion is
recorded under the version whose weights produced it (checked by recomputing its log-probs at both versions'
weights), and no KV cached under old weights is reused after a reload."""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from forge_stream.kafka.history import read_completions
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

from vllm_support import open_session, trainer_logprobs, vllm_socket

pytestmark = pytest.mark.slow

TOLERANCE = 2e-3  # nats, fp32 on the CPU


def _records(bootstrap: str, sessions: set[str]) -> list[dict]:
    return read_completions(bootstrap, keep=lambda r: r["session_id"] in sessions)


def test_a_pushed_version_is_proven_then_served(vllm_engine, checkpoints):
    before = vllm_engine.health()
    version = vllm_engine.push_version(checkpoints[0])
    after = vllm_engine.health()
    assert after["checkpoint"] == str(checkpoints[0]) and after["loads"] == before["loads"] + 1
    assert after["probe_mismatch"] is not None and after["probe_mismatch"] < 1e-3
    log = vllm_engine.log.read_text()
    assert f"serving policy version {version} from {checkpoints[0]}" in log
    assert "checksums equal the checkpoint's" in log


def test_an_unreadable_version_is_not_announced(vllm_engine, checkpoints, tmp_path):
    before = vllm_engine.health()
    missing = tmp_path / "rotated-away"
    producer = EventProducer(vllm_engine.bootstrap)
    producer.send_sync(TOPICS.policy, vllm_engine.run, {
        "event_id": uuid.uuid4().hex, "event_time": int(time.time() * 1000), "version": before["policy_version"] + 1,
        "step": 0, "checkpoint_uri": str(missing), "base_model": str(missing)})
    producer.close()
    deadline = time.monotonic() + 60
    while vllm_engine.health()["failed_loads"] == before["failed_loads"]:
        assert time.monotonic() < deadline, vllm_engine.health()
        time.sleep(0.2)
    now = vllm_engine.health()
    assert (now["policy_version"], now["checkpoint"]) == (before["policy_version"], before["checkpoint"])
    assert vllm_engine.push_version(checkpoints[1]) == before["policy_version"] + 1  # the next good one loads


async def _session(client: httpx.AsyncClient, gateway: str, group: str, turns: int, answered=lambda: None) -> str:
    session = (await client.post(f"{gateway}/v1/sessions", json={"group_id": group, "task_id": "t"})).json()
    messages = [{"role": "user", "content": "Count with me."}]
    for _ in range(turns):
        response = await client.post(session["base_url"] + "/chat/completions", json={
            "model": "m", "messages": messages, "max_tokens": 16, "temperature": 1.0})
        assert response.status_code == 200, response.text
        answered()
        messages += [{"role": "assistant", "content": response.json()["choices"][0]["message"]["content"] or "."},
                     {"role": "user", "content": "Go on."}]
    return session["session_id"]


def test_a_version_pushed_under_64_sessions_in_flight_labels_every_completion(vllm_engine, vllm_gateway, checkpoints,
                                                                              run_id):
    old = vllm_engine.health()
    pushed = {}
    answers = []
    busy = threading.Event()  # the first 32 of the 256 completions are answered: the sessions are under way

    def answered():
        answers.append(1)
        if len(answers) >= 32:
            busy.set()

    def push_when_busy():
        assert busy.wait(300), "no 32 completions answered within 300 s"
        pushed["version"] = vllm_engine.push_version(checkpoints[2])

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=128)) as client:
            return await asyncio.gather(*(_session(client, vllm_gateway, f"{run_id}-{i // 8}", 4, answered)
                                          for i in range(64)))

    pusher = threading.Thread(target=push_when_busy)
    pusher.start()
    sessions = set(asyncio.run(run()))
    pusher.join()
    records = _records(vllm_engine.bootstrap, sessions)
    assert len(records) == 64 * 4
    versions = {r["policy_version"] for r in records}
    assert versions == {old["policy_version"], pushed["version"]}, versions
    weights = {old["policy_version"]: old["checkpoint"], pushed["version"]: str(checkpoints[2])}
    at = {v: trainer_logprobs(path, records) for v, path in weights.items()}
    told_apart = 0
    for i, r in enumerate(records):
        recorded = torch.tensor(r["completion_logprobs"])
        own = (recorded - at[r["policy_version"]][i]).abs().max().item()
        other = min((recorded - at[v][i]).abs().max().item() for v in weights if v != r["policy_version"])
        assert own < TOLERANCE, (r["policy_version"], own, other)
        told_apart += other > 10 * TOLERANCE
    counts = {v: sum(r["policy_version"] == v for r in records) for v in sorted(versions)}
    print(f"64 sessions x 4 turns across a reload: completions per version {counts}; "
          f"{told_apart} of {len(records)} distinguishable from the other version's weights")
    assert told_apart > len(records) * 0.9


def test_no_kv_cached_under_old_weights_is_reused(vllm_engine, vllm_gateway, checkpoints, run_id):
    session = open_session(vllm_gateway, run_id)
    body = {"model": "m", "temperature": 1.0, "max_tokens": 8, "prompt": list(range(40, 400))}  # 22 KV blocks
    first = httpx.post(session["base_url"] + "/completions", json=body, timeout=60)
    again = httpx.post(session["base_url"] + "/completions", json=body, timeout=60)  # served from the prefix cache
    assert first.status_code == again.status_code == 200
    version = vllm_engine.push_version(checkpoints[0])  # back to v1's weights: other than the cached KV's
    after = httpx.post(session["base_url"] + "/completions", json=body, timeout=60)
    assert after.status_code == 200
    records = sorted(_records(vllm_engine.bootstrap, {session["session_id"]}), key=lambda r: r["turn"])
    assert [r["policy_version"] for r in records][-1] == version
    expected = trainer_logprobs(checkpoints[0], records[-1:])[0]
    assert (torch.tensor(records[-1]["completion_logprobs"]) - expected).abs().max().item() < TOLERANCE


def test_a_version_with_the_served_weights_is_announced_without_a_reload(vllm_engine, vllm_gateway, checkpoints,
                                                                        tmp_path, run_id):
    """A trainer step whose batch had no signal changes no weight but publishes a version: saved again by
    transformers, its weight files are the served ones byte for byte, and the engine names it without a reload."""
    from transformers import AutoModelForCausalLM

    vllm_engine.push_version(checkpoints[1])
    before = vllm_engine.health()
    same = tmp_path / "v-no-signal"
    shutil.copytree(checkpoints[1], same)
    AutoModelForCausalLM.from_pretrained(checkpoints[1]).save_pretrained(same)  # as the trainer saves each version
    version = vllm_engine.push_version(same)
    now = vllm_engine.health()
    assert now["checkpoint"] == str(same) and now["loads"] == before["loads"]
    assert now["renamed_versions"] == before["renamed_versions"] + 1
    assert f"serving policy version {version} from {same}: its weights are version" in vllm_engine.log.read_text()
    session = open_session(vllm_gateway, run_id)
    answer = httpx.post(session["base_url"] + "/completions", timeout=60, json={
        "model": "m", "prompt": "Count with me:", "max_tokens": 8, "temperature": 1.0})
    assert answer.status_code == 200, answer.text
    record = _records(vllm_engine.bootstrap, {session["session_id"]})[-1]
    assert record["policy_version"] == version
    expected = trainer_logprobs(checkpoints[1], [record])[0]
    assert (torch.tensor(record["completion_logprobs"]) - expected).abs().max().item() < TOLERANCE


def test_a_trainer_faster_than_the_reloads_leaves_the_engine_on_its_newest_version(vllm_engine, vllm_gateway,
                                                                                  checkpoints, tmp_path, run_id):
    """Versions published back to back, the trainer's rotation deleting all but the newest two folders right after
    each (faster than a load: on SmolLM2 one takes 10-20 s), then one more whose folder is deleted as soon as the
    engine has begun to load it. The engine must end on the newest version, proven, awake, never going backwards,
    with nothing unproven announced."""
    from forge_stream.trainer.service import rotate_checkpoints

    before = vllm_engine.health()
    log_start = len(vllm_engine.log.read_text())
    producer = EventProducer(vllm_engine.bootstrap)
    version = before["policy_version"]

    def publish(source: Path) -> Path:
        nonlocal version
        version += 1
        folder = tmp_path / f"v{version:06d}-{uuid.uuid4().hex[:8]}"
        shutil.copytree(source, folder)
        producer.send_sync(TOPICS.policy, vllm_engine.run, {
            "event_id": uuid.uuid4().hex, "event_time": int(time.time() * 1000), "version": version,
            "step": version, "checkpoint_uri": str(folder), "base_model": str(folder)})
        return folder

    def served(v: int) -> dict:
        deadline = time.monotonic() + 180
        while (now := vllm_engine.health())["policy_version"] != v:
            assert time.monotonic() < deadline, f"version {v} not served: {now}; see {vllm_engine.log}"
            time.sleep(0.05)
        return now

    began = time.monotonic()
    for i in range(12):
        folder = publish(checkpoints[i % len(checkpoints)])
        rotate_checkpoints(tmp_path, keep=2)
    burst = time.monotonic() - began
    now = served(version)
    assert now["checkpoint"] == str(folder) and now["loads"] > before["loads"]

    source = checkpoints[12 % len(checkpoints)]  # other weights than the burst's last
    folder = publish(source)
    weights = folder / "model.safetensors"
    deadline = time.monotonic() + 60
    while weights.stat().st_nlink < 2:  # the engine holds the files of the version it loads
        assert time.monotonic() < deadline, "the engine did not hold the checkpoint it loads"
        time.sleep(0.005)
    shutil.rmtree(folder)  # rotated away mid-load
    producer.close()
    now = served(version)
    assert now["checkpoint"] == str(folder) and now["probe_mismatch"] is not None and now["probe_mismatch"] < 1e-3

    log = vllm_engine.log.read_text()[log_start:]
    assert "was not proven" not in log and "starts afresh" not in log, log[-3000:]
    loaded = [int(v) for v in re.findall(r"serving policy version (\d+) from", log)]
    print(f"12 versions in {burst:.2f}s, then one rotated away mid-load: the engine loaded {loaded}; "
          f"versions rotated away before it could hold them: {now['failed_loads'] - before['failed_loads']}")
    assert loaded == sorted(loaded) and loaded[-1] == version  # never backwards, ends on the newest
    session = open_session(vllm_gateway, run_id)  # it serves: awake, and under the version it announced
    answer = httpx.post(session["base_url"] + "/completions", timeout=60, json={
        "model": "m", "prompt": "Count with me:", "max_tokens": 8, "temperature": 1.0})
    assert answer.status_code == 200, answer.text
    record = _records(vllm_engine.bootstrap, {session["session_id"]})[-1]
    assert record["policy_version"] == version
    expected = trainer_logprobs(source, [record])[0]
    assert (torch.tensor(record["completion_logprobs"]) - expected).abs().max().item() < TOLERANCE


def test_a_reload_that_fails_inside_vllm_is_resumed_and_rolled_back(vllm_engine, checkpoints, tmp_path):
    """The plan's failure path against the real server: a reload from a folder that vanished fails inside vLLM's
    worker (it takes the path for a hub repo id), which leaves vLLM paused and breaks its HTTP connection; the
    control resumes it on a fresh connection and loads the served weights back."""
    from forge_stream.engine.vllm_front.load_plan import Call, VllmControl, WorkerError

    url, transport = "http://vllm", httpx.AsyncHTTPTransport(uds=str(vllm_socket(vllm_engine.log)))
    vllm_engine.push_version(checkpoints[1])
    now = vllm_engine.health()

    async def fail_then_roll_back():
        async with httpx.AsyncClient(timeout=300, transport=transport) as client:
            control = VllmControl(url, client)
            gone = tmp_path / "rotated-away"
            try:
                await control.load(str(gone), now["policy_version"] + 1)
            except WorkerError as exc:
                failure = str(exc)
            else:
                raise AssertionError("a reload from a missing folder was proven")
            sleeping = (await client.get(url + "/is_sleeping")).json()["is_sleeping"]
            proof = await control.load(now["checkpoint"], now["policy_version"])
            return failure, sleeping, proof, (await control.call(Call("GET", "/weight_info")))["weight_version"]

    failure, sleeping, proof, served = asyncio.run(fail_then_roll_back())
    assert "collective_rpc" in failure and "HTTP 500" in failure
    assert sleeping is False  # resumed after the failed step
    assert proof.matched > 0 and served == str(now["policy_version"])
