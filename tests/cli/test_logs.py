"""`forge-stream logs`: the tail of each service's log under the home's run directory, named or all (prefixed by
service), kept after the service is gone; `-f` prints lines as the services write them; a name that is not a log
of the home says which are."""

import os
import subprocess
import sys
import threading

from forge_stream.cli.logs import _Followed, follow
from forge_stream.proc import tail_lines as tail
from forge_stream.services import ServiceSpec, Supervisor
from helpers import until


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(tmp_path / "home"), COLUMNS="240")
    return env


def cli(env, *args):
    return subprocess.run([sys.executable, "-m", "forge_stream", "logs", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def _counter(name: str, every_s: float, first: int = 0) -> str:
    return (f"import itertools, time\nfor i in itertools.count({first}):\n"
            f"    print('{name} line', i, flush=True)\n    time.sleep({every_s})\n")


def test_logs_shows_the_tail_of_named_or_all_services_and_follows_them(tmp_path):
    env = _env(tmp_path)
    supervisor = Supervisor(tmp_path / "home" / "run")
    try:
        supervisor.start(ServiceSpec("alpha", [sys.executable, "-c", _counter("alpha", 0.01)]))
        supervisor.start(ServiceSpec("beta", [sys.executable, "-c", _counter("beta", 0.2)]))
        until(lambda: "alpha line 300" in (tmp_path / "home" / "run" / "alpha.log").read_text(), 60)

        one = cli(env, "alpha", "-n", "5")
        assert one.returncode == 0, one.stderr
        shown = one.stdout.splitlines()
        assert len(shown) == 5 and all(line.startswith("alpha line ") for line in shown)
        numbers = [int(line.split()[-1]) for line in shown]
        assert numbers == list(range(numbers[0], numbers[0] + 5)) and numbers[0] >= 296  # the last ones, in order

        both = cli(env, "-n", "2").stdout.splitlines()
        assert [line.split(" | ")[0].strip() for line in both] == ["alpha", "alpha", "beta", "beta"]
        assert all(" | alpha line " in line for line in both[:2]) and all(" | beta line " in line for line in both[2:])

        # -f: what is shown first, then the lines written afterwards, as they come
        follower = subprocess.Popen([sys.executable, "-m", "forge_stream", "logs", "beta", "-f", "-n", "1"], env=env,
                                    stdout=subprocess.PIPE, text=True)
        try:
            got: list[str] = []
            reader = threading.Thread(target=lambda: got.extend(iter(follower.stdout.readline, "")), daemon=True)
            reader.start()
            until(lambda: len(got) >= 6, 30)
            numbers = [int(line.split()[-1]) for line in got[:6]]
            assert numbers == list(range(numbers[0], numbers[0] + 6))  # nothing skipped, nothing twice
        finally:
            follower.terminate()
            follower.wait(10)

        assert "supervising the services of" in cli(env, "supervisor").stdout
    finally:
        supervisor.stop_all()
    after = cli(env, "alpha", "-n", "1")  # stopped and removed from the deployment: its log is still there
    assert after.returncode == 0 and after.stdout.startswith("alpha line ")

    missing = cli(env, "gateway")
    assert missing.returncode == 2 and "there are: alpha, beta, supervisor" in missing.stderr


def test_logs_in_a_home_where_nothing_ran_says_how_to_start(tmp_path):
    out = cli(_env(tmp_path), "-n", "3")
    assert out.returncode == 1 and "forge-stream up" in out.stderr


def test_tail_reads_back_across_blocks_and_follow_survives_truncation(tmp_path):
    log = tmp_path / "x.log"
    log.write_bytes(b"".join(b"%06d %s\n" % (i, b"y" * 200) for i in range(2000)))  # ~400 KB: several blocks
    lines, end = tail(log, 1500)
    assert len(lines) == 1500 and lines[0].startswith("000500 ") and lines[-1].startswith("001999 ")
    assert end == log.stat().st_size and tail(log, 0) == ([], end)

    followed = [_Followed("x", log, end), _Followed("later", tmp_path / "later.log", 0)]
    rounds = iter(range(10))
    out = []

    def stop() -> bool:
        step = next(rounds, None)
        if step == 1:
            with open(log, "ab") as f:
                f.write(b"appended\nhalf a ")  # the unfinished line waits for its end
        elif step == 2:
            with open(log, "ab") as f:
                f.write(b"line\n")
        elif step == 3:
            log.write_bytes(b"after truncation\n")  # rotated or rewritten: read from its start
        elif step == 4:
            (tmp_path / "later.log").write_bytes(b"a log that appeared\n")
        return step is None

    out = list(follow(followed, interval=0, stop=stop))
    assert out == [("x", "appended"), ("x", "half a line"), ("x", "after truncation"), ("later", "a log that appeared")]
