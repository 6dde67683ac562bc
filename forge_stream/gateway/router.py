"""The gateway's HTTP surface over the GatewayService kept in `app.state.gateway`: the agents' calls (`AGENT_CALLS`,
which the app serves without FastAPI's routing: forge_stream.gateway.app) and thin FastAPI routes for the rest.

Agents: `/s/{session_id}/v1/chat/completions`, `/s/{session_id}/v1/completions`, `/s/{session_id}/v1/responses`
(the Responses API, served through the chat path), `/s/{session_id}/v1/messages` (Anthropic's Messages API, also
through the chat path, with Anthropic's error bodies), `/s/{session_id}/v1/models`, or
the same under `/v1/...` with the session named by `X-Forge-Session` (or by the agent's own bearer token).
A token is read from `Authorization: Bearer` or, as the anthropic SDK sends it, `x-api-key`.
`X-Forge-Agent` names which agent of a multi-agent rollout asked. Controllers and graders: `POST /v1/sessions`,
`GET /v1/sessions/{id}`, `POST /v1/sessions/{id}/reward`, `/spans`, `/finish`.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from forge_stream import httpbody
from forge_stream.gateway.messages import SCHEMA as MESSAGES, anthropic_error
from forge_stream.gateway.protocol import (
    CHAT, COMPLETION, FinishIn, GatewayError, Recorded, RewardIn, SessionCreate, SpansIn, invalid,
)
from forge_stream.gateway import apis
from forge_stream.gateway.serving import GatewayService
from forge_stream.httpbody import BodyRejected
from forge_stream.gateway.sessions import Session

router = APIRouter()
JSON = "application/json"


def _service(request: Request) -> GatewayService:
    return request.app.state.gateway


async def read_json(request: Request):
    """The body as JSON under the gateway's size and depth limits (413, 400)."""
    settings = _service(request).settings
    return await httpbody.read_json(request, settings.max_request_bytes, settings.max_json_depth)


async def read_model(request: Request, model: type[BaseModel]):
    body = await read_json(request)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise invalid(f"{first['msg']}: {'.'.join(str(p) for p in first['loc'])}",
                      ".".join(str(p) for p in first["loc"]) or None) from exc


def _bearer(request: Request) -> str | None:
    """The caller's token: `Authorization: Bearer ...`, else `x-api-key` (the anthropic SDK's header)."""
    header = request.headers.get("authorization")
    if header and header[:7].lower() == "bearer " and header.isascii():  # tokens are ASCII; others match none
        return header[7:].strip()
    key = request.headers.get("x-api-key")
    return key.strip() if key and key.isascii() else None


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "authentication_error")


def require_admin(request: Request) -> None:
    settings = _service(request).settings
    token = _bearer(request)
    if settings.auth and not (token and hmac.compare_digest(token, settings.admin_token)):
        raise _unauthorized("This route needs the admin token (Authorization: Bearer ...).")


async def agent_session(request: Request, session_id: str | None) -> Session:
    """The session an agent's call belongs to (path, X-Forge-Session, or its token), checking its token."""
    return await _service(request).restorer.get(agent_session_id(request, session_id))


def agent_session_id(request: Request, session_id: str | None) -> str:
    """The id of the session an agent's call belongs to, its token checked: from memory, nothing read from Kafka."""
    service = _service(request)
    settings = service.settings
    token = _bearer(request)
    is_admin = bool(settings.auth and token and hmac.compare_digest(token, settings.admin_token))
    owner = service.sessions.owner(token) if token else None
    if settings.auth and not (is_admin or owner):
        raise _unauthorized("A session token or the admin token is needed (Authorization: Bearer ...).")
    session_id = session_id or request.headers.get("x-forge-session")
    if session_id is None:
        if owner is None:
            raise GatewayError(404, "No session named: call /s/{session_id}/v1/... or set X-Forge-Session.",
                               "not_found_error", "session_id")
        session_id = owner
    if settings.auth and not is_admin and owner != session_id:
        raise GatewayError(403, "This token belongs to another session.", "permission_error", "session_id")
    return session_id


