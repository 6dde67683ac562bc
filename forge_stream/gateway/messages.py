"""Pure core of the Anthropic Messages API, served on top of the chat path so it is recorded exactly as chat is.

A Messages request becomes a chat request (`to_chat`): `system` a system message; each user or assistant message
its chat messages (text blocks joined; an assistant's `tool_use` blocks its `tool_calls`, the block id the call
id and its `input` the JSON arguments; a user's `tool_result` blocks `tool` messages answering them, so tool
spans are inferred as for chat); tools' `input_schema` function parameters; `tool_choice` auto/any/tool/none;
`stop_sequences` the chat `stop`. The chat answer becomes a Message (`message_object`), or its chunks become the
SSE events of a Messages stream (`EventStream`, each with its `event:` line, which the anthropic SDK needs).
Thinking blocks of past assistant turns are dropped and `thinking` is ignored; images, documents and server
tools are refused with the block or tool type named. Errors take Anthropic's shape (`anthropic_error`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

from forge_stream.gateway.protocol import GatewayError, first_choice_deltas

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}
# the Anthropic type of an error event in a stream, from the OpenAI type of the chat stream's error (whose body has
# no status: OpenAI's `code` is a string or null)
_STREAM_ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
                       "permission_error": "permission_error", "not_found_error": "not_found_error",
                       "rate_limit_error": "rate_limit_error", "service_unavailable": "overloaded_error"}
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")  # a past turn's reasoning: no chat prompt holds it

# JSON schema of a Messages request as far as `to_chat` reads it, for the OpenAPI document
_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "tool_use", "tool_result"]}, "text": {"type": "string"}, "id": {"type": "string"},
    "name": {"type": "string"}, "input": {"type": "object"}, "tool_use_id": {"type": "string"},
    "content": {"type": "string"}, "is_error": {"type": "boolean"}}}
SCHEMA = {"type": "object", "required": ["model", "max_tokens", "messages"], "properties": {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["user", "assistant"]},
                       "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]}}}},
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]},
    "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "input_schema": {"type": "object"}}}},
    "tool_choice": {"type": "object", "required": ["type"],
                    "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"}}},
    "stop_sequences": {"type": "array", "items": {"type": "string"}},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "stream": {"type": "boolean"}}}


def bad_request(message: str) -> GatewayError:
    """A request Anthropic's API would refuse: 400 invalid_request_error."""
    return GatewayError(400, message, "invalid_request_error")


def anthropic_error_body(kind: str, message: str) -> bytes:
    """The JSON body of an error in Anthropic's shape (OpenAI's is forge_stream.openai_error.error_body)."""
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def anthropic_error(status: int, message: str, retry_after: int | None = None, raw: bytes | None = None
                    ) -> GatewayError:
    """A gateway error answered in Anthropic's shape; a 422 (invalid request) is 400 as Anthropic answers it, and
    an engine's own error body gives its message.

    >>> anthropic_error(422, "'max_tokens' is required.").body()
    b'{"type":"error","error":{"type":"invalid_request_error","message":"\\'max_tokens\\' is required."}}'
    """
    if raw is not None:
        try:
            error = orjson.loads(raw).get("error")
            message = error.get("message") or message if isinstance(error, dict) else message
        except (orjson.JSONDecodeError, AttributeError):
            pass
    status = 400 if status == 422 else status
    kind = _ERROR_TYPES.get(status, "api_error")
    return GatewayError(status, message, kind, retry_after=retry_after, raw=anthropic_error_body(kind, message))


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of content blocks.")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{where}.{i}: a content block must be an object with a string 'type'.")
    return content


def _block_text(block: dict, where: str) -> str:
    if block["type"] in _SKIPPED_BLOCKS:
        return ""
    if block["type"] != "text" or not isinstance(block.get("text"), str):
        raise bad_request(f"{where}: content block type {block['type']!r} is not supported by the gateway here "
                          f"(text only).")
    return block["text"]


def _text(content, where: str) -> str:
    return "".join(_block_text(block, f"{where}.{i}") for i, block in enumerate(_blocks(content, where)))


def _user(content, where: str) -> list[dict]:
    """A user turn: its tool_result blocks as tool messages, its text between them as user messages."""
    out: list[dict] = []
    for i, block in enumerate(_blocks(content, where)):
        if block["type"] == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{where}.{i}: a tool_result block needs a string tool_use_id.")
            result = block.get("content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _text(result or "", f"{where}.{i}.content")})
        else:
            text = _block_text(block, f"{where}.{i}")
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
    return out


def _assistant(content, where: str) -> dict:
    texts, calls = [], []
    for i, block in enumerate(_blocks(content, where)):
        if block["type"] == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
                raise bad_request(f"{where}.{i}: a tool_use block needs a string id and name.")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": orjson.dumps(block.get("input") or {}).decode()}})
        else:
            texts.append(_block_text(block, f"{where}.{i}"))
    message = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(body: dict) -> list[dict]:
    """The chat messages of a Messages request: its system prompt, then its turns.

    >>> chat_messages({"system": "Be brief.", "messages": [  # doctest: +NORMALIZE_WHITESPACE
    ...     {"role": "user", "content": "Weather?"},
    ...     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
    ...     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"},
    ...                                  {"type": "text", "text": "Thanks."}]}]})
    [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Weather?'},
     {'role': 'assistant', 'content': None, 'tool_calls': [{'id': 't1', 'type': 'function',
                                                             'function': {'name': 'f', 'arguments': '{"a":1}'}}]},
     {'role': 'tool', 'tool_call_id': 't1', 'content': '3'}, {'role': 'user', 'content': 'Thanks.'}]
    """
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad_request("messages: a non-empty list of messages is required.")
    system = body.get("system")
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, turn in enumerate(turns):
        where = f"messages.{i}"
        role = turn.get("role") if isinstance(turn, dict) else None
        if role == "user":
            out += _user(turn.get("content"), f"{where}.content")
        elif role == "assistant":
            out.append(_assistant(turn.get("content"), f"{where}.content"))
        else:
            raise bad_request(f"{where}.role: must be 'user' or 'assistant' (the system prompt goes in 'system').")
    return out


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list.")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom") if isinstance(tool, dict) else None
        if kind != "custom" or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools.{i}: tool type {kind!r} is not supported by the gateway (client tools with a "
                              f"name and input_schema only).")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice, chat: dict) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad_request("tool_choice: must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}.")
    if choice.get("disable_parallel_tool_use") is not None:
        chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]


