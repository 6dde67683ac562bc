"""The engine as a real server process, over HTTP: OpenAI shapes plus vLLM's token-id and logprob fields."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"}]


def _chat(url, **body):
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _sse(url, path, body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def test_chat_returns_prompt_ids_token_ids_and_exact_logprobs(engine_url, tokenizer, hf_model, reference_logprobs):
    body = _chat(engine_url, max_tokens=12, temperature=1.0, seed=5, n=3, logprobs=True, top_logprobs=3,
                 return_token_ids=True, ignore_eos=True)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert body["prompt_token_ids"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert body["policy_version"] == 0
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 36
    for choice in body["choices"]:
        ids = choice["token_ids"]
        assert len(ids) == 12 and choice["finish_reason"] == "length"
        assert tokenizer.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [tokenizer.decode([i]) for i in ids]
        assert all(len(c["top_logprobs"]) == 3 for c in content)
        expected = reference_logprobs(hf_model, body["prompt_token_ids"], ids)
        assert [c["logprob"] for c in content] == pytest.approx(expected, abs=1e-4)


def test_seed_reproduces_and_choices_differ(engine_url):
    a = _chat(engine_url, max_tokens=10, seed=11, n=2, return_token_ids=True, ignore_eos=True)
    b = _chat(engine_url, max_tokens=10, seed=11, n=2, return_token_ids=True, ignore_eos=True)
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert a["choices"][0]["token_ids"] != a["choices"][1]["token_ids"]


def test_stop_string_cuts_text_but_keeps_tokens(engine_url):
    full = _chat(engine_url, max_tokens=20, temperature=0, return_token_ids=True, ignore_eos=True)
    text = full["choices"][0]["message"]["content"]
    stop = text[6:9]
    cut = _chat(engine_url, max_tokens=20, temperature=0, stop=[stop], return_token_ids=True, ignore_eos=True)
    choice = cut["choices"][0]
    assert choice["message"]["content"] == text[: text.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["token_ids"] == full["choices"][0]["token_ids"][: len(choice["token_ids"])]


def test_stream_chunks_carry_the_same_ids_and_logprobs(engine_url):
    request = dict(messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, return_token_ids=True,
                   ignore_eos=True, n=2, stream_options={"include_usage": True})
    whole = _chat(engine_url, **{k: v for k, v in request.items() if k not in ("messages", "stream_options")})
    chunks = _sse(engine_url, "/v1/chat/completions", request)
    firsts = [c for c in chunks if "prompt_token_ids" in c]
    assert [f["prompt_token_ids"] for f in firsts] == [whole["prompt_token_ids"]] * 2
    assert all(f["choices"][0]["delta"] == {"role": "assistant", "content": ""} for f in firsts)
    assert all(c["policy_version"] == 0 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]
                and "token_ids" in c["choices"][0]]
        assert sum((m["token_ids"] for m in mine), []) == choice["token_ids"]
        assert "".join(m["delta"].get("content", "") for m in mine) == choice["message"]["content"]
        streamed = [lp["logprob"] for m in mine for lp in m["logprobs"]["content"]]
        assert streamed == pytest.approx([lp["logprob"] for lp in choice["logprobs"]["content"]], abs=1e-5)
        assert mine[-1]["finish_reason"] == "length" and all(m["finish_reason"] is None for m in mine[:-1])


def test_concurrent_requests_are_batched_and_match_sequential_greedy(engine_url):
    prompts = [[{"role": "user", "content": f"question number {i}"}] for i in range(4)]

    async def one(client, messages):
        r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 16,
                                                             "temperature": 0, "return_token_ids": True,
                                                             "ignore_eos": True})
        return r.json()["choices"][0]["token_ids"]

    async def run():
        async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
            sequential = [await one(client, m) for m in prompts]
            before = (await client.get("/health")).json()["stats"]["max_batch"]
            together = await asyncio.gather(*(one(client, m) for m in prompts))
            after = (await client.get("/health")).json()["stats"]
            return sequential, together, before, after

    sequential, together, _, stats = asyncio.run(run())
    assert sequential == together
    assert stats["max_batch"] > 1
    assert stats["decode_rows"] > stats["decode_steps"]


def test_completions_take_token_ids_and_return_them(engine_url, tokenizer):
    ids = tokenizer.encode("The engine reads")
    r = httpx.post(f"{engine_url}/v1/completions", json={
        "prompt": [ids, tokenizer.encode("def add(a, b):")], "max_tokens": 5, "n": 2, "logprobs": 2, "return_token_ids": True,
        "ignore_eos": True, "seed": 1}, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][0]["prompt_token_ids"] == ids
    assert r["choices"][2]["prompt_token_ids"] == tokenizer.encode("def add(a, b):")
    for c in r["choices"]:
        assert tokenizer.decode(c["token_ids"]) == c["text"]
        assert len(c["logprobs"]["token_logprobs"]) == 5 and len(c["logprobs"]["top_logprobs"][0]) >= 2
    chunks = _sse(engine_url, "/v1/completions", {"prompt": ids, "max_tokens": 4, "return_token_ids": True,
                                                  "ignore_eos": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 4


def test_openai_client_and_models(engine_url, tiny_model_dir):
    client = openai.OpenAI(base_url=f"{engine_url}/v1", api_key="none")
    [model] = client.models.list().data
    assert model.id == tiny_model_dir.name and str(tiny_model_dir) not in model.model_dump_json()  # no host path
    out = client.chat.completions.create(model=model.id, messages=MESSAGES, max_tokens=4, logprobs=True,
                                         extra_body={"return_token_ids": True})
    assert len(out.choices[0].logprobs.content) == len(out.choices[0].token_ids) <= 4
    stream = client.chat.completions.create(model=model.id, messages=MESSAGES, max_tokens=3, stream=True)
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].finish_reason) == 1


def test_bad_requests_get_openai_errors(engine_url):
    bad = httpx.post(f"{engine_url}/v1/chat/completions", json={"messages": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    long = httpx.post(f"{engine_url}/v1/completions", json={"prompt": "hi", "max_tokens": 10**6})
    assert long.status_code == 400 and long.json()["error"]["param"] == "max_tokens"
    # outside its checkpoint store ($FORGE_HOME/checkpoints by default): refused (tests/security tries paths)
    refused = httpx.post(f"{engine_url}/v1/admin/load_weights", json={"path": "/nonexistent", "version": 3})
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "PermissionDeniedError"


def test_hostile_requests_are_400_before_they_run(engine_url):
    """Sampling edge values, deep nesting and oversized prompt counts are refused with OpenAI errors (no 5xx), and
    the connection keeps serving."""
    deep = b'{"type": "object", "properties": {"x": ' * 1000 + b"{}" + b"}}" * 1000
    tools = b'[{"type": "function", "function": {"name": "f", "parameters": ' + deep + b"}}]"
    with httpx.Client(base_url=engine_url, timeout=60) as client:
        cases = [
            ({"prompt": "hi", "max_tokens": 2, "temperature": 1e-320}, "temperature"),
            ({"prompt": "hi", "max_tokens": 2, "top_p": 0}, "top_p"),
            ({"prompt": ["hi"] * 2000, "max_tokens": 1}, "prompt"),
            ({"prompt": "hi", "max_tokens": 1, "n": 1000}, "n"),
        ]
        for body, param in cases:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        nested = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}], '
                                                             b'"tools": ' + tools + b"}",
                             headers={"content-type": "application/json"})
        assert nested.status_code == 400, nested.text
        tiny_p = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_p": 1e-320, "seed": 1})
        assert tiny_p.status_code == 200, tiny_p.text
        assert client.get("/health").status_code == 200


@pytest.mark.slow
def test_a_large_body_does_not_block_health(engine_url):
    """A 7.9 MB prompt is parsed and tokenized off the event loop (then refused: longer than the context)."""
    body = {"prompt": "word " * 1_580_000, "max_tokens": 1}
    result = {}

    def post():
        result["big"] = httpx.post(f"{engine_url}/v1/completions", json=body, timeout=120)

    sender = threading.Thread(target=post)
    sender.start()
    time.sleep(0.3)
    slowest = 0.0
    while sender.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{engine_url}/health", timeout=30).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.05)
    sender.join()
    assert result["big"].status_code == 400 and result["big"].json()["error"]["param"] == "max_tokens"
    assert slowest < 2.0  # parsed on the event loop, the prompt would hold /health 7 s to over a minute
