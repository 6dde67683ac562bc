"""The engine's HTTP surface: a thin FastAPI router over the services kept in `app.state`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`POST /v1/admin/load_weights`. Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`;
invalid requests are 400 (as vLLM), not FastAPI's 422; an unexpected error is 500 with a request id and nothing of
the error itself (that goes to the log).

With a token (EngineSettings.token) every route but /health needs it. `load_weights` loads only a directory
inside the engine's checkpoint directory (symbolic links resolved first), as the forge.policy follower does: both
go through EngineService.load_weights.

The generation routes read their own bodies under the engine's limits (size while reading, JSON depth), and
parse, validate and tokenize them on the engine's preparing thread, so a large request never stalls the event
loop (health checks, other requests' streams).
"""

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from forge_stream import httpbody
from forge_stream.credentials import RequireBearer

from forge_stream.engine.shared.follower import Applied, FollowerStatus, NotServed, follow, supervise
from forge_stream.engine.torch_engine.serving import EngineRequestError, EngineService
from forge_stream.engine.torch_engine.serving_chat import ChatServing
from forge_stream.engine.torch_engine.serving_completion import CompletionServing
from forge_stream.openai_error import error_body
from forge_stream.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    HealthResponse,
    LoadWeightsRequest,
    LoadWeightsResponse,
    ModelList,
)
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)

router = APIRouter()


def _engine(request: Request) -> EngineService:
    return request.app.state.engine


def _respond(result):
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump())


def _validated(raw: bytes, model: type[BaseModel], max_depth: int):
    try:
        return model.model_validate(httpbody.parse_json(raw, max_depth))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise EngineRequestError(f"{first['msg']}: {'.'.join(str(p) for p in first['loc'])}",
                                 param=".".join(str(p) for p in first["loc"]) or None) from exc


async def _body(request: Request, model: type[BaseModel]):
    engine = _engine(request)
    raw = await httpbody.read_body(request, engine.settings.max_request_bytes)
    return await engine.off_loop(_validated, raw, model, engine.settings.max_json_depth)


@router.post("/v1/chat/completions", openapi_extra=httpbody.openapi_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    return _respond(await request.app.state.chat.create(await _body(request, ChatCompletionRequest)))


@router.post("/v1/completions", openapi_extra=httpbody.openapi_body(CompletionRequest))
async def completions(request: Request):
    return _respond(await request.app.state.completion.create(await _body(request, CompletionRequest)))


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    return _engine(request).models()


@router.get("/health", response_model=HealthResponse)
async def health(request: Request) -> HealthResponse:
    follower: FollowerStatus | None = request.app.state.follower
    engine = _engine(request)
    if follower is not None and follower.stopped:  # serving, but following no longer: unhealthy until restarted
        return JSONResponse({"status": "not following", "model": engine.settings.model_name,
                             "reason": follower.stopped, "policy_version": engine.policy_version}, status_code=503)
    health = engine.health()
    if follower is not None:
        health.loads, health.failed_loads = follower.loads, follower.failed
        health.switch_s = follower.health()["switch_s"]
    return health


@router.post("/v1/admin/load_weights", response_model=LoadWeightsResponse)
async def load_weights(body: LoadWeightsRequest, request: Request) -> LoadWeightsResponse:
    return await _engine(request).load_weights(body.path, body.version)


def _error(status: int, message: str, kind: str, param: str | None = None) -> Response:
    return Response(error_body(message, kind, param), status_code=status, media_type="application/json")


def _follow_policy(engine: EngineService, bootstrap: str, run: str, status: FollowerStatus) -> asyncio.Task:
    """The engine's policy follower (forge_stream.engine.shared.follower): each newer version of run `run` is loaded
    with `load_weights`; requests in flight finish on the weights they started with."""

    def served() -> tuple[int, str]:
        return engine.policy_version, engine.batcher.current.path

    async def apply(checkpoint: str, version: int) -> Applied:
        try:
            result = await engine.load_weights(checkpoint, version)
        except EngineRequestError as exc:  # e.g. the trainer already rotated that checkpoint away
            raise NotServed(exc.message) from exc
        return Applied(True, f"loaded in {result.load_seconds:.2f}s, its probe log-probs finite")

    return supervise(follow(bootstrap, run, served, apply, status), status)


def create_app(engine: EngineService, policy_bootstrap: str | None = None, policy_run: str = "default") -> FastAPI:
    """An app serving `engine`; the batcher's thread (and, with `policy_bootstrap`, a follower of forge.policy
    that loads each newer published version) runs for the app's lifespan."""
    status = FollowerStatus() if policy_bootstrap else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        watcher = _follow_policy(engine, policy_bootstrap, policy_run, status) if policy_bootstrap else None
        settings, path = engine.settings, engine.batcher.current.path
        log.info("engine ready (pid %d) on %s:%d: model %s at policy version %d (%s, %s); %s", os.getpid(),
                 settings.host, settings.port, path if settings.model_name == path else f"{settings.model_name} "
                 f"from {path}", engine.policy_version, settings.device, settings.dtype,
                 f"loads each new version of run {policy_run!r} from {TOPICS.policy.name} at {policy_bootstrap}"
                 if policy_bootstrap else "follows no policy topic (no --bootstrap-servers)")
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            engine.stop()

    app = FastAPI(title="forge-stream local rollout engine", lifespan=lifespan)
    app.state.engine = engine
    app.state.follower = status
    app.state.chat = ChatServing(engine)
    app.state.completion = CompletionServing(engine)
    app.include_router(router)

    @app.exception_handler(EngineRequestError)
    async def _engine_error(_: Request, exc: EngineRequestError) -> Response:
        kind = "BadRequestError" if exc.status < 500 else "InternalServerError"
        kind = {403: "PermissionDeniedError", 404: "NotFoundError"}.get(exc.status, kind)
        return _error(exc.status, exc.message, kind, exc.param)

    @app.exception_handler(httpbody.BodyRejected)
    async def _body_rejected(_: Request, exc: httpbody.BodyRejected) -> Response:
        return _error(exc.status, exc.message, "BadRequestError", exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, str(exc.errors()), "BadRequestError", param)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        request_id = f"req_{uuid.uuid4().hex}"
        log.error("engine error (request id %s)", request_id, exc_info=exc)
        response = _error(500, f"Internal engine error (request id {request_id}); its details are in the engine's "
                               "log.", "InternalServerError")
        response.headers["x-request-id"] = request_id
        return response

    if engine.settings.token:
        app.add_middleware(RequireBearer, token=engine.settings.token)
    return app
