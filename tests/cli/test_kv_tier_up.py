"""`forge-stream up` of a topology with the shared KV tier alone (LMCache's server from the vLLM runtime, no vLLM
engine): it runs supervised, `status` shows its address, L1 and counters, and a tier that cannot start is one line
from `up`, exit 1. The tier with real vLLM engines on it: tests/vllm/test_shared_kv_tier.py."""

import json
import os
import socket
import subprocess
import sys

import pytest

from forge_stream.engine.vllm_front.runtime import runtime
from forge_stream.kafka.broker import free_port
from forge_stream.settings import ForgeSettings

from helpers import cli

pytestmark = pytest.mark.slow


@pytest.fixture
def tier_home(tmp_path, kafka_bootstrap):
    if not runtime(ForgeSettings().cache_dir).ready():
        if os.environ.get("CI"):
            pytest.fail("CI installs the vLLM runtime (with LMCache) first: forge-stream engine install-vllm")
        pytest.skip("the vLLM runtime is not installed here: forge-stream engine install-vllm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(tmp_path / "home"), FORGE_KV_TIER_PORT=str(free_port()),
               FORGE_KV_TIER_HTTP_PORT=str(free_port()))
    topology = tmp_path / "tier.yaml"
    topology.write_text(json.dumps({"name": "tier-only", "services": [{"kv_tier": {"l1_size_gb": 0.25,
                                                                                    "start_timeout_s": 60}}]}))
    try:
        yield env, [str(topology), "--bootstrap-servers", kafka_bootstrap]
    finally:
        subprocess.run([sys.executable, "-m", "forge_stream", "down"], env=env, capture_output=True, timeout=120)


def test_the_tier_runs_supervised_and_status_shows_it(tier_home):
    env, args = tier_home
    up = json.loads(cli(env, "up", *args, "--json", timeout=300))
    assert up["services"]["kv_tier"]["url"] == f"tcp://127.0.0.1:{env['FORGE_KV_TIER_PORT']}"
    status = json.loads(cli(env, "status", "--json"))
    assert status["services"]["kv_tier"]["state"] == "running"
    tier = status["kv_tier"]
    assert tier["reachable"] and tier["healthy"] and tier["l1_total_bytes"] == 2 ** 28
    assert tier["lookups"] == 0 and tier["hit_tokens"] == 0 and tier["l1_used_bytes"] == 0
    assert f"KV tier (LMCache) at tcp://127.0.0.1:{env['FORGE_KV_TIER_PORT']}: L1 0 of 256 MiB used" in cli(
        env, "status")


def test_a_tier_that_cannot_start_is_one_line_from_up(tier_home):
    env, args = tier_home
    with socket.socket() as taken:  # its admin port is someone else's
        taken.bind(("127.0.0.1", int(env["FORGE_KV_TIER_HTTP_PORT"])))
        taken.listen()
        done = subprocess.run([sys.executable, "-m", "forge_stream", "up", *args], env=env, capture_output=True,
                              text=True, timeout=300)
    assert done.returncode == 1
    failure = [line for line in done.stderr.splitlines() if line.startswith("forge-stream up failed")]
    assert len(failure) == 1 and "kv_tier" in failure[0], done.stderr[-2000:]
