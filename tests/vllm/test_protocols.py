"""Every protocol of the gateway against real vLLM: the Completion events hold exactly the tokens vLLM consumed and
produced, with log-probs the trainer's own forward pass reproduces at the weights of the recorded policy version."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer

from forge_stream.kafka.history import read_completions

from vllm_support import open_session, trainer_logprobs

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_HISTORY = ASK + [
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "paris"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def _sse(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def _post(url: str, path: str, body: dict, stream: bool = False) -> list[dict] | dict:
    if stream:
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as response:
            assert response.status_code == 200, response.read()
            return _sse(response)
    response = httpx.post(url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _template_ids(tokenizer, messages, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_every_protocol_records_vllms_exact_tokens(vllm_engine, vllm_gateway, tiny_model_dir, run_id):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    session = open_session(vllm_gateway, run_id)
    base = session["base_url"].removesuffix("/v1")
    sampling = {"model": "whatever-the-agent-says", "temperature": 1.0, "max_tokens": 12}
    answers = [
        _post(base, "/v1/chat/completions", {**sampling, "messages": ASK, "logprobs": True, "return_token_ids": True}),
        _post(base, "/v1/chat/completions", {**sampling, "messages": ASK, "n": 2}, stream=True),
        _post(base, "/v1/chat/completions", {**sampling, "messages": TOOL_HISTORY, "tools": TOOLS,
                                             "return_token_ids": True}),
        _post(base, "/v1/chat/completions", {**sampling, "messages": TOOL_HISTORY, "tools": TOOLS}, stream=True),
        _post(base, "/v1/completions", {**sampling, "prompt": "The weather in Paris is", "n": 2}),
        _post(base, "/v1/completions", {**sampling, "prompt": "The weather in Paris is"}, stream=True),
        _post(base, "/v1/responses", {**sampling, "max_output_tokens": 12, "input": "What is the weather?"}),
        _post(base, "/v1/responses", {**sampling, "max_output_tokens": 12, "input": "What is the weather?",
                                      "tools": [{"type": "function", **TOOLS[0]["function"]}]}, stream=True),
        _post(base, "/v1/messages", {**sampling, "messages": ASK}),
        _post(base, "/v1/messages", {**sampling, "system": "Be brief.", "messages": ASK}, stream=True),
    ]
    first = answers[0]
    assert first["model"] == "whatever-the-agent-says" or first["model"]  # vLLM answered, whatever the name
    records = sorted(read_completions(vllm_engine.bootstrap, keep=lambda r: r["session_id"] == session["session_id"]),
                     key=lambda r: (r["turn"], r["choice_index"]))
    assert [(r["turn"], r["choice_index"]) for r in records] == [
        (0, 0), (1, 0), (1, 1), (2, 0), (3, 0), (4, 0), (4, 1), (5, 0), (6, 0), (7, 0), (8, 0), (9, 0)]
    health = vllm_engine.health()  # the package's engine may serve a version another test pushed
    version, served = health["policy_version"], health["checkpoint"]
    for r in records:
        assert r["trainable"], (r["turn"], r["untrainable_reason"])
        assert r["policy_version"] == version
        assert r["prompt_token_ids"] and r["completion_token_ids"]
        assert len(r["completion_logprobs"]) == len(r["completion_token_ids"])
        assert r["logprobs_mode"] == "processed" and r["temperature"] == 1.0
    # what vLLM said it consumed and produced is what was recorded
    choice = first["choices"][0]
    assert records[0]["prompt_token_ids"] == first["prompt_token_ids"]
    assert records[0]["completion_token_ids"] == choice["token_ids"]
    assert records[0]["completion_logprobs"] == pytest.approx([c["logprob"] for c in choice["logprobs"]["content"]])
    # the chat template vLLM rendered is the model's own; with tools and a tool result, what vLLM rendered
    assert records[0]["prompt_token_ids"] == _template_ids(tokenizer, ASK)
    assert records[3]["prompt_token_ids"] == answers[2]["prompt_token_ids"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in tokenizer.decode(records[3]["prompt_token_ids"])
    assert records[3]["completion_token_ids"] == answers[2]["choices"][0]["token_ids"]
    # the trainer's own forward pass at the served weights gives the recorded (processed, T=1) log-probs
    expected = trainer_logprobs(served, records)
    mismatch = max((torch.tensor(r["completion_logprobs"]) - lp).abs().max().item() for r, lp in zip(records, expected))
    print(f"recorded vLLM log-probs vs the trainer's, {len(records)} completions: max |diff| {mismatch:.2e} nats")
    assert mismatch < 2e-3


def test_a_bad_request_gets_vllms_openai_error(vllm_engine, vllm_gateway, run_id):
    session = open_session(vllm_gateway, run_id)
    response = httpx.post(session["base_url"] + "/chat/completions", timeout=60, json={
        "model": "x", "messages": ASK, "max_tokens": 100_000})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    direct = httpx.post(vllm_engine.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert direct.status_code == 400 and "not JSON" in direct.json()["error"]["message"]


def test_a_sampling_parameter_no_completion_records_is_refused_naming_it(vllm_engine, vllm_gateway, run_id):
    """vLLM applies top_k, min_p, the penalties, logit_bias and min_tokens; a Completion records temperature and top_p
    only, which the trainer scores at. So the gateway refuses the others (at a value that reshapes the distribution)
    before vLLM samples anything, and nothing is recorded; at their neutral values they pass."""
    session = open_session(vllm_gateway, run_id)
    url = session["base_url"] + "/chat/completions"
    base = {"model": "x", "messages": ASK, "max_tokens": 4, "temperature": 0.7}
    for name, value in (("top_k", 20), ("min_p", 0.1), ("repetition_penalty", 1.3), ("frequency_penalty", 0.5),
                        ("presence_penalty", -0.5), ("logit_bias", {"11": 5}), ("min_tokens", 3)):
        refused = httpx.post(url, json={**base, name: value}, timeout=60)
        assert refused.status_code == 400, (name, refused.text)
        error = refused.json()["error"]
        assert error["param"] == name and error["type"] == "invalid_request_error" and name in error["message"]
    answered = httpx.post(url, json={**base, "top_k": -1, "presence_penalty": 0, "logit_bias": {}}, timeout=60)
    assert answered.status_code == 200, answered.text
    records = read_completions(vllm_engine.bootstrap, keep=lambda r: r["session_id"] == session["session_id"])
    assert len(records) == 1 and records[0]["temperature"] == 0.7


def test_seeded_requests_whose_prompts_a_step_splits_are_answered_and_repeatable(vllm_engine):
    """vLLM on a CPU shares a step's 2048 prompt tokens among every prompt being read, so under load a prompt is read
    in parts; for a seeded request vLLM then rewinds its generator with an offset that a CPU generator lacks, and
    its engine died ("CPU Generator does not use offset"). Eight seeded prompts of 1,100 tokens at once cannot share
    one step: all eight are answered, the engine still serves, and a seed alone gives the same tokens twice."""
    def complete(ids: list[int], seed: int) -> list[int]:
        response = httpx.post(vllm_engine.url + "/v1/completions", timeout=300, json={
            "model": "x", "prompt": ids, "max_tokens": 4, "temperature": 1.0, "seed": seed, "return_token_ids": True})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    prompts = [[random.Random(k).randrange(10, 900) for _ in range(1100)] for k in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(complete, prompts, range(8)))
    assert all(len(tokens) == 4 for tokens in answers)
    assert httpx.get(vllm_engine.url + "/health", timeout=10).status_code == 200
    alone = [random.Random(5).randrange(10, 900) for _ in range(300)]
    assert complete(alone, 11) == complete(alone, 11)


FORECAST = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "rain": {"type": "boolean"}},
            "required": ["unit", "rain"]}


def _closed(create, **kwargs) -> tuple[object, int]:
    """The first of a few seeded answers that the model closed, and how many it took. The grammar lets whitespace run
    on, and at temperature 1 the random tiny model sometimes writes it until max_tokens (an unseeded call did, once in CI)."""
    for tries in range(1, 7):
        answer = create(seed=tries, **kwargs)
        if answer.choices[0].finish_reason != "length":
            return answer, tries
    raise AssertionError(f"{tries} seeds ran out of tokens; the last answer: {answer}")


def test_the_openai_sdk_gets_forced_tool_calls_and_json_from_vllm(vllm_engine, vllm_gateway, run_id):
    """tool_choice and response_format reach vLLM as sent: its grammar backend makes even the random tiny model
    call the named tool and answer the JSON schema, and the tool call is recorded as vLLM parsed it."""
    session = open_session(vllm_gateway, run_id)
    client = OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    create = client.chat.completions.create
    called, calls = _closed(create, model="any", messages=ASK, tools=TOOLS, max_tokens=512, temperature=1.0,
                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    json.loads(call.function.arguments)  # JSON (vLLM 0.32 on the CPU does not hold it to the parameters' schema)
    shaped, shapes = _closed(create, model="any", messages=ASK, max_tokens=1024, temperature=1.0,
                             response_format={"type": "json_schema", "json_schema": {
                                 "name": "forecast", "schema": FORECAST}})
    assert shaped.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(shaped.choices[0].message.content), FORECAST)
    records = sorted(read_completions(vllm_engine.bootstrap, keep=lambda r: r["session_id"] == session["session_id"]),
                     key=lambda r: r["turn"])
    assert len(records) == calls + shapes and all(r["trainable"] for r in records)  # every try is recorded
    assert json.loads(records[calls - 1]["tool_calls_json"])[0]["function"]["name"] == "get_weather"
    assert records[-1]["output_text"] == shaped.choices[0].message.content
