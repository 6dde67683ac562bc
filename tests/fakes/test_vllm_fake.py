"""The fake vLLM server answers in vLLM's shapes (checked field by field) with consistent ids and logprobs."""

import json

import httpx
from transformers import AutoTokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_non_streaming_response_has_vllm_fields(fake_vllm_url, tiny_model_dir, fake_vllm_module):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    body = httpx.post(f"{fake_vllm_url}/v1/chat/completions", json={
        "messages": MESSAGES, "logprobs": True, "return_token_ids": True, "tools": TOOLS, "n": 2}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert {"prompt_token_ids", "prompt_logprobs", "usage", "system_fingerprint", "kv_transfer_params"} <= set(body)
    prompt = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert body["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    plain, tool = body["choices"]
    assert plain["message"]["content"] == "Hello there, agent." and "tool_calls" not in plain["message"]
    assert plain["token_ids"][-1] == tok.eos_token_id
    assert tok.decode(plain["token_ids"], skip_special_tokens=True) == plain["message"]["content"]
    assert [e["logprob"] for e in plain["logprobs"]["content"]] == [fake_vllm_module.fake_logprob(t) for t in plain["token_ids"]]
    assert (plain["finish_reason"], plain["stop_reason"]) == ("stop", None)
    assert tool["finish_reason"] == "tool_calls" and tool["message"]["content"] == "Checking."
    call = tool["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "paris"}
    assert body["usage"]["completion_tokens"] == len(plain["token_ids"]) + len(tool["token_ids"])


def test_stream_chunks_follow_vllm(fake_vllm_url):
    chunks = []
    with httpx.stream("POST", f"{fake_vllm_url}/v1/chat/completions", json={
            "messages": MESSAGES, "stream": True, "logprobs": True, "return_token_ids": True, "max_tokens": 3,
            "stream_options": {"include_usage": True}}) as response:
        chunks = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    data = [json.loads(c) for c in chunks[:-1]]
    first = data[0]
    assert set(first) == {"id", "object", "created", "model", "choices", "prompt_token_ids"}
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    tokens = data[1:-1]
    assert all(set(c) == {"id", "object", "created", "model", "choices"} for c in tokens)
    assert [len(c["choices"][0]["token_ids"]) for c in tokens] == [1, 1, 1]
    assert tokens[-1]["choices"][0]["finish_reason"] == "length" and "stop_reason" in tokens[-1]["choices"][0]
    assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] == 3


def test_models_and_recorded_requests(fake_vllm_url, tiny_model_dir):
    models = httpx.get(f"{fake_vllm_url}/v1/models").json()
    assert models["data"][0]["id"] == str(tiny_model_dir) and models["data"][0]["owned_by"] == "vllm"
    assert all("messages" in r for r in httpx.get(f"{fake_vllm_url}/fake/requests").json())
