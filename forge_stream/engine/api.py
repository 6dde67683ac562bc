"""The engine's HTTP surface: a thin FastAPI router over the services kept in `app.state`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`POST /v1/admin/load_weights`. Errors use OpenAI's body `{"error": {"message", "type", "param", "code"}}`;
invalid requests are 400 (as vLLM), not FastAPI's 422.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from forge_stream.engine.policy_watch import watch_policy
from forge_stream.engine.serving import EngineRequestError, EngineService
from forge_stream.engine.serving_chat import ChatServing
from forge_stream.engine.serving_completion import CompletionServing
from forge_stream.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    HealthResponse,
    LoadWeightsRequest,
    LoadWeightsResponse,
    ModelList,
)

router = APIRouter()


def _engine(request: Request) -> EngineService:
    return request.app.state.engine


def _respond(result):
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump())


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return _respond(await request.app.state.chat.create(body))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return _respond(await request.app.state.completion.create(body))


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    return _engine(request).models()


@router.get("/health", response_model=HealthResponse)
async def health(request: Request) -> HealthResponse:
    return _engine(request).health()


@router.post("/v1/admin/load_weights", response_model=LoadWeightsResponse)
async def load_weights(body: LoadWeightsRequest, request: Request) -> LoadWeightsResponse:
    return await _engine(request).load_weights(body.path, body.version)


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def create_app(engine: EngineService, policy_bootstrap: str | None = None, policy_run: str = "default") -> FastAPI:
    """An app serving `engine`; the scheduler thread (and, with `policy_bootstrap`, a watcher of forge.policy
    that loads each newer published version) runs for the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        watcher = asyncio.create_task(watch_policy(engine, policy_bootstrap, policy_run)) if policy_bootstrap else None
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
    app.state.chat = ChatServing(engine)
    app.state.completion = CompletionServing(engine)
    app.include_router(router)

    @app.exception_handler(EngineRequestError)
    async def _engine_error(_: Request, exc: EngineRequestError) -> JSONResponse:
        kind = "BadRequestError" if exc.status < 500 else "InternalServerError"
        if exc.status == 404:
            kind = "NotFoundError"
        return _error(exc.status, exc.message, kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, str(exc.errors()), "BadRequestError", param)

    return app
