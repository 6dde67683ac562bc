"""Sessions outlive their gateway: another replica, or the same gateway restarted, rebuilds a session it does not hold
from its events on Kafka and serves it on (turn numbers, prompt references, pending tool calls, finished or not)."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from openai import OpenAI

from forge_stream.events.prompts import Lane, message_digest, whole_completions
from forge_stream.gateway import recording, restore
from forge_stream.gateway.ledger import WorkerLedger
from forge_stream.gateway.fold import fold, fold_more
from forge_stream.gateway.sessions import Session
from forge_stream.gateway.spans import SessionKeys
from forge_stream.bench.scripted import ScriptedEngine
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import read_completions
from forge_stream.proc import running
from forge_stream.topics import TOPICS

from gateway_support import ADMIN, open_session
from helpers import read_events, serving, since_this_test
from test_gateway_prompt_refs import REPLIES, check_recorded, conversation

RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def engine():
    with serving(ScriptedEngine(REPLIES)) as url:
        yield url


def _chat(base_url, messages, token=None, **extra):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.post(f"{base_url}/chat/completions", headers=headers, timeout=60,
                          json={"model": "scripted", "messages": messages, "return_token_ids": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _turns(bootstrap, sid):
    return sorted(r["turn"] for r in read_events(bootstrap, TOPICS.completions, lambda r: r["session_id"] == sid))


class CountingAgent:
    """One growing conversation; each turn may go to another gateway."""

    def __init__(self):
        self.messages = [{"role": "system", "content": "You count."}]
        self.sent: list[tuple[str, list[int]]] = []  # (messages JSON, engine's prompt ids) per turn

    def turn(self, base_url: str) -> None:
        self.messages.append({"role": "user", "content": f"Say {len(self.sent)}."})
        body = _chat(base_url, self.messages)
        self.sent.append((orjson.dumps(self.messages).decode(), body["prompt_token_ids"]))
        self.messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    def check(self, bootstrap: str, sid: str) -> None:
        """Every turn recorded once, each extending the one before by reference, the prompts rebuilt exactly."""
        recorded = sorted(read_events(bootstrap, TOPICS.completions, lambda r: r["session_id"] == sid),
                          key=lambda r: r["turn"])
        assert [r["turn"] for r in recorded] == list(range(len(self.sent)))
        assert [r["prompt_ref"] for r in recorded] == [None] + [r["completion_id"] for r in recorded[:-1]]
        rebuilt = sorted(read_completions(bootstrap, since_this_test(),
                                          keep=lambda r: r["session_id"] == sid), key=lambda r: r["turn"])
        assert [(r["messages_json"], r["prompt_token_ids"]) for r in rebuilt] == self.sent


@pytest.fixture(params=["kafka", "ledger"])
def sharing(request, tmp_path):
    """How replicas learn what the others recorded: following Kafka (`--shared-sessions`, replicas on any hosts), or
    the workers' ledger of one host (`--workers N`: here two gateways in this process map one ledger file)."""
    if request.param == "kafka":
        yield {"shared_sessions": True}
        return
    with WorkerLedger.hosted(2, str(tmp_path)) as path:
        yield {"worker_ledger": path, "workers": 2}


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()


@pytest.mark.parametrize("packed", [False, True], ids=["lanes", "packed-lanes"])
def test_one_session_served_alternately_by_two_replicas(kafka_bootstrap, make_gateway, engine, run_id, sharing,
                                                       packed, monkeypatch):
    """Every request of a conversation (appends, n = 3, a sub-agent, a rewritten history) goes to the other
    replica: turn numbers and prompt references are those one gateway records, and the prompts rebuild exactly.
    With `packed`, every lane keeps a digest of its prompt (as lanes of 4,096 ids or more do), the ones each replica
    rebuilds from Kafka included, and every prompt the engine returns is kept as its text (as those of 16 KB or more
    are)."""
    if packed:
        monkeypatch.setattr(Lane, "packed_from", 1)
        monkeypatch.setattr(recording, "TEXT_FROM", 0)
    with make_gateway(engines=(engine,), **sharing) as a, make_gateway(engines=(engine,), **sharing) as b:
        session = open_session(a, run_id)
        again = httpx.post(f"{b}/v1/sessions", json={"group_id": run_id, "task_id": "other",
                                                     "session_id": session["session_id"]})
        assert again.status_code == 409, again.text  # taken on another replica, for another task
        sent = conversation(a + session["path"], b + session["path"])
        health = [httpx.get(f"{g}/health").json() for g in (a, b)]
    check_recorded(kafka_bootstrap, session["session_id"], sent)
    assert health[0]["sessions_restored"] == 0 and health[1]["sessions_restored"] == 1
    assert health[0]["turn_collisions"] == health[1]["turn_collisions"] == 0


