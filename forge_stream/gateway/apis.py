"""The Anthropic Messages and OpenAI Responses APIs of the gateway: each request is translated to a chat request,
served and recorded by the chat path (`GatewayService.complete`), and its answer translated back (whole, or as
the API's SSE events). The translations themselves live in forge_stream.gateway.messages and .responses."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

from forge_stream.events import new_event_id
from forge_stream.gateway import messages
from forge_stream.gateway.admission import Lease
from forge_stream.gateway.responses import (
    EventStream, StoredResponse, assistant_message, conversation, output_items, response_object, stored_response_id,
    to_chat,
)
from forge_stream.gateway.completing import sse_data
from forge_stream.gateway.serving import GatewayService
from forge_stream.gateway.sessions import Session


async def message(service: GatewayService, session: Session, body, agent: str,
                  lease: Lease) -> bytes | AsyncIterator[bytes]:
    """Serve an Anthropic Messages request through the chat path (so it is recorded as chat), in the admission slot
    `lease`; returns the Message body, or its SSE event stream."""
    session.require_open()
    chat = messages.to_chat(body)
    message_id = "msg_" + new_event_id()
    result = await service.complete(session, "chat", chat, agent, lease)
    if isinstance(result, bytes):
        return orjson.dumps(messages.message_object(message_id, body, orjson.loads(result)))
    return messages.events(message_id, body, result)

async def respond(service: GatewayService, session: Session, body, agent: str,
                  lease: Lease) -> bytes | AsyncIterator[bytes]:
    """Serve a Responses API request through the chat path (so it is recorded as chat), in the admission slot
    `lease`; returns the Response body, or its SSE event stream."""
    session.require_open()
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    if isinstance(previous, str) and previous not in session.responses:  # another replica's, or before a restart
        await service.restorer.response(session, previous)
    chat, added = to_chat(body, conversation(session.responses, previous))
    store = body.get("store", True) is not False
    request_id = new_event_id()
    response_id = stored_response_id(request_id, bool(body.get("instructions"))) if store else (
        "resp_" + new_event_id())
    result = await service.complete(session, "chat", chat, agent, lease, request_id)
    if not isinstance(result, bytes):
        return _respond_stream(session, response_id, body, result, added, store)
    data = orjson.loads(result)
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    if store:
        session.responses[response_id] = StoredResponse(previous, added + [assistant_message(
            message.get("content") or "", message.get("tool_calls"))])
    return orjson.dumps(response_object(
        response_id, body, data.get("model") or body.get("model") or "", status="completed",
        output=output_items(response_id, message, choice.get("logprobs")), chat_usage=data.get("usage"),
        finish_reason=choice.get("finish_reason")))

async def _respond_stream(session: Session, response_id: str, body: dict, chat: AsyncIterator[bytes],
                          added: list[dict], store: bool) -> AsyncIterator[bytes]:
    """The chat stream's chunks as Responses events; its [DONE] (sent once recorded) completes the response,
    its error event fails it."""
    events = EventStream(response_id, body)
    for event in events.start():
        yield event
    try:
        async for raw in chat:
            data = sse_data(raw)
            if data == b"[DONE]":
                if store:
                    session.responses[response_id] = StoredResponse(body.get("previous_response_id"),
                                                                    added + [events.assistant()])
                for event in events.finish():
                    yield event
                return
            chunk = orjson.loads(data) if data else {}
            if "error" in chunk:
                for event in events.fail(chunk["error"] or {}):
                    yield event
                return
            for event in events.feed(chunk):
                yield event
        for event in events.fail({"message": "The chat stream ended early; nothing was recorded."}):
            yield event
    finally:
        await chat.aclose()
