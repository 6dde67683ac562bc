"""tool_choice and response_format under grammar-constrained decoding, against the engine server process.

The tiny random model never writes JSON or a tool call on its own, so every valid output here is the grammar's
doing. Each test replays the returned token ids through a fresh matcher of the same grammar: every sampled
token was allowed, and the recorded ids are exactly the sampled ones (they decode to the returned text).
"""

import doctest
import json

import httpx
import jsonschema
import pytest
import torch
import xgrammar as xgr

from forge_stream import openai_protocol
from forge_stream.engine.torch_engine import constraints, serving_chat
from forge_stream.engine.torch_engine.constraints import Grammars, chat_format

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
FORECAST = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                             "rain": {"type": "boolean"}},
            "required": ["unit", "days", "rain"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"enum": ["paris", "rome"]},
                                                                          "days": {"type": "integer"}},
                                                           "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time",
                                          "parameters": {"type": "object",
                                                         "properties": {"utc": {"type": "boolean"}},
                                                         "required": ["utc"]}}}


@pytest.fixture(scope="module")
def grammars(tokenizer, hf_model):
    eos = {tokenizer.eos_token_id} | set(hf_model.generation_config.eos_token_id)
    return Grammars(tokenizer, hf_model.config.vocab_size, eos)


def _post(url, body, status=200):
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=120)
    assert response.status_code == status, response.text
    return response.json()


def _replay(grammars, body, token_ids, finish_reason):
    """Every token was allowed by the request's grammar; a choice that stopped ended where the grammar ends."""
    spec = chat_format(body.get("tools"), body.get("tool_choice"), body.get("response_format"),
                       body.get("parallel_tool_calls"), grammars.marker_tokens)
    matcher = xgr.GrammarMatcher(grammars.compile(spec))
    for i, token in enumerate(token_ids):
        assert matcher.accept_token(token), f"token {i} ({token}) is not allowed by the grammar"
    assert matcher.is_terminated() == (finish_reason != "length")


def _check_ids(tokenizer, choice, text):
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == text


def test_json_schema_output_validates_and_logprobs_are_of_the_masked_distribution(
        engine_url, grammars, tokenizer, hf_model):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}},
            "n": 3, "seed": 7, "max_tokens": 80, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    out = _post(engine_url, body)
    for choice in out["choices"]:
        assert choice["finish_reason"] == "stop", choice
        content = choice["message"]["content"]
        jsonschema.validate(json.loads(content), FORECAST)
        assert list(json.loads(content)) == list(FORECAST["properties"])  # in the schema's order
        _check_ids(tokenizer, choice, content)
        _replay(grammars, body, choice["token_ids"], "stop")
    # the reported logprobs are those of the masked distribution sampled from (temperature 1: its log-softmax)
    choice = out["choices"][0]
    ids, prompt = choice["token_ids"], out["prompt_token_ids"]
    matcher = xgr.GrammarMatcher(grammars.compile(chat_format(None, None, body["response_format"], None)))
    bitmask = xgr.allocate_token_bitmask(1, hf_model.config.vocab_size)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:].float()
    for step, token in enumerate(ids):
        row = logits[step:step + 1].clone()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(row, bitmask)
        expected = torch.log_softmax(row[0], dim=-1)
        assert choice["logprobs"]["content"][step]["logprob"] == pytest.approx(expected[token].item(), abs=1e-4)
        matcher.accept_token(token)


@pytest.mark.slow
def test_json_object_output_is_one_json_object(engine_url, grammars, tokenizer):
    # near-uniform sampling over the allowed tokens, so the random model closes its strings and objects
    body = {"response_format": {"type": "json_object"}, "n": 4, "seed": 3, "temperature": 50.0,
            "max_tokens": 400, "return_token_ids": True}
    out = _post(engine_url, body)
    stopped = [c for c in out["choices"] if c["finish_reason"] == "stop"]
    assert len(stopped) >= 2, [c["finish_reason"] for c in out["choices"]]
    for choice in out["choices"]:
        content = choice["message"]["content"]
        assert content.startswith("{")
        _check_ids(tokenizer, choice, content)
        _replay(grammars, body, choice["token_ids"], choice["finish_reason"])
    for choice in stopped:
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def _arguments_match(call):
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


