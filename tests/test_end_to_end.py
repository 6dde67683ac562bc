"""The main job end to end: `forge-stream up` on a fresh home, an unmodified OpenAI-SDK agent rolled out through
the gateway, the processors turn its groups into samples, the trainer steps, and the engine serves the new policy."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from forge_stream.kafka.broker import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def cli(env, *args, timeout=300):
    out = subprocess.run([sys.executable, "-m", "forge_stream", *args], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_agent_rollouts_train_a_new_policy_that_the_engine_serves(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env["FORGE_HOME"] = str(tmp_path / "home")
    for name in ("KAFKA_PORT", "KAFKA_CONTROLLER_PORT", "REGISTRY_PORT", "ENGINE_PORT", "GATEWAY_PORT"):
        env[f"FORGE_{name}"] = str(free_port())
    engine = f"http://127.0.0.1:{env['FORGE_ENGINE_PORT']}"
    try:
        up = json.loads(cli(env, "up", "--json"))
        assert set(up["services"]) == {"registry", "engine", "gateway", "processors", "trainer"}
        assert httpx.get(f"{engine}/health").json()["policy_version"] == 0

        result = json.loads(cli(env, "rollout", "run", "--tasks", str(REPO / "examples" / "tasks_arith.jsonl"),
                                "--agent", f"{sys.executable} {REPO / 'examples' / 'agents' / 'tool_agent.py'}",
                                "--json"))
        assert result == {**result, "groups": 4, "sessions": 16, "failed_sessions": 0}

        deadline = time.monotonic() + 180
        while httpx.get(f"{engine}/health").json()["policy_version"] < 1 and time.monotonic() < deadline:
            time.sleep(1)
        assert httpx.get(f"{engine}/health").json()["policy_version"] >= 1

        status = json.loads(cli(env, "status", "--json"))
        assert status["topics"]["forge.completions"]["messages"] >= 16
        assert status["topics"]["forge.samples"]["messages"] == 4
        assert status["topics"]["forge.train_metrics"]["messages"] >= 1
        assert status["topics"]["forge.dlq"]["messages"] == 0
        assert all(s["healthy"] for s in status["services"].values())
        # the engine loaded the new policy and the trainer saved it: their logs tell so without progress bars
        logs = Path(env["FORGE_HOME"]) / "run"
        assert "step 0" in (logs / "trainer.log").read_text()
        assert not [name for name in ("trainer.log", "engine.log") if "it/s]" in (logs / name).read_text()]
    finally:
        subprocess.run([sys.executable, "-m", "forge_stream", "down"], env=env, capture_output=True, timeout=120)
