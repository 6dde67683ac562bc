"""Under load the gateway sheds (429, or 503 after waiting too long) with Retry-After before anything is recorded,
keeps the client's connection usable, loses nothing it acknowledged, and keeps its session memory bounded."""

import http.client
import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from openai import OpenAI

from forge_stream.bench.load import LoadSettings, run
from forge_stream.bench.scripted import ScriptedEngine
from forge_stream.topics import TOPICS

from gateway_support import open_session
from helpers import read_events, serving

HI = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.slow
def test_200_agents_are_shed_with_retry_after_and_nothing_acknowledged_is_lost(kafka_bootstrap):
    result = run(LoadSettings(agents=200, seconds=10, max_in_flight=4, max_waiting=4, retry_after_s=0.5,
                              engine_delay_ms=20, bootstrap=kafka_bootstrap))
    assert result["acknowledged"] > 0
    assert result["lost"] == 0 and result["duplicates"] == 0 and result["shed_recorded"] == 0, result
    assert result["shed"] > 0 and result["shed_without_retry_after"] == 0, result
    assert result["errors"] == {}, result  # no other 5xx, no timeout, no dropped connection
    assert result["p99_ms"] is not None and result["rss_mb_max"] > 0


@contextmanager
def _busy(gateway: str, run_id: str):
    """One slow call in flight (the engine takes 1 s) on a session of its own, while the block runs."""
    busy = open_session(gateway, f"{run_id}-busy")
    thread = threading.Thread(target=httpx.post, args=(f"{busy['base_url']}/chat/completions",),
                              kwargs={"json": HI, "timeout": 30})
    thread.start()
    deadline = time.monotonic() + 10
    while httpx.get(f"{gateway}/health").json()["admission"]["in_flight"] < 1:
        assert time.monotonic() < deadline, "the slow call never got in flight"
        time.sleep(0.01)
    try:
        yield
    finally:
        thread.join()


def _chat(conn: http.client.HTTPConnection, path: str) -> tuple[http.client.HTTPResponse, dict]:
    conn.request("POST", path, body=json.dumps(HI), headers={"content-type": "application/json"})
    response = conn.getresponse()
    return response, json.loads(response.read())


def test_a_shed_call_records_nothing_and_its_connection_serves_the_next(make_gateway, kafka_bootstrap, run_id):
    with serving(ScriptedEngine(delay_s=1.0)) as engine, make_gateway(
            engines=(engine,), max_in_flight=1, max_waiting=0, shed_retry_after_s=0.25) as gateway:
        session = open_session(gateway, run_id)
        path = f"/s/{session['session_id']}/v1/chat/completions"
        conn = http.client.HTTPConnection("127.0.0.1", int(gateway.rsplit(":", 1)[1]), timeout=30)
        with _busy(gateway, run_id):
            shed, body = _chat(conn, path)
            local = conn.sock.getsockname()
        assert shed.status == 429 and body["error"]["type"] == "rate_limit_error"
        assert shed.getheader("retry-after") == "1" and shed.getheader("retry-after-ms") == "250"
        assert shed.getheader("connection") != "close"
        served, body = _chat(conn, path)
        assert served.status == 200 and conn.sock.getsockname() == local  # same keep-alive connection
        conn.close()
        assert httpx.get(f"{gateway}/v1/sessions/{session['session_id']}").json()["turns"] == 1
        recorded = read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["session_id"] == session["session_id"])
        assert [r["turn"] for r in recorded] == [0]
        assert httpx.get(f"{gateway}/health").json()["admission"]["shed_429"] == 1