def test_a_held_session_is_rebuilt_only_when_another_replica_recorded_for_it(
        kafka_bootstrap, make_gateway, engine, run_id, sharing):
    """Shared sessions: a replica serving its own session's calls rebuilds nothing; after another replica served a
    turn, its next call rebuilds the session once (and sees that turn), and the calls after it rebuild nothing."""
    agent = CountingAgent()
    rebuilt = lambda url: httpx.get(f"{url}/health").json()["sessions_refreshed"]  # noqa: E731
    with make_gateway(engines=(engine,), **sharing) as a, make_gateway(engines=(engine,), **sharing) as b:
        session = open_session(a, run_id)
        sid, path = session["session_id"], session["path"]
        for _ in range(3):
            agent.turn(a + path)
        assert rebuilt(a) == 0
        agent.turn(b + path)  # B does not hold it: restored, not refreshed
        assert (rebuilt(b), httpx.get(f"{b}/health").json()["sessions_restored"]) == (0, 1)
        for _ in range(3):
            agent.turn(a + path)
        assert rebuilt(a) == 1
        agent.turn(b + path)
        assert rebuilt(b) == 1
    agent.check(kafka_bootstrap, sid)


def test_a_held_session_catches_up_on_what_was_recorded_since_not_from_its_start(
        kafka_bootstrap, make_gateway, engine, run_id, sharing):
    """A session whose calls alternate between two replicas for 24 turns: each replica, before serving a turn, reads
    only what the other recorded since its own last turn (a few records), not the session from its start (which
    would read about 24 * 24 / 2 = 288 records over the run). What it folds in is what a full rebuild gives: every
    turn extends the one before by reference (the lanes are right), and a third replica that rebuilds the session
    from its start sees the same turns and completions."""
    agent = CountingAgent()
    with make_gateway(engines=(engine,), **sharing) as a, make_gateway(engines=(engine,), **sharing) as b:
        session = open_session(a, run_id)
        sid, path = session["session_id"], session["path"]
        for turn in range(24):
            agent.turn((a, b)[turn % 2] + path)
        ha, hb = _health(a), _health(b)
        views = [httpx.get(f"{g}/v1/sessions/{sid}").json() for g in (a, b)]
        with make_gateway(engines=(engine,)) as c:  # not sharing: it rebuilds what it does not hold
            rebuilt = httpx.get(f"{c}/v1/sessions/{sid}").json()
    assert (hb["sessions_restored"], ha["sessions_refreshed"], hb["sessions_refreshed"]) == (1, 11, 11)
    # B's restore decodes turn 0; then each catch-up decodes the other's one turn: its own turn before it, which it
    # holds, is passed over by its offset
    assert (ha["session_records_read"], hb["session_records_read"]) == (11, 12), (ha, hb)
    assert ha["turn_collisions"] == hb["turn_collisions"] == 0
    for view in views:
        assert (view["turns"], view["completions"]) == (rebuilt["turns"], rebuilt["completions"]) == (24, 24)
    agent.check(kafka_bootstrap, sid)


def test_a_session_one_replica_served_long_is_caught_up_whole_past_the_offsets_it_keeps(
        kafka_bootstrap, make_gateway, engine, run_id, sharing, monkeypatch):
    """A replica keeps the offsets of its own records for a catch-up to pass over only up to MAX_OWN_OFFSETS (4
    here) per session: after 10 turns served alone and one elsewhere, its catch-up decodes the other's turn and its
    own turns from before the set was last emptied (told apart by request id), and the session goes on whole."""
    monkeypatch.setattr(restore, "MAX_OWN_OFFSETS", 4)
    agent = CountingAgent()
    with make_gateway(engines=(engine,), **sharing) as a, make_gateway(engines=(engine,), **sharing) as b:
        session = open_session(a, run_id)
        sid, path = session["session_id"], session["path"]
        for _ in range(10):
            agent.turn(a + path)
        agent.turn(b + path)
        before = _health(a)
        agent.turn(a + path)
        after = _health(a)
        views = [httpx.get(f"{g}/v1/sessions/{sid}").json() for g in (a, b)]
    assert after["sessions_refreshed"] == before["sessions_refreshed"] + 1
    decoded = after["session_records_read"] - before["session_records_read"]
    # B's turn and A's turns 0-7; the offsets of 8 and 9, kept since the set was last emptied (at turn 8), passed over
    assert decoded == 1 + 8, (before, after)
    assert after["session_records_scanned"] - before["session_records_scanned"] >= 11  # from its start
    assert [(v["turns"], v["completions"]) for v in views] == [(12, 12), (12, 12)]
    agent.check(kafka_bootstrap, sid)


