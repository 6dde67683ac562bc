"""The sequence a newcomer met: a rollout run against a wrong gateway port, the same command again, then the run with
the right port. Nothing the first two did may hold the trainer's window: the trainer trains its first step within 2
minutes of the third run's first finished group (the processors' idle cut, 600 s, would be far later).

Real processes throughout: the processors and the trainer (tiny model) as `forge-stream` commands, the rollout runs as
a user types them, on the test session's broker and the scripted gateway (tests/scripted_gateway.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import read_events, since_this_test, until

from forge_stream.kafka.broker import free_port
from forge_stream.kafka.consumer import has_committed_offsets
from forge_stream.kafka.history import read_slice
from forge_stream.topics import TOPICS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# an agent that asks the gateway once and prints the answer ("The answer is 42." from the scripted engine)
AGENT = (f"{sys.executable} -c \"import os, httpx; print(httpx.post(os.environ['OPENAI_BASE_URL'] + "
         "'/chat/completions', headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']}, json={'model': "
         "'m', 'messages': [{'role': 'user', 'content': 'What is 6*7?'}], 'max_tokens': 16}, timeout=60)"
         ".json()['choices'][0]['message']['content'])\"")
FIRST_STEP_S = 120


def start(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "forge_stream", *argv], cwd=REPO, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def test_failed_runs_do_not_hold_the_window_of_the_run_that_works(kafka_bootstrap, gateway, tiny_model_dir, run_id,
                                                                  tmp_path):
    env = {**os.environ, "FORGE_HOME": str(tmp_path / "home")}
    run = f"run-{run_id}"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": f"{run_id}-{i}", "prompt": {"answer": "42"},
                                         "grader": "numeric", "group_size": 2}) + "\n" for i in range(4)))
    trainer_log = tmp_path / "trainer.log"
    services = [
        start(["processors", "run", "-b", kafka_bootstrap, "--data-dir", str(tmp_path / "processors"), "--app-id",
               f"processors-{run_id}", "--tick-s", "0.5"], tmp_path / "processors.log", env),
        start(["train", "-b", kafka_bootstrap, "--run", run, "--model", str(tiny_model_dir), "--checkpoint-dir",
               str(tmp_path / "ckpt"), "--from-now", "--batch-size", "2", "--wait-s", "2", "--steps", "1"],
              trainer_log, env),
    ]
    try:
        until(lambda: has_committed_offsets(kafka_bootstrap, f"scheduler:{run}", [TOPICS.tasks, TOPICS.samples]),
              120, lambda: f"the trainer did not start; its log:\n{trainer_log.read_text()[-3000:]}")

        def rollout(gateway_url: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "forge_stream", "rollout", "run", "--tasks", str(tasks),
                                   "--agent", AGENT, "--gateway-url", gateway_url, "--name", run_id,
                                   "-b", kafka_bootstrap, "--json"],
                                  env=env, cwd=REPO, capture_output=True, text=True, timeout=300)

        wrong = f"http://127.0.0.1:{free_port()}"
        for attempt in ("the first run", "the rerun"):
            failed = rollout(wrong)
            assert failed.returncode == 1, f"{attempt}: {failed.stdout}{failed.stderr[-3000:]}"
            assert failed.stderr.splitlines()[-1].startswith(f"error: the gateway at {wrong} is not reachable")

        fresh = rollout(gateway)
        assert fresh.returncode == 0, fresh.stderr[-3000:]
        result = json.loads(fresh.stdout)
        assert result == {**result, "groups": 4, "sessions": 8, "failed_sessions": 0, "skipped_groups": 0}
        groups = {t["group_id"] for t in read_events(kafka_bootstrap, TOPICS.tasks,
                                                     lambda r: r["metadata"].get("controller") == run_id)}
        finished = [r["event_time"] for r in read_events(kafka_bootstrap, TOPICS.sessions,
                                                         lambda r: r["group_id"] in groups and "status" in r)]
        first_finished_ms = min(finished)
        left = FIRST_STEP_S - (time.time() - first_finished_ms / 1000)
        steps = until(lambda: [e.record for e in read_slice(kafka_bootstrap, TOPICS.train_metrics, since_this_test())
                               if e.key == run], max(left, 1),
                      lambda: f"no step within {FIRST_STEP_S} s of the first finished group; the trainer's log:\n"
                              f"{trainer_log.read_text()[-3000:]}")
        assert steps[0]["event_time"] - first_finished_ms < FIRST_STEP_S * 1000
        assert set(steps[0]["group_ids"]) <= groups
    finally:
        for service in services:
            service.kill()
            service.wait()

