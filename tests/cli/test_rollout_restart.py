"""`forge-stream rollout run` killed mid-run and started again: no Task twice, no session left open."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import read_events

from forge_stream.events import deterministic_id
from forge_stream.topics import TOPICS

REPO = Path(__file__).resolve().parents[2]
AGENT = (f"{sys.executable} -c \"import os, time; time.sleep(float(os.environ['AGENT_SLEEP'])); print(42)\"")


def controller(kafka_bootstrap, gateway, tasks, name, sleep, *options, **popen):
    env = {**os.environ, "AGENT_SLEEP": str(sleep)}
    argv = [sys.executable, "-m", "forge_stream", "rollout", "run", "--tasks", str(tasks), "--agent", AGENT,
            "--gateway-url", gateway, "--name", name, "--concurrency", "4", "-b", kafka_bootstrap, "--json",
            *options]
    return subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


def mine(name):
    return lambda r: r["metadata"].get("controller") == name


@pytest.mark.slow
def test_killed_controller_restarts_without_duplicates_or_open_sessions(kafka_bootstrap, gateway, run_id,
                                                                        tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": f"{run_id}-{i}", "prompt": {"answer": "42"},
                                         "grader": "numeric", "group_size": 2}) + "\n" for i in range(4)))
    first = controller(kafka_bootstrap, gateway, tasks, run_id, 60, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # two groups (four sessions) in flight, the others waiting for slots
            published = read_events(kafka_bootstrap, TOPICS.tasks, mine(run_id))
            groups = {t["group_id"] for t in published}
            started = read_events(kafka_bootstrap, TOPICS.sessions,
                                  lambda r: r["group_id"] in groups and "base_url" in r)
            if len(started) == 4:
                break
            assert time.monotonic() < deadline and first.poll() is None, first.stderr.read()
            time.sleep(0.3)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    before = {t["event_id"]: t["seq"] for t in read_events(kafka_bootstrap, TOPICS.tasks, mine(run_id))}
    assert len(before) == 2
    orphans = {e["session_id"] for e in started}

    second = controller(kafka_bootstrap, gateway, tasks, run_id, 0)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err[-3000:]
    result = json.loads(out)
    assert result == {**result, "groups": 2, "sessions": 4, "failed_sessions": 0, "skipped_groups": 2,
                      "recovered_sessions": 4}

    after = read_events(kafka_bootstrap, TOPICS.tasks, mine(run_id))
    assert len(after) == 4 and len({t["event_id"] for t in after}) == 4
    assert {t["event_id"]: t["seq"] for t in after if t["event_id"] in before} == before
    assert min(t["seq"] for t in after if t["event_id"] not in before) > max(before.values())
    for t in after:  # ids derive from (controller name, cycle, position, task_id)
        position = int(t["metadata"]["position"])
        assert t["event_id"] == deterministic_id("task", run_id, 0, position, f"{run_id}-{position}")

    sessions = [deterministic_id("session", t["group_id"], i) for t in after for i in range(2)]
    statuses = {s: httpx.get(f"{gateway}/v1/sessions/{s}").json()["status"] for s in sessions}
    assert set(statuses.values()) == {"finished"}
    finished = read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] in statuses and "status" in r)
    assert len(finished) == 8
    assert {e["session_id"] for e in finished if e["reason"] == "rollout controller restarted"} == orphans


def test_sigterm_stops_taking_groups_and_lets_pooled_episodes_finish(kafka_bootstrap, gateway, run_id, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": f"{run_id}-{i}", "prompt": {"answer": "42", "sleep": 3},
                                         "grader": "numeric", "group_size": 2}) + "\n" for i in range(4)))
    worker = f"{sys.executable} {REPO / 'tests' / 'rollout' / 'agent_worker.py'}"
    argv = [sys.executable, "-m", "forge_stream", "rollout", "run", "--tasks", str(tasks), "--agent", worker,
            "--agent-workers", "1", "--gateway-url", gateway, "--name", run_id, "--concurrency", "4", "--loop",
            "-b", kafka_bootstrap, "--json"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while len(read_events(kafka_bootstrap, TOPICS.tasks, mine(run_id))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # as `forge-stream down` does
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out)
    # every group it had started ran to the end (how many depends on when the signal came); --loop ended
    assert result == {**result, "sessions": 2 * result["groups"], "failed_sessions": 0, "mean_reward": 1.0}
    assert 2 <= result["groups"] < 8
    assert len(read_events(kafka_bootstrap, TOPICS.tasks, mine(run_id))) == result["groups"]


def test_without_a_terminal_the_controller_logs_its_progress(kafka_bootstrap, gateway, run_id, tmp_path):
    """A controller run as a service (`up learn`) or piped has no progress bar: it logs a line every
    `--report-every` seconds (groups, sessions, mean reward by domain, sessions in flight)."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": f"{run_id}-{i}", "prompt": {"answer": "42"}, "domain": "lookup",
                                         "grader": "numeric", "group_size": 2}) + "\n" for i in range(4)))
    run = controller(kafka_bootstrap, gateway, tasks, run_id, 1.5, "--report-every", "0.5")
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err[-3000:]
    assert json.loads(out)["groups"] == 4
    lines = [line for line in err.splitlines() if "INFO forge_stream.rollout.controller:" in line]
    assert "rolling out" in lines[0] and f"through {gateway}: up to 4 sessions in flight" in lines[0], err
    progress = [line.split("controller: ", 1)[1] for line in lines[1:]]
    assert progress and all(p.startswith("last ") for p in progress), err
    assert any(p.endswith("4 of 4 sessions in flight") for p in progress), err  # while the first two groups run
    assert any("in all: 2 groups, 4 sessions, mean reward 1.000" in p for p in progress), err
    assert any("2 groups, 4 sessions (0 failed), mean reward 1.000 (lookup 1.000)" in p for p in progress), err
