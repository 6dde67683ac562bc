"""Pure core of the OpenAI Responses API, served on top of the chat path so it is recorded exactly as chat is.

A Responses request becomes a chat request (`to_chat`): `instructions` a system message, then the conversation
its `previous_response_id` chain holds, then its `input` items as chat messages (a `function_call` item joins
the assistant message before it as a tool call whose id is the item's `call_id`; a `function_call_output` item is
a `tool` message answering it, so tool spans are inferred as for chat). Function tools become chat tools. The
chat answer becomes a Response (`response_object`, `output_items`), or its chunks become the typed SSE events
of a Responses stream (`EventStream`). Only text and function tools are translated; anything else is refused
with the item or tool type named.

Per OpenAI, `instructions` are not carried along a chain, and a response made with `store: false` cannot be
continued. A chain is kept as `StoredResponse`s, each holding only the messages it added; a stored response's id
names the chat request that answered it (`stored_response_id`), so a gateway that does not hold it rebuilds it
from that request's recorded Completion.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import orjson

from forge_stream.gateway.protocol import GatewayError, first_choice_deltas, invalid

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "refusal")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass
class StoredResponse:
    """A response a later request may continue: its parent and the chat messages it added (input and output)."""

    parent: str | None
    messages: list[dict] = field(default_factory=list)


def stored_response_id(request_id: str, instructions: bool) -> str:
    """The id of a response that is stored: `resp_`, then `i` if the chat prompt that answered it begins with the
    request's `instructions` (which its chain does not carry) else `c`, then that chat request's id; so that a
    gateway that did not serve it can rebuild its chain from the recorded Completion (forge_stream.gateway.restore).

    >>> stored_response_id("abc", True), recorded_request(stored_response_id("abc", False))
    ('resp_iabc', ('abc', False))
    """
    return f"resp_{'i' if instructions else 'c'}{request_id}"


def recorded_request(response_id: str) -> tuple[str, bool] | None:
    """(the request id, whether its prompt begins with instructions) of a `stored_response_id`; None otherwise."""
    if not response_id.startswith(("resp_i", "resp_c")) or len(response_id) < 7:
        return None
    return response_id[6:], response_id[5] == "i"


def conversation(stored: dict[str, StoredResponse], response_id: str | None) -> list[dict]:
    """The chat messages of a chain ending at `response_id` (none for None); 400 as OpenAI if it is unknown.

    >>> chain = {"r1": StoredResponse(None, [{"n": 1}]), "r2": StoredResponse("r1", [{"n": 2}])}
    >>> conversation(chain, "r2")
    [{'n': 1}, {'n': 2}]
    """
    parts = []
    while response_id is not None:
        link = stored.get(response_id)
        if link is None:
            raise GatewayError(400, f"Previous response with id '{response_id}' not found.", "invalid_request_error",
                               "previous_response_id", code="previous_response_not_found")
        parts.append(link.messages)
        response_id = link.parent
    return [message for part in reversed(parts) for message in part]


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of content parts.", where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise invalid(f"Content part type {kind!r} is not supported by the gateway (text only).", where)
        texts.append(part.get("text") or part.get("refusal") or "")
    return "".join(texts)


def input_messages(items, param: str = "input") -> list[dict]:
    """Responses input (a string or a list of items) as chat messages.

    >>> input_messages([{"role": "user", "content": "hi"},  # doctest: +NORMALIZE_WHITESPACE
    ...                 {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ...                 {"type": "function_call_output", "call_id": "c1", "output": "3"}])
    [{'role': 'user', 'content': 'hi'},
     {'role': 'assistant', 'content': None, 'tool_calls': [{'id': 'c1', 'type': 'function',
                                                             'function': {'name': 'f', 'arguments': '{}'}}]},
     {'role': 'tool', 'tool_call_id': 'c1', 'content': '3'}]
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise invalid(f"'{param}' must be a string or a list of input items.", param)
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"{param}.{i}"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object.", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise invalid(f"{where}.role must be one of user, assistant, system, developer.", f"{where}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise invalid(f"{where} (function_call) needs string call_id, name and arguments.", where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["content"] = last["content"] or None
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{where} (function_call_output) needs a string call_id.", where)
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind != "reasoning":  # reasoning items carry nothing a chat prompt holds
            raise invalid(f"Input item type {kind!r} is not supported by the gateway.", f"{where}.type")
    return messages


def chat_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list.", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise invalid(f"Tool type {kind!r} is not supported by the gateway (function tools with a name only).",
                          f"tools.{i}")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text):
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    return {"type": fmt["type"]}


