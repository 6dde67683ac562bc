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

Control routes of `vllm serve` with VLLM_SERVER_DEV_MODE=1 (vllm 0.32: vllm/entrypoints/serve/dev/{rlhf,rpc,sleep,
cache}/api_router.py), same paths, query/body fields and success bodies: `POST /pause?mode=abort|wait|keep`
-> {"status": "paused"}, `POST /resume` -> {"status": "resumed"}, `GET /is_paused`, `GET /is_sleeping` ->
{"is_sleeping": b}, `POST /sleep?level=N`, `POST /wake_up`, `POST /collective_rpc` {"method", "args", "kwargs"}
(400 without a method; `update_config` with {"model_config": {"model": DIR}} then `reload_weights` loads DIR),
`POST /update_weight_version` {"new_version"} -> {"success": true, "new_version": v}, `GET /weight_info` ->
{"weight_version": v}, `POST /reset_prefix_cache[?reset_external=true]`. Reloading while asleep crashes real
vLLM (vllm #57853); the fake answers 500. `--fail-first N` answers the first N control requests with 500.
`GET /fake/state` (fake-only) reports the loaded model directory, weight version, paused/sleeping flags, prefix
cache resets and every control call as [method, path, query, body].

Run: python tests/fakes/vllm_server.py --model DIR --port P [--reply TEXT ...] [--served-model-name NAME]
     [--fail-first N]
"""

import argparse
import itertools
import json
import time
import uuid

import uvicorn
from typing import Annotated, Literal

from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoTokenizer

from forge_stream.engine.tool_calls import parse_tool_calls


def fake_logprob(token_id: int) -> float:
    return -(0.05 + 0.01 * (token_id % 97))


def create_app(model_dir: str, replies: list[str], served_name: str | None = None,
               max_model_len: int = 2048, fail_first: int = 0) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    name = served_name or model_dir
    script = itertools.cycle(replies)
    received: list[dict] = []
    app = FastAPI()
    state = {"model": model_dir, "pending_model": model_dir, "weight_version": None, "paused": False,
             "sleeping": False, "prefix_cache_resets": 0, "calls": [], "fail_left": fail_first}

    @app.middleware("http")
    async def record_control_calls(request: Request, call_next):
        if request.url.path.startswith(("/v1/", "/fake/", "/health")):
            return await call_next(request)
        raw = await request.body()
        state["calls"].append([request.method, request.url.path, dict(request.query_params),
                               json.loads(raw) if raw else None])
        if state["fail_left"] > 0:
            state["fail_left"] -= 1
            return JSONResponse({"error": "injected failure"}, status_code=500)
        return await call_next(request)

    @app.get("/fake/state")
    async def fake_state():
        return JSONResponse({k: v for k, v in state.items() if k not in ("pending_model", "fail_left")})

    @app.post("/pause")
    async def pause(mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
                    clear_cache: Annotated[bool, Query()] = True):
        state["paused"] = True
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume():
        state["paused"] = False
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused():
        return JSONResponse({"is_paused": state["paused"]})

    @app.post("/sleep")
    async def sleep(level: int = 1):
        state["sleeping"] = True
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up():
        state["sleeping"] = False
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": state["sleeping"]})

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        body = await request.json()
        method = body.get("method")
        if method is None:
            return JSONResponse({"detail": "Missing 'method' in request body"}, status_code=400)
        if state["sleeping"]:
            return JSONResponse({"error": "EngineDeadError: engine core died (collective_rpc while asleep)"},
                                status_code=500)
        if method == "update_config":
            state["pending_model"] = body["args"][0]["model_config"]["model"]
        elif method == "reload_weights":
            state["model"] = state["pending_model"]
        else:
            return JSONResponse({"error": f"worker has no method {method!r}"}, status_code=500)
        return JSONResponse({"results": [None]})

    @app.post("/update_weight_version")
    async def update_weight_version(new_version: Annotated[str, Body(embed=True)]):
        state["weight_version"] = new_version
        return JSONResponse({"success": True, "new_version": new_version})

    @app.get("/weight_info")
    async def weight_info():
        return JSONResponse({"weight_version": state["weight_version"]})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        state["prefix_cache_resets"] += 1
        return Response(status_code=200)

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
    parser.add_argument("--fail-first", type=int, default=0, help="answer the first N control requests with 500")
    args = parser.parse_args()
    app = create_app(args.model, args.reply or ["Hello from the fake vLLM server."], args.served_model_name,
                     fail_first=args.fail_first)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