def _folds_agree(bootstrap: str, sid: str) -> None:
    """For every split of the session's records between two requests: folding the later ones (`fold_more`, all its
    spans with them) into the state folded from the earlier ones gives the state folded from all at once."""
    completions = read_events(bootstrap, TOPICS.completions, lambda r: r["session_id"] == sid)  # in offset order
    spans = read_events(bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    keys = SessionKeys(sid, completions[0]["group_id"], completions[0]["task_id"])

    def folded(*parts):
        session = Session(keys, "", {})
        fold(session, *parts[0], True)
        for part in parts[1:]:
            fold_more(session, *part, True)
        return (session.turns, session.completions, session.requests, session.lanes, session.pending,
                session.span_ids, session.explicit)

    whole = folded((completions, spans))
    lanes = {}  # the lanes of the whole prompts, rebuilt by the readers' path (resolve_prompt), not by the fold's
    for record in whole_completions(completions):
        if record["prompt_token_ids"]:
            lanes[record["agent"], record["choice_index"]] = Lane(
                record["completion_id"], record["prompt_token_ids"], record["completion_token_ids"],
                tuple(message_digest(orjson.dumps(m)) for m in orjson.loads(record["messages_json"])))
    assert whole[3] == lanes
    splits = [k for k in range(len(completions) + 1)
              if k in (0, len(completions)) or completions[k - 1]["request_id"] != completions[k]["request_id"]]
    for k in splits:
        assert folded((completions[:k], []), (completions[k:], spans)) == whole, k
        assert folded((completions[:k], spans), (completions[k:], spans)) == whole, k


def test_folding_on_from_any_turn_gives_what_a_rebuild_from_the_start_gives(
        kafka_bootstrap, make_gateway, engine, scripted_url, run_id):
    """The conversation of the prompt-reference tests (appends, n = 3, a sub-agent, a rewritten history) and one of
    tool calls answered by tool results: `_folds_agree` on each."""
    with make_gateway(engines=(engine,)) as gateway, make_gateway(engines=(scripted_url,)) as tooled:
        talk = open_session(gateway, run_id)
        conversation(gateway + talk["path"])
        tools = open_session(tooled, run_id)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        for _ in range(5):
            message = _chat(tooled + tools["path"], messages, tools=TOOLS)["choices"][0]["message"]
            messages.append(message)
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "21C"}
                            if message.get("tool_calls") else {"role": "user", "content": "And tomorrow?"})
    _folds_agree(kafka_bootstrap, talk["session_id"])
    _folds_agree(kafka_bootstrap, tools["session_id"])
    Lane.packed_from, kept = 1, Lane.packed_from  # every lane as long prompts' are: a digest extended by each turn
    try:
        _folds_agree(kafka_bootstrap, talk["session_id"])
        _folds_agree(kafka_bootstrap, tools["session_id"])
    finally:
        Lane.packed_from = kept