async def _admin_session(request: Request, session_id: str) -> Session:
    require_admin(request)
    return await _service(request).restorer.get(session_id)


def idempotency_key(request: Request) -> str | None:
    """The call's `Idempotency-Key` header (a retry carrying the same one is the same call), checked."""
    key = request.headers.get("idempotency-key")
    if key is not None and not (0 < len(key) <= 256 and key.isprintable()):
        raise invalid("Idempotency-Key must be 1-256 printable characters", "Idempotency-Key")
    return key


async def _admitted(request: Request, session_id: str | None, serve) -> bytes | AsyncIterator[bytes]:
    """An agent's call in admission order: its token checked, then a slot taken (shed with 429/503 here), and only
    then its body read and its session rebuilt from Kafka if this process does not hold it, so shedding bounds the
    memory and the broker reads of calls that are turned away. `serve(service, session, body, agent, lease)` takes
    the lease over (GatewayService.complete)."""
    service = _service(request)
    known = agent_session_id(request, session_id)
    lease = await service.admission.acquire()
    try:
        session = await service.restorer.get(known)
        body = await read_json(request)
        return await serve(service, session, body, request.headers.get("x-forge-agent", ""), lease)
    except BaseException:
        lease.release()
        raise


async def _complete(request: Request, session_id: str | None, kind: str) -> Response:
    """An agent's OpenAI call: `kind` is chat, completion or responses."""
    if kind == "responses":
        result = await _admitted(request, session_id, apis.respond)
    else:
        key = idempotency_key(request)
        result = await _admitted(request, session_id, lambda service, session, body, agent, lease:
                                 service.complete(session, kind, body, agent, lease, idempotency_key=key))
    if isinstance(result, bytes):
        return Response(result, media_type=JSON)
    return StreamingResponse(result, media_type="text/event-stream")


async def _message(request: Request, session_id: str | None) -> Response:
    """An agent's Anthropic Messages call; every error answered in Anthropic's shape."""
    try:
        result = await _admitted(request, session_id, apis.message)
    except BodyRejected as exc:
        raise anthropic_error(exc.status, exc.message) from exc
    except GatewayError as exc:
        raise anthropic_error(exc.status, exc.message, exc.retry_after, exc.raw) from exc
    if isinstance(result, bytes):
        return Response(result, media_type=JSON)
    return StreamingResponse(result, media_type="text/event-stream")


AGENT_CALLS = {  # path after /v1/ -> (request, session id or None) -> response; served by GatewayApp, not routes
    "chat/completions": lambda request, session_id: _complete(request, session_id, "chat"),
    "completions": lambda request, session_id: _complete(request, session_id, "completion"),
    "responses": lambda request, session_id: _complete(request, session_id, "responses"),
    "messages": _message,
}
_BODIES = {"chat/completions": CHAT, "completions": COMPLETION, "messages": MESSAGES}  # what their bodies are


def agent_paths() -> dict:
    """The OpenAPI description of the agents' calls (each under /s/{session_id}/v1/ and /v1/), which FastAPI does
    not describe, having no routes for them."""
    answer = {"responses": {"200": {"description": "The answer, or a stream of server-sent events",
                                    "content": {"application/json": {"schema": {}}}}}}
    in_path = {"parameters": [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}]}
    paths = {}
    for name in AGENT_CALLS:
        post = {**(httpbody.openapi_body(_BODIES[name]) if name in _BODIES else {}), **answer}
        paths[f"/s/{{session_id}}/v1/{name}"] = {"post": {**post, **in_path}}
        paths[f"/v1/{name}"] = {"post": post}
    return paths


