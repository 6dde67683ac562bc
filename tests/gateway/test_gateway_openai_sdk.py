"""The official `openai` SDK, unmodified, drives the gateway in front of the local engine (tiny model); the Completion
events read back from the real broker hold exactly the engine's tokens. (In front of real vLLM: tests/vllm/.)"""


import jsonschema
import openai
import orjson
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from forge_stream.engine.shared.process import EngineProcess
from forge_stream.engine.shared.tool_calls import parse_tool_calls
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.kafka.history import read_completions

from early import EARLY
from gateway_support import open_session
from helpers import since_this_test

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _engine(get):
    log = get("tmp_path_factory").mktemp("gw_engine") / "engine.log"
    return EngineProcess(str(get("tiny_model_dir")), log_path=log).start


EARLY.declare("sdk_engine", lambda item: "engine_gateway" in item.fixturenames, _engine, stop=EngineProcess.stop)


@pytest.fixture(scope="module")
def engine_gateway(request, kafka_bootstrap):
    """A gateway in front of the torch engine (started in the background from the session's start: tests/early.py)."""
    from helpers import serving
    from forge_stream.gateway.app import create_app

    engine = EARLY.take("sdk_engine", request.getfixturevalue)
    try:
        with serving(create_app(GatewaySettings(engines=(engine.url,), bootstrap=kafka_bootstrap))) as gateway:
            yield gateway
    finally:
        engine.stop()


def _client(session) -> OpenAI:
    return OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)


def _records(bootstrap, session_id):
    return sorted(read_completions(bootstrap, since_this_test(),
                                   keep=lambda r: r["session_id"] == session_id),  # prompts whole
                  key=lambda r: (r["turn"], r["choice_index"]))


