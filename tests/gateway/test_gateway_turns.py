"""One turn per turn: each call of a session is recorded once, under a turn number no other call of it has, whatever
the concurrency (two worker processes), the retries (an Idempotency-Key, also sent by several calls at once), a
delivery Kafka took but did not acknowledge in time, a worker hung holding a session's lock, a gateway restart, or
a finish that comes while calls are in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from forge_stream.gateway.ledger import WorkerLedger
from forge_stream.bench.scripted import ScriptedEngine
from forge_stream.kafka.admin import create_topics
from forge_stream.kafka.broker import BrokerConfig, LocalBroker, free_port
from forge_stream.settings import ForgeSettings
from forge_stream.topics import TOPICS

from gateway_support import open_session
from helpers import read_events, serving
from test_gateway_replicas import _workers, gateway_process

pytestmark = pytest.mark.kafka

REPLIES = tuple(f"Reply number {i}." for i in range(64))
HI = [{"role": "user", "content": "hi"}]


def _post(url: str, key: str | None = None, stream: bool = False, **extra) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return httpx.post(f"{url}/chat/completions", headers=headers, timeout=60,
                      json={"model": "scripted", "messages": HI, "stream": stream, **extra})


def _recorded(bootstrap: str, sid: str) -> list[dict]:
    return sorted(read_events(bootstrap, TOPICS.completions, lambda r: r["session_id"] == sid),
                  key=lambda r: r["turn"])


def _finished(bootstrap: str, sid: str) -> dict:
    [end] = [r for r in read_events(bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
             if "num_completions" in r]
    return end


def _content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_concurrent_calls_of_one_session_on_two_worker_processes_take_one_turn_each(kafka_bootstrap, run_id):
    """`serve --workers 2`: 16 calls of one session at once, each on its own connection (so both workers serve
    them), each holding the session: the turns recorded are 0..15, each once, and the finish counts 16."""
    with serving(ScriptedEngine(REPLIES, delay_s=0.2)) as engine, \
            gateway_process(engine, kafka_bootstrap, "--workers", "2") as (url, _):
        session = open_session(url, run_id)
        sid, path = session["session_id"], session["path"]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _post(url + path), range(16)))
        assert [a.status_code for a in answers] == [200] * 16
        served = [h["calls_answered"] for h in _workers(url).values()]
        finish = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"status": "ok"})
        assert finish.status_code == 200, finish.text
    assert len(served) == 2 and min(served) > 0 and sum(served) == 16, served  # both workers took calls
    recorded = _recorded(kafka_bootstrap, sid)
    assert [r["turn"] for r in recorded] == list(range(16))
    assert len({r["request_id"] for r in recorded}) == 16
    assert _finished(kafka_bootstrap, sid)["num_completions"] == 16


def test_a_call_retried_with_its_idempotency_key_is_answered_as_recorded(kafka_bootstrap, make_gateway, run_id):
    """The same Idempotency-Key again (its first answer lost, say): the engine is not asked again, the answer is the
    one recorded (whole or streamed), and Kafka holds the call once; another key is the next turn."""
    engine = ScriptedEngine(REPLIES)
    with serving(engine) as engine_url, make_gateway(engines=(engine_url,)) as gateway:
        session = open_session(gateway, run_id)
        sid, url = session["session_id"], gateway + session["path"]
        first = _content(_post(url, key="call-1"))
        again = _content(_post(url, key="call-1"))
        streamed = _post(url, key="call-1", stream=True)
        assert streamed.status_code == 200 and f'"content":"{first}"' in streamed.text, streamed.text
        assert streamed.text.rstrip().endswith("data: [DONE]")
        other = _content(_post(url, key="call-2"))
        assert httpx.post(f"{gateway}/v1/sessions/{sid}/finish", json={"status": "ok"}).status_code == 200
        bad = httpx.post(f"{url}/chat/completions", headers={"Idempotency-Key": "x" * 300}, json={"messages": HI})
        assert bad.status_code == 422 and "Idempotency-Key" in bad.text
    assert again == first and other != first
    recorded = _recorded(kafka_bootstrap, sid)
    assert [(r["turn"], r["output_text"]) for r in recorded] == [(0, first), (1, other)]
    assert _finished(kafka_bootstrap, sid)["num_completions"] == 2


def test_an_idempotency_key_is_bound_to_its_request(kafka_bootstrap, make_gateway, run_id):
    """Eight calls sent at once with one key run the engine once and all get its answer; the key with another body
    (sent at the same time, or after) or on the completions endpoint is refused with 422 saying so, and nothing of
    those is recorded; the session finishes at once (no call is left counted in flight)."""
    engine = ScriptedEngine(REPLIES, delay_s=0.5)
    with serving(engine) as engine_url, make_gateway(engines=(engine_url,), engine_timeout_s=20) as gateway:
        session = open_session(gateway, run_id)
        sid, url = session["session_id"], gateway + session["path"]
        with ThreadPoolExecutor(9) as pool:
            same = [pool.submit(_post, url, "the-call") for _ in range(8)]
            other_at_once = pool.submit(_post, url, "the-call", max_tokens=5)
            answers = [_content(call.result()) for call in same]
        other_after = _post(url, key="the-call", temperature=0.5)
        elsewhere = httpx.post(f"{url}/completions", headers={"Idempotency-Key": "the-call"}, timeout=60,
                               json={"model": "scripted", "prompt": "hi"})
        again = _content(_post(url, key="the-call", stream=False))  # the same request: answered as recorded
        finish = httpx.post(f"{gateway}/v1/sessions/{sid}/finish", json={"status": "ok"}, timeout=60)
        assert finish.status_code == 200, finish.text
    assert answers == [REPLIES[0]] * 8 and again == REPLIES[0] and engine.served == 1
    for refused in (other_at_once.result(), other_after, elsewhere):
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("Idempotency-Key", "idempotency_key_reused"), error
        assert "another request of this session" in error["message"] and "new key" in error["message"], error
    assert [(r["turn"], r["output_text"]) for r in _recorded(kafka_bootstrap, sid)] == [(0, REPLIES[0])]
    assert _finished(kafka_bootstrap, sid)["num_completions"] == 1


def test_calls_sent_at_once_with_one_key_run_the_engine_once_across_workers(kafka_bootstrap, run_id):
    """`serve --workers 2`: eight calls of a session sent at once with one Idempotency-Key, each on its own
    connection: the engine sees one, all eight get its answer, Kafka holds it once, and the finish counts it. A round
    whose eight connections the kernel all gave to one worker (1 in 128) is run again with another key, until both
    workers took some."""
    engine = ScriptedEngine(REPLIES, delay_s=0.5)
    with serving(engine) as engine_url, gateway_process(engine_url, kafka_bootstrap, "--workers", "2") as (url, _):
        session = open_session(url, run_id)
        sid, path = session["session_id"], session["path"]
        before: dict[int, int] = {}
        for round_ in range(6):
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda _: _post(url + path, f"call-{round_}"), range(8)))
            assert [_content(a) for a in answers] == [REPLIES[round_]] * 8
            assert engine.served == round_ + 1
            served = {pid: h["calls_answered"] for pid, h in _workers(url).items()}
            took = [served[pid] - before.get(pid, 0) for pid in served]
            assert sum(took) == 8, (served, before)
            if len(took) == 2 and min(took) > 0:
                break
            before = served
        else:
            raise AssertionError("the kernel gave every round's connections to one worker")
        finish = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"status": "ok"}, timeout=60)
        assert finish.status_code == 200, finish.text
    recorded = _recorded(kafka_bootstrap, sid)
    assert [(r["turn"], r["output_text"]) for r in recorded] == [(i, REPLIES[i]) for i in range(round_ + 1)]
    assert _finished(kafka_bootstrap, sid)["num_completions"] == round_ + 1


_HOLDER = """import asyncio, os, signal, sys
from forge_stream.gateway.ledger import WorkerLedger
ledger = WorkerLedger(sys.argv[1], 2)
asyncio.run(ledger.take(ledger.session_byte(sys.argv[2]), 10))
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_worker_hung_holding_a_session_s_lock_gets_the_waiting_call_a_503(kafka_bootstrap, make_gateway, run_id,
                                                                              tmp_path):
    """A worker that stops (SIGSTOP) while it holds the ledger's lock of a session: another worker's call of the
    session waits `turn_lock_wait_s` for it, then answers 503 with Retry-After, nothing recorded; once the holder is
    gone, the call is served."""
    with WorkerLedger.hosted(2, str(tmp_path)) as ledger, serving(ScriptedEngine(REPLIES)) as engine_url, \
            make_gateway(engines=(engine_url,), worker_ledger=ledger, workers=2, turn_lock_wait_s=2) as gateway:
        session = open_session(gateway, run_id)
        sid, url = session["session_id"], gateway + session["path"]
        _content(_post(url))
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, ledger, sid], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline() == "held\n"
            refused = _post(url)
        finally:
            holder.kill()  # the lock dies with its holder
            holder.wait()
        assert refused.status_code == 503 and refused.headers["retry-after"] == "2", refused.text
        assert "may be stuck" in refused.json()["error"]["message"], refused.text
        _content(_post(url))
    assert [r["turn"] for r in _recorded(kafka_bootstrap, sid)] == [0, 1]