def test_a_shed_call_is_turned_away_before_its_body_is_read_or_its_session_rebuilt(make_gateway, run_id):
    """Admission comes first: a call shed at a replica that does not hold its session reads nothing from Kafka (no
    rebuild), and its body is not read (a body over the size limit is shed, not refused as too large)."""
    with serving(ScriptedEngine(delay_s=1.0)) as engine, make_gateway(engines=(engine,)) as first, make_gateway(
            engines=(engine,), max_in_flight=1, max_waiting=0, max_request_bytes=64 * 1024) as second:
        session = open_session(first, run_id)  # opened and served by another replica: on Kafka only, for `second`
        assert httpx.post(f"{session['base_url']}/chat/completions", json=HI, timeout=30).status_code == 200
        path = f"{second}/s/{session['session_id']}/v1/chat/completions"
        with _busy(second, run_id):
            shed = httpx.post(path, json=HI, timeout=30)
            big = httpx.post(path, content=b'{"messages": "' + b"x" * (1 << 20) + b'"}',
                             headers={"content-type": "application/json"}, timeout=30)
            health = httpx.get(f"{second}/health").json()
        for response in (shed, big):
            assert response.status_code == 429 and "retry-after" in response.headers
            assert response.json()["error"]["type"] == "rate_limit_error" and response.json()["error"]["message"]
        assert health["admission"]["shed_429"] == 2
        assert health["sessions_restored"] == 0 and health["session_records_read"] == 0, health
        served = httpx.post(path, json=HI, timeout=30)  # admitted: now the session is rebuilt, and served
        assert served.status_code == 200, served.text
        health = httpx.get(f"{second}/health").json()
        assert health["sessions_restored"] == 1 and health["session_records_read"] > 0, health
        assert httpx.post(path, content=b'{"messages": "' + b"x" * (1 << 20) + b'"}',
                          headers={"content-type": "application/json"}, timeout=30).status_code == 413


def test_a_call_waiting_past_max_wait_is_503_with_retry_after(make_gateway, run_id):
    with serving(ScriptedEngine(delay_s=1.0)) as engine, make_gateway(
            engines=(engine,), max_in_flight=1, max_waiting=4, max_wait_s=0.2, shed_retry_after_s=2) as gateway:
        session = open_session(gateway, run_id)
        with _busy(gateway, run_id):
            started = time.monotonic()
            response = httpx.post(f"{session['base_url']}/chat/completions", json=HI, timeout=30)
            waited = time.monotonic() - started
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        assert response.headers["retry-after"] == "2" and 0.2 <= waited < 1.0
        view = httpx.get(f"{gateway}/v1/sessions/{session['session_id']}").json()
        assert view["turns"] == 0 and view["completions"] == 0


def test_the_openai_sdk_retries_a_shed_call_by_itself(make_gateway, run_id):
    with serving(ScriptedEngine(delay_s=0.5)) as engine, make_gateway(
            engines=(engine,), max_in_flight=1, max_waiting=0, shed_retry_after_s=0.2) as gateway:
        session = open_session(gateway, run_id)
        client = OpenAI(base_url=session["base_url"], api_key="unused", max_retries=10)
        with _busy(gateway, run_id):
            answer = client.chat.completions.create(model="scripted", messages=HI["messages"])
        assert answer.choices[0].message.content == "Hello from the scripted engine."
        assert httpx.get(f"{gateway}/health").json()["admission"]["shed_429"] >= 1


def test_open_sessions_are_capped_and_finished_ones_forgotten_oldest_first(make_gateway, scripted_url, run_id):
    with make_gateway(engines=(scripted_url,), max_open_sessions=2, finished_sessions_kept=1) as gateway:
        first, second = open_session(gateway, run_id), open_session(gateway, run_id)
        refused = httpx.post(f"{gateway}/v1/sessions", json={"group_id": run_id, "task_id": "t"})
        assert refused.status_code == 429 and "retry-after" in refused.headers
        for session in (first, second):
            assert httpx.post(f"{gateway}/v1/sessions/{session['session_id']}/finish",
                              json={"status": "ok"}).status_code == 200
        open_session(gateway, run_id)  # room again
        assert httpx.get(f"{gateway}/v1/sessions/{first['session_id']}").status_code == 404  # forgotten
        assert httpx.post(f"{second['base_url']}/chat/completions", json=HI).status_code == 409  # still known
        health = httpx.get(f"{gateway}/health").json()
        assert health["sessions"] == 2 and health["open_sessions"] == 1
