"""Two gateway hosts behind HAProxy with the shipped config (infra/haproxy/gateway.cfg): real processes throughout
(the broker, a scripted engine, two `gateway serve --workers 2` with their own ledgers and homes, haproxy). Every
call of a session goes to one host, so the hosts' ledgers number its turns once each; a host killed mid-run gives
its sessions (only those) to the other, which rebuilds them from Kafka and numbers on after their last turn."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from forge_stream.balancer import render
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.proc import running
from forge_stream.topics import TOPICS

from helpers import needs_haproxy

pytestmark = [pytest.mark.kafka, needs_haproxy("this test runs two gateway hosts behind it")]

SESSIONS = 24
TURNS = 6  # answered chat calls per session; the first is a burst of two parallel calls for every third session


def _serve_gateway(stack: ExitStack, tmp_path, name: str, kafka: str, engine: str) -> tuple[int, object]:
    port = free_port()
    home = tmp_path / name
    home.mkdir()
    proc = stack.enter_context(running(
        [sys.executable, "-m", "forge_stream", "gateway", "serve", "--engine", engine, "--port", str(port),
         "--bootstrap-servers", kafka, "--workers", "2"],
        url=f"http://127.0.0.1:{port}/health", log=home / "gateway.log", timeout=120, stop_timeout=10,
        new_session=True, env={**os.environ, "FORGE_HOME": str(home)}))
    return port, proc


class Agents:
    """Each session a growing conversation; every chat call tagged with a unique id. A call that gets no answer
    (its host died under it: 502, 503, a reset) is sent again as a new call."""

    def __init__(self, base: str, run: str):
        self.client = httpx.Client(base_url=base, timeout=60, limits=httpx.Limits(max_connections=32))
        self.run = run
        self.lock = threading.Lock()
        self.answered: dict[str, tuple[str, str, int]] = {}  # call id -> (session, host, answered after the kill)
        self.calls = 0
        self.per_session: Counter = Counter()  # session -> calls answered
        self.opened_on: dict[str, str] = {}  # session -> the host that opened it (X-Forge-Session)
        self.killed = threading.Event()
        self.unanswered = Counter()

    def open(self, sid: str, header: bool) -> None:
        """Open `sid` through the balancer, which routes by the body's session_id or by X-Forge-Session."""
        response = self.client.post("/v1/sessions", headers={"X-Forge-Session": sid} if header else {},
                                    json={"session_id": sid, "group_id": sid, "task_id": "hosts"})
        assert response.status_code == 201, response.text
        self.opened_on[sid] = response.headers["x-forge-gateway-host"]

    def _call(self, sid: str, messages: list[dict], n: int) -> dict:
        while True:
            call_id = f"{sid}.{n}.{os.urandom(4).hex()}"
            body = {"model": "scripted", "messages": messages + [{"role": "user", "content": f"turn #{call_id}"}]}
            after = self.killed.is_set()
            try:
                response = self.client.post(f"/s/{sid}/v1/chat/completions", json=body)
            except httpx.TransportError as exc:
                self.unanswered[type(exc).__name__] += 1
                continue
            if response.status_code in (502, 503, 504):
                self.unanswered[response.status_code] += 1
                continue
            assert response.status_code == 200, response.text
            with self.lock:
                self.answered[call_id] = (sid, response.headers["x-forge-gateway-host"], after)
                self.calls += 1
                self.per_session[sid] += 1
            return body["messages"] + [response.json()["choices"][0]["message"]]

    def converse(self, sid: str, burst: int) -> None:
        messages = [{"role": "system", "content": "You answer."}]
        with ThreadPoolExecutor(burst) as pool:  # parallel calls of one session, as an agent fanning out
            first = list(pool.map(lambda i: self._call(sid, messages, i), range(burst)))
        messages = first[0]
        for n in range(burst, TURNS + burst - 1):
            messages = self._call(sid, messages, n)


def _recorded(kafka: str, run: str) -> list[tuple[str, int, int, str, str, int]]:
    """(session, turn, choice, request id, call id, offset) of the run's Completions, in their partitions' order."""
    out = []
    for event in read_slice(kafka, TOPICS.completions, Slice()):
        record = event.record
        if event.schema in TOPICS.completions.value_schemas and record["session_id"].startswith(run):
            call_id = record["messages_json"].rsplit("#", 1)[-1].split('"', 1)[0]
            out.append((record["session_id"], record["turn"], record["choice_index"], record["request_id"], call_id,
                        event.offset))
    return out


