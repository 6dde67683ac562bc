"""Pure core of tool spans: infer them from the conversation, or build them from spans an agent posted.

A tool call issued by completion k stays pending in its session; when a later request of the session carries a
`tool` message answering that call id, the pair becomes an inferred ToolSpan (arguments from the call, ok or
error from the result, wall time from the end of completion k to the arrival of that request). A span posted by
the agent for the same call id gets the same `span_id` with source "explicit": it replaces the inferred one
(consumers keep the explicit span of a span_id), and once posted no span is inferred for that call.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from forge_stream.events import deterministic_id, new_event_id

ERROR_PREFIXES = ("error", "traceback", "exception", "failed")
RESULT_CHARS = 8192  # of a tool's output kept on its ToolSpan (process rules and analytics read it)


@dataclass(frozen=True)
class PendingCall:
    """A tool call some completion issued whose result has not been seen yet."""

    tool_call_id: str
    name: str
    arguments_json: str
    issued_ms: int
    completion_id: str
    agent: str


@dataclass(frozen=True)
class SessionKeys:
    session_id: str
    group_id: str
    task_id: str


def span_id(session_id: str, tool_call_id: str) -> str:
    return deterministic_id("span", session_id, tool_call_id)


def content_text(content) -> str:
    """A message's content as text (OpenAI content parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def tool_result_status(content) -> tuple[str, str | None]:
    """("ok", None) or ("error", message): a JSON object with an error field, or text that reads as an error.

    >>> tool_result_status('{"temperature": 21}')
    ('ok', None)
    >>> tool_result_status('{"error": "city not found"}')
    ('error', 'city not found')
    >>> tool_result_status('Traceback (most recent call last): ...')[0]
    'error'
    """
    text = content_text(content).strip()
    if text.startswith("{"):
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            error = value.get("error")
            if error or value.get("is_error") is True or value.get("status") == "error":
                return "error", (error if isinstance(error, str) else text)[:1000]
            return "ok", None
    if text.lower().startswith(ERROR_PREFIXES):
        return "error", text[:1000]
    return "ok", None


def pending_calls(tool_calls: list[dict] | None, *, issued_ms: int, completion_id: str,
                  agent: str) -> list[PendingCall]:
    """The calls of one completion's `tool_calls` (OpenAI shape) that carry an id."""
    out = []
    for call in tool_calls or []:
        function = call.get("function") or {}
        if call.get("id"):
            out.append(PendingCall(call["id"], function.get("name", ""), function.get("arguments") or "{}",
                                   issued_ms, completion_id, agent))
    return out


def answered_calls(messages: list, pending: dict[str, PendingCall]) -> list[tuple[PendingCall, object]]:
    """The pending calls that `messages` answer with a `tool` message, with that message's content."""
    out = []
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "tool":
            call = pending.get(message.get("tool_call_id") or "")
            if call is not None:
                out.append((call, message.get("content")))
    return out


def inferred_span(keys: SessionKeys, call: PendingCall, result_content, received_ms: int,
                  sid: str | None = None) -> dict:
    """The inferred ToolSpan of `call` answered by `result_content`; its span id derives from the call id unless
    `sid` is given (textspans: calls named only in an agent's text)."""
    status, error = tool_result_status(result_content)
    sid = sid or span_id(keys.session_id, call.tool_call_id)
    return {
        "event_id": deterministic_id("span-event", sid, "inferred"), "event_time": received_ms, "span_id": sid,
        "session_id": keys.session_id, "group_id": keys.group_id, "task_id": keys.task_id,
        "tool_call_id": call.tool_call_id, "name": call.name, "arguments_json": call.arguments_json,
        "status": status, "error": error, "result": content_text(result_content)[:RESULT_CHARS],
        "start_ms": call.issued_ms, "end_ms": max(received_ms, call.issued_ms), "source": "inferred", "completion_id": call.completion_id, "agent": call.agent,
    }


def explicit_span(keys: SessionKeys, posted: dict, pending: PendingCall | None, now: int) -> dict:
    """A ToolSpan from a posted span (protocol.SpanIn fields); fills name/args/completion from its pending call."""
    tool_call_id = posted.get("tool_call_id") or ""
    arguments = posted.get("arguments")
    if arguments is None:
        arguments_json = pending.arguments_json if pending else "{}"
    else:
        arguments_json = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
    sid = span_id(keys.session_id, tool_call_id) if tool_call_id else new_event_id()
    return {
        "event_id": new_event_id(), "event_time": now, "span_id": sid,
        "session_id": keys.session_id, "group_id": keys.group_id, "task_id": keys.task_id,
        "tool_call_id": tool_call_id, "name": posted.get("name") or (pending.name if pending else ""),
        "arguments_json": arguments_json, "status": posted.get("status", "ok"), "error": posted.get("error"),
        "result": posted["result"][:RESULT_CHARS] if posted.get("result") is not None else None, "start_ms": posted["start_ms"], "end_ms": posted["end_ms"], "source": "explicit",
        "completion_id": pending.completion_id if pending else posted.get("completion_id"),
        "agent": posted.get("agent") or (pending.agent if pending else ""),
    }
