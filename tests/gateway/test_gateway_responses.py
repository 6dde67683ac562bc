"""The OpenAI Responses API on the gateway, driven by the real `openai` SDK (unmodified) against a real gateway in
front of the scripted engine: streamed and whole responses, a function tool round trip, previous_response_id
chains; what is recorded on the real broker is exactly what the engine returned, as for chat completions."""

import openai
import orjson
import pytest
from openai import OpenAI

from forge_stream.bench.scripted import EOS, decode, encode, logprob, render
from forge_stream.kafka.history import read_completions
from forge_stream.topics import TOPICS

from gateway_support import open_session
from helpers import read_events, since_this_test

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
REPLY = "Hello there, agent."


def _client(session) -> OpenAI:
    return OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)


def _completions(bootstrap, session_id):
    return sorted(read_completions(bootstrap, since_this_test(),
                                   keep=lambda r: r["session_id"] == session_id),  # prompts whole
                  key=lambda r: (r["turn"], r["choice_index"]))


def _assert_engine_tokens(record, messages, tools, text):
    """The record holds the scripted engine's own ids and logprobs for this prompt and reply."""
    assert record["trainable"], record["untrainable_reason"]
    assert orjson.loads(record["messages_json"]) == messages
    assert record["prompt_token_ids"] == encode(render(messages, tools))
    assert record["completion_token_ids"] == encode(text) + [EOS]
    assert record["completion_logprobs"] == pytest.approx([logprob(t) for t in record["completion_token_ids"]])