def test_a_held_session_catching_up_learns_the_tool_calls_issued_and_answered_elsewhere(
        kafka_bootstrap, make_gateway, scripted_url, run_id, sharing):
    """A's completion issues a call that B's next turn answers, and B's completion after it issues another. A,
    holding the session, catches up before its next turn: the first call is answered (no span inferred for it
    twice), the second pending, so A infers its span from the tool result it is sent."""
    with make_gateway(engines=(scripted_url,), **sharing) as a, make_gateway(engines=(scripted_url,), **sharing) as b:
        session = open_session(a, run_id)
        sid, path = session["session_id"], session["path"]
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        for url in (a, b, b, a):
            body = _chat(url + path, messages, tools=TOOLS)
            message = body["choices"][0]["message"]
            messages.append(message)
            if message.get("tool_calls"):
                messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "21C"})
            else:
                messages.append({"role": "user", "content": "And tomorrow?"})
        view = httpx.get(f"{a}/v1/sessions/{sid}").json()
        refreshed = httpx.get(f"{a}/health").json()["sessions_refreshed"]
    assert (view["turns"], view["completions"], view["pending_tool_calls"], refreshed) == (4, 4, [], 1)
    issued = [orjson.loads(r["tool_calls_json"])[0]["id"]
              for r in sorted(read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["session_id"] == sid),
                              key=lambda r: r["turn"]) if r["tool_calls_json"]]
    spans = read_events(kafka_bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    assert len(issued) == 2 and sorted(s["tool_call_id"] for s in spans) == sorted(issued)


def test_a_session_moves_to_another_replica_with_its_token_and_pending_tool_calls(
        kafka_bootstrap, make_gateway, scripted_url, run_id):
    """With auth: the session token issued by A works on B (also alone, naming no session), B infers the span of a
    tool call A's completion issued, and B's SessionFinished counts A's completion."""
    with make_gateway(engines=(scripted_url,), admin_token=ADMIN) as a, \
            make_gateway(engines=(scripted_url,), admin_token=ADMIN) as b:
        session = open_session(a, run_id, token=ADMIN)
        sid, token = session["session_id"], session["token"]
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        asked = _chat(a + session["path"], messages, token, tools=TOOLS)
        call = asked["choices"][0]["message"]["tool_calls"][0]
        messages += [asked["choices"][0]["message"], {"role": "tool", "tool_call_id": call["id"], "content": "21C"}]
        _chat(f"{b}/v1", messages, token, tools=TOOLS)  # the token alone names the session
        view = httpx.get(f"{b}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert (view["turns"], view["completions"], view["pending_tool_calls"]) == (2, 2, [])
        other = open_session(a, run_id, token=ADMIN)
        refused = httpx.post(f"{b}/s/{sid}/v1/chat/completions", json={"messages": messages},
                             headers={"Authorization": f"Bearer {other['token']}"})
        assert refused.status_code == 403, refused.text
        finished = httpx.post(f"{b}/v1/sessions/{sid}/finish", json={"status": "ok"},
                              headers={"Authorization": f"Bearer {ADMIN}"})
        assert finished.status_code == 200, finished.text
    assert _turns(kafka_bootstrap, sid) == [0, 1]
    first = next(r for r in read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["session_id"] == sid)
                 if r["turn"] == 0)
    spans = read_events(kafka_bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    assert [(s["tool_call_id"], s["source"], s["completion_id"]) for s in spans] == [
        (call["id"], "inferred", first["completion_id"])]
    [end] = [r for r in read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
             if "num_completions" in r]
    assert (end["num_completions"], end["num_tool_spans"]) == (2, 1)


def test_a_restarted_gateway_continues_its_open_sessions_and_keeps_finished_ones_finished(
        kafka_bootstrap, make_gateway, engine, run_id):
    agent = CountingAgent()
    with make_gateway(engines=(engine,)) as first:
        session = open_session(first, run_id)
        sid, path = session["session_id"], session["path"]
        agent.turn(first + path)
        agent.turn(first + path)
    with make_gateway(engines=(engine,)) as second:  # the same gateway, restarted (here on another port)
        view = httpx.get(f"{second}/v1/sessions/{sid}").json()
        assert (view["status"], view["turns"], view["completions"]) == ("open", 2, 2)
        agent.turn(second + path)
        agent.turn(second + path)
        assert httpx.post(f"{second}/v1/sessions/{sid}/reward", json={"value": 1.0}).status_code == 200
        assert httpx.post(f"{second}/v1/sessions/{sid}/finish", json={"status": "ok"}).status_code == 200
        assert httpx.post(f"{second}/s/nobody-{run_id}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 404
    with make_gateway(engines=(engine,)) as third:
        assert httpx.get(f"{third}/v1/sessions/{sid}").json()["status"] == "finished"
        late = httpx.post(f"{third}/v1/sessions/{sid}/reward", json={"value": 1.0})
        assert late.status_code == 409, late.text
        chat = httpx.post(f"{third}{path}/chat/completions", json={"messages": agent.messages})
        assert chat.status_code == 409, chat.text
    agent.check(kafka_bootstrap, sid)


@contextmanager
def gateway_process(engine: str, bootstrap: str, *options: str, log=subprocess.DEVNULL):
    """`forge-stream gateway serve` as a real process (its output to `log`); yields (its URL, its Popen)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running([sys.executable, "-m", "forge_stream", "gateway", "serve", "--engine", engine, "--port", str(port),
                  "--bootstrap-servers", bootstrap, *options], name="the gateway", url=f"{url}/health",
                 log=log, timeout=120, stop_timeout=60) as proc:
        yield url, proc


@pytest.mark.slow
def test_two_replica_processes_alternate_one_session_and_one_is_killed(kafka_bootstrap, engine, run_id):
    """Turns alternate between two gateway processes; one is SIGKILLed mid-session; the other finishes it, and the
    trajectory on Kafka is whole: every turn once, in order, each extending the one before."""
    agent = CountingAgent()
    with gateway_process(engine, kafka_bootstrap, "--shared-sessions") as (a, proc_a), \
            gateway_process(engine, kafka_bootstrap, "--shared-sessions") as (b, _):
        session = open_session(a, run_id)
        sid, path = session["session_id"], session["path"]
        for i in range(6):
            agent.turn((a, b)[i % 2] + path)
        os.kill(proc_a.pid, signal.SIGKILL)
        proc_a.wait(timeout=30)
        for _ in range(3):
            agent.turn(b + path)
        assert httpx.post(f"{b}/v1/sessions/{sid}/finish", json={"status": "ok"}).status_code == 200
        assert httpx.get(f"{b}/health").json()["turn_collisions"] == 0
    agent.check(kafka_bootstrap, sid)
    [end] = [r for r in read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
             if "num_completions" in r]
    assert end["num_completions"] == 9


def _workers(url: str, tries: int = 400) -> dict[int, dict]:
    """The /health of each worker answering `url`, asked on new connections until two answered."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        health = httpx.get(f"{url}/health").json()
        seen[health["pid"]] = health
        if len(seen) == 2:
            break
    return seen


@pytest.mark.slow
def test_gateway_serve_with_workers_serves_and_records_any_session_on_any_worker(kafka_bootstrap, engine, run_id,
                                                                                  tmp_path):
    """`--workers 2`: one port, two processes; each call on a new connection goes to either; once a worker has
    served a session the other opened, the sessions' turns are all recorded once, in order. Each worker's log says
    where it serves and records, dated, and so does librdkafka's (no raw `%4|...|` lines)."""
    log_path = tmp_path / "gateway.log"
    with log_path.open("w") as log, gateway_process(engine, kafka_bootstrap, "--workers", "2", log=log) as (url, _):
        workers = _workers(url)
        assert len(workers) == 2 and {h["sessions_shared_by"] for h in workers.values()} == {"ledger"}
        agents = [(CountingAgent(), open_session(url, run_id)) for _ in range(3)]
        for _ in range(12):
            for agent, session in agents:
                agent.turn(url + session["path"])  # a new connection per call
            workers = _workers(url)
            if len(agents[0][0].sent) >= 3 and sum(h["sessions_restored"] for h in workers.values()) > 0:
                break
        assert sum(h["sessions_restored"] for h in workers.values()) > 0
        for _, session in agents:
            finish = httpx.post(f"{url}/v1/sessions/{session['session_id']}/finish", json={"status": "ok"})
            assert finish.status_code == 200, finish.text
    for agent, session in agents:
        agent.check(kafka_bootstrap, session["session_id"])
    lines = log_path.read_text().splitlines()
    for pid in workers:
        assert any(f"INFO forge_stream.gateway.app: gateway ready (pid {pid}) on 127.0.0.1:{url.rsplit(':', 1)[1]}: "
                   f"engines {engine}; recording to Kafka at {kafka_bootstrap}" in line for line in lines), lines
    assert not [line for line in lines if line.startswith("%")], lines


def _listening_sockets(port: int) -> int:
    """How many TCP sockets listen on `port` on this host (/proc/net/tcp: state 0A)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for row in rows if row.split()[1].endswith(f":{port:04X}") and row.split()[3] == "0A")


@pytest.mark.slow
def test_workers_each_accept_on_their_own_socket_so_a_burst_of_connections_is_shared(kafka_bootstrap, engine):
    """`--workers 2` listens with one socket per worker (SO_REUSEPORT): 64 connections opened at once, as a load
    balancer's pool or 64 starting agents open them, are spread over both workers by the kernel. (With one socket
    shared, each worker takes what it can when woken, so the split is uneven: under `bench gateway` at 64 callers one
    worker can do twice the other's work and run out of CPU first.)"""

    async def pid_of(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        writer.write(b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return orjson.loads(await reader.readexactly(length))["pid"]

    async def burst(port: int) -> list[int]:
        connections = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(64)))
        try:
            return await asyncio.gather(*(pid_of(reader, writer) for reader, writer in connections))
        finally:
            for _, writer in connections:
                writer.close()

    with gateway_process(engine, kafka_bootstrap, "--workers", "2") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        assert len(_workers(url)) == 2
        assert _listening_sockets(port) == 2
        pids = asyncio.run(burst(port))
    shares = sorted(Counter(pids).values())
    assert len(shares) == 2 and shares[0] >= 12, f"connections per worker: {shares}"  # hashing: 32 +- 4


def test_workers_on_a_port_in_use_are_refused_with_what_to_do(kafka_bootstrap, engine):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "forge_stream", "gateway", "serve", "--engine", engine, "--port",
                               str(port), "--bootstrap-servers", kafka_bootstrap, "--workers", "2"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "choose another --port" in done.stderr


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_the_sessions_its_ledger_slot_served_go_on_whole(
        kafka_bootstrap, engine, run_id):
    """`--workers 2` shares sessions through the ledger: turns land on either worker (a new connection per call);
    SIGKILL one mid-session: the other serves the next turns, uvicorn starts a worker in its place, which takes the
    dead one's ledger slot; every turn is on Kafka once, in order, each extending the one before."""
    agent = CountingAgent()
    with gateway_process(engine, kafka_bootstrap, "--workers", "2") as (url, _):
        session = open_session(url, run_id)
        sid, path = session["session_id"], session["path"]
        for _ in range(30):  # until both workers served it (the kernel picks the worker of each connection)
            agent.turn(url + path)
            workers = _workers(url)
            if len(agent.sent) >= 4 and sum(h["sessions_restored"] for h in workers.values()) > 0:
                break
        assert sum(h["sessions_restored"] for h in workers.values()) > 0
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        for _ in range(4):
            agent.turn(url + path)
        deadline = time.monotonic() + 60
        while victim in (workers := _workers(url, tries=50)) or len(workers) < 2:
            assert time.monotonic() < deadline, f"no worker replaced {victim}: {sorted(workers)}"
            time.sleep(0.5)
        for _ in range(6):
            agent.turn(url + path)
        finish = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"status": "ok"})
        assert finish.status_code == 200, finish.text
        assert sum(h["turn_collisions"] for h in _workers(url).values()) == 0
    agent.check(kafka_bootstrap, sid)
    [end] = [r for r in read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
             if "num_completions" in r]
    assert end["num_completions"] == len(agent.sent)


def _turn_on_each_then_both_at_once(a: str, b: str, path: str) -> list[dict]:
    """Turns 0 and 1 of the session on `a` then `b` (so both hold it), then one call on each at the same time (the
    engine takes 2 s); returns the messages sent."""
    hi = [{"role": "user", "content": "hi"}]
    _chat(a + path, hi)
    _chat(b + path, hi)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda url: _chat(url + path, hi), (a, b)))
    return hi


