"""`forge-stream bench load --json` at toy size on the test broker: two gateway workers, agents that ask a turn as a
burst of parallel calls, and the run's proof of what it recorded (one record per call and per turn) and of what it
left running (nothing). (Shedding and memory under load are tests/gateway/test_gateway_load.py's.)"""

import json
import os
import signal
import subprocess
import sys

import pytest

from forge_stream.bench.load import descendants, still_running

from helpers import needs_haproxy

pytestmark = pytest.mark.kafka

COUNTS = ("acknowledged", "lost", "duplicates", "shed_recorded", "duplicate_turns", "turns_recorded", "orphans",
          "processes_started", "burst_sessions", "sessions_finished", "workers", "parallel_every")


@pytest.mark.slow
def test_bench_load_reports_turns_recorded_twice_and_stops_every_process_it_started(kafka_bootstrap):
    out = subprocess.run(
        [sys.executable, "-m", "forge_stream", "bench", "load", "--agents", "12", "--seconds", "4", "--workers", "2",
         "--parallel-every", "3", "--bootstrap-servers", kafka_bootstrap, "--json"],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in COUNTS:
        assert type(result[key]) is int, (key, result)
    assert isinstance(result["orphan_processes"], list) and isinstance(result["errors"], dict)
    assert result["workers"] == 2 and result["parallel_every"] == 3
    # the engine, the gateway's supervisor and its two workers (the broker is the test's, not the bench's)
    assert result["processes_started"] >= 4, result
    assert result["orphans"] == 0 and result["orphan_processes"] == [], result
    assert result["lost"] == result["duplicates"] == result["shed_recorded"] == 0, result
    # one turn per turn: two workers and parallel calls of one session, each turn recorded by one request
    assert result["acknowledged"] > 0 and result["turns_recorded"] > 0, result
    assert result["duplicate_turns"] == 0, result


# starts one process when told to, says its pid once that process runs its own code, and reaps it when it ends.
# (Right after exec, /proc/<pid>/cmdline reads empty for a moment: the kernel sets the new arguments last.)
PARENT = ("import subprocess, sys\nsys.stdin.readline()\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; print(flush=True); time.sleep(60)'],\n"
          "                         stdout=subprocess.PIPE)\n"
          "child.stdout.readline()\nprint(child.pid, flush=True)\nchild.wait()\n")


def test_a_process_left_running_is_counted_until_it_ends():
    """Below a process of the test's own: pytest's own descendants change meanwhile (tests/early.py starts vLLM)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = descendants(parent.pid)
        parent.stdin.write("go\n")
        parent.stdin.flush()
        child = int(parent.stdout.readline())
        started = descendants(parent.pid) - before
        assert [pid for pid, _ in started] == [child]
        [command] = still_running(started)
        assert "time.sleep(60)" in command
        os.kill(child, signal.SIGKILL)
        assert parent.wait(30) == 0  # it reaped the child
        assert still_running(started) == []
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.slow
@needs_haproxy("--hosts 2 runs the gateways behind it")
def test_bench_load_across_two_hosts_behind_haproxy_loses_nothing_when_one_is_killed(kafka_bootstrap):
    out = subprocess.run(
        [sys.executable, "-m", "forge_stream", "bench", "load", "--agents", "12", "--seconds", "8", "--workers", "2",
         "--hosts", "2", "--kill-host-after-s", "3", "--parallel-every", "3", "--bootstrap-servers", kafka_bootstrap,
         "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["hosts"], result["hosts_killed"]) == (2, 1), result
    # the engine, two gateway supervisors with two workers each, haproxy
    assert result["processes_started"] >= 6 and result["orphans"] == 0, result
    assert result["acknowledged"] > 0 and result["errors"] == {}, result
    assert type(result["finished_before"]) is int, result
    assert result["lost"] == result["duplicates"] == result["duplicate_turns"] == 0, result