@pytest.mark.slow
def test_tool_choice_required_yields_valid_calls_of_listed_tools(engine_url, grammars, tokenizer):
    body = {"tools": [WEATHER, CLOCK], "tool_choice": "required", "n": 4, "seed": 1, "max_tokens": 400,
            "return_token_ids": True}
    out = _post(engine_url, body)
    for choice in out["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls and choice["message"].get("content") is None
        for call in calls:
            _arguments_match(call)
        _replay(grammars, body, choice["token_ids"], "stop")


def test_named_tool_choice_and_no_parallel_calls_give_one_call(engine_url, grammars):
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice_param, parallel, name in ((named, None, "get_time"), ("required", False, None)):
        body = {"tools": [WEATHER, CLOCK], "tool_choice": choice_param, "parallel_tool_calls": parallel, "n": 3,
                "seed": 2, "max_tokens": 120, "return_token_ids": True}
        out = _post(engine_url, {k: v for k, v in body.items() if v is not None})
        for choice in out["choices"]:
            assert choice["finish_reason"] == "tool_calls", choice
            calls = choice["message"]["tool_calls"]
            assert len(calls) == 1
            assert name is None or calls[0]["function"]["name"] == name
            _arguments_match(calls[0])
            _replay(grammars, body, choice["token_ids"], "stop")


def test_streaming_under_a_constraint_matches_the_whole_response(engine_url):
    for seed in range(5, 25):  # the random model may let the grammar's whitespace run past max_tokens: a seed whose
        body = {"messages": MESSAGES, "tools": [WEATHER, CLOCK], "tool_choice": "required", "seed": seed,
                "max_tokens": 120, "return_token_ids": True}
        whole = _post(engine_url, body)["choices"][0]
        if whole["finish_reason"] == "tool_calls":  # call closes within it (seed 5 once ran out, in a full run)
            break
    chunks = []
    with httpx.stream("POST", f"{engine_url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [t for c in choices for t in c.get("token_ids") or []] == whole["token_ids"]
    assert choices[-1]["finish_reason"] == "tool_calls"
    streamed = [(c["function"]["name"], c["function"]["arguments"]) for c in choices[-1]["delta"]["tool_calls"]]
    assert streamed == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert not "".join(c["delta"].get("content") or "" for c in choices)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}},
     "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_what_cannot_be_enforced_is_a_400_naming_the_parameter(engine_url, body, param):
    error = _post(engine_url, {"max_tokens": 4, **body}, status=400)["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error


def test_completions_refuse_response_format(engine_url):
    response = httpx.post(f"{engine_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                "response_format": {"type": "json_object"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


def test_doctests_hold():
    for module in (constraints, serving_chat, openai_protocol):
        assert doctest.testmod(module).failed == 0


def test_tool_choice_none_never_writes_a_tool_call(engine_url, grammars, tokenizer):
    """With tools and tool_choice "none" the engine writes text only: its grammar refuses the `<tool_call>` marker
    (as the single token and spelled out), which an unconstrained request could sample."""
    body = {"tools": [WEATHER], "tool_choice": "none", "max_tokens": 24, "n": 3, "temperature": 5.0,
            "return_token_ids": True}
    out = _post(engine_url, body)
    marker = tokenizer.convert_tokens_to_ids("<tool_call>")
    for choice in out["choices"]:
        assert choice["message"].get("tool_calls") is None and "<tool_call>" not in choice["message"]["content"]
        assert marker not in choice["token_ids"]
        _replay(grammars, body, choice["token_ids"], choice["finish_reason"])
    spec = chat_format([WEATHER], "none", None, None, grammars.marker_tokens)
    refuses = xgr.GrammarMatcher(grammars.compile(spec))
    assert not refuses.accept_token(marker) and not refuses.accept_string("<tool_call>")
    assert chat_format([WEATHER], "auto", None, None, grammars.marker_tokens) is None  # auto samples anything
