"""What a newcomer meets: a command that needs the deployment, run while it is down, ends within seconds with the
one line `status` gives (not "waiting for Kafka" for ever); a rollout run whose every session failed, or that ran
none, exits non-zero with one line saying so (not a line per session).

The deployment here is a fresh home whose Kafka port has no broker; the rollout runs use the test session's broker
and a scripted gateway (tests/scripted_gateway.py)."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from forge_stream.kafka.broker import free_port
from forge_stream.startup import KAFKA_ANSWER_S

from helpers import until

REPO = Path(__file__).resolve().parents[2]
HANGS_AFTER_S = 90  # far beyond the few seconds a command gives Kafka: a command that waits for ever fails the test


def _down_home(tmp_path) -> tuple[dict, str]:
    """A home whose deployment is down: nothing listens on its Kafka port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    port = free_port()
    env.update(FORGE_HOME=str(tmp_path / "home"), FORGE_KAFKA_PORT=str(port))
    return env, f"Kafka at 127.0.0.1:{port} is not reachable: start it with `forge-stream up`."


COMMANDS = {
    "rollout run": ["rollout", "run", "--tasks", "suite:train", "--agent", "true"],
    "eval": ["eval", "--tasks", "suite:test", "--agent", "true", "--limit", "1"],
    "claims gc": ["claims", "gc"],
    "topics create": ["topics", "create"],
    "sink parquet": ["sink", "parquet", "--out", "OUT"],
    "plot rewards": ["plot", "rewards", "--out", "OUT/rewards.png"],
    "gateway serve": ["gateway", "serve", "--engine", "http://127.0.0.1:9"],
    "processors run": ["processors", "run"],
}


@pytest.mark.slow
def test_commands_that_need_the_deployment_say_in_one_line_that_it_is_down(tmp_path):
    env, line = _down_home(tmp_path)
    out = str(tmp_path / "out")
    started = {name: subprocess.Popen([sys.executable, "-m", "forge_stream",
                                       *(word.replace("OUT", out) for word in argv)],
                                      env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for name, argv in COMMANDS.items()}
    try:
        ended = {name: proc.communicate(timeout=HANGS_AFTER_S) for name, proc in started.items()}
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait()
    for name, (_, stderr) in ended.items():
        assert started[name].returncode == 1, f"{name}: exit {started[name].returncode}\n{stderr[-2000:]}"
        assert stderr.splitlines() == [f"error: {line}"], f"{name}: {stderr[-2000:]}"
    status = subprocess.run([sys.executable, "-m", "forge_stream", "status"], env=env, capture_output=True,
                            text=True, timeout=HANGS_AFTER_S)
    assert status.returncode == 1 and status.stderr.splitlines() == [line]  # the same hint


@pytest.mark.slow
def test_a_service_told_to_wait_for_kafka_still_waits(tmp_path):
    """What `up` passes its services (--wait-for-kafka): a supervised service restarted while the broker restarts
    waits for it (tests/kafka/test_topic_checks.py sees one come up once Kafka is back)."""
    env, _ = _down_home(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "forge_stream", "processors", "run", "--wait-for-kafka"], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said: list[str] = []
    threading.Thread(target=lambda: [said.append(line) for line in proc.stdout], daemon=True).start()
    try:
        until(lambda: any("waiting for Kafka at" in line for line in said), HANGS_AFTER_S,
              lambda: f"no 'waiting for Kafka' line; it said: {said[-5:]}")
        time.sleep(KAFKA_ANSWER_S)  # said after its first try: by now past what a command run by hand gives Kafka
        assert proc.poll() is None, f"it stopped waiting (exit {proc.returncode})"
    finally:
        proc.kill()
        proc.wait()


def _rollout(kafka_bootstrap, gateway, tmp_path, *options, agent: str = "true", tasks: int = 2):
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": {"answer": "42"}, "grader": "numeric",
                                              "group_size": 2}) + "\n" for i in range(tasks)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env["FORGE_HOME"] = str(tmp_path / "home")
    return subprocess.run([sys.executable, "-m", "forge_stream", "rollout", "run", "--tasks", str(tasks_file),
                           "--agent", agent, "--gateway-url", gateway, "--name", tmp_path.name, "-b", kafka_bootstrap,
                           "--json", *options], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=HANGS_AFTER_S)


def test_a_rollout_whose_every_session_failed_exits_1_saying_so(kafka_bootstrap, gateway, tmp_path):
    agent = f"{sys.executable} -c \"import sys; print('no key for the tool', file=sys.stderr); sys.exit(1)\""
    done = _rollout(kafka_bootstrap, gateway, tmp_path, agent=agent)
    assert done.returncode == 1, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["sessions"] == result["failed_sessions"] == 4
    said = [line for line in done.stderr.splitlines() if " INFO " not in line]  # not one warning per session
    assert said == ["error: every session failed (4 of 4): agent exited with 1: no key for the tool"]


def test_a_rollout_that_ran_no_session_exits_non_zero_saying_so(kafka_bootstrap, gateway, tmp_path):
    none = _rollout(kafka_bootstrap, gateway, tmp_path, "--group-size", "0")
    assert none.returncode == 2 and none.stderr.splitlines() == [
        "error: --group-size 0: a group needs at least 1 session"]

    empty = _rollout(kafka_bootstrap, gateway, tmp_path, tasks=0)
    assert empty.returncode == 1, empty.stderr[-3000:]
    assert json.loads(empty.stdout)["sessions"] == 0
    assert empty.stderr.splitlines()[-1] == ("error: no session ran: the task source gave no task (an empty file, "
                                             "or --max-groups 0)")


def test_a_rollout_with_one_session_that_worked_succeeds(kafka_bootstrap, gateway, tmp_path):
    done = _rollout(kafka_bootstrap, gateway, tmp_path, agent=f"{sys.executable} -c \"print(42)\"", tasks=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["failed_sessions"] == 0 and "error:" not in done.stderr
