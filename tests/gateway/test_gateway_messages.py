"""The Anthropic Messages API on the gateway, driven by the real `anthropic` SDK (unmodified) against a real gateway
in front of the scripted engine: whole and streamed messages, stop sequences and the token limit, a tool_use /
tool_result round trip with its inferred span, x-api-key auth, and errors in Anthropic's shape; what is recorded
on the real broker is exactly what the engine returned, as for chat completions."""

import anthropic
import httpx
import orjson
import pytest

from forge_stream.bench.scripted import EOS, encode, logprob, render
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import read_completions
from forge_stream.topics import TOPICS

from gateway_support import ADMIN, open_session
from helpers import read_events, since_this_test

TOOL = {"name": "get_weather", "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL["input_schema"],
                                                "description": "Weather of a city"}}]
REPLY = "Hello there, agent."


def _client(session, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key=api_key, max_retries=0)


def _completions(bootstrap, session_id):
    return sorted(read_completions(bootstrap, since_this_test(),
                                   keep=lambda r: r["session_id"] == session_id),  # prompts whole
                  key=lambda r: (r["turn"], r["choice_index"]))


def _assert_engine_tokens(record, messages, tools, completion_ids):
    """The record holds the scripted engine's own ids and logprobs for this prompt and reply."""
    assert record["trainable"], record["untrainable_reason"]
    assert orjson.loads(record["messages_json"]) == messages
    assert record["prompt_token_ids"] == encode(render(messages, tools))
    assert record["completion_token_ids"] == completion_ids
    assert record["completion_logprobs"] == pytest.approx([logprob(t) for t in completion_ids])


