"""Engine errors as an agent sees them through the gateway: an engine that fails with its internals in the answer (a
traceback, a path, a token: what a vLLM or a hand-rolled engine puts in a 500) must not hand them to the agent, who
gets an OpenAI-style error body instead; an engine's 4xx reaches the agent with its status and a clear message.

The engine is a real HTTP server (an ASGI app served in a thread) that answers every call with the failure its last
message names."""

from __future__ import annotations

import httpx
import orjson
import pytest
from helpers import serving
from security_support import ADMIN, bearer, open_session

from forge_stream.gateway.app import create_app
from forge_stream.gateway.settings import GatewaySettings

pytestmark = pytest.mark.kafka

SECRET = "s3cr3t-engine-token"
TRACEBACK = ('Traceback (most recent call last):\n  File "/opt/engine/secret_sampler.py", line 42, in sample\n'
             f'    logits = model(ids)\nRuntimeError: CUDA error: an illegal memory access at 0x7f3a11c0 '
             f'(FORGE_ENGINE_TOKEN={SECRET})')
INTERNALS = ("Traceback", 'File "', "secret_sampler", "/opt/engine", SECRET, "0x7f3a11c0")
def _openai_error(status: int, message: str, kind: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


FAILURES = {  # what the engine answers: status, content type, body
    "500-text": (500, b"text/plain", TRACEBACK.encode()),
    "500-json": (500, b"application/json", _openai_error(500, TRACEBACK, "InternalServerError")),
    "500-fastapi": (500, b"application/json", orjson.dumps({"detail": TRACEBACK})),
    "502-html": (502, b"text/html", f"<html><body><pre>{TRACEBACK}</pre></body></html>".encode()),
    "400-json": (400, b"application/json",
                 _openai_error(400, "temperature must be non-negative, got -1.0", "BadRequestError")),
    "422-text": (422, b"text/plain", b"max_tokens must be at most 4096, got 100000"),
}


async def _failing_engine(scope, receive, send) -> None:
    """ASGI: /health answers {}; a completion call answers the failure its last message names (FAILURES, or
    "stream-error": a 200 event stream whose first event is an error holding the traceback); /v1/models 500s."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body, more = b"", scope["method"] == "POST"
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    if scope["path"] == "/health":
        status, kind, content = 200, b"application/json", b"{}"
    elif scope["path"] == "/v1/models":
        status, kind, content = FAILURES["500-text"]
    else:
        request = orjson.loads(body)
        mode = (request.get("messages") or [{"content": request.get("prompt")}])[-1]["content"]
        if mode == "stream-error":
            status, kind = 200, b"text/event-stream"
            content = (b"data: " + orjson.dumps({"error": {"message": TRACEBACK, "type": "InternalServerError",
                                                           "code": 500}}) + b"\n\ndata: [DONE]\n\n")
        else:
            status, kind, content = FAILURES[mode]
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
    await send({"type": "http.response.body", "body": content})


@pytest.fixture(scope="module")
def gateway(kafka_bootstrap):
    with serving(_failing_engine) as engine, \
            serving(create_app(GatewaySettings(engines=(engine,), bootstrap=kafka_bootstrap, admin_token=ADMIN))) as gw:
        yield gw


def _ask(gateway: str, run_id: str, mode: str, stream: bool = False, kind: str = "chat") -> httpx.Response:
    session = open_session(gateway, run_id)
    body = {"messages": [{"role": "user", "content": mode}]} if kind == "chat" else {"prompt": mode}
    return httpx.post(f"{session['base_url']}/{'chat/completions' if kind == 'chat' else 'completions'}",
                      json={**body, "stream": stream}, headers=bearer(session["token"]), timeout=30)


ENGINE_FAILED = "The engine failed (HTTP {}); retry shortly (the gateway's log has the engine's answer)."


def _error_of(response: httpx.Response) -> dict:
    """The OpenAI-style error of an answer: {"error": {"message", "type", "code", ...}} with a message."""
    assert response.headers.get("content-type", "").startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"], error
    return error


def _no_internals(text: str) -> None:
    leaked = [marker for marker in INTERNALS if marker in text]
    assert not leaked, f"the engine's internals reached the agent ({leaked}): {text[:300]!r}"


@pytest.mark.parametrize("mode", ["500-text", "500-json", "500-fastapi", "502-html"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_engine_failure_reaches_the_agent_as_an_error_body_without_the_engines_internals(gateway, run_id, mode,
                                                                                           kind):
    response = _ask(gateway, run_id, mode, kind=kind)
    status = FAILURES[mode][0]
    assert response.status_code == status, response.text
    _no_internals(response.text)
    error = _error_of(response)
    assert (error["type"], error["message"]) == ("engine_error", ENGINE_FAILED.format(status))


def test_an_engine_failure_on_a_streamed_call_says_nothing_of_the_engines_internals(gateway, run_id):
    response = _ask(gateway, run_id, "500-text", stream=True)
    assert response.status_code == 500, response.text
    _no_internals(response.text)
    assert _error_of(response)["message"] == ENGINE_FAILED.format(500)


def test_an_error_event_inside_an_engines_stream_says_nothing_of_the_engines_internals(gateway, run_id):
    response = _ask(gateway, run_id, "stream-error", stream=True)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    _no_internals(response.text)
    events = [block.removeprefix("data: ") for block in response.text.split("\n\n") if block]
    assert len(events) == 2 and events[1] == "[DONE]", response.text
    error = orjson.loads(events[0])["error"]
    assert error["type"] == "engine_error" and error["message"].startswith("The engine failed during the stream")


def test_the_model_list_of_a_failing_engine_says_nothing_of_the_engines_internals(gateway, run_id):
    session = open_session(gateway, run_id)
    response = httpx.get(f"{session['base_url']}/models", headers=bearer(session["token"]), timeout=30)
    assert response.status_code == 500, response.text
    _no_internals(response.text)
    assert _error_of(response)["message"] == ENGINE_FAILED.format(500)


def test_an_engines_openai_style_4xx_reaches_the_agent_with_its_status_and_message(gateway, run_id):
    response = _ask(gateway, run_id, "400-json")
    assert response.status_code == 400
    assert "temperature must be non-negative" in _error_of(response)["message"]


def test_an_engines_plain_text_4xx_reaches_the_agent_as_an_openai_style_error(gateway, run_id):
    response = _ask(gateway, run_id, "422-text")
    assert response.status_code == 422
    assert "max_tokens must be at most 4096" in _error_of(response)["message"]