def test_whole_response_is_recorded_with_the_engines_tokens(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    response = client.responses.create(model="scripted", instructions="Be brief.", input="What is new?",
                                       temperature=0.5, max_output_tokens=100)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.output_text == REPLY
    [message] = response.output
    assert (message.type, message.role, message.status, message.content[0].type) == (
        "message", "assistant", "completed", "output_text")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is new?"}]
    assert response.usage.input_tokens == len(encode(render(messages, None)))
    assert response.usage.output_tokens == len(encode(REPLY)) + 1
    assert (response.instructions, response.temperature, response.max_output_tokens) == ("Be brief.", 0.5, 100)

    [record] = _completions(kafka_bootstrap, session["session_id"])
    _assert_engine_tokens(record, messages, None, REPLY)
    assert record["temperature"] == 0.5 and record["turn"] == 0


def test_streamed_text_events_parse_and_add_up(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    events = list(client.responses.create(model="scripted", input="Stream please.", stream=True))
    types = [e.type for e in events]
    deltas = len(encode(REPLY)) + 1  # one per token, EOS included (it decodes to "")
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[4:-4] == ["response.output_text.delta"] * len(types[4:-4]) and len(types[4:-4]) <= deltas
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    final = events[-1].response
    assert final.output_text == REPLY and final.status == "completed" and final.usage.output_tokens == deltas
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert all(e.logprobs == [] for e in events if e.type == "response.output_text.delta")

    # the SDK's own stream helper rebuilds the same response from the events
    with client.responses.stream(model="scripted", input="Again.") as stream:
        rebuilt = stream.get_final_response()
    assert rebuilt.output_text == REPLY

    records = _completions(kafka_bootstrap, session["session_id"])
    assert [r["turn"] for r in records] == [0, 1]
    _assert_engine_tokens(records[0], [{"role": "user", "content": "Stream please."}], None, REPLY)
    assert records[0]["first_token_ms"] is not None


def test_function_tool_round_trip_with_previous_response_id(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    events = list(client.responses.create(model="scripted", input="Weather in Paris?", tools=[TOOL],
                                          stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    first = events[-1].response
    [call] = first.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert orjson.loads(call.arguments) == {"city": "paris"}
    assert events[4].arguments == call.arguments and events[2].item.call_id == call.call_id

    second = client.responses.create(model="scripted", previous_response_id=first.id, tools=[TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"error": "city not found"}'}])
    assert second.output_text == REPLY and second.previous_response_id == first.id
    third = client.responses.create(model="scripted", previous_response_id=second.id, input="Thanks.")
    assert third.output_text == REPLY

    sid = session["session_id"]
    records = _completions(kafka_bootstrap, sid)
    assert [r["turn"] for r in records] == [0, 1, 2]
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    tool_calls = orjson.loads(records[0]["tool_calls_json"])
    assert tool_calls[0]["id"] == call.call_id and records[0]["finish_reason"] == "tool_calls"
    assert orjson.loads(records[0]["tools_json"]) == CHAT_TOOLS
    chained = asked + [{"role": "assistant", "content": None, "tool_calls": tool_calls},
                       {"role": "tool", "tool_call_id": call.call_id, "content": '{"error": "city not found"}'}]
    _assert_engine_tokens(records[1], chained, CHAT_TOOLS, REPLY)
    _assert_engine_tokens(records[2], chained + [{"role": "assistant", "content": REPLY},
                                                 {"role": "user", "content": "Thanks."}], None, REPLY)

    [span] = read_events(kafka_bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    assert (span["tool_call_id"], span["name"], span["source"]) == (call.call_id, "get_weather", "inferred")
    assert (span["status"], span["error"]) == ("error", "city not found")
    assert span["completion_id"] == records[0]["completion_id"]
    assert span["end_ms"] == records[1]["received_ms"]


def test_full_input_items_without_a_chain_infer_the_span(kafka_bootstrap, gateway_url, run_id):
    """An agent that resends its whole history as items (the Agents SDK's default) gets the same chat prompt."""
    session = open_session(gateway_url, run_id)
    client = _client(session)
    history = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    first = client.responses.create(model="scripted", input=history, tools=[TOOL], store=False)
    [call] = first.output
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees"})
    second = client.responses.create(model="scripted", input=history, tools=[TOOL], store=False)
    assert second.output_text == REPLY

    sid = session["session_id"]
    records = _completions(kafka_bootstrap, sid)
    assert orjson.loads(records[1]["messages_json"]) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": orjson.loads(records[0]["tool_calls_json"])},
        {"role": "tool", "tool_call_id": call.call_id, "content": "22 degrees"}]
    [span] = read_events(kafka_bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    assert (span["tool_call_id"], span["status"]) == (call.call_id, "ok")

    with pytest.raises(openai.BadRequestError) as unstored:  # store=False: nothing to continue from
        client.responses.create(model="scripted", previous_response_id=first.id, input="More?")
    assert unstored.value.status_code == 400 and unstored.value.code == "previous_response_not_found"
    assert first.id in unstored.value.message


def test_unknown_previous_response_and_unsupported_input_are_refused(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    other = open_session(gateway_url, run_id)
    theirs = _client(other).responses.create(model="scripted", input="hi")
    with pytest.raises(openai.BadRequestError) as unknown:  # another session's response is not in this one
        client.responses.create(model="scripted", previous_response_id=theirs.id, input="hi")
    assert unknown.value.code == "previous_response_not_found"
    assert unknown.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.UnprocessableEntityError) as tool:
        client.responses.create(model="scripted", input="hi", tools=[{"type": "web_search"}])
    assert "web_search" in tool.value.message and tool.value.body["param"] == "tools.0"
    with pytest.raises(openai.UnprocessableEntityError) as item:
        client.responses.create(model="scripted", input=[{"type": "input_image_call", "id": "x"}])
    assert "input_image_call" in item.value.message
    assert _completions(kafka_bootstrap, session["session_id"]) == []


def test_token_limit_answers_an_incomplete_response(gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    cut = client.responses.create(model="scripted", input="hi", max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == REPLY[:5]
    events = list(client.responses.create(model="scripted", input="hi", max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == REPLY[:5]


def test_logprobs_reach_a_response_only_when_included(gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    client = _client(session)
    plain = client.responses.create(model="scripted", input="hi")
    assert not plain.output[0].content[0].logprobs
    asked = client.responses.create(model="scripted", input="hi", include=["message.output_text.logprobs"])
    values = [lp.logprob for lp in asked.output[0].content[0].logprobs]
    assert values == pytest.approx([logprob(t) for t in encode(REPLY) + [EOS]])
    assert decode(encode(REPLY)) == "".join(lp.token for lp in asked.output[0].content[0].logprobs)
