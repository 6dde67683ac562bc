"""A benchmark ended by SIGTERM (a `kill`, a CI timeout) stops the broker and services it started."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def java_brokers_under(marker: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"java" in cmdline and marker.encode() in cmdline:
            found.append(int(proc.name))
    return found


def test_sigterm_stops_the_benchmarks_own_broker(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the bench's broker lives in a temporary dir under tmp_path
    stderr = tmp_path / "bench.stderr"
    with open(stderr, "wb") as err:
        bench = subprocess.Popen([sys.executable, "-m", "forge_stream", "bench", "processors", "--groups", "100000",
                                  "--json"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        until(lambda: java_brokers_under(str(tmp_path)), 120)
        time.sleep(3)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=90) == 128 + signal.SIGTERM, stderr.read_text()[-4000:]
        assert until(lambda: not java_brokers_under(str(tmp_path)), 60), "the bench left its broker running"
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in java_brokers_under(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


CLEANUP_FAILS = """
import sys, time
import typer
from forge_stream.cli.bench import _StopsOnSigterm

app = typer.Typer(cls=_StopsOnSigterm)

@app.command()
def hold(ready: str) -> None:
    try:
        open(ready, "w").close()
        time.sleep(60)
    finally:
        raise RuntimeError("the broker would not stop")

@app.command()
def other() -> None:
    pass

app()
"""


def test_sigterm_exit_status_survives_a_failing_cleanup(tmp_path):
    """Stopping what a bench started can fail on the way out; the status still says SIGTERM, and the error shows."""
    ready = tmp_path / "ready"
    bench = subprocess.Popen([sys.executable, "-c", CLEANUP_FAILS, "hold", str(ready)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert until(ready.exists, 60)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        stderr = bench.stderr.read().decode()
        assert "stopped by SIGTERM" in stderr and "the broker would not stop" in stderr, stderr
    finally:
        if bench.poll() is None:
            bench.kill()
