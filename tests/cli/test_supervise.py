"""`up` runs a supervisor per home: a service killed with SIGKILL comes back and `status` says how it ended; one
that keeps dying at once is crash-looping, never healthy; `down` stops the supervisor first, so nothing returns."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from forge_stream.kafka.broker import free_port
from forge_stream.proc import alive as _alive
from forge_stream.services import ServiceSpec, Supervisor
from helpers import until


def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(tmp_path / "home"), COLUMNS="240", **extra)
    return env


def cli(env, *args, check=True):
    out = subprocess.run([sys.executable, "-m", "forge_stream", *args], env=env, capture_output=True, text=True,
                         timeout=180)
    assert not check or out.returncode == 0, out.stderr[-3000:]
    return out


def services(env, bootstrap) -> dict:
    return json.loads(cli(env, "status", "-b", bootstrap, "--json").stdout)["services"]


@pytest.mark.slow
def test_killed_service_is_restarted_and_status_says_why(kafka_bootstrap, tmp_path):
    topology = tmp_path / "registry-only.yaml"
    topology.write_text("name: registry-only\nservices:\n  - registry\n")
    port = free_port()
    env = _env(tmp_path, FORGE_REGISTRY_PORT=str(port))
    try:
        up = json.loads(cli(env, "up", str(topology), "-b", kafka_bootstrap, "--json").stdout)
        first, supervisor = up["services"]["registry"]["pid"], up["supervisor"]
        assert _alive(supervisor)
        assert services(env, kafka_bootstrap)["registry"]["state"] == "running"

        os.kill(first, signal.SIGKILL)
        back = until(lambda: (s := services(env, kafka_bootstrap)["registry"])["restarts"] == 1
                     and s["state"] == "running" and s, 60)
        assert back["pid"] != first and back["healthy"]
        assert back["last_exit"]["reason"] == "killed by SIGKILL" and back["last_exit"]["code"] == -9
        assert httpx.get(f"http://127.0.0.1:{port}/subjects").status_code == 200
        table = cli(env, "status", "-b", kafka_bootstrap).stdout
        assert "killed by SIGKILL" in table and "running" in table
        piped = cli({k: v for k, v in env.items() if k != "COLUMNS"}, "status", "-b", kafka_bootstrap).stdout
        row = next(line for line in piped.splitlines() if "registry" in line)  # no cell cut short at 80 columns
        assert "killed by SIGKILL after" in row and f"http://127.0.0.1:{port} " in row and "…" not in piped

        down = json.loads(cli(env, "down", "-b", kafka_bootstrap, "--json").stdout)
        assert down["stopped_services"] == ["registry"]
        assert not _alive(supervisor) and not _alive(back["pid"])
        time.sleep(3)  # longer than the first restart delay: nobody brings it back
        assert services(env, kafka_bootstrap) == {}
        try:
            httpx.get(f"http://127.0.0.1:{port}/subjects", timeout=2)
            raise AssertionError("the registry came back after down")
        except httpx.ConnectError:
            pass
    finally:
        cli(env, "down", "-b", kafka_bootstrap, check=False)


@pytest.mark.slow
def test_service_that_dies_at_once_is_crash_looping(kafka_bootstrap, tmp_path):
    env = _env(tmp_path)
    supervisor = Supervisor(tmp_path / "home" / "run")
    flaky = "import sys, time; time.sleep(0.5); print('no config here', flush=True); sys.exit(3)"
    try:
        supervisor.start(ServiceSpec("flaky", [sys.executable, "-c", flaky]))
        svc = until(lambda: (s := services(env, kafka_bootstrap)["flaky"])["state"] == "crash-looping" and s, 60)
        assert not svc["healthy"] and svc["restarts"] >= 2
        assert svc["last_exit"]["reason"] == "exit code 3" and "no config here" in svc["last_exit"]["log_tail"]
        table = cli(env, "status", "-b", kafka_bootstrap).stdout
        assert "crash-looping" in table and "no config here" in table
        # it is still retried, each time after a longer wait
        later = until(lambda: (s := services(env, kafka_bootstrap)["flaky"])["restarts"] > svc["restarts"] and s, 30)
        assert later["state"] == "crash-looping"
    finally:
        supervisor.stop_all()
    assert supervisor.daemon_pid() is None


def test_the_supervisor_being_started_is_not_taken_for_a_reused_pid(tmp_path):
    """Between its fork and its exec the supervisor's command line is still its parent's, so a check by command line
    alone has `up` report "the supervisor ... is not running" (with an empty log) in that window under load. A child
    of ours counts as the supervisor then; another process under the pid file's pid still counts as a reused pid."""
    supervisor = Supervisor(tmp_path / "run")
    supervisor.run_dir.mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # our child, not yet 'exec'd'
    try:
        supervisor.write_pid(child.pid)
        assert supervisor.daemon_pid() == child.pid
    finally:
        child.kill()
        child.wait()
    supervisor.write_pid(1)  # alive, not ours, not a supervisor: a pid reused since the file was written
    assert supervisor.daemon_pid() is None


FORKING = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(sys.argv[1], "a") as f:
    f.write(f"{child.pid}\\n")
time.sleep(600)
"""


def test_a_restarted_service_leaves_no_child_behind_and_stop_ends_a_child_that_ignores_sigterm(tmp_path):
    """A service is its process group: when its process dies, the child it forked (as a gateway's workers, holding
    their SO_REUSEPORT sockets) is ended before the service starts again, even one that ignores SIGTERM; stopping
    the service waits for its whole group too."""
    supervisor = Supervisor(tmp_path / "run")
    children = tmp_path / "children"
    born = lambda n: (lines := children.read_text().split() if children.exists() else []) and len(lines) >= n \
        and [int(p) for p in lines]  # noqa: E731
    try:
        first = supervisor.start(ServiceSpec("forks", [sys.executable, "-c", FORKING, str(children)]))["pid"]
        [orphan] = until(lambda: born(1), 30)
        assert os.getpgid(orphan) == first  # in the service's group
        os.kill(first, signal.SIGKILL)  # the service's own process only, as a crash ends it
        until(lambda: born(2), 60, "the service restarted")
        assert not _alive(orphan), "the dead service's child survived its restart"
        second = supervisor.status()["forks"]["pid"]
        [_, child] = born(2)
        assert second != first and _alive(child) and os.getpgid(child) == second
        assert supervisor.stop("forks", timeout=2)
        assert not _alive(second) and not _alive(child), "stop left the child that ignores SIGTERM running"
    finally:
        supervisor.stop_all()
        for pid in born(1) or []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
