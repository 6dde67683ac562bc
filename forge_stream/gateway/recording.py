"""Pure core of token-in/token-out recording: engine responses (whole or streamed) -> Completion records.

The gateway never tokenizes. It reads the ids and logprobs the engine returned in vLLM's OpenAI fields:
`prompt_token_ids` on a chat response (on the first stream chunk of each choice), `prompt_token_ids` per choice
on a completions response, `token_ids` per choice (per chunk: that chunk's new tokens), and logprobs in OpenAI's
format (chat: `logprobs.content[*].logprob`; completions: `logprobs.token_logprobs`). A choice that lacks any of
them, or whose logprobs do not line up with its tokens, is recorded as untrainable with the reason.

Each Completion also records how it was sampled: the request's `temperature` and `top_p` (OpenAI's defaults,
1.0, when absent) and the engine's logprobs mode (`GatewaySettings.engine_logprobs_mode`, since engines do not
report it): "processed" when the logprobs are those of the distribution actually sampled from.

A Completion's prompt is recorded whole here; the service then records a chat prompt that extends an earlier
completion of its session by reference (forge_stream.events.prompts.by_reference). An engine's answer is parsed by
`engine_json`, which keeps each `prompt_token_ids` array as its text (`PromptIds`): a long prompt's ids are parsed
only as far as they are recorded.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import orjson

from forge_stream.engine.shared.tool_calls import TOOL_CALL_START, parse_tool_calls
from forge_stream.events import deterministic_id
from forge_stream.events.prompts import PromptIds

Kind = Literal["chat", "completion"]


@dataclass
class ChoiceRecord:
    """What the engine returned for one choice, as the gateway records it."""

    index: int
    prompt: PromptIds | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    text: str = ""
    tool_calls: list[dict] | None = None
    finish_reason: str | None = None
    prompt_index: int = 0  # completions API: which prompt of a batched request this choice answers

    def __post_init__(self):
        self.prompt = PromptIds.of(self.prompt)  # (a list of ids is taken too)

    def trainability(self) -> tuple[bool, str | None]:
        if self.prompt is None:
            return False, "engine returned no prompt_token_ids"
        if self.token_ids is None:
            return False, "engine returned no completion token_ids"
        if self.logprobs is None:
            return False, "engine returned no logprobs"
        if len(self.logprobs) != len(self.token_ids):
            return False, f"engine returned {len(self.logprobs)} logprobs for {len(self.token_ids)} tokens"
        return True, None

    def tool_call_error(self, tools_offered: bool) -> str | None:
        """Why a tool call the model wrote in the Hermes format (`<tool_call>...</tool_call>`) did not come back
        parsed, or None. Only a request that offered tools can have one. Engines parse a text's blocks all or none
        (vLLM's `hermes` parser, forge_stream.engine.shared.tool_calls) and leave a text that failed as content, so a
        start marker in the content is a call that failed.

        >>> ChoiceRecord(0, text='<tool_call>{"name": "f"').tool_call_error(True)
        "unterminated <tool_call> block: Expecting ',' delimiter: line 1 column 13 (char 12)"
        >>> ChoiceRecord(0, text='<tool_call>{"name": "f"}</tool_call>').tool_call_error(False) is None
        True
        """
        if not tools_offered or TOOL_CALL_START not in self.text:
            return None
        reason = parse_tool_calls(self.text).error or "a well-formed <tool_call> block the engine did not parse"
        if self.tool_calls:
            return f"{reason}, beside {len(self.tool_calls)} parsed tool call(s)"
        return reason


def _chat_logprobs(logprobs: dict | None) -> list[float] | None:
    content = (logprobs or {}).get("content")
    return None if content is None else [entry["logprob"] for entry in content]


def _completion_logprobs(logprobs: dict | None) -> list[float] | None:
    values = (logprobs or {}).get("token_logprobs")
    return None if values is None else [-9999.0 if v is None else v for v in values]


_IDS_KEY = b'"prompt_token_ids":['
TEXT_FROM = 16384  # bytes: a shorter prompt_token_ids array is parsed (below a few thousand ids that costs less)


def engine_json(raw: bytes, text_from: int | None = None) -> dict:
    """An engine's answer (or one stream chunk) parsed, with each `prompt_token_ids` array (the response's, or a
    choice's) of `text_from` (default `TEXT_FROM`) bytes or more held as a PromptIds of its text rather than parsed; an array not in
    compact form (or a key found elsewhere) makes it parse the answer as it is. The key, with its quotes, cannot be
    inside a JSON string (whose quotes are escaped), and an array of ids ends at the first `]`.

    >>> data = engine_json(b'{"prompt_token_ids":[1,2],"choices":[{"prompt_token_ids":[3],"text":"]"}]}', 0)
    >>> data["prompt_token_ids"].ids(), data["choices"][0]["prompt_token_ids"].ids(), data["choices"][0]["text"]
    ([1, 2], [3], ']')
    >>> engine_json(b'{"prompt_token_ids":[1, 2]}', 0)["prompt_token_ids"], engine_json(b'{"prompt_token_ids":[1]}')
    ([1, 2], {'prompt_token_ids': [1]})
    """
    text_from = TEXT_FROM if text_from is None else text_from
    at = raw.find(_IDS_KEY) if len(raw) >= text_from else -1
    if at < 0:
        return orjson.loads(raw)
    pieces, texts, start = [], [], 0
    while at >= 0:
        begin = at + len(_IDS_KEY) - 1
        end = raw.find(b"]", begin) + 1
        if 0 < end - begin < text_from:  # parsed with the rest
            at = raw.find(_IDS_KEY, end)
            continue
        prompt = PromptIds.of_text(raw[begin:end]) if end else None
        if prompt is None:
            return orjson.loads(raw)
        pieces += [raw[start:begin], b"%d" % len(texts)]  # the array's place holds its index in `texts`
        texts.append(prompt)
        start = end
        at = raw.find(_IDS_KEY, start)
    if not texts:
        return orjson.loads(raw)
    pieces.append(raw[start:])
    data = orjson.loads(b"".join(pieces))
    if not isinstance(data, dict):
        return orjson.loads(raw)
    placed = 0
    for holder in (data, *(c for c in data.get("choices") or () if isinstance(c, dict))):
        index = holder.get("prompt_token_ids")
        if type(index) is int and index < len(texts):
            holder["prompt_token_ids"] = texts[index]
            placed += 1
    return data if placed == len(texts) else orjson.loads(raw)


def client_json(data: dict) -> bytes:
    """An answer parsed by `engine_json` (less what the client did not ask for) as JSON again, prompt ids as their
    text."""
    return orjson.dumps(data, default=_ids_text)


def _ids_text(value):
    if isinstance(value, PromptIds):
        return orjson.Fragment(value.text())
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def chat_choices(response: dict) -> list[ChoiceRecord]:
    """Choices of a non-streamed chat response."""
    prompt = PromptIds.of(response.get("prompt_token_ids"))
    out = []
    for choice in response.get("choices") or []:
        message = choice.get("message") or {}
        out.append(ChoiceRecord(
            index=choice.get("index", len(out)), prompt=prompt, token_ids=choice.get("token_ids"),
            logprobs=_chat_logprobs(choice.get("logprobs")), text=message.get("content") or "",
            tool_calls=message.get("tool_calls") or None, finish_reason=choice.get("finish_reason")))
    return out


def completion_choices(response: dict, n: int) -> list[ChoiceRecord]:
    """Choices of a non-streamed completions response (`n` choices per prompt, indexed prompt * n + j)."""
    out = []
    for choice in response.get("choices") or []:
        index = choice.get("index", len(out))
        out.append(ChoiceRecord(
            index=index, prompt=choice.get("prompt_token_ids"), token_ids=choice.get("token_ids"),
            logprobs=_completion_logprobs(choice.get("logprobs")), text=choice.get("text") or "",
            finish_reason=choice.get("finish_reason"), prompt_index=index // max(n, 1)))
    return out


@dataclass
class StreamAccumulator:
    """Folds SSE chunks (already JSON-decoded) into per-choice records; notes when the first token came."""

    kind: Kind
    n: int = 1
    first_token_ms: int | None = None
    policy_version: int | None = None
    model: str | None = None
    choices: dict[int, ChoiceRecord] = field(default_factory=dict)
    _text: dict[int, list[str]] = field(default_factory=dict)
    _calls: dict[int, dict[int, dict]] = field(default_factory=dict)

    def feed(self, chunk: dict, now_ms: int) -> None:
        if chunk.get("policy_version") is not None:
            self.policy_version = chunk["policy_version"]
        self.model = chunk.get("model", self.model)
        response_prompt = chunk.get("prompt_token_ids")
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            record = self.choices.get(index)
            if record is None:
                record = self.choices[index] = ChoiceRecord(index=index, prompt_index=index // max(self.n, 1))
                self._text[index] = []
            prompt = choice.get("prompt_token_ids", response_prompt)
            if prompt is not None:
                record.prompt = self._shared(PromptIds.of(prompt))
            ids = choice.get("token_ids")
            if ids:
                record.token_ids = (record.token_ids or []) + ids
                if self.first_token_ms is None:
                    self.first_token_ms = now_ms
            lps = (_chat_logprobs if self.kind == "chat" else _completion_logprobs)(choice.get("logprobs"))
            if lps:
                record.logprobs = (record.logprobs or []) + lps
            text = (choice.get("delta") or {}).get("content") if self.kind == "chat" else choice.get("text")
            if text:
                self._text[index].append(text)
                if self.first_token_ms is None:
                    self.first_token_ms = now_ms
            for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                self._merge_call(index, delta)
            if choice.get("finish_reason") is not None:
                record.finish_reason = choice["finish_reason"]

    def _shared(self, prompt: PromptIds) -> PromptIds:
        """`prompt`, or the same prompt another choice already holds (a chat stream sends it with each choice's first
        chunk): the choices of a request share one, parsed or hashed once."""
        for other in self.choices.values():
            if other.prompt is not None and (other.prompt is prompt or other.prompt.text() == prompt.text()):
                return other.prompt
        return prompt

    def _merge_call(self, index: int, delta: dict) -> None:
        calls = self._calls.setdefault(index, {})
        call = calls.setdefault(delta.get("index", len(calls)),
                                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if delta.get("id"):
            call["id"] = delta["id"]
        function = delta.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]

    def results(self) -> list[ChoiceRecord]:
        out = []
        for index in sorted(self.choices):
            record = self.choices[index]
            record.text = "".join(self._text[index])
            calls = self._calls.get(index)
            record.tool_calls = [calls[k] for k in sorted(calls)] if calls else None
            out.append(record)
        return out


@dataclass(frozen=True)
class RequestContext:
    """Who asked and when: everything a Completion record needs besides the engine's answer."""

    session_id: str
    group_id: str
    task_id: str
    request_id: str
    agent: str
    received_ms: int
    kind: Kind
    messages_json: str  # chat: the messages; completions: the prompt(s)
    tools_json: str | None
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs_mode: str = "processed"
    message_parts: tuple[bytes, ...] = ()  # chat: each message's JSON (messages_json is their JSON list)
    message_digests: tuple[bytes, ...] = ()  # chat, prompts by reference: message_digest of each of message_parts
    request_digest: str | None = None  # a call with an Idempotency-Key: `request_digest` of its kind and body


def chat_messages_json(parts: tuple[bytes, ...]) -> str:
    """The JSON list of messages whose JSON texts are `parts` (as orjson writes the list itself).

    >>> chat_messages_json((b'{"role":"user"}', b'{"a":1}')) == orjson.dumps([{"role": "user"}, {"a": 1}]).decode()
    True
    """
    return (b"[" + b",".join(parts) + b"]").decode()


def sampling_setting(body: dict, name: str) -> float:
    """A request's `temperature` or `top_p` as the engine applied it (absent or null: OpenAI's default 1.0).

    >>> sampling_setting({"temperature": 0}, "temperature"), sampling_setting({"top_p": None}, "top_p")
    (0.0, 1.0)
    """
    value = body.get(name)
    return 1.0 if value is None else float(value)


_DELIVERY = ("stream", "stream_options")  # how the answer is sent, not what it is: a retry may change them


def request_digest(kind: Kind, body: dict) -> str:
    """The SHA-256 (hex) of a call's endpoint and canonical body (keys sorted, `stream` and `stream_options` left
    out): what an Idempotency-Key is bound to.

    >>> a = request_digest("chat", {"messages": [], "model": "m", "stream": True})
    >>> a == request_digest("chat", {"model": "m", "messages": []}), a == request_digest("completion", {"messages": [],
    ...                                                                                              "model": "m"})
    (True, False)
    """
    canonical = orjson.dumps({k: v for k, v in body.items() if k not in _DELIVERY}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(kind.encode() + b"\n" + canonical).hexdigest()


def dumps(value) -> str:
    return orjson.dumps(value).decode()


def prompt_json(ctx: RequestContext, choice: ChoiceRecord) -> str:
    """The request input this choice answers: all messages (chat) or its own prompt (batched completions)."""
    if ctx.kind == "chat":
        return ctx.messages_json
    prompts = orjson.loads(ctx.messages_json)
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
        return dumps(prompts[min(choice.prompt_index, len(prompts) - 1)])
    return ctx.messages_json


def prompt_sources(prompt_cache: dict | None) -> tuple[int | None, int | None, int | None]:
    """(computed, from the engine's prefix cache, from the shared KV tier) of an answer's prompt tokens, as the
    vLLM engine's `prompt_cache` says (forge_stream.engine.vllm_front.app.prompt_cache); None where it did not say.

    >>> prompt_sources({"prompt_tokens": 300, "engine": 32, "tier": 256}), prompt_sources(None)
    ((12, 32, 256), (None, None, None))
    >>> prompt_sources({"prompt_tokens": 300, "engine": 32, "tier": None})
    (None, 32, None)
    """
    if not prompt_cache:
        return None, None, None
    engine, tier = prompt_cache.get("engine"), prompt_cache.get("tier")
    known = engine is not None and tier is not None
    return (prompt_cache["prompt_tokens"] - engine - tier if known else None), engine, tier


def completion_record(ctx: RequestContext, choice: ChoiceRecord, *, turn: int, model: str, engine_id: str,
                      policy_version: int, first_token_ms: int | None, done_ms: int,
                      prompt_ids: bool = True, prompt_cache: dict | None = None) -> dict:
    """The Completion event of one choice; with `prompt_ids` False its prompt_token_ids are left empty, for the
    caller to record (by reference, without parsing a long prompt whole). `prompt_cache`: where the engine found
    the prompt's KV (prompt_sources)."""
    trainable, reason = choice.trainability()
    computed, engine_cache, tier = prompt_sources(prompt_cache)
    completion_id = deterministic_id("completion", ctx.session_id, ctx.request_id, choice.index)
    return {
        "event_id": completion_id,
        "event_time": done_ms,
        "completion_id": completion_id,
        "session_id": ctx.session_id,
        "group_id": ctx.group_id,
        "task_id": ctx.task_id,
        "turn": turn,
        "choice_index": choice.index,
        "request_id": ctx.request_id,
        "model": model,
        "engine_id": engine_id,
        "policy_version": policy_version,
        "prompt_token_ids": choice.prompt.ids() if prompt_ids and choice.prompt is not None else [],
        "completion_token_ids": choice.token_ids or [],
        "completion_logprobs": choice.logprobs or [],
        "messages_json": prompt_json(ctx, choice),
        "tools_json": ctx.tools_json,
        "output_text": choice.text,
        "tool_calls_json": dumps(choice.tool_calls) if choice.tool_calls else None,
        "tool_call_error": choice.tool_call_error(ctx.tools_json is not None),
        "finish_reason": choice.finish_reason or "unknown",
        "trainable": trainable,
        "untrainable_reason": reason,
        "received_ms": ctx.received_ms,
        "first_token_ms": first_token_ms,
        "done_ms": done_ms,
        "agent": ctx.agent,
        "temperature": ctx.temperature,
        "top_p": ctx.top_p,
        "logprobs_mode": ctx.logprobs_mode,
        "prompt_ref": None,
        "prompt_ref_tokens": 0,
        "prompt_ref_messages": 0,
        "request_digest": ctx.request_digest,
        "prompt_tokens_computed": computed,
        "prompt_tokens_engine_cache": engine_cache,
        "prompt_tokens_tier": tier,
    }
