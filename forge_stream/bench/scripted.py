"""A scripted engine: a real HTTP server that answers at once in vLLM's OpenAI format, for benchmarks and tests.

It is an LLM that returns scripted text over a byte-level tokenizer (token id = UTF-8 byte, EOS = 256), so the
ids it reports decode back to exactly the text it sent. The prompt is rendered as `<|role|>content\\n` per
message (tools as JSON first) followed by `<|assistant|>`. Replies cycle through `replies`, except that a request
with tools whose last message is not a tool result gets `tool_call` (if set; several cycle like the replies), a
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` text answered as a tool call (finish_reason
"tool_calls"). The logprob of token t is `-(0.05 + 0.01 * (t % 97))`. Fields follow vLLM: `prompt_token_ids` on
chat responses (first stream chunk of each choice), `prompt_token_ids` per completions choice, `token_ids` per
choice or per chunk, OpenAI logprobs, `stop_reason` (the `stop` string that cut a reply); a last chunk with `usage`
and no choices when `stream_options.include_usage` is set; plus `policy_version`. With `token_ids=False` it
behaves as an engine that cannot return ids. With `delay_s` each completion takes that long (a stand-in for
decoding time, for load tests). `served` counts the completions it was asked for.

It is a raw ASGI app (no framework) so that its own cost stays far below the gateway's in the benchmark.
Run: python -m forge_stream.bench.scripted --port P [--reply TEXT ...] [--no-token-ids] [--delay-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass

import orjson

from forge_stream.openai_error import error_body

EOS = 256
MODEL = "scripted"


def logprob(token_id: int) -> float:
    return -(0.05 + 0.01 * (token_id % 97))


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", "replace")


def render(messages: list[dict], tools: list | None) -> str:
    parts = [f"<|tools|>{orjson.dumps(tools).decode()}\n"] if tools else []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        calls = orjson.dumps(m["tool_calls"]).decode() if m.get("tool_calls") else ""
        parts.append(f"<|{m.get('role')}|>{content or ''}{calls}\n")
    return "".join(parts) + "<|assistant|>"


def tool_calls(text: str) -> list[dict] | None:
    if not (text.startswith("<tool_call>") and text.endswith("</tool_call>")):
        return None
    call = orjson.loads(text[len("<tool_call>"):-len("</tool_call>")])
    return [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
             "function": {"name": call["name"], "arguments": orjson.dumps(call.get("arguments", {})).decode()}}]


@dataclass
class ScriptedEngine:
    replies: tuple[str, ...] = ("Hello from the scripted engine.",)
    token_ids: bool = True
    policy_version: int = 0
    tool_call: str | tuple[str, ...] | None = None
    delay_s: float = 0.0

    def __post_init__(self):
        self.served = 0  # chat and completions requests answered
        self._script = itertools.cycle(self.replies)
        calls = (self.tool_call,) if isinstance(self.tool_call, str) else self.tool_call or ()
        self._calls = itertools.cycle(calls) if calls else None

    def _outputs(self, body: dict, n: int) -> list[tuple[str, list[int], str, str | None]]:
        """(text, token ids, finish_reason, stop_reason) per choice; a reply is cut before the first stop string
        it contains (which ends it, as in vLLM, without EOS and without the stop string)."""
        out = []
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 1 << 30
        messages = body.get("messages") or [{}]
        call = next(self._calls) if self._calls and body.get("tools") and messages[-1].get("role") != "tool" else None
        stops = body.get("stop") or ()
        stops = [stops] if isinstance(stops, str) else stops
        for _ in range(n):
            text = call or next(self._script)
            matched = min((s for s in stops if s and s in text), key=text.index, default=None)
            if matched is not None:
                text = text[:text.index(matched)]
            ids = (encode(text) + ([] if matched else [EOS]))[:limit]
            finish = "stop" if len(ids) == len(encode(text)) + (not matched) else "length"
            out.append((decode(ids), ids, finish, matched if finish == "stop" else None))
        return out

    def chat(self, body: dict) -> bytes | list[bytes]:
        prompt = encode(render(body["messages"], body.get("tools")))
        outputs = self._outputs(body, body.get("n") or 1)
        ids_on = self.token_ids and body.get("return_token_ids")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": MODEL}
        if body.get("stream"):
            return self._chat_stream(head, prompt, outputs, ids_on, body)
        choices = []
        for i, (text, ids, finish, matched) in enumerate(outputs):
            message = {"role": "assistant", "content": text}
            calls = tool_calls(text) if body.get("tools") else None
            if calls:
                message, finish = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            choices.append({"index": i, "message": message, "finish_reason": finish, "stop_reason": matched,
                            "logprobs": {"content": [{"token": decode([t]), "logprob": logprob(t), "bytes": None,
                                                      "top_logprobs": []} for t in ids]}
                            if body.get("logprobs") else None,
                            "token_ids": ids if ids_on else None})
        return orjson.dumps({**head, "choices": choices, "prompt_token_ids": prompt if ids_on else None,
                             "policy_version": self.policy_version,
                             "usage": _usage(len(prompt), sum(len(o[1]) for o in outputs))})

    def _chat_stream(self, head, prompt, outputs, ids_on, body) -> list[bytes]:
        head = {**head, "object": "chat.completion.chunk", "policy_version": self.policy_version}

        def chunk(choices, **extra):
            return b"data: " + orjson.dumps({**head, "choices": choices, **extra}) + b"\n\n"

        events = []
        for i, (text, ids, finish, matched) in enumerate(outputs):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
            events.append(chunk([first], prompt_token_ids=prompt if ids_on else None))
            calls = tool_calls(text) if body.get("tools") else None
            for k, t in enumerate(ids):
                last = k == len(ids) - 1
                delta = {} if calls else {"content": decode([t])}
                if calls and last:
                    delta = {"tool_calls": [{"index": 0, "id": calls[0]["id"], "type": "function",
                                             "function": calls[0]["function"]}]}
                events.append(chunk([{
                    "index": i, "delta": delta,
                    "logprobs": {"content": [{"token": decode([t]), "logprob": logprob(t), "bytes": None,
                                              "top_logprobs": []}]} if body.get("logprobs") else None,
                    "finish_reason": ("tool_calls" if calls else finish) if last else None,
                    "stop_reason": matched if last else None,
                    "token_ids": [t] if ids_on else None}]))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(chunk([], usage=_usage(len(prompt), sum(len(o[1]) for o in outputs))))
        events.append(b"data: [DONE]\n\n")
        return events

    def completion(self, body: dict) -> bytes:
        prompts = body["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = body.get("n") or 1
        ids_on = self.token_ids and body.get("return_token_ids")
        choices, total = [], 0
        for p, prompt in enumerate(prompts):
            prompt_ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
            for j, (text, ids, finish, matched) in enumerate(self._outputs(body, n)):
                total += len(prompt_ids) + len(ids)
                choices.append({
                    "index": p * n + j, "text": text, "finish_reason": finish, "stop_reason": matched,
                    "logprobs": {"tokens": [decode([t]) for t in ids], "token_logprobs": [logprob(t) for t in ids],
                                 "top_logprobs": [None] * len(ids), "text_offset": list(range(len(ids)))}
                    if body.get("logprobs") is not None else None,
                    "prompt_token_ids": prompt_ids if ids_on else None, "token_ids": ids if ids_on else None})
        return orjson.dumps({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                             "created": int(time.time()), "model": MODEL, "choices": choices,
                             "policy_version": self.policy_version,
                             "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": total}})

    def models(self) -> bytes:
        return orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                         "owned_by": "forge-stream", "root": MODEL,
                                                         "policy_version": self.policy_version}]})

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        more = scope["method"] == "POST"
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["path"]
        if self.delay_s and path in ("/v1/chat/completions", "/v1/completions"):
            await asyncio.sleep(self.delay_s)
        if path in ("/v1/chat/completions", "/v1/completions"):
            self.served += 1
        if path == "/v1/chat/completions":
            result = self.chat(orjson.loads(body))
        elif path == "/v1/completions":
            result = self.completion(orjson.loads(body))
        elif path == "/v1/models":
            result = self.models()
        elif path == "/health":
            result = b"{}"
        else:
            return await reply_json(send, 404, error_body("not found", "not_found_error"))
        if isinstance(result, list):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for event in result:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        await reply_json(send, 200, result)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def reply_json(send, status: int, body: bytes) -> None:
    """Answer an ASGI request with a JSON `body` (its content-length set)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description="A scripted engine answering instantly in vLLM's format.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--reply", action="append", default=None)
    parser.add_argument("--tool-call", default=None)
    parser.add_argument("--no-token-ids", action="store_true")
    parser.add_argument("--policy-version", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="time each completion takes")
    args = parser.parse_args()
    import uvicorn

    engine = ScriptedEngine(tuple(args.reply or ScriptedEngine.replies), not args.no_token_ids, args.policy_version,
                            args.tool_call, args.delay_ms / 1000)
    uvicorn.run(engine, host=args.host, port=args.port, log_level="warning", access_log=False,
                loop="auto", http="auto", lifespan="on", timeout_keep_alive=30)  # the gateway's (bench's callers idle)


if __name__ == "__main__":
    main()
