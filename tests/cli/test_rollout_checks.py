"""`forge-stream rollout run` checks the gateway, and through it the engine, before it publishes any task: where
either does not answer it ends with one line naming the URL and what to do, exit status 1, and forge.tasks holds
nothing of it."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import read_events, serving

from forge_stream.gateway.app import create_app
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.kafka.broker import free_port
from forge_stream.topics import TOPICS

REPO = Path(__file__).resolve().parents[2]
AGENT = f"{sys.executable} -c \"print(42)\""


def write_tasks(path: Path, run_id: str, n: int = 2) -> Path:
    path.write_text("".join(json.dumps({"task_id": f"{run_id}-{i}", "prompt": {"answer": "42"},
                                        "grader": "numeric", "group_size": 2}) + "\n" for i in range(n)))
    return path


def rollout(kafka_bootstrap: str, gateway_url: str, tasks: Path, name: str, tmp_path: Path,
            timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "FORGE_HOME": str(tmp_path / "home")}
    return subprocess.run([sys.executable, "-m", "forge_stream", "rollout", "run", "--tasks", str(tasks),
                           "--agent", AGENT, "--gateway-url", gateway_url, "--name", name, "-b", kafka_bootstrap,
                           "--json"], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def published(kafka_bootstrap: str, name: str) -> list[dict]:
    return read_events(kafka_bootstrap, TOPICS.tasks, lambda r: r["metadata"].get("controller") == name)


def test_a_gateway_that_does_not_answer_ends_the_run_before_any_task(kafka_bootstrap, run_id, tmp_path):
    nowhere = f"http://127.0.0.1:{free_port()}"
    done = rollout(kafka_bootstrap, nowhere, write_tasks(tmp_path / "tasks.jsonl", run_id), run_id, tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: the gateway at {nowhere} is not reachable (ConnectError"), line
    assert "forge-stream up" in line and "--gateway-url" in line
    assert done.stdout == "" and published(kafka_bootstrap, run_id) == []


def test_a_gateway_whose_engine_is_down_ends_the_run_before_any_task(kafka_bootstrap, run_id, tmp_path):
    settings = GatewaySettings(engines=(f"http://127.0.0.1:{free_port()}",), bootstrap=kafka_bootstrap)
    with serving(create_app(settings)) as gateway:
        done = rollout(kafka_bootstrap, gateway, write_tasks(tmp_path / "tasks.jsonl", run_id), run_id, tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: the gateway at {gateway} answers, but its engine does not (HTTP 503"), line
    assert "forge-stream logs engine" in line
    assert published(kafka_bootstrap, run_id) == []


def test_with_gateway_and_engine_up_the_run_goes_on(kafka_bootstrap, gateway, run_id, tmp_path):
    done = rollout(kafka_bootstrap, gateway, write_tasks(tmp_path / "tasks.jsonl", run_id), run_id, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["sessions"] == 4 and len(published(kafka_bootstrap, run_id)) == 2


def test_status_gives_the_line_a_run_would_fail_with():
    from forge_stream.cli.up import _rollout_hint
    from forge_stream.startup import engine_unreachable, gateway_unreachable

    url = "http://127.0.0.1:8000"
    gateway, engine = {"state": "running", "url": url}, {"state": "running", "url": "http://127.0.0.1:8001"}
    assert _rollout_hint({"gateway": gateway, "engine": engine}) is None
    assert _rollout_hint({"gateway": {**gateway, "state": "dead"}, "engine": engine}) == gateway_unreachable(
        url, "its service is dead")
    assert _rollout_hint({"gateway": gateway, "engine": {**engine, "state": "crash-looping"}}) == engine_unreachable(
        url, "its service is crash-looping")
