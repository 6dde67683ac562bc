"""Errors are OpenAI-style bodies with the right status; Kafka or engine trouble is 503 and records nothing."""

import time

import httpx
import openai
import pytest

from forge_stream.gateway.app import create_app
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

from gateway_support import ADMIN, open_session
from helpers import read_events, serving

HI = {"messages": [{"role": "user", "content": "hi"}]}


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] is None  # OpenAI's: no status
    return error


def test_bad_requests_get_openai_errors(gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    url = session["base_url"]
    _error(httpx.post(f"{gateway_url}/s/nope/v1/chat/completions", json=HI), 404)
    _error(httpx.post(f"{gateway_url}/v1/chat/completions", json=HI), 404)  # no session named
    _error(httpx.post(f"{url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
           400)
    assert _error(httpx.post(f"{url}/chat/completions", json={"messages": []}), 422)["param"] == "messages"
    assert _error(httpx.post(f"{url}/chat/completions", json={**HI, "n": 0}), 422)["param"] == "n"
    _error(httpx.post(f"{gateway_url}/v1/sessions", json={"group_id": "g"}), 422)
    _error(httpx.post(f"{gateway_url}/v1/sessions/{session['session_id']}/reward", json={"value": "x"}), 422)
    for value in ("NaN", "Infinity", "-inf"):  # pydantic would read these strings as floats
        _error(httpx.post(f"{gateway_url}/v1/sessions/{session['session_id']}/reward", json={"value": value}), 422)
    assert _error(httpx.get(f"{gateway_url}/no/such/route"), 404)["message"].startswith(
        "GET /no/such/route is not supported")
    big = {"messages": [{"role": "user", "content": "x" * 9_000_000}]}
    _error(httpx.post(f"{url}/chat/completions", json=big), 413)
    assert httpx.get(f"{url}/models").json()["data"][0]["id"] == "scripted"


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "maybe"}, "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
])
def test_structured_output_that_cannot_be_enforced_is_400_naming_it(gateway_url, run_id, body, param):
    url = open_session(gateway_url, run_id)["base_url"]
    assert _error(httpx.post(f"{url}/chat/completions", json={**HI, **body}), 400)["param"] == param
    completion = {"prompt": "hi", "response_format": {"type": "json_object"}}
    assert _error(httpx.post(f"{url}/completions", json=completion), 400)["param"] == "response_format"


def test_engine_down_is_503_with_retry_after(make_gateway, run_id):
    with make_gateway(engines=(f"http://127.0.0.1:{free_port()}",)) as gateway:
        session = open_session(gateway, run_id)
        response = httpx.post(f"{session['base_url']}/chat/completions", json=HI)
        _error(response, 503)
        assert int(response.headers["retry-after"]) > 0
        view = httpx.get(f"{gateway}/v1/sessions/{session['session_id']}").json()
        assert view["turns"] == 0 and view["completions"] == 0


def _starting_engine():
    """An engine that is up but not serving yet, as a restarted vLLM engine answers while vLLM starts: 503."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def starting(request):
        return JSONResponse({"status": "starting"}, status_code=503)

    return Starlette(routes=[Route("/{path:path}", starting, methods=["GET", "POST"])])


def _served_by_the_other(make_gateway, home: str, other: str, kafka_bootstrap: str, run_id: str) -> None:
    """A call of a group whose home engine is `home` is answered, and recorded, by `other`."""
    from forge_stream.gateway.engines import preference

    engines = (home, other)
    group = next(g for g in (f"{run_id}-{i}" for i in range(100)) if preference(g, list(engines))[0] == 0)
    with make_gateway(engines=engines) as gateway:
        session = open_session(gateway, group)
        response = httpx.post(f"{session['base_url']}/chat/completions", json=HI, timeout=30)
        assert response.status_code == 200, response.text
    [record] = read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["group_id"] == group)
    assert record["engine_id"] == other


def test_a_group_whose_engine_answers_503_is_served_by_another(make_gateway, scripted_url, kafka_bootstrap, run_id):
    with serving(_starting_engine()) as starting:
        _served_by_the_other(make_gateway, starting, scripted_url, kafka_bootstrap, run_id)
    with serving(_starting_engine()) as starting, make_gateway(engines=(starting,)) as gateway:
        session = open_session(gateway, run_id)  # no other engine: its 503 is the answer
        _error(httpx.post(f"{session['base_url']}/chat/completions", json=HI, timeout=30), 503)


def test_a_group_whose_engine_drops_the_connection_unanswered_is_served_by_another(make_gateway, scripted_url,
                                                                                   kafka_bootstrap, run_id):
    """An engine killed mid-run: what the gateway meets on the connection it kept to it is a drop, not a refusal."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def drop_every_connection():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()

    threading.Thread(target=drop_every_connection, daemon=True).start()
    try:
        _served_by_the_other(make_gateway, f"http://127.0.0.1:{listener.getsockname()[1]}", scripted_url,
                             kafka_bootstrap, run_id)
    finally:
        listener.close()