def _template(tokenizer, messages, tools=None):
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def test_a_call_naming_any_model_or_none_is_answered_by_the_served_policy(engine_gateway, tiny_model_dir, run_id):
    """`model` routes nothing: the session's policy answers. OpenAI's API refuses a call without it; the gateway
    answers it (docs/guides/agents.md says so), and every answer names the served model, never a host path."""
    import httpx

    url = open_session(engine_gateway, run_id)["base_url"]
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for body in (hi, {**hi, "model": "gpt-4o"}):
        answer = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == tiny_model_dir.name
    answer = httpx.post(f"{url}/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert answer.status_code == 200 and answer.json()["model"] == tiny_model_dir.name, answer.text


def test_sdk_chat_stream_and_n_through_the_local_engine(kafka_bootstrap, engine_gateway, tokenizer, tiny_model_dir,
                                                        run_id):
    session = open_session(engine_gateway, run_id)
    client = _client(session)
    [card] = client.models.list().data
    model = card.id
    assert model == tiny_model_dir.name and str(tiny_model_dir) not in card.model_dump_json()  # no host path
    messages = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0.0)
    both = client.chat.completions.create(model=model, messages=messages, max_tokens=8, n=2, seed=1)
    streamed_text = ""
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=10, stream=True):
        streamed_text += "".join(c.delta.content or "" for c in chunk.choices)
    with_tools = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=6)
    assert {plain.model, both.model, with_tools.model} == {model}  # the served name, never the engine's directory

    records = _records(kafka_bootstrap, session["session_id"])
    assert [(r["turn"], r["choice_index"]) for r in records] == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0)]
    expected_prompt = tokenizer.encode(_template(tokenizer, messages), add_special_tokens=False)
    texts = [plain.choices[0].message.content, both.choices[0].message.content, both.choices[1].message.content,
             streamed_text]
    for record, text in zip(records, texts):
        assert record["trainable"], record["untrainable_reason"]
        assert record["prompt_token_ids"] == expected_prompt
        assert tokenizer.decode(record["completion_token_ids"], skip_special_tokens=True) == text
        assert len(record["completion_logprobs"]) == len(record["completion_token_ids"])
        assert all(lp <= 0 for lp in record["completion_logprobs"])
        assert record["policy_version"] == 0 and record["model"] == model
    assert records[3]["first_token_ms"] is not None
    tool_record = records[4]
    assert orjson.loads(tool_record["tools_json"]) == TOOLS
    assert tool_record["prompt_token_ids"] == tokenizer.encode(_template(tokenizer, messages, TOOLS),
                                                               add_special_tokens=False)
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_rewritten_history_is_recorded_with_the_exact_prompt_of_each_turn(kafka_bootstrap, engine_gateway,
                                                                          tokenizer, run_id):
    session = open_session(engine_gateway, run_id)
    client = _client(session)
    model = client.models.list().data[0].id
    sent = []
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "First question?"}]
    for turn in range(3):
        if turn == 2:  # the agent drops its old turns and inserts a summary
            history = [{"role": "system", "content": "You are terse."},
                       {"role": "user", "content": "Summary of earlier turns: two questions were answered."},
                       {"role": "user", "content": "Last question?"}]
        sent.append(list(history))
        reply = client.chat.completions.create(model=model, messages=history, max_tokens=6)
        history = history + [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": f"Follow-up {turn}?"}]
    records = _records(kafka_bootstrap, session["session_id"])
    assert [r["turn"] for r in records] == [0, 1, 2]
    for record, messages in zip(records, sent):
        assert orjson.loads(record["messages_json"]) == messages
        assert record["prompt_token_ids"] == tokenizer.encode(_template(tokenizer, messages),
                                                              add_special_tokens=False)
    assert records[1]["prompt_token_ids"][:len(records[0]["prompt_token_ids"])] == records[0]["prompt_token_ids"]
    assert records[2]["prompt_token_ids"][:len(records[0]["prompt_token_ids"])] != records[0]["prompt_token_ids"]


def test_a_full_context_is_answered_as_openai_and_vllm_do(kafka_bootstrap, engine_gateway, run_id):
    """Prompt plus max_tokens past the tiny model's 2048 positions: 400 context_length_exceeded, vLLM's words."""
    session = open_session(engine_gateway, run_id)
    client = _client(session)
    model = client.models.list().data[0].id
    long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4000)
    error = too_many.value
    assert error.status_code == 400 and error.code == "context_length_exceeded"
    assert error.body["message"].startswith(
        "This model's maximum context length is 2048 tokens. However, you requested ")
    assert "in the completion" in error.message and error.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.chat.completions.create(model=model, messages=long, stream=True)
    assert long_prompt.value.code == "context_length_exceeded" and "in the messages" in long_prompt.value.message
    with pytest.raises(openai.BadRequestError) as response:
        client.responses.create(model=model, input=long[0]["content"])
    assert response.value.code == "context_length_exceeded"
    assert client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices
    assert [r["turn"] for r in _records(kafka_bootstrap, session["session_id"])] == [0]


CITY = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}, "days": {"type": "integer"}},
        "required": ["city", "days"]}
FORECAST = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "rain": {"type": "boolean"}},
            "required": ["unit", "rain"]}


def test_sdk_tool_choice_and_response_format_are_enforced_through_the_gateway(kafka_bootstrap, engine_gateway,
                                                                               tokenizer, run_id):
    session = open_session(engine_gateway, run_id)
    client = _client(session)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    forced = client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=80, seed=4,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    shaped = client.chat.completions.create(model=model, messages=messages, max_tokens=80, seed=4, response_format={
        "type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}})
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert refused.value.status_code == 400 and refused.value.param == "tool_choice"

    call = forced.choices[0].message.tool_calls[0]
    assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(orjson.loads(call.function.arguments), CITY)
    jsonschema.validate(orjson.loads(shaped.choices[0].message.content), FORECAST)
    records = _records(kafka_bootstrap, session["session_id"])
    assert len(records) == 2 and all(r["trainable"] for r in records)  # the refused request recorded nothing
    called = parse_tool_calls(tokenizer.decode(records[0]["completion_token_ids"], skip_special_tokens=True))
    assert [(c.name, c.arguments) for c in called.tool_calls] == [(call.function.name, call.function.arguments)]
    assert tokenizer.decode(records[1]["completion_token_ids"], skip_special_tokens=True) == \
        shaped.choices[0].message.content