@pytest.mark.slow
def test_two_hosts_behind_haproxy_number_turns_once_and_a_killed_host_s_sessions_go_on_on_the_other(
        kafka_bootstrap, run_id, tmp_path):
    run = f"{run_id}-hosts-"
    with ExitStack() as stack:
        engine_port = free_port()
        stack.enter_context(running(
            [sys.executable, "-m", "forge_stream.bench.scripted", "--port", str(engine_port), "--reply",
             "The answer is 42.", "--delay-ms", "20"],
            url=f"http://127.0.0.1:{engine_port}/health", log=tmp_path / "engine.log", stop_timeout=10))
        engine = f"http://127.0.0.1:{engine_port}"
        hosts = [_serve_gateway(stack, tmp_path, f"gw-{i}", kafka_bootstrap, engine) for i in range(2)]
        balancer_port = free_port()
        config = tmp_path / "haproxy.cfg"
        config.write_text(render([f"127.0.0.1:{port}" for port, _ in hosts], port=balancer_port, check_ms=300))
        stack.enter_context(running(
            [shutil.which("haproxy") or "/usr/sbin/haproxy", "-db", "-f", str(config)],
            url=f"http://127.0.0.1:{balancer_port}/health", log=tmp_path / "haproxy.log", stop_timeout=10))

        agents = Agents(f"http://127.0.0.1:{balancer_port}", run)
        stack.callback(agents.client.close)
        sids = [f"{run}{i}" for i in range(SESSIONS)]
        for i, sid in enumerate(sids):
            agents.open(sid, header=i % 2 == 1)
        total = sum(TURNS + (i % 3 == 0) for i in range(SESSIONS))
        with ThreadPoolExecutor(12) as pool:
            done = [pool.submit(agents.converse, sid, 2 if i % 3 == 0 else 1) for i, sid in enumerate(sids)]
            def later_calls_on_gw_0() -> bool:  # a session of gw-0 with two calls or more to make
                return any(host == "gw-0" and agents.per_session[sid] < TURNS + (i % 3 == 0) - 1
                           for i, (sid, host) in enumerate(agents.opened_on.items()))

            while (agents.calls < total // 3 or not later_calls_on_gw_0()) and not all(f.done() for f in done):
                threading.Event().wait(0.02)
            assert later_calls_on_gw_0(), "gw-0's sessions ended before it could be killed"
            os.killpg(hosts[0][1].pid, signal.SIGKILL)  # gw-0: its supervisor and both workers, mid-run
            agents.killed.set()
            for future in done:
                future.result()
        recorded = _recorded(kafka_bootstrap, run)

    # every answered call is on forge.completions once, and no turn of a session was recorded by two requests
    seen = Counter(call_id for *_, call_id, _ in recorded)
    assert {c for c in agents.answered if seen[c] != 1} == set(), "answered calls not recorded exactly once"
    by_turn = defaultdict(set)
    for sid, turn, choice, request_id, _, _ in recorded:
        by_turn[sid, turn, choice].add(request_id)
    assert [t for t, ids in by_turn.items() if len(ids) > 1] == [], "duplicate turn numbers"
    # numbered on after the last recorded turn: in each session's partition, turns only go up
    for sid in sids:
        turns = [turn for s, turn, *_, offset in sorted(recorded, key=lambda r: r[-1]) if s == sid]
        assert turns == sorted(turns) and len(turns) == len(set(turns)), (sid, turns)

    # before the kill each session served by the host that opened it, both hosts used; after it, every call went
    # to gw-1: gw-0's sessions moved there, gw-1's stayed
    before, after = defaultdict(set), defaultdict(set)
    for sid, host, late in agents.answered.values():
        (after if late else before)[sid].add(host)
    assert all(h == {agents.opened_on[sid]} for sid, h in before.items()), (before, agents.opened_on)
    lost_host = {sid for sid, host in agents.opened_on.items() if host == "gw-0"}
    assert lost_host and len(lost_host) < SESSIONS, agents.opened_on
    assert all(after[sid] == {"gw-1"} for sid in after), after
    moved = {sid for sid in lost_host if after.get(sid)}
    assert moved, "no session of the killed host was called after the kill"
    print(f"answered {len(agents.answered)}, recorded {len(recorded)}, sessions of the killed host {len(lost_host)} "
          f"(moved {len(moved)}), unanswered and sent again {dict(agents.unanswered)}")


def test_the_shipped_config_renders_for_the_hosts_given_and_haproxy_accepts_it(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text(render(["gw-0:8000", "10.0.0.7:8001"], bind="0.0.0.0", port=8000, check_ms=750))
    text = config.read_text()
    assert "    server gw-0 gw-0:8000 check\n    server gw-1 10.0.0.7:8001 check" in text
    assert "bind 0.0.0.0:8000" in text and "inter 750" in text and "@@" not in text
    checked = subprocess.run([shutil.which("haproxy") or "/usr/sbin/haproxy", "-c", "-f", str(config)],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with pytest.raises(ValueError, match="give it as HOST:PORT"):
        render(["gw-0"])