def to_chat(body) -> dict:
    """The chat request of a Messages request."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if body.get("max_tokens") is None:
        raise bad_request("max_tokens: Field required")
    chat = {"messages": chat_messages(body), "model": body.get("model"), "max_tokens": body["max_tokens"]}
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            _tool_choice(body["tool_choice"], chat)
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop_sequences: must be a list of strings.")
        if stop:
            chat["stop"] = stop
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if user is not None:
        chat["user"] = user
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
        if body["stream"]:
            chat["stream_options"] = {"include_usage": True}
    return chat


def stop_reason(finish_reason: str | None, matched, stop_sequences, tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and vLLM's `stop_reason` (the stop string
    it matched, if any).

    >>> stop_reason("stop", "END", ["END"], False), stop_reason("length", None, None, False)
    (('stop_sequence', 'END'), ('max_tokens', None))
    """
    if tool_calls or finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def _usage(chat_usage) -> dict:
    chat_usage = chat_usage or {}
    return {"input_tokens": chat_usage.get("prompt_tokens") or 0,
            "output_tokens": chat_usage.get("completion_tokens") or 0}


def _input(arguments: str):
    """A tool call's arguments as the tool_use block's input (an object; arguments that are not one are kept
    under "arguments")."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def message_object(message_id: str, body: dict, data: dict) -> dict:
    """The Message of a chat completion (of its first choice: a Message has one)."""
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or "", "name": function.get("name") or "",
                        "input": _input(function.get("arguments"))})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   body.get("stop_sequences"), bool(message.get("tool_calls")))
    return {"id": message_id, "type": "message", "role": "assistant", "model": data.get("model") or body.get("model"),
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(data.get("usage"))}


def _sse(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


class EventStream:
    """Turns the chat stream's chunks into Messages events: message_start, per content block (text, then each
    tool call) content_block_start / _delta (text_delta, input_json_delta) / _stop, message_delta (stop reason,
    usage), message_stop."""

    def __init__(self, message_id: str, body: dict):
        self.message_id, self.body = message_id, body
        self.index = -1  # of the open content block; -1 before the first
        self.open: str | None = None  # its type
        self.calls: dict[int, int] = {}  # block index by the chat tool call's index
        self.usage = None
        self.finish_reason: str | None = None
        self.matched = None

    def start(self) -> list[bytes]:
        return [_sse("message_start", {"message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.body.get("model") or "",
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(None)}})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"index": self.index})]

    def _open(self, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + [_sse("content_block_start", {"index": self.index, "content_block": block})]

    def feed(self, chunk: dict) -> list[bytes]:
        """The events of one chat chunk (of its first choice)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[bytes] = []
        for choice, delta in first_choice_deltas(chunk):
            if delta.get("content"):
                if self.open != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(_sse("content_block_delta", {"index": self.index,
                                                        "delta": {"type": "text_delta", "text": delta["content"]}}))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if call.get("index", 0) not in self.calls:
                    out += self._open({"type": "tool_use", "id": call.get("id") or "",
                                       "name": function.get("name") or "", "input": {}})
                    self.calls[call.get("index", 0)] = self.index
                if function.get("arguments"):
                    out.append(_sse("content_block_delta", {
                        "index": self.calls[call.get("index", 0)],
                        "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}}))
            if choice.get("finish_reason") is not None:
                self.finish_reason, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return out

    def finish(self) -> list[bytes]:
        """The closing events, once the chat path recorded the completion."""
        reason, sequence = stop_reason(self.finish_reason, self.matched, self.body.get("stop_sequences"),
                                       bool(self.calls))
        return self._close() + [_sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                       "usage": _usage(self.usage)}),
                                _sse("message_stop", {})]


def fail(error: dict) -> bytes:
    """The `error` event of a stream whose engine or Kafka failed (nothing was recorded)."""
    message = str(error.get("message") or "The message failed.")
    return b"event: error\ndata: " + anthropic_error_body(_STREAM_ERROR_TYPES.get(error.get("type"), "api_error"),
                                                          message) + b"\n\n"


async def events(message_id: str, body: dict, chat: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The chat stream as Messages events; its [DONE] (sent once recorded) ends the message, its error event
    fails it."""
    stream = EventStream(message_id, body)
    for event in stream.start():
        yield event
    try:
        async for raw in chat:
            data = next((line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")), b"")
            if data == b"[DONE]":
                for event in stream.finish():
                    yield event
                return
            chunk = orjson.loads(data) if data else {}
            if "error" in chunk:
                yield fail(chunk["error"] or {})
                return
            for event in stream.feed(chunk):
                yield event
        yield fail({"message": "The chat stream ended early; nothing was recorded."})
    finally:
        await chat.aclose()