def test_whole_message_is_recorded_with_the_engines_tokens(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    message = client.messages.create(model="scripted", max_tokens=100, system="Be brief.",
                                     extra_body={"temperature": 0.5},  # this SDK has no sampling arguments
                                     messages=[{"role": "user", "content": "What is new?"}])
    assert message.id.startswith("msg_") and (message.type, message.role) == ("message", "assistant")
    [block] = message.content
    assert (block.type, block.text) == ("text", REPLY)
    assert (message.stop_reason, message.stop_sequence, message.model) == ("end_turn", None, "scripted")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is new?"}]
    assert message.usage.input_tokens == len(encode(render(messages, None)))
    assert message.usage.output_tokens == len(encode(REPLY)) + 1

    cut = client.messages.create(model="scripted", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert (cut.stop_reason, cut.content[0].text) == ("max_tokens", REPLY[:5])
    stopped = client.messages.create(model="scripted", max_tokens=100, stop_sequences=["zzz", "there"],
                                     messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "there")
    assert stopped.content[0].text == "Hello "

    records = _completions(kafka_bootstrap, session["session_id"])
    assert [r["turn"] for r in records] == [0, 1, 2]
    _assert_engine_tokens(records[0], messages, None, encode(REPLY) + [EOS])
    assert records[0]["temperature"] == 0.5
    assert records[1]["finish_reason"] == "length" and records[1]["completion_token_ids"] == encode(REPLY[:5])
    _assert_engine_tokens(records[2], [{"role": "user", "content": "hi"}], None, encode("Hello "))


def test_streamed_message_events_parse_and_add_up(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    with client.messages.stream(model="scripted", max_tokens=100,
                                messages=[{"role": "user", "content": "Stream please."}]) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == REPLY and final.id.startswith("msg_")
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", len(encode(REPLY)) + 1)
    messages = [{"role": "user", "content": "Stream please."}]
    assert final.usage.input_tokens == len(encode(render(messages, None)))
    # the SDK adds its own `text` event after each text delta
    raw = [e for e in events if e != "text"]
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}

    [record] = _completions(kafka_bootstrap, session["session_id"])
    _assert_engine_tokens(record, messages, None, encode(REPLY) + [EOS])
    assert record["first_token_ms"] is not None


def test_tool_use_round_trip_infers_the_span(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    with client.messages.stream(model="scripted", max_tokens=200, tools=[TOOL], tool_choice={"type": "auto"},
                                messages=asked) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        first = stream.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    [use] = first.content
    assert (use.type, use.name, use.input, first.stop_reason) == ("tool_use", "get_weather", {"city": "paris"},
                                                                  "tool_use")

    turn = asked + [{"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": [{"type": "text", "text": '{"error": "not found"}'}]}]}]
    second = client.messages.create(model="scripted", max_tokens=200, tools=[TOOL], messages=turn)
    assert (second.content[0].text, second.stop_reason) == (REPLY, "end_turn")

    sid = session["session_id"]
    records = _completions(kafka_bootstrap, sid)
    assert [r["turn"] for r in records] == [0, 1]
    tool_calls = orjson.loads(records[0]["tool_calls_json"])
    assert tool_calls[0]["id"] == use.id and records[0]["finish_reason"] == "tool_calls"
    assert orjson.loads(records[0]["tools_json"]) == CHAT_TOOLS
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city":"paris"}'}}]},
            {"role": "tool", "tool_call_id": use.id, "content": '{"error": "not found"}'}]
    _assert_engine_tokens(records[1], chat, CHAT_TOOLS, encode(REPLY) + [EOS])

    [span] = read_events(kafka_bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    assert (span["tool_call_id"], span["name"], span["source"]) == (use.id, "get_weather", "inferred")
    assert (span["status"], span["error"]) == ("error", "not found")
    assert orjson.loads(span["arguments_json"]) == {"city": "paris"}
    assert span["completion_id"] == records[0]["completion_id"]
    assert span["end_ms"] == records[1]["received_ms"]


def test_bad_requests_are_errors_in_anthropics_shape(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    with pytest.raises(anthropic.BadRequestError) as image:
        client.messages.create(model="scripted", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}])
    assert image.value.status_code == 400
    assert image.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "messages.0.content.0: content block type 'image' is not supported by the gateway here "
                   "(text only)."}}
    with pytest.raises(anthropic.BadRequestError) as tokens:  # the chat path's own limits, in Anthropic's shape
        client.messages.create(model="scripted", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert "max_tokens" in tokens.value.body["error"]["message"]
    missing = httpx.post(f"{session['base_url']}/messages", json={"messages": [{"role": "user", "content": "hi"}]})
    assert missing.status_code == 400
    assert missing.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "max_tokens: Field required"}}
    with pytest.raises(anthropic.NotFoundError) as unknown:
        _client({"base_url": f"{gateway_url}/s/no-such-session/v1"}).messages.create(
            model="scripted", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.body["error"]["type"] == "not_found_error"
    assert _completions(kafka_bootstrap, session["session_id"]) == []


def test_x_api_key_is_a_session_token(make_gateway, scripted_url, run_id):
    with make_gateway(engines=(scripted_url,), admin_token=ADMIN) as gateway:
        session = open_session(gateway, run_id, token=ADMIN)
        hi = {"model": "scripted", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
        assert _client(session, session["token"]).messages.create(**hi).content[0].text == REPLY[:10]
        with pytest.raises(anthropic.AuthenticationError) as wrong:
            _client(session, "not-a-token").messages.create(**hi)
        assert wrong.value.body["error"]["type"] == "authentication_error"
        other = open_session(gateway, run_id, token=ADMIN)
        with pytest.raises(anthropic.PermissionDeniedError):  # a session's key reaches only its own session
            _client(other, session["token"]).messages.create(**hi)
        unscoped = anthropic.Anthropic(base_url=gateway, api_key=session["token"], max_retries=0)
        assert unscoped.messages.create(**hi).content[0].text == REPLY[:10]  # session from its token


def test_engine_down_is_an_overloaded_error_with_retry_after(make_gateway, run_id):
    with make_gateway(engines=(f"http://127.0.0.1:{free_port()}",)) as gateway:
        session = open_session(gateway, run_id)
        with pytest.raises(anthropic.InternalServerError) as down:
            _client(session).messages.create(model="scripted", max_tokens=10, stream=True,
                                             messages=[{"role": "user", "content": "hi"}])
    assert down.value.status_code == 503 and down.value.response.headers["retry-after"] == "2"
    assert down.value.body["type"] == "error" and down.value.body["error"]["type"] == "overloaded_error"