def agent_call(path: str):
    """(handler, session id or None) of an agent's POST to `path` (/s/{session_id}/v1/... or /v1/...), or None
    when `path` is not one of them; what FastAPI's route matching would find for these paths.

    >>> [(h is AGENT_CALLS["messages"], s) for h, s in [agent_call("/s/abc/v1/messages"), agent_call("/v1/messages")]]
    [(True, 'abc'), (True, None)]
    >>> agent_call("/s/a/b/v1/messages"), agent_call("/s//v1/responses"), agent_call("/v1/models")
    (None, None, None)
    """
    session_id = None
    if path.startswith("/s/"):
        session_id, _, path = path[3:].partition("/")
        if not session_id:
            return None
        path = "/" + path
    handler = AGENT_CALLS.get(path[4:]) if path.startswith("/v1/") else None
    return None if handler is None else (handler, session_id)


async def _models(request: Request) -> Response:
    return Response(await _service(request).models(), media_type=JSON)


@router.get("/s/{session_id}/v1/models")
async def session_models(session_id: str, request: Request) -> Response:
    await agent_session(request, session_id)
    return await _models(request)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    settings = _service(request).settings
    token = _bearer(request)
    if settings.auth and not (token and (hmac.compare_digest(token, settings.admin_token)
                                         or _service(request).sessions.owner(token))):
        raise _unauthorized("A session token or the admin token is needed (Authorization: Bearer ...).")
    return await _models(request)


@router.get("/health")
async def health(request: Request) -> dict:
    service = _service(request)
    return {"status": "ok", "pid": os.getpid(), "sessions": len(service.sessions),
            "open_sessions": service.sessions.open, "admission": service.admission.view(),
            "sessions_restored": service.restorer.restored, "sessions_refreshed": service.restorer.refreshed,
            "calls_answered": service.calls_answered,  # chat and completions calls (run, or answered as recorded)
            "turn_collisions": len(service.restorer.collisions),
            "session_records_read": service.restorer.events.records_read,  # by the rebuilds and catch-ups above
            "session_records_scanned": service.restorer.events.records_scanned,  # and went through to find those
            # how this process learns what other replicas recorded: Kafka (--shared-sessions), the ledger of the
            # host's --workers, or not at all (a session's calls should come here)
            "sessions_shared_by": ("kafka" if service.restorer.log is not None else
                                   "ledger" if service.restorer.ledger is not None else None),
            "engines": [{"url": e.url, "in_flight": e.in_flight} for e in service.pool.engines]}


@router.post("/v1/sessions", status_code=201, openapi_extra=httpbody.openapi_body(SessionCreate))
async def open_session(request: Request) -> Response:
    require_admin(request)
    created, new = await _service(request).open_session(await read_model(request, SessionCreate),
                                                         str(request.base_url))
    return Response(created.model_dump_json(), status_code=201 if new else 200, media_type=JSON)


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> Response:
    session = await _admin_session(request, session_id)
    return Response(_service(request).view(session).model_dump_json(), media_type=JSON)


@router.post("/v1/sessions/{session_id}/reward", openapi_extra=httpbody.openapi_body(RewardIn))
async def reward(session_id: str, request: Request) -> Response:
    session = await _admin_session(request, session_id)
    key = idempotency_key(request)
    ids = await _service(request).reward(session, await read_model(request, RewardIn), key)
    return Response(Recorded(event_ids=ids).model_dump_json(), media_type=JSON)


@router.post("/v1/sessions/{session_id}/spans", openapi_extra=httpbody.openapi_body(SpansIn))
async def spans(session_id: str, request: Request) -> Response:
    session = await agent_session(request, session_id)
    ids = await _service(request).post_spans(session, await read_model(request, SpansIn))
    return Response(Recorded(event_ids=ids).model_dump_json(), media_type=JSON)


@router.post("/v1/sessions/{session_id}/finish", openapi_extra=httpbody.openapi_body(FinishIn))
async def finish(session_id: str, request: Request) -> Response:
    session = await _admin_session(request, session_id)
    ids = await _service(request).finish(session, await read_model(request, FinishIn))
    return Response(Recorded(event_ids=ids).model_dump_json(), media_type=JSON)