def wants_logprobs(body: dict) -> bool:
    return LOGPROBS_INCLUDE in (body.get("include") or ())


def to_chat(body, history: list[dict]) -> tuple[dict, list[dict]]:
    """(the chat request of a Responses request, the messages its input adds to the conversation)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    if body.get("input") is None:
        raise invalid("'input' is required: a string or a list of input items.", "input")
    added = input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string.", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + added
    chat = {"messages": messages, "model": body.get("model")}
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    for source, target in (("temperature", "temperature"), ("top_p", "top_p"), ("max_output_tokens", "max_tokens"),
                           ("user", "user")):
        if body.get(source) is not None:
            chat[target] = body[source]
    response_format = _response_format(body.get("text"))
    if response_format:
        chat["response_format"] = response_format
    if wants_logprobs(body):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
        if body["stream"]:
            chat["stream_options"] = {"include_usage": True}
    return chat, added


def assistant_message(text: str, tool_calls: list[dict] | None) -> dict:
    """The assistant turn as a chat message, as it is continued along a chain."""
    message = {"role": "assistant", "content": text or (None if tool_calls else "")}
    if tool_calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["function"]["name"],
                                               "arguments": c["function"]["arguments"]}} for c in tool_calls]
    return message


def _logprobs(chat_logprobs) -> list[dict]:
    return [{"token": e.get("token", ""), "logprob": e.get("logprob"), "bytes": e.get("bytes") or [],
             "top_logprobs": [{"token": t.get("token", ""), "logprob": t.get("logprob"), "bytes": t.get("bytes") or []}
                              for t in e.get("top_logprobs") or ()]}
            for e in (chat_logprobs or {}).get("content") or ()]


def _text_part(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, text: str, logprobs: list[dict], status: str = "completed") -> dict:
    content = [_text_part(text, logprobs)] if status == "completed" else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(response_id: str, message: dict, logprobs) -> list[dict]:
    """The output of a Response from a chat choice's message: its text (if any), then its tool calls."""
    suffix = response_id.removeprefix("resp_")
    items = []
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(f"msg_{suffix}_0", message.get("content") or "", _logprobs(logprobs)))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        items.append(call_item(f"fc_{suffix}_{len(items)}", call.get("id", ""), function.get("name", ""),
                               function.get("arguments") or ""))
    return items


def usage(chat_usage) -> dict | None:
    if not chat_usage:
        return None
    prompt, completion = chat_usage.get("prompt_tokens") or 0, chat_usage.get("completion_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(response_id: str, body: dict, model: str, *, status: str = "in_progress",
                    output: list[dict] | None = None, chat_usage=None, finish_reason: str | None = None,
                    error: dict | None = None, created_at: int | None = None) -> dict:
    """A Response: the request's settings echoed, with `output` and `usage` once done (a choice cut by its
    token limit is "incomplete" with reason max_output_tokens)."""
    incomplete = None
    if status == "completed" and finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    return {
        "id": response_id, "object": "response", "created_at": created_at or int(time.time()), "status": status,
        "error": error, "incomplete_details": incomplete, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": model, "output": output or [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
        "store": body.get("store", True), "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "top_p": body.get("top_p", 1.0), "truncation": "disabled",
        "usage": usage(chat_usage), "user": body.get("user"), "metadata": body.get("metadata") or {},
    }


