"""Builds the gateway's FastAPI app: its service in `app.state`, its Kafka producer and engine client for the
app's lifespan, and OpenAI-style error bodies for every error (including FastAPI's own 404/405/422/500).

Agents' calls (chat/completions, completions, responses, messages) skip FastAPI's middleware stack and routing
(`GatewayApp.__call__`): they are most of the gateway's traffic, and route matching and dependency solving cost about
a third of their CPU, the stack's layers (error handling, FastAPI's telemetry and body limit, each wrapping `send`)
another tenth. They have no FastAPI routes; the app's OpenAPI document describes them too (`router.agent_paths`).
FastAPI serves everything else.

An unexpected error is answered 500 by `_ContainErrors`, which keeps the client's keep-alive connection usable
(Starlette's own last-resort handler re-raises, and uvicorn then drops the connection). Its body says nothing of the
error but a request id (also in `x-request-id`), under which the log has the traceback."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import uuid
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from forge_stream.gateway.protocol import GatewayError
from forge_stream.openai_error import error_body
from forge_stream.httpbody import BodyRejected
from forge_stream.gateway.router import agent_call, agent_paths, router
from forge_stream.gateway.completing import EventSink
from forge_stream.gateway.serving import GatewayService
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.kafka.producer import DeliveryError, EventProducer

log = logging.getLogger(__name__)
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error"}


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> Response:
    return Response(error_body(message, _KINDS.get(status, "server_error"), param), status_code=status,
                    media_type="application/json", headers=headers)


def internal_error(exc: BaseException) -> Response:
    """The 500 answer to an unexpected error: a generic message and a request id; the details go to the log only."""
    request_id = f"req_{uuid.uuid4().hex}"
    log.error("gateway error (request id %s)", request_id, exc_info=exc)
    return _error(500, f"Internal gateway error (request id {request_id}); its details are in the gateway's log.",
                  headers={"x-request-id": request_id})


class GatewayApp(FastAPI):
    """The gateway's FastAPI app, whose hot path, an agent's call (POST to chat/completions, completions, responses
    or messages), goes straight to its function in the router, past the middleware stack, route matching and
    dependency solving; its errors are answered as the app's handlers answer them, and an unexpected one before the
    response started as `_ContainErrors` does."""

    async def __call__(self, scope, receive, send):
        found = agent_call(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if found is None:
            return await super().__call__(scope, receive, send)
        scope["app"] = self  # as Starlette sets it: the handlers find the service in request.app.state
        handler, session_id = found
        try:
            response = await handler(Request(scope, receive, send), session_id)
        except GatewayError as exc:
            response = _gateway_error(exc)
        except BodyRejected as exc:
            response = _error(exc.status, exc.message, exc.param)
        except Exception as exc:
            response = internal_error(exc)
        await response(scope, receive, send)

    def openapi(self) -> dict:
        """FastAPI's OpenAPI document, with the agents' calls that `__call__` serves."""
        if self.openapi_schema is None:
            super().openapi()["paths"].update(agent_paths())
        return self.openapi_schema


def _gateway_error(exc: GatewayError) -> Response:
    headers = None
    if exc.retry_after is not None:  # whole seconds (HTTP), and ms (the OpenAI SDKs read retry-after-ms first)
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after))),
                   "retry-after-ms": str(round(exc.retry_after * 1000))}
    return Response(exc.body(), status_code=exc.status, media_type="application/json", headers=headers)


class _ContainErrors:
    """ASGI middleware: an exception raised before the response started becomes a 500 error body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            if started:
                raise
            await internal_error(exc)(scope, receive, send)


def create_app(settings: GatewaySettings, sink: EventSink | None = None) -> FastAPI:
    """The gateway app; without `sink` it opens its own idempotent producer to `settings.bootstrap`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        producer = None
        if sink is None:
            producer = EventProducer(settings.bootstrap, **{"message.timeout.ms": settings.ack_timeout_ms,
                                                            "linger.ms": settings.linger_ms})
        connector = aiohttp.TCPConnector(limit=settings.engine_connections)
        timeout = aiohttp.ClientTimeout(total=settings.engine_timeout_s, connect=5.0)
        engine_auth = {"Authorization": f"Bearer {settings.engine_token}"} if settings.engine_token else None
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                         headers=engine_auth) as http:
            app.state.gateway = GatewayService(settings, sink or producer, http)
            try:
                await app.state.gateway.restorer.start()
                log.info("gateway ready (pid %d) on %s:%d: engines %s; recording to Kafka at %s", os.getpid(),
                         settings.host, settings.port, ", ".join(settings.engines), settings.bootstrap)
                yield
            finally:
                await app.state.gateway.restorer.close()
                if producer is not None:
                    try:
                        await asyncio.to_thread(producer.close)
                    except DeliveryError as exc:
                        log.warning("gateway producer closed with unacknowledged records: %s", exc)

    app = GatewayApp(title="forge-stream gateway", lifespan=lifespan)
    app.include_router(router)
    app.add_middleware(_ContainErrors)

    @app.exception_handler(GatewayError)
    async def _gateway_error_handler(_: Request, exc: GatewayError) -> Response:
        return _gateway_error(exc)

    @app.exception_handler(BodyRejected)
    async def _body_rejected(_: Request, exc: BodyRejected) -> Response:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:  # no route matched
            return _error(404, f"{request.method} {request.url.path} is not supported by the forge-stream gateway "
                               "(it serves chat/completions, completions, responses, messages and models).")
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        return _error(422, str(first.get("msg", exc)), ".".join(str(p) for p in first.get("loc", ())) or None)

    return app
