"""Real `vllm serve` on the tiny model directory: token ids and logprobs come back as the gateway expects.

Run on a GPU machine with vLLM installed (about 2-5 minutes, most of it vLLM start-up):
    PYTHONPATH=$PWD python -m pytest tests/gpu/test_vllm_tiny.py -q -s
FORGE_VLLM_DTYPE (default float32) sets `--dtype`; logprob tolerance is 2e-2 in float32, 0.15 in 16-bit.
The same fields are what tests/fakes/vllm_server.py imitates; a mismatch here means the fake must change.
"""

import json
import os
import sys

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.kafka.broker import free_port
from helpers import http_process

DTYPE = os.environ.get("FORGE_VLLM_DTYPE", "float32")
TOLERANCE = 2e-2 if DTYPE == "float32" else 0.15
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def vllm_url(tiny_model_dir, tmp_path_factory):
    port = free_port()
    with open(tmp_path_factory.mktemp("vllm_log") / "vllm.log", "wb") as log, http_process(
            [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(tiny_model_dir), "--port", str(port),
             "--dtype", DTYPE, "--max-model-len", "1024", "--gpu-memory-utilization", "0.2", "--enforce-eager",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], port, timeout=600, log=log) as url:
        yield url


def _reference(tiny_model_dir, prompt_ids, completion_ids):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(completion_ids)]


def test_chat_returns_token_ids_and_raw_logprobs(vllm_url, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    body = httpx.post(f"{vllm_url}/v1/chat/completions", timeout=120, json={
        "model": str(tiny_model_dir), "messages": MESSAGES, "max_tokens": 16, "temperature": 0.7, "seed": 3,
        "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "ignore_eos": True}).json()
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert body["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    choice = body["choices"][0]
    ids = choice["token_ids"]
    assert len(ids) == 16 and choice["finish_reason"] == "length"
    assert tok.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert len(content) == 16 and all({"token", "logprob", "bytes", "top_logprobs"} <= set(c) for c in content)
    # vLLM's default logprobs mode is raw: temperature 0.7 must not change them.
    expected = _reference(tiny_model_dir, body["prompt_token_ids"], ids)
    assert [c["logprob"] for c in content] == pytest.approx(expected, abs=TOLERANCE)


def test_stream_chunks_carry_prompt_ids_first_and_token_ids_per_chunk(vllm_url, tiny_model_dir):
    request = {"model": str(tiny_model_dir), "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
               "logprobs": True, "return_token_ids": True, "ignore_eos": True}
    whole = httpx.post(f"{vllm_url}/v1/chat/completions", json=request, timeout=120).json()
    with httpx.stream("POST", f"{vllm_url}/v1/chat/completions", timeout=120,
                      json={**request, "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    print("first chunk:", chunks[0], "\nsecond chunk:", chunks[1], "\nlast chunks:", chunks[-2:])
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = [t for c in chunks[1:] for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    assert streamed == whole["choices"][0]["token_ids"]
    logprobs = [e["logprob"] for c in chunks[1:] for ch in c["choices"] if ch.get("logprobs")
                for e in ch["logprobs"]["content"]]
    assert len(logprobs) == 8
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_models_lists_the_directory(vllm_url, tiny_model_dir):
    models = httpx.get(f"{vllm_url}/v1/models").json()
    assert models["data"][0]["id"] == str(tiny_model_dir)