def test_kafka_unreachable_at_session_start_is_503(make_gateway, scripted_url, run_id):
    with make_gateway(engines=(scripted_url,), bootstrap=f"127.0.0.1:{free_port()}", ack_timeout_ms=1500) as gw:
        response = httpx.post(f"{gw}/v1/sessions", json={"group_id": run_id, "task_id": "t"})
        _error(response, 503)
        assert "retry-after" in response.headers
        started = time.monotonic()  # a session not held here cannot be looked up on Kafka either
        response = httpx.post(f"{gw}/s/any/v1/chat/completions", json=HI, timeout=30)
        _error(response, 503)
        assert "retry-after" in response.headers and time.monotonic() - started < 10


class SwitchableSink:
    """The real producer, or (while `down`) a real producer whose bootstrap has no broker behind it."""

    def __init__(self, bootstrap: str):
        self.up = EventProducer(bootstrap)
        self.dead = EventProducer(f"127.0.0.1:{free_port()}", **{"message.timeout.ms": 1500})
        self.down = False

    def send(self, *args, **kwargs):
        return (self.dead if self.down else self.up).send(*args, **kwargs)


@pytest.fixture
def switchable(kafka_bootstrap, scripted_url):
    sink = SwitchableSink(kafka_bootstrap)
    settings = GatewaySettings(engines=(scripted_url,), bootstrap=kafka_bootstrap, ack_timeout_ms=1500)
    with serving(create_app(settings, sink=sink)) as gateway:
        yield gateway, sink
    sink.up.close()
    sink.dead.close()


def test_kafka_down_mid_session_answers_503_and_rolls_the_turn_back(kafka_bootstrap, switchable, run_id):
    gateway, sink = switchable
    session = open_session(gateway, run_id)
    sink.down = True
    response = httpx.post(f"{session['base_url']}/chat/completions", json=HI)
    _error(response, 503)
    assert "retry-after" in response.headers
    lines = []
    with httpx.stream("POST", f"{session['base_url']}/chat/completions", json={**HI, "stream": True}) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] != "data: [DONE]" and '"type":"service_unavailable","param":null,"code":null' in lines[-1]
    sink.down = False
    assert httpx.post(f"{session['base_url']}/chat/completions", json=HI).status_code == 200
    records = read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["session_id"] == session["session_id"])
    assert [r["turn"] for r in records] == [0]


def test_kafka_down_fails_a_response_and_keeps_no_chain(kafka_bootstrap, switchable, run_id):
    gateway, sink = switchable
    session = open_session(gateway, run_id)
    client = openai.OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    first = client.responses.create(model="scripted", input="hi")
    sink.down = True
    with pytest.raises(openai.APIStatusError) as whole:
        client.responses.create(model="scripted", input="again", previous_response_id=first.id)
    assert whole.value.status_code == 503
    events = list(client.responses.create(model="scripted", input="again", stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code is None and "Kafka did not acknowledge" in events[-2].message
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    with pytest.raises(openai.BadRequestError) as unknown:  # the failed response was not kept
        client.responses.create(model="scripted", input="x", previous_response_id=events[-1].response.id)
    assert unknown.value.code == "previous_response_not_found"
    sink.down = False
    assert client.responses.create(model="scripted", input="again", previous_response_id=first.id).output_text
    records = read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["session_id"] == session["session_id"])
    assert sorted(r["turn"] for r in records) == [0, 1]


def test_auth_session_tokens_reach_only_their_session(make_gateway, scripted_url, run_id):
    with make_gateway(engines=(scripted_url,), admin_token=ADMIN) as gateway:
        _error(httpx.post(f"{gateway}/v1/sessions", json={"group_id": run_id, "task_id": "t"}), 401)
        mine = open_session(gateway, run_id, token=ADMIN)
        other = open_session(gateway, run_id, token=ADMIN)
        as_me = {"Authorization": f"Bearer {mine['token']}"}
        _error(httpx.post(f"{mine['base_url']}/chat/completions", json=HI), 401)
        _error(httpx.post(f"{other['base_url']}/chat/completions", json=HI, headers=as_me), 403)
        _error(httpx.post(f"{gateway}/v1/sessions/{mine['session_id']}/finish", json={}, headers=as_me), 401)
        assert httpx.post(f"{mine['base_url']}/chat/completions", json=HI, headers=as_me).status_code == 200
        # the token alone names the session
        assert httpx.post(f"{gateway}/v1/chat/completions", json=HI, headers=as_me).status_code == 200
        view = httpx.get(f"{gateway}/v1/sessions/{mine['session_id']}",
                         headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert view["turns"] == 2


def test_unsupported_openai_routes_are_named_in_a_404(gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = openai.OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as embeddings:
        client.embeddings.create(model="scripted", input="hi")
    path = f"/s/{session['session_id']}/v1/embeddings"
    assert embeddings.value.body["message"] == (f"POST {path} is not supported by the forge-stream gateway (it serves "
                                        "chat/completions, completions, responses, messages and models).")
    assert embeddings.value.body["type"] == "not_found_error"