class EventStream:
    """Chat completion chunks in, the typed SSE events of a Responses stream out, one output item open at a time
    (the text message, then each function call). Each event is serialized when made, so the items are updated
    in place."""

    def __init__(self, response_id: str, body: dict):
        self.response_id, self.body = response_id, body
        self.created_at = int(time.time())
        self.model = body.get("model") or ""
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None
        self.text: list[str] = []
        self.logprobs: list[dict] = []
        self.calls: dict[int, dict] = {}  # function_call items by the chat tool call's index
        self.usage = None
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _response(self, status: str, **extra) -> dict:
        return response_object(self.response_id, self.body, self.model, status=status, created_at=self.created_at,
                               **extra)

    def start(self) -> list[bytes]:
        response = self._response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def _add(self, item: dict) -> list[bytes]:
        out = self._close()
        item["output_index"] = len(self.items)  # kept out of the events below by _public
        self.items.append(item)
        self.open = item
        return out + [self._event("response.output_item.added", output_index=item["output_index"],
                                  item=_public(item))]

    def _open_text(self) -> list[bytes]:
        item = message_item(f"msg_{self.response_id.removeprefix('resp_')}_{len(self.items)}", "", [],
                            status="in_progress")
        return self._add(item) + [self._event("response.content_part.added", item_id=item["id"],
                                              output_index=item["output_index"], content_index=0,
                                              part=_text_part("", []))]

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": item["output_index"]}
        item["status"] = "completed"
        if item["type"] == "message":
            part = _text_part("".join(self.text), self.logprobs)
            item["content"] = [part]
            out = [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                               logprobs=self.logprobs),
                   self._event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            out = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                               arguments=item["arguments"])]
        return out + [self._event("response.output_item.done", output_index=item["output_index"],
                                  item=_public(item))]

    def feed(self, chunk: dict) -> list[bytes]:
        """The events of one chat chunk (of its first choice: a Response has one)."""
        self.model = chunk.get("model") or self.model
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[bytes] = []
        for choice, delta in first_choice_deltas(chunk):
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._open_text()
                logprobs = _logprobs(choice.get("logprobs"))
                self.text.append(delta["content"])
                self.logprobs += logprobs
                out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                       output_index=self.open["output_index"], content_index=0,
                                       delta=delta["content"], logprobs=logprobs))
            for call in delta.get("tool_calls") or ():
                out += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return out

    def _call_delta(self, delta: dict) -> list[bytes]:
        function = delta.get("function") or {}
        index = delta.get("index", 0)
        item = self.calls.get(index)
        out = []
        if item is None:
            item = self.calls[index] = call_item(
                f"fc_{self.response_id.removeprefix('resp_')}_{len(self.items)}", delta.get("id") or "",
                function.get("name") or "", "", status="in_progress")
            out = self._add(item)
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=item["output_index"], delta=function["arguments"]))
        return out

    def finish(self) -> list[bytes]:
        """The closing events, once the chat path recorded the completion."""
        out = self._close() if self.items else self._open_text() + self._close()
        response = self._response("completed", output=[_public(i) for i in self.items], chat_usage=self.usage,
                                  finish_reason=self.finish_reason)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=response)]

    def fail(self, error: dict) -> list[bytes]:
        """An `error` event, then response.failed: the engine or Kafka failed, and nothing was recorded."""
        message = str(error.get("message") or "The response failed.")
        code = error.get("code")
        failed = self._response("failed", output=[_public(i) for i in self.items],
                                error={"code": "server_error", "message": message})
        return [self._event("error", code=None if code is None else str(code), message=message,
                            param=error.get("param")),
                self._event("response.failed", response=failed)]

    def assistant(self) -> dict:
        """The assistant turn streamed, as a chat message (for the stored conversation)."""
        calls = [{"id": c["call_id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self.calls.values()]
        return assistant_message("".join(self.text), calls)


def _public(item: dict) -> dict:
    return {k: v for k, v in item.items() if k != "output_index"}
