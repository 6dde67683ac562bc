"""A recorded call answered again: the OpenAI answer (whole, or as a stream) rebuilt from the Completion events
Kafka holds for it, for a retry that carries the same `Idempotency-Key` as a call that was recorded.

It carries what the agent acts on (each choice's message or text, tool calls, finish reason) and the model and
policy version that answered; not the log-probs or token ids a caller may have asked for (the events hold the
ids, not the tokens' texts).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

from forge_stream.gateway.recording import Kind


def _usage(records: list[dict]) -> dict:
    prompt = len(records[0]["prompt_token_ids"]) + records[0]["prompt_ref_tokens"]
    completion = sum(len(r["completion_token_ids"]) for r in records)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _message(record: dict) -> dict:
    calls = orjson.loads(record["tool_calls_json"]) if record["tool_calls_json"] else None
    message = {"role": "assistant", "content": record["output_text"] or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def answer(kind: Kind, request_id: str, records: list[dict]) -> dict:
    """The whole answer of a chat or completions call whose Completions (one per choice, in choice order) are
    `records`.

    >>> record = {"choice_index": 0, "output_text": "4", "tool_calls_json": None, "finish_reason": "stop",
    ...           "done_ms": 1700000000000, "model": "m", "policy_version": 3, "prompt_token_ids": [1, 2],
    ...           "prompt_ref_tokens": 0, "completion_token_ids": [5]}
    >>> reply = answer("chat", "r1", [record])
    >>> reply["choices"][0]["message"], reply["usage"]["total_tokens"], reply["policy_version"]
    ({'role': 'assistant', 'content': '4'}, 3, 3)
    """
    first = records[0]
    if kind == "chat":
        choices = [{"index": r["choice_index"], "message": _message(r), "finish_reason": r["finish_reason"],
                    "logprobs": None} for r in records]
        head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion"}
    else:
        choices = [{"index": r["choice_index"], "text": r["output_text"], "finish_reason": r["finish_reason"],
                    "logprobs": None} for r in records]
        head = {"id": f"cmpl-{request_id}", "object": "text_completion"}
    return {**head, "created": first["done_ms"] // 1000, "model": first["model"], "choices": choices,
            "usage": _usage(records), "policy_version": first["policy_version"]}


async def stream(kind: Kind, request_id: str, records: list[dict]) -> AsyncIterator[bytes]:
    """The same answer as server-sent events: one chunk per choice holding all of it, then [DONE]."""
    whole = answer(kind, request_id, records)
    for choice in whole["choices"]:
        if kind == "chat":
            delta = dict(choice["message"])
            if delta.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
            part = {"index": choice["index"], "delta": delta, "finish_reason": choice["finish_reason"],
                    "logprobs": None}
            chunk_object = "chat.completion.chunk"
        else:
            part, chunk_object = choice, "text_completion"
        chunk = {"id": whole["id"], "object": chunk_object, "created": whole["created"], "model": whole["model"],
                 "choices": [part], "policy_version": whole["policy_version"]}
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"


def recorded_answer(kind: Kind, request_id: str, records: list[dict], streamed: bool) -> bytes | AsyncIterator[bytes]:
    """What `GatewayService.complete` returns for a call answered as recorded."""
    return stream(kind, request_id, records) if streamed else orjson.dumps(answer(kind, request_id, records))
