"""`forge-stream up --engine vllm` on a fresh home: the default topology runs real vLLM as its engine, rollouts through
the gateway train the policy, and the trainer's versions reach vLLM and label the completions that follow."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import read_completions

from helpers import cli

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_up_with_vllm_trains_and_moves_the_served_version(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    ports = {name: free_port() for name in ("KAFKA", "KAFKA_CONTROLLER", "REGISTRY", "ENGINE", "GATEWAY")}
    env.update(FORGE_HOME=str(tmp_path / "home"), **{f"FORGE_{k}_PORT": str(v) for k, v in ports.items()})
    engine = f"http://127.0.0.1:{ports['ENGINE']}"
    try:
        up = json.loads(cli(env, "up", "--engine", "vllm", "--json", timeout=1500))
        bootstrap = up["bootstrap_servers"]
        status = json.loads(cli(env, "status", "--json"))
        assert status["services"]["engine"]["state"] == "running"
        assert status["services"]["engine"]["argv"][2:4] == ["forge_stream.engine", "vllm"]
        assert httpx.get(f"{engine}/health", timeout=10).json()["engine"] == "vllm"

        def rollouts(groups: int, seed: int) -> None:
            cli(env, "rollout", "run", "--tasks", f"suite:train?seed={seed}", "--max-groups", str(groups),
                "--group-size", "4", "--agent", f"{sys.executable} {REPO / 'examples/agents/tool_agent.py'} --serve",
                "--agent-workers", "1", "--concurrency", "16", timeout=600)

        rollouts(8, seed=1)  # two batches of the local topology's trainer (4 groups a step)
        deadline = time.monotonic() + 300
        while (served := httpx.get(f"{engine}/health", timeout=10).json())["policy_version"] < 1:
            assert time.monotonic() < deadline, f"no trained version reached vLLM: {served}"
            time.sleep(2)
        log = (tmp_path / "home" / "run" / "engine.log").read_text()
        assert "serving policy version 1 from" in log and "probe log-probs within" in log
        before = {r["completion_id"] for r in read_completions(bootstrap)}
        rollouts(2, seed=2)
        later = [r for r in read_completions(bootstrap) if r["completion_id"] not in before]
        assert later and all(r["policy_version"] >= served["policy_version"] for r in later)
        assert all(r["trainable"] for r in later)
    finally:
        subprocess.run([sys.executable, "-m", "forge_stream", "down"], env=env, capture_output=True, timeout=180)
