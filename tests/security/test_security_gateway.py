"""The gateway as an attacker on its host sees it: without the admin token nobody opens, rewards, finishes or reads
a session; a session token reaches its own session's agent calls and nothing else, whatever X-Forge-Session or the
path says; tokens cannot be minted without the admin token; bodies too large or malformed are refused before they
cost anything; and a 500 says nothing of the error but a request id."""

from __future__ import annotations

import logging
import secrets

import httpx
import pytest
from helpers import serving
from security_support import ADMIN, as_admin, bearer, open_session

from forge_stream.gateway.app import create_app
from forge_stream.bench.scripted import ScriptedEngine
from forge_stream.gateway.sessions import session_token
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

pytestmark = pytest.mark.kafka
HI = {"messages": [{"role": "user", "content": "hi"}]}


def _refused(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    return error


def _view(gateway: str, session_id: str) -> dict:
    return httpx.get(f"{gateway}/v1/sessions/{session_id}", headers=as_admin()).json()


def test_without_a_token_or_with_a_wrong_one_nothing_is_opened_rewarded_finished_or_served(secured_gateway, run_id):
    gw = secured_gateway
    victim = open_session(gw, run_id)
    sid = victim["session_id"]
    minted = session_token(secrets.token_urlsafe(32), sid)  # a well-formed session token under a guessed secret
    for headers in ({}, bearer("wrong"), bearer(secrets.token_urlsafe(32)), bearer(minted), bearer(ADMIN + "x"),
                    {"x-api-key": "wrong"}, {"Authorization": ADMIN}):  # the admin token without "Bearer"
        _refused(httpx.post(f"{gw}/v1/sessions", json={"group_id": run_id, "task_id": "t"}, headers=headers), 401)
        _refused(httpx.post(f"{gw}/v1/sessions/{sid}/reward", json={"value": 1.0}, headers=headers), 401)
        _refused(httpx.post(f"{gw}/v1/sessions/{sid}/finish", json={}, headers=headers), 401)
        _refused(httpx.get(f"{gw}/v1/sessions/{sid}", headers=headers), 401)
        _refused(httpx.post(f"{gw}/v1/sessions/{sid}/spans", json={"spans": []}, headers=headers), 401)
        _refused(httpx.post(f"{victim['base_url']}/chat/completions", json=HI, headers=headers), 401)
        _refused(httpx.post(f"{gw}/v1/chat/completions", json=HI, headers={**headers, "X-Forge-Session": sid}), 401)
        _refused(httpx.get(f"{gw}/v1/models", headers=headers), 401)
    view = _view(gw, sid)
    assert (view["status"], view["turns"]) == ("open", 0)


def test_a_session_token_reaches_only_its_own_sessions_agent_calls(secured_gateway, run_id):
    gw = secured_gateway
    mine, other = open_session(gw, run_id), open_session(gw, run_id)
    assert mine["token"] != other["token"] and ADMIN not in (mine["token"], other["token"])
    me = bearer(mine["token"])
    # admin routes, even for its own session
    _refused(httpx.post(f"{gw}/v1/sessions", json={"group_id": run_id, "task_id": "t"}, headers=me), 401)
    for session in (mine, other):
        sid = session["session_id"]
        _refused(httpx.post(f"{gw}/v1/sessions/{sid}/reward", json={"value": 1.0}, headers=me), 401)
        _refused(httpx.post(f"{gw}/v1/sessions/{sid}/finish", json={"status": "ok"}, headers=me), 401)
        _refused(httpx.get(f"{gw}/v1/sessions/{sid}", headers=me), 401)
    # the other session: by its path, by a forged X-Forge-Session, and its spans
    other_id = other["session_id"]
    _refused(httpx.post(f"{other['base_url']}/chat/completions", json=HI, headers=me), 403)
    _refused(httpx.post(f"{gw}/v1/chat/completions", json=HI, headers={**me, "X-Forge-Session": other_id}), 403)
    _refused(httpx.post(f"{gw}/v1/responses", json={"input": "hi"}, headers={**me, "X-Forge-Session": other_id}), 403)
    _refused(httpx.post(f"{gw}/v1/sessions/{other_id}/spans", json={"spans": []}, headers=me), 403)
    # a forged X-Forge-Session beside its own path does not move the call either
    own_path = httpx.post(f"{mine['base_url']}/chat/completions", json=HI, headers={**me, "X-Forge-Session": other_id})
    assert own_path.status_code == 200, own_path.text
    assert httpx.post(f"{gw}/v1/chat/completions", json=HI, headers=me).status_code == 200
    assert (_view(gw, mine["session_id"])["turns"], _view(gw, other_id)["turns"]) == (2, 0)
    assert (_view(gw, mine["session_id"])["status"], _view(gw, other_id)["status"]) == ("open", "open")
    # what the admin token does
    assert httpx.post(f"{gw}/v1/sessions/{other_id}/finish", json={"status": "ok"}, headers=as_admin()).status_code \
        == 200


def test_bodies_too_large_or_malformed_are_refused_and_the_gateway_goes_on(secured_gateway, run_id):
    gw = secured_gateway
    session = open_session(gw, run_id)
    me = {**bearer(session["token"]), "content-type": "application/json"}
    chat = f"{session['base_url']}/chat/completions"
    huge = b'{"messages": [{"role": "user", "content": "' + b"x" * (1 << 20) + b'"}]}'
    # without a token the body is not even read: 401, not 413
    _refused(httpx.post(chat, content=huge, headers={"content-type": "application/json"}), 401)
    _refused(httpx.post(chat, content=huge, headers=me), 413)
    _refused(httpx.post(f"{gw}/v1/sessions", content=huge, headers={**as_admin(), "content-type": "application/json"}),
             413)
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for body in (b"{", b"\xff\xfe not json", b"[1, 2", b"null", b'{"messages": "hi"}', deep, b"",
                 b'{"messages": [{"role": "user", "content": "\\ud800"}]}'):
        response = httpx.post(chat, content=body, headers=me)
        assert 400 <= response.status_code < 500, (body[:40], response.status_code, response.text)
        assert "Traceback" not in response.text and "File \"" not in response.text
    _refused(httpx.post(f"{gw}/v1/sessions/{session['session_id']}/reward", content=b'{"value": "NaN?"',
                        headers={**as_admin(), "content-type": "application/json"}), 400)
    assert httpx.post(chat, json=HI, headers=me).status_code == 200
    assert _view(gw, session["session_id"])["turns"] == 1


class _LeakySink:
    """Kafka as the gateway knows it, except that recording a Completion breaks in an unforeseen way, with
    something secret in the error's message."""

    SECRET = "sasl.password=hunter2 at /etc/forge/secret.conf"

    def __init__(self, bootstrap: str):
        self.producer = EventProducer(bootstrap)

    def send(self, topic, key, record, schema=None):
        if topic == TOPICS.completions:
            raise RuntimeError(self.SECRET)
        return self.producer.send(topic, key, record, schema)


def test_a_500_carries_a_request_id_and_nothing_of_the_error(kafka_bootstrap, run_id, caplog):
    caplog.set_level(logging.ERROR, logger="forge_stream.gateway.app")
    sink = _LeakySink(kafka_bootstrap)
    with serving(ScriptedEngine(("Hello.",))) as engine, \
            serving(create_app(GatewaySettings(engines=(engine,), bootstrap=kafka_bootstrap, admin_token=ADMIN),
                               sink=sink)) as gw:
        session = open_session(gw, run_id)
        me = bearer(session["token"])
        calls = [httpx.post(f"{session['base_url']}/chat/completions", json=HI, headers=me),  # the hot path
                 httpx.post(f"{session['base_url']}/completions", json={"prompt": "hi"}, headers=me),
                 httpx.post(f"{gw}/v1/chat/completions", json=HI, headers=me)]
        ids = set()
        for response in calls:
            error = _refused(response, 500)
            assert error["type"] == "server_error"
            request_id = response.headers["x-request-id"]
            assert request_id in error["message"]
            for leaked in ("hunter2", "secret.conf", "RuntimeError", "sasl"):
                assert leaked not in response.text
            logged = [r for r in caplog.records if request_id in r.getMessage()]
            assert len(logged) == 1 and "hunter2" in str(logged[0].exc_info[1])
            ids.add(request_id)
        assert len(ids) == len(calls)
    sink.producer.close()
