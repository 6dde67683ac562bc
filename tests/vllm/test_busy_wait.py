"""vLLM's engine core and worker hand each step over through a shared-memory queue whose waits spin
(`sched_yield` in a loop, for a second after every message): under load they spin all the time, on a 2-core host a
core taken from the trainer. On CPU hosts forge-stream's runtime makes them poll the queue instead
(vllm_ext/sitecustomize.py); these tests check it on vLLM's own queue and on the served engine."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from forge_stream.bench.cpu import proc_tree_cpu, processes
from forge_stream.engine.vllm_front.runtime import MQ_POLL_S, runtime, vllm_env
from forge_stream.settings import ForgeSettings

pytestmark = pytest.mark.slow

# a reader inside its busy window waits 200 times. vLLM's spin yields the core and stays runnable: no voluntary
# context switch (and microseconds on an idle host, but a loaded host may hand the core away at each yield: CI measured
# 0.34 s); a poll sleeps, a voluntary switch each, and at least its pause each.
WAITS = """
import resource, time, zmq
from vllm.distributed.device_communicators import shm_broadcast
reader = shm_broadcast.SpinCondition(True, zmq.Context(), "ipc:///tmp/forge-test-spin-{tag}")
reader.record_read()
started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
for _ in range(200):
    reader.wait()
seconds, slept = time.monotonic() - started, resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
print(getattr(shm_broadcast, "forge_poll_s", None), seconds, slept)
"""


def _waits(env: dict[str, str], tag: str) -> tuple[str, float, int]:
    """What vLLM's queue waits with in a runtime started with `env`: its poll pause ('None': vLLM's own spin), and
    the seconds and the voluntary context switches (sleeps) of 200 waits inside the busy window."""
    rt = runtime(ForgeSettings().cache_dir, "cpu")
    assert rt.ready(), "the vLLM runtime is not installed: forge-stream engine install-vllm"
    out = subprocess.run([str(rt.python), "-c", WAITS.format(tag=tag)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    poll, seconds, slept = out.stdout.split()[-3:]
    return poll, float(seconds), int(slept)


def _vllm_cpu_s(front: int) -> dict[str, float]:
    """CPU seconds so far of each of vLLM's titled processes under the engine's front (VLLM::EngineCore, ...)."""
    parts = proc_tree_cpu(front, processes())
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(parts), parts
    return parts


def test_the_served_engines_worker_stops_using_cpu_with_the_last_step(vllm_engine):
    assert vllm_engine.health()["mq_poll_s"] == [MQ_POLL_S]  # read back from the worker at start-up

    def complete(i: int) -> None:
        response = httpx.post(f"{vllm_engine.url}/v1/completions", timeout=60, json={
            "model": "any", "prompt": f"Count to {i}:", "max_tokens": 24, "temperature": 1.0})
        assert response.status_code == 200, response.text

    started, before = time.monotonic(), _vllm_cpu_s(vllm_engine.pid)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(complete, range(48)))
    ended, after = time.monotonic(), _vllm_cpu_s(vllm_engine.pid)
    time.sleep(1.5)  # a spinning worker spins on for a second after the last step's message
    idle = _vllm_cpu_s(vllm_engine.pid)
    print(f"48 requests, 8 in flight, in {ended - started:.1f} s: vLLM CPU-s "
          f"{ {name: round(after[name] - before[name], 2) for name in after} }; in the 1.5 s after: "
          f"{ {name: round(idle[name] - after[name], 2) for name in idle} }")
    assert idle["VLLM::Worker"] - after["VLLM::Worker"] < 0.3  # measured spinning: 1.0; polling: about 0.02


def test_vllms_queue_is_polled_in_the_cpu_runtime_and_spun_otherwise(tmp_path):
    poll, seconds, slept = _waits(vllm_env(tmp_path, "cpu"), "cpu")
    assert float(poll) == MQ_POLL_S and seconds >= 200 * MQ_POLL_S and slept >= 200
    poll, seconds, slept = _waits(vllm_env(tmp_path, "cpu", mq_poll_s=0.002), "set")
    assert float(poll) == 0.002 and seconds >= 200 * 0.002 and slept >= 200
    poll, seconds, slept = _waits(vllm_env(tmp_path, "gpu"), "spun")  # unset: vLLM's own spin, untouched
    assert poll == "None" and slept < 20, (seconds, slept)  # measured: 0 sleeps (0.2 ms idle, 0.34 s in CI)
