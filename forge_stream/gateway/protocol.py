"""Wire models of the gateway's own routes (sessions, rewards, spans, finish) and its OpenAI-style errors.

The OpenAI routes are not modelled here: their bodies are forwarded to the engine as JSON, checked only as much
as the gateway needs (serving.check_*), so large token arrays are never re-validated on the hot path.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from forge_stream.openai_error import error_body

log = logging.getLogger("forge_stream.gateway")


class GatewayError(Exception):
    """An error answered with OpenAI's body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 retry_after: float | None = None, raw: bytes | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.retry_after = status, message, kind, param, retry_after
        self.raw = raw  # a body of its own (the Anthropic shape), answered instead of OpenAI's
        self.code = code  # OpenAI's error code (e.g. "context_length_exceeded"); None where it has none

    def body(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return error_body(self.message, self.kind, self.param, self.code)


CONTEXT_FULL = "maximum context length"  # in vLLM's (and OpenAI's) message when prompt + max_tokens do not fit


ENGINE_MESSAGE_CHARS = 1000  # the most of an engine's 4xx message passed on


def _engine_message(content: bytes) -> str | None:
    """The message of an engine's error body: OpenAI's `error.message`, FastAPI's `detail` (a string), or the
    text of a plain-text body; None for anything else (HTML, other JSON)."""
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        text = content.decode("utf-8", "replace").strip()
        return None if text.startswith("<") else text
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    message = error.get("message") if isinstance(error, dict) else data.get("detail")
    return message if isinstance(message, str) else None


def engine_error(status: int, content: bytes) -> GatewayError:
    """An engine's error answer, as the agent gets it. A 4xx is about the request: its status and the engine's
    message (a full context answered as OpenAI does: 400, code "context_length_exceeded", which clients recognize to
    trim their history). Anything else is the engine's own failure: its status (502 for one below 500) and a message
    that says only that, since an engine's 500 may hold a traceback, paths or secrets (the gateway logs it).

    >>> engine_error(500, b'Traceback (most recent call last): ...').message
    "The engine failed (HTTP 500); retry shortly (the gateway's log has the engine's answer)."
    >>> engine_error(422, b'max_tokens must be at most 4096').message
    'max_tokens must be at most 4096'
    """
    message = _engine_message(content)
    if status == 400 and isinstance(message, str) and CONTEXT_FULL in message.lower():
        return GatewayError(400, message, "invalid_request_error", "messages", code="context_length_exceeded")
    if 400 <= status < 500:
        message = (message or "")[:ENGINE_MESSAGE_CHARS] or f"The engine refused the request (HTTP {status})."
        return GatewayError(status, message, "invalid_request_error")
    log.warning("engine answered HTTP %d: %s", status, content[:4000].decode("utf-8", "replace"))
    return GatewayError(status if status >= 500 else 502, f"The engine failed (HTTP {status}); retry shortly (the "
                        f"gateway's log has the engine's answer).", "engine_error")


def engine_stream_error(chunk: dict) -> bytes:
    """The SSE event an agent gets for an error event inside an engine's stream (`chunk`: {"error": ...}): its
    message when the engine says it is about the request (a 4xx code), else only that the engine failed."""
    error = chunk.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if isinstance(code, int) and 400 <= code < 500 and isinstance(message, str):
        body = error_body(message[:ENGINE_MESSAGE_CHARS], "invalid_request_error")
    else:
        log.warning("engine sent an error event in its stream: %s", orjson.dumps(chunk)[:4000].decode())
        body = error_body("The engine failed during the stream, and nothing was recorded; retry shortly (the "
                          "gateway's log has the engine's answer).", "engine_error")
    return b"data: " + body + b"\n\n"


def invalid(message: str, param: str | None = None) -> GatewayError:
    """A request that is valid JSON but not a valid request: 422."""
    return GatewayError(422, message, "invalid_request_error", param)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SessionCreate(_Model):
    task_id: str
    group_id: str
    metadata: dict[str, str] = Field(default_factory=dict)
    session_id: str | None = None  # a caller-chosen id (e.g. deterministic from the task); default: random


class SessionCreated(_Model):
    session_id: str
    base_url: str  # {public url}/s/{session_id}/v1: all an OpenAI client needs
    path: str  # /s/{session_id}/v1
    token: str  # the agent's bearer token (only needed when the gateway requires auth)
    group_id: str
    task_id: str


class RewardIn(_Model):
    value: float = Field(allow_inf_nan=False)  # one NaN reward would poison every advantage of its group
    kind: str = "outcome"
    name: str = "grader"
    source: str = "grader"
    turn: int | None = Field(None, ge=0, lt=2**31)  # Avro int
    metadata: dict[str, str] = Field(default_factory=dict)


class SpanIn(_Model):
    tool_call_id: str | None = None
    name: str | None = None
    arguments: Any = None  # JSON text or a JSON value
    status: Literal["ok", "error"] = "ok"
    error: str | None = None
    result: str | None = None  # the tool's output (its first 8,192 characters are kept)
    start_ms: int = Field(ge=0, lt=2**63)  # Avro long, epoch milliseconds
    end_ms: int = Field(ge=0, lt=2**63)
    completion_id: str | None = None
    agent: str | None = None


class SpansIn(_Model):
    spans: list[SpanIn]


class FinishIn(_Model):
    status: Literal["ok", "error", "timeout", "aborted"] = "ok"
    reason: str | None = None


class Recorded(_Model):
    """Answer of the event routes: the ids of the events Kafka acknowledged."""

    event_ids: list[str]


class SessionView(_Model):
    session_id: str
    group_id: str
    task_id: str
    status: str
    turns: int
    completions: int
    pending_tool_calls: list[str]


# JSON schemas of the OpenAI requests, as far as the gateway checks them (checks.check_request), for the OpenAPI
# document; the other fields of OpenAI's requests are forwarded to the engine unchecked.
_SAMPLING = {
    "model": {"type": "string"},
    "n": {"type": "integer", "minimum": 1},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "stream": {"type": "boolean"},
}
CHAT = {"type": "object", "required": ["messages"], "properties": {
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role"],
        "properties": {"role": {"type": "string"}, "content": {"type": ["string", "null"]},
                       "tool_call_id": {"type": "string"}}}},
    "tools": {"type": "array", "items": {"type": "object"}},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    **_SAMPLING}}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    "prompt": {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,
                         {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                         {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]},
    **_SAMPLING}}


def first_choice_deltas(chunk: dict):
    """(choice, delta) of a chat stream chunk's first choice (index 0), if the chunk has it: what the Messages and
    Responses streams translate (a Message or a Response has one choice)."""
    for choice in chunk.get("choices") or ():
        if choice.get("index", 0) == 0:
            yield choice, choice.get("delta") or {}
