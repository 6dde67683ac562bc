"""Hostile input is answered 4xx with an OpenAI error body before it reaches the engine or Kafka, and the client's
keep-alive connection stays usable; a session's turn numbers stay contiguous when writes fail concurrently."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from forge_stream.gateway.app import create_app
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.kafka.producer import DeliveryError, EventProducer
from forge_stream.topics import TOPICS

from gateway_support import ADMIN, on_one_connection, open_session
from helpers import read_events, serving

HI = {"messages": [{"role": "user", "content": "hi"}]}


def _deep_tools(depth: int) -> bytes:
    """A chat body whose one tool's parameter schema nests `depth` objects (as JSON text: orjson writes 255)."""
    schema = b'{"type": "object", "properties": {"x": ' * depth + b'{"type": "string"}' + b"}}" * depth
    return (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
            b'{"name": "f", "parameters": ' + schema + b"}}]}")


def _post(path: str, body, headers: dict | None = None):
    return "POST", path, json.dumps(body).encode() if not isinstance(body, bytes) else body, headers or {}


def test_bad_requests_are_4xx_and_the_connection_survives(gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    chat = f"{session['path']}/chat/completions"
    good = _post(chat, HI)
    bad = [
        (_post(chat, {**HI, "temperature": 1e-320}), 422, "temperature"),
        (_post(chat, {**HI, "temperature": 1e6}), 422, "temperature"),
        (_post(chat, {**HI, "top_p": 0}), 422, "top_p"),
        (_post(chat, _deep_tools(1000)), 400, None),
        (_post(chat, {**HI, "n": 1000}), 422, "n"),
        (_post(chat, {**HI, "max_tokens": "many"}), 422, "max_tokens"),
        (_post(chat, {"messages": [{"role": "tool", "tool_call_id": ["x"], "content": "1"}]}), 422,
         "messages.0.tool_call_id"),
        (_post(f"{session['path']}/completions", {"prompt": ["p"] * 2000}), 422, "prompt"),
        (_post(f"{session['path']}/completions", {"prompt": ["p", 7]}), 422, "prompt"),
        (_post("/v1/sessions", {"group_id": "g" * 1_000_000, "task_id": "t"}), 422, "group_id"),
        (_post(f"/v1/sessions/{session['session_id']}/spans", {"spans": [{"start_ms": 2**70, "end_ms": 1}]}), 422,
         "spans.0.start_ms"),
        (_post(chat, b"{" * 5000), 400, None),
    ]
    started = time.monotonic()
    answers = on_one_connection(gateway_url, [call for case in bad for call in (case[0], good)])
    assert time.monotonic() - started < 20
    for (call, status, param), (got, body), (after, _) in zip(bad, answers[::2], answers[1::2]):
        assert got == status, (call[1], call[2][:80], body)
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] is None  # OpenAI's: no status
        assert error["param"] == param, error
        assert after == 200, call[1]
    view = httpx.get(f"{gateway_url}/v1/sessions/{session['session_id']}").json()
    assert view["turns"] == len(bad)  # only the good requests were recorded