def test_a_restarted_gateway_does_not_open_an_existing_session_again(kafka_bootstrap, make_gateway, run_id):
    """A session id is opened once: after a restart, opening it again (a retried open) answers the session as it
    stands (200, the same token: not a second SessionStarted and a session starting over at turn 0), with another
    task 409; its calls go on at the next turn."""
    engine = ScriptedEngine(REPLIES)
    sid = f"fixed-{run_id}"
    with serving(engine) as engine_url:
        with make_gateway(engines=(engine_url,)) as gateway:
            session = open_session(gateway, run_id, session_id=sid)
            _content(_post(gateway + session["path"]))
        with make_gateway(engines=(engine_url,)) as restarted:
            again = httpx.post(f"{restarted}/v1/sessions", json={"group_id": run_id, "task_id": "task",
                                                                  "session_id": sid})
            assert again.status_code == 200 and again.json() == {**session, "base_url": again.json()["base_url"]}
            other = httpx.post(f"{restarted}/v1/sessions", json={"group_id": run_id, "task_id": "another",
                                                                  "session_id": sid})
            assert other.status_code == 409 and "opened once" in other.text, other.text
            _content(_post(restarted + session["path"]))
    assert [r["turn"] for r in _recorded(kafka_bootstrap, sid)] == [0, 1]
    started = [r for r in read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
               if "base_url" in r]
    assert len(started) == 1


