"""forge_stream.proc, with real processes: start, wait until healthy, fail naming the log, stop."""

import sys
import time

import pytest

from forge_stream.kafka.broker import free_port
from forge_stream.proc import ProcessError, ProcessExited, running, start_process, stop, wait_healthy

HEALTH_SERVER = """
import http.server, sys, time
time.sleep(0.5)  # not healthy at once
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_running_waits_for_health_then_stops_the_process(tmp_path):
    port = free_port()
    with running([sys.executable, "-c", HEALTH_SERVER, str(port)], url=f"http://127.0.0.1:{port}/health",
                 log=tmp_path / "server.log", timeout=60) as proc:
        assert proc.poll() is None
    assert proc.returncode == -15  # SIGTERM


def test_a_process_that_exits_is_reported_with_its_log(tmp_path):
    log = tmp_path / "dies.log"
    with pytest.raises(ProcessExited) as failed:
        with running([sys.executable, "-c", "print('no config here', flush=True); raise SystemExit(3)"],
                     name="the dying service", check=lambda: False, log=log, timeout=60):
            pass
    message = str(failed.value)
    assert "the dying service did not start (exit code 3)" in message
    assert str(log) in message and "no config here" in message


def test_a_process_never_healthy_times_out_and_a_stubborn_one_is_killed(tmp_path):
    ignores_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    proc = start_process([sys.executable, "-c", ignores_term], tmp_path / "stubborn.log")
    started = time.monotonic()
    with pytest.raises(ProcessError) as failed:
        wait_healthy("the stubborn one", proc, check=lambda: False, log=tmp_path / "stubborn.log", timeout=1)
    assert not isinstance(failed.value, ProcessExited) and "not healthy within 1s" in str(failed.value)
    assert time.monotonic() - started < 10
    stop(proc, timeout=1)
    assert proc.returncode == -9  # SIGTERM was ignored: SIGKILL