def test_oversized_body_is_413_and_the_connection_survives(gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    chat = f"{session['path']}/chat/completions"
    big = {"messages": [{"role": "user", "content": "x" * 9_000_000}]}
    (status, body), (after, _) = on_one_connection(gateway_url, [_post(chat, big), _post(chat, HI)])
    assert status == 413 and "limit" in body["error"]["message"] and after == 200


def test_event_larger_than_kafka_takes_is_413(gateway_url, run_id):
    """7 MB of metadata passes the body limit but not Kafka's record limit: 413, not 500, and no session."""
    body = {"group_id": run_id, "task_id": "t", "session_id": f"{run_id}-big", "metadata": {"k": "v" * 7_000_000}}
    response = httpx.post(f"{gateway_url}/v1/sessions", json=body)
    assert response.status_code == 413, response.text
    assert httpx.get(f"{gateway_url}/v1/sessions/{run_id}-big").status_code == 404


def test_non_ascii_authorization_is_401_and_the_connection_survives(make_gateway, scripted_url, run_id):
    with make_gateway(engines=(scripted_url,), admin_token=ADMIN) as gateway:
        session = open_session(gateway, run_id, token=ADMIN)
        chat = f"{session['path']}/chat/completions"
        answers = on_one_connection(gateway, [
            _post(chat, HI, {"Authorization": b"Bearer \xff\xfe\x80token"}),
            _post("/v1/sessions", {"group_id": run_id, "task_id": "t"}, {"Authorization": b"Bearer \xc3(\xa0"}),
            _post(chat, HI, {"Authorization": f"Bearer {session['token']}"}),
        ])
        assert [status for status, _ in answers] == [401, 401, 200]


@pytest.mark.parametrize("session_id", ["../../etc", "a\r\nX-Injected: 1", "..", ".hidden", "a/b", "s" * 300, ""])
def test_unsafe_session_ids_are_refused(gateway_url, run_id, session_id):
    response = httpx.post(f"{gateway_url}/v1/sessions",
                          json={"group_id": run_id, "task_id": "t", "session_id": session_id})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "session_id"


def test_control_characters_in_ids_are_refused_and_safe_ids_pass(gateway_url, run_id):
    for field in ("group_id", "task_id"):
        body = {"group_id": run_id, "task_id": "t", field: "a\nb"}
        response = httpx.post(f"{gateway_url}/v1/sessions", json=body)
        assert response.status_code == 422 and response.json()["error"]["param"] == field
    created = open_session(gateway_url, run_id, task_id="dataset/task 7", session_id=f"{run_id}_ok-1.2:x")
    assert created["base_url"].endswith(f"/s/{run_id}_ok-1.2:x/v1")


def test_reward_on_a_finished_session_is_409(gateway_url, run_id):
    sid = open_session(gateway_url, run_id)["session_id"]
    assert httpx.post(f"{gateway_url}/v1/sessions/{sid}/finish", json={}).status_code == 200
    response = httpx.post(f"{gateway_url}/v1/sessions/{sid}/reward", json={"value": 1.0})
    assert response.status_code == 409 and response.json()["error"]["param"] == "session_id"


class SlowFailingSink:
    """The real producer, except that Completion events of requests saying "fail" are refused after a delay
    (as Kafka would after its delivery timeout), so other requests of the session run meanwhile."""

    def __init__(self, bootstrap: str):
        self.producer = EventProducer(bootstrap)

    def send(self, topic, key, record, schema=None):
        if topic is TOPICS.completions and "fail" in record["messages_json"]:
            return asyncio.ensure_future(self._refuse())
        return self.producer.send(topic, key, record, schema)

    @staticmethod
    async def _refuse():
        await asyncio.sleep(0.6)
        raise DeliveryError("no acknowledgement (test)")


def test_turns_stay_contiguous_when_a_concurrent_write_fails(kafka_bootstrap, scripted_url, run_id):
    sink = SlowFailingSink(kafka_bootstrap)
    settings = GatewaySettings(engines=(scripted_url,), bootstrap=kafka_bootstrap)
    try:
        with serving(create_app(settings, sink=sink)) as gateway:
            session = open_session(gateway, run_id)
            chat = f"{session['base_url']}/chat/completions"
            statuses = {}

            def call(name, content):
                body = {"messages": [{"role": "user", "content": content}]}
                statuses[name] = httpx.post(chat, json=body, timeout=30).status_code

            failing = threading.Thread(target=call, args=("failing", "please fail"))
            failing.start()
            time.sleep(0.2)  # the failing write is in flight
            call("concurrent", "hello")
            failing.join()
            call("after", "hello again")
            assert statuses == {"failing": 503, "concurrent": 200, "after": 200}
            view = httpx.get(f"{gateway}/v1/sessions/{session['session_id']}").json()
            assert view["turns"] == 2
    finally:
        sink.producer.close()
    records = read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["session_id"] == session["session_id"])
    assert sorted(r["turn"] for r in records) == [0, 1]


def test_a_prompt_too_large_to_record_is_413_before_the_engine_runs(make_gateway, run_id):
    with make_gateway(engines=("http://127.0.0.1:9",), max_event_bytes=100_000) as gateway:  # no engine there
        session = open_session(gateway, run_id)
        chat = f"{session['base_url']}/chat/completions"
        big = httpx.post(chat, json={"model": "m", "messages": [{"role": "user", "content": "x" * 120_000}]})
        assert big.status_code == 413, big.text  # not 503: the engine was never asked
        error = big.json()["error"]
        assert error["param"] == "messages" and "forge.completions takes at most 100000" in error["message"]
        small = httpx.post(chat, json={"model": "m", "messages": [{"role": "user", "content": "x" * 80_000}]})
        assert small.status_code == 503, small.text
        batch = httpx.post(f"{gateway}/v1/completions", headers={"X-Forge-Session": session["session_id"]},
                           json={"model": "m", "prompt": ["y" * 60_000, "z" * 60_000]})
        assert batch.status_code == 503, batch.text  # each prompt is its own event


@pytest.mark.parametrize("refs", [True, False])
def test_a_long_session_fits_when_its_prompts_go_by_reference(make_gateway, scripted_url, run_id, refs):
    with make_gateway(engines=(scripted_url,), max_event_bytes=150_000, prompt_refs=refs) as gateway:
        session = open_session(gateway, run_id)
        chat = f"{session['base_url']}/chat/completions"
        messages = [{"role": "user", "content": "a" * 80_000}]
        first = httpx.post(chat, json={"model": "m", "messages": messages})
        assert first.status_code == 200, first.text
        messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "b" * 80_000}]
        second = httpx.post(chat, json={"model": "m", "messages": messages})
        assert second.status_code == (200 if refs else 413), second.text