def test_a_turn_two_replicas_record_at_once_is_found_and_the_session_goes_on_past_it(kafka_bootstrap, make_gateway,
                                                                                     run_id):
    """No lock spans replicas on several hosts (`--shared-sessions`): two calls of one session served at once by
    two replicas (each holding it) both take turn 2. The next call finds it (counted in /health), and its turn is
    numbered past both."""
    with serving(ScriptedEngine(REPLIES, delay_s=2.0)) as slow, \
            make_gateway(engines=(slow,), shared_sessions=True) as a, \
            make_gateway(engines=(slow,), shared_sessions=True) as b:
        session = open_session(a, run_id)
        sid, path = session["session_id"], session["path"]
        hi = _turn_on_each_then_both_at_once(a, b, path)
        assert httpx.get(f"{a}/health").json()["turn_collisions"] == 0  # not seen yet
        _chat(a + path, hi)
        assert httpx.get(f"{a}/health").json()["turn_collisions"] == 1
    assert _turns(kafka_bootstrap, sid) == [0, 1, 2, 2, 3]


def test_workers_of_one_host_number_a_session_s_concurrent_turns_once_each(kafka_bootstrap, make_gateway, run_id,
                                                                          tmp_path):
    """Workers of one host (the ledger) number a session's turns under the session's lock: two calls served at once
    by two workers each holding the session take turns 2 and 3, not 2 twice; the session's count is right."""
    with WorkerLedger.hosted(2, str(tmp_path)) as path, serving(ScriptedEngine(REPLIES, delay_s=2.0)) as slow, \
            make_gateway(engines=(slow,), worker_ledger=path, workers=2) as a, \
            make_gateway(engines=(slow,), worker_ledger=path, workers=2) as b:
        session = open_session(a, run_id)
        sid, path = session["session_id"], session["path"]
        hi = _turn_on_each_then_both_at_once(a, b, path)
        _chat(a + path, hi)
        assert [httpx.get(f"{g}/health").json()["turn_collisions"] for g in (a, b)] == [0, 0]
        finish = httpx.post(f"{b}/v1/sessions/{sid}/finish", json={"status": "ok"})
        assert finish.status_code == 200, finish.text
    assert _turns(kafka_bootstrap, sid) == [0, 1, 2, 3, 4]
    [end] = [r for r in read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
             if "num_completions" in r]
    assert end["num_completions"] == 5


