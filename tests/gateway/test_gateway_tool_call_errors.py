"""A tool call the model wrote in its template's format (Hermes `<tool_call>` blocks) that did not come back parsed
is recorded on its Completion with the reason (`tool_call_error`), never left as plain text: the detection on
its own, then through the gateway on the real broker."""

import httpx
import pytest

from forge_stream.gateway.recording import ChoiceRecord, RequestContext, completion_record
from forge_stream.kafka.history import read_completions

from helpers import since_this_test
from gateway_support import open_session

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
VALID = '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>'
BAD_JSON = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}</tool_call>'
UNTERMINATED = '<tool_call>{"name": "get_weather", "arguments": {"city"'
PARSED = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]
INVALID_REASON = "invalid JSON in <tool_call> block: Expecting ',' delimiter: line 1 column 55 (char 54)"
UNTERMINATED_REASON = "unterminated <tool_call> block: Expecting ':' delimiter: line 1 column 45 (char 44)"


@pytest.mark.parametrize("text, calls, tools, reason", [
    ("", PARSED, True, None),  # the engine parsed the call: the text holds no block
    ("Let me look.", PARSED, True, None),
    (BAD_JSON, None, True, INVALID_REASON),
    (UNTERMINATED, None, True, UNTERMINATED_REASON),
    ('<tool_call>{"arguments": {}}</tool_call>', None, True,
     '<tool_call> block is not a JSON object with a string "name"'),
    (VALID, None, True, "a well-formed <tool_call> block the engine did not parse"),
    (BAD_JSON, PARSED, True, f"{INVALID_REASON}, beside 1 parsed tool call(s)"),
    ("It is sunny in Paris.", None, True, None),  # text without a call
    (BAD_JSON, None, False, None),  # no tools offered: a <tool_call> in the text is only text
])
def test_detection(text, calls, tools, reason):
    choice = ChoiceRecord(0, prompt=[1, 2], token_ids=[3], logprobs=[-0.1], text=text, tool_calls=calls,
                          finish_reason="stop")
    ctx = RequestContext(session_id="s", group_id="g", task_id="t", request_id="r", agent="", received_ms=0,
                         kind="chat", messages_json="[]", tools_json='[{"type": "function"}]' if tools else None)
    record = completion_record(ctx, choice, turn=0, model="m", engine_id="e", policy_version=0,
                               first_token_ms=None, done_ms=1)
    assert record["tool_call_error"] == reason
    assert record["output_text"] == text and record["trainable"]  # still trained on: the model wrote it


def test_gateway_records_why_a_tool_call_did_not_parse(kafka_bootstrap, scripted_gateway, run_id):
    """Asked with tools, the engine answers a call with invalid JSON, an unterminated one (streamed) and a valid
    one; asked without tools it writes a broken block as text, which is no tool call at all."""
    with scripted_gateway(("<tool_call>{oops",), tool_call=(BAD_JSON, UNTERMINATED, VALID)) as gateway:
        session = open_session(gateway, run_id)
        url = f"{session['base_url']}/chat/completions"
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        bodies = [{"tools": TOOLS}, {"tools": TOOLS, "stream": True}, {"tools": TOOLS}, {}]
        for body in bodies:
            response = httpx.post(url, json={"model": "scripted", "messages": messages, **body})
            assert response.status_code == 200, response.text
    records = sorted(read_completions(kafka_bootstrap, since_this_test(),
                                      keep=lambda r: r["session_id"] == session["session_id"]),
                     key=lambda r: r["turn"])
    assert [r["tool_call_error"] for r in records] == [INVALID_REASON, UNTERMINATED_REASON, None, None]
    assert [r["output_text"] for r in records] == [BAD_JSON, UNTERMINATED, "", "<tool_call>{oops"]
    assert [r["tool_calls_json"] is not None for r in records] == [False, False, True, False]
