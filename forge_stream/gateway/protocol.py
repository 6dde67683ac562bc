"""Wire models of the gateway's own routes (sessions, rewards, spans, finish) and its OpenAI-style errors.

The OpenAI routes are not modelled here: their bodies are forwarded to the engine as JSON, checked only as much
as the gateway needs (serving.check_*), so large token arrays are never re-validated on the hot path.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field


class GatewayError(Exception):
    """An error answered with OpenAI's body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 retry_after: float | None = None, raw: bytes | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.retry_after = status, message, kind, param, retry_after
        self.raw = raw  # an engine's own error body, passed through as is
        self.code = code  # OpenAI's error code (e.g. "context_length_exceeded"); default: the status

    def body(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return error_body(self.status, self.message, self.kind, self.param, self.code)


def error_body(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param,
                                   "code": status if code is None else code}})


CONTEXT_FULL = "maximum context length"  # in vLLM's (and OpenAI's) message when prompt + max_tokens do not fit


def engine_error(status: int, content: bytes) -> GatewayError:
    """An engine's error answer: passed through as is, except a full context, answered as OpenAI does
    (400, code "context_length_exceeded", the engine's message), which clients recognize to trim their history."""
    try:
        error = orjson.loads(content).get("error")
        message = error.get("message") if isinstance(error, dict) else None
    except (orjson.JSONDecodeError, AttributeError):
        message = None
    if status == 400 and isinstance(message, str) and CONTEXT_FULL in message.lower():
        return GatewayError(400, message, "invalid_request_error", "messages", code="context_length_exceeded")
    return GatewayError(status, "engine error", "engine_error", raw=content)


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