def test_a_responses_chain_goes_on_across_replicas(kafka_bootstrap, make_gateway, scripted_url, run_id):
    """`previous_response_id` names a response another replica served (streamed, with instructions, a tool call):
    the chain rebuilt from its Completion gives the prompt one gateway would have sent."""
    with make_gateway(engines=(scripted_url,), shared_sessions=True) as a, \
            make_gateway(engines=(scripted_url,), shared_sessions=True) as b:
        session = open_session(a, run_id)
        on_a, on_b = (OpenAI(base_url=g + session["path"], api_key="unused", max_retries=0) for g in (a, b))
        events = list(on_a.responses.create(model="scripted", instructions="Be brief.", input="Weather in Paris?",
                                            tools=[RESPONSES_TOOL], stream=True))
        first = events[-1].response
        [call] = first.output
        second = on_b.responses.create(model="scripted", previous_response_id=first.id, tools=[RESPONSES_TOOL],
                                       input=[{"type": "function_call_output", "call_id": call.call_id,
                                               "output": "21 degrees"}])
        third = on_a.responses.create(model="scripted", previous_response_id=second.id, input="Thanks.")
        assert third.previous_response_id == second.id
        unstored = on_a.responses.create(model="scripted", input="hi", store=False)
        with pytest.raises(openai.BadRequestError) as refused:
            on_b.responses.create(model="scripted", previous_response_id=unstored.id, input="more")
        assert refused.value.code == "previous_response_not_found"
    records = sorted(read_completions(kafka_bootstrap, since_this_test(),
                                      keep=lambda r: r["session_id"] == session["session_id"]),
                     key=lambda r: r["turn"])
    calls = orjson.loads(records[0]["tool_calls_json"])
    chained = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"}]
    assert [orjson.loads(r["messages_json"]) for r in records[:3]] == [
        [{"role": "system", "content": "Be brief."}, chained[0]], chained,
        chained + [{"role": "assistant", "content": records[1]["output_text"]}, {"role": "user", "content": "Thanks."}]]


