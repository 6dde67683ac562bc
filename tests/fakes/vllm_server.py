"""A fake `vllm serve`: a real HTTP server that answers /v1/chat/completions the way vLLM's OpenAI server does.

It is an LLM that returns scripted text: reply k (cycling through `--reply` values) is tokenized with the model
directory's tokenizer, followed by the EOS token, and cut at max_tokens. Every byte on the wire follows vLLM's
chat serving (vllm/entrypoints/openai/chat_completion/{protocol,serving}.py):

- non-streaming: the full `ChatCompletionResponse` dump, every field present (null where unset), `tool_calls`
  dropped from the message when empty; `prompt_token_ids` (request `return_token_ids: true`) on the response,
  `token_ids` on each choice (the EOS id included), `stop_reason` next to `finish_reason`;
- streaming (dumped with exclude_unset): for each choice a first chunk with delta {"role": "assistant",
  "content": ""}, `"logprobs": null`, `"finish_reason": null` and the response's `prompt_token_ids` (null when
  not requested); then one chunk per token with `delta.content`, `logprobs` ({"content": [one entry]} or null)
  and `token_ids` ([that token] or null), the last one with `finish_reason` and `stop_reason`; with
  stream_options.include_usage a final chunk with `"choices": []` and usage; then `data: [DONE]`;
- logprobs entries: {"token", "logprob", "bytes", "top_logprobs"}; the fake's logprob of token t is
  `-(0.05 + 0.01 * (t % 97))`, so callers can check they stored the right number for the right token.
- tools (as `--enable-auto-tool-choice --tool-call-parser hermes`): non-streaming replies parse
  `<tool_call>` blocks into `tool_calls` with finish_reason "tool_calls".

`GET /fake/requests` returns the request bodies received, for assertions.

Run: python tests/fakes/vllm_server.py --model DIR --port P [--reply TEXT ...] [--served-model-name NAME]
"""

import argparse
import itertools
import json
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoTokenizer

from forge_stream.engine.tool_calls import parse_tool_calls


def fake_logprob(token_id: int) -> float:
    return -(0.05 + 0.01 * (token_id % 97))


def create_app(model_dir: str, replies: list[str], served_name: str | None = None,
               max_model_len: int = 2048) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    name = served_name or model_dir
    script = itertools.cycle(replies)
    received: list[dict] = []
    app = FastAPI()

    def logprob_entry(token_id: int) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": fake_logprob(token_id), "bytes": list(text.encode("utf-8", "replace")),
                "top_logprobs": []}

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/fake/requests")
    async def requests():
        return JSONResponse(received)

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": model_dir,
            "parent": None, "max_model_len": max_model_len, "permission": []}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        received.append(body)
        tools = body.get("tools")
        prompt = tokenizer.apply_chat_template(body["messages"], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        n = body.get("n") or 1
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or max_model_len - len(prompt_ids)
        outputs = []
        for _ in range(n):
            ids = tokenizer.encode(next(script), add_special_tokens=False) + [tokenizer.eos_token_id]
            finish = "stop" if len(ids) <= max_tokens else "length"
            outputs.append((ids[:max_tokens], finish))
        want_ids, want_lp = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        usage = {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + sum(len(o) for o, _ in outputs),
                 "completion_tokens": sum(len(o) for o, _ in outputs), "prompt_tokens_details": None}
        if body.get("stream"):
            return StreamingResponse(_stream(rid, created, outputs, prompt_ids, want_ids, want_lp, body, usage),
                                     media_type="text/event-stream")
        choices = []
        for i, (ids, finish) in enumerate(outputs):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                       "function_call": None, "reasoning": None}
            parsed = parse_tool_calls(text) if tools and body.get("tool_choice") != "none" else None
            if parsed and parsed.tool_calls:
                message["content"] = parsed.content
                message["tool_calls"] = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in parsed.tool_calls]
                finish = "tool_calls"
            choices.append({
                "index": i, "message": message,
                "logprobs": {"content": [logprob_entry(t) for t in ids]} if want_lp else None,
                "finish_reason": finish, "stop_reason": None, "token_ids": ids if want_ids else None,
                "routed_experts": None})
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
            "service_tier": None, "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if want_ids else None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})

    def _stream(rid, created, outputs, prompt_ids, want_ids, want_lp, body, usage):
        def chunk(choices: list, **extra) -> str:
            data = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": choices, **extra}
            return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

        for i in range(len(outputs)):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
            yield chunk([first], prompt_token_ids=prompt_ids if want_ids else None)
        for i, (ids, finish) in enumerate(outputs):
            released = ""
            for k, token_id in enumerate(ids):
                text = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
                last = k == len(ids) - 1
                delta = text[len(released):] if (last or not text.endswith("\ufffd")) else ""
                released += delta
                choice = {"index": i, "delta": {"content": delta},
                          "logprobs": {"content": [logprob_entry(token_id)]} if want_lp else None,
                          "finish_reason": finish if last else None}
                if last:
                    choice["stop_reason"] = None
                choice["token_ids"] = [token_id] if want_ids else None
                yield chunk([choice])
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            yield chunk([], usage={k: v for k, v in usage.items() if v is not None})
        yield "data: [DONE]\n\n"

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--reply", action="append", default=None, help="scripted reply text (repeatable)")
    args = parser.parse_args()
    app = create_app(args.model, args.reply or ["Hello from the fake vLLM server."], args.served_model_name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