def test_finish_waits_for_the_calls_in_flight(kafka_bootstrap, make_gateway, run_id):
    """A finish that comes while a call is at the engine waits for it: the call is answered and recorded, and the
    SessionFinished counts it; calls that come after the finish began are refused (409)."""
    with serving(ScriptedEngine(REPLIES, delay_s=2.0)) as engine_url, make_gateway(engines=(engine_url,)) as gateway:
        session = open_session(gateway, run_id)
        sid, url = session["session_id"], gateway + session["path"]
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(_post, url)
            time.sleep(0.5)
            finish = httpx.post(f"{gateway}/v1/sessions/{sid}/finish", json={"status": "ok"}, timeout=60)
            assert call.result().status_code == 200
        assert finish.status_code == 200, finish.text
        assert _post(url).status_code == 409
    assert len(_recorded(kafka_bootstrap, sid)) == 1
    assert _finished(kafka_bootstrap, sid)["num_completions"] == 1


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory):
    """A broker of this module's own, which the test may freeze (SIGSTOP) without stopping anyone else's."""
    broker = LocalBroker(BrokerConfig(tmp_path_factory.mktemp("frozen-kafka"), ForgeSettings().cache_dir,
                                      port=free_port(), controller_port=free_port()))
    bootstrap = broker.start()
    create_topics(bootstrap)
    yield broker, bootstrap
    broker.stop()


@pytest.mark.slow
def test_a_delivery_the_broker_took_but_did_not_acknowledge_in_time(own_broker, make_gateway, run_id):
    """The ambiguous case: the broker is frozen (SIGSTOP) while a turn's Completion is in flight, so the gateway's
    delivery times out (503: it may or may not have been recorded), and then thawed, when it writes what it had
    received. The retry with the same Idempotency-Key is answered as recorded, the next call is numbered past it,
    and the session's count is right: every turn once."""
    broker, bootstrap = own_broker
    engine = ScriptedEngine(REPLIES)
    with serving(engine) as engine_url, \
            make_gateway(engines=(engine_url,), bootstrap=bootstrap, ack_timeout_ms=3000) as gateway:
        session = open_session(gateway, run_id)
        sid, url = session["session_id"], gateway + session["path"]
        _content(_post(url))
        pid = broker.pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            lost = _post(url, key="the-call")  # the engine answers; its Completion reaches the frozen broker
        finally:
            threading.Timer(0, os.kill, (pid, signal.SIGCONT)).start()
        assert lost.status_code == 503 and "may or may not have been recorded" in lost.text, lost.text
        time.sleep(2)  # the thawed broker appends what it had received (a retry reading the log sooner may miss it)
        deadline = time.monotonic() + 60
        while (retry := _post(url, key="the-call")).status_code == 503:  # until the broker answers again
            assert time.monotonic() < deadline, retry.text
            time.sleep(1)
        answered = _content(retry)
        _content(_post(url))
        finish = httpx.post(f"{gateway}/v1/sessions/{sid}/finish", json={"status": "ok"})
        assert finish.status_code == 200, finish.text
    recorded = _recorded(bootstrap, sid)
    assert [r["turn"] for r in recorded] == [0, 1, 2]
    assert recorded[1]["output_text"] == answered == REPLIES[1]  # the one the frozen broker wrote: not run again
    assert _finished(bootstrap, sid)["num_completions"] == 3