def test_a_finish_counts_what_every_replica_recorded(kafka_bootstrap, make_gateway, scripted_url, run_id):
    """A span posted to B for a call A's completion issued, then the finish on A: its SessionFinished counts it."""
    with make_gateway(engines=(scripted_url,), shared_sessions=True) as a, \
            make_gateway(engines=(scripted_url,), shared_sessions=True) as b:
        session = open_session(a, run_id)
        sid = session["session_id"]
        asked = _chat(a + session["path"], [{"role": "user", "content": "Weather?"}], tools=TOOLS)
        call = asked["choices"][0]["message"]["tool_calls"][0]
        span = {"name": "get_weather", "tool_call_id": call["id"], "status": "ok", "start_ms": 1, "end_ms": 2}
        posted = httpx.post(f"{b}/v1/sessions/{sid}/spans", json={"spans": [span]})
        assert posted.status_code == 200, posted.text
        assert httpx.post(f"{a}/v1/sessions/{sid}/finish", json={"status": "ok"}).status_code == 200
        late = httpx.post(f"{b}/v1/sessions/{sid}/reward", json={"value": 1.0})
        assert late.status_code == 409, late.text  # finished on A: B, which holds it, finds out
    [end] = [r for r in read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
             if "num_completions" in r]
    assert (end["num_completions"], end["num_tool_spans"]) == (1, 1)
