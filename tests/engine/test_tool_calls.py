import json

from forge_stream.engine.shared.tool_calls import parse_tool_calls


def test_single_call_with_content_before():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "paris"})]


def test_several_calls_and_string_arguments():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": "{\\"q\\": 1}"}</tool_call>')
    parsed = parse_tool_calls(text)
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("a", "{}"), ("b", '{"q": 1}')]


def test_invalid_json_keeps_everything_as_content():
    text = "x <tool_call>{not json}</tool_call>"
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == ()
    assert parsed.content == text


def test_unclosed_last_block_with_complete_json_is_a_call():
    parsed = parse_tool_calls('<tool_call>\n{"name": "search", "arguments": {"query": "kafka"}}\n')
    assert [c.name for c in parsed.tool_calls] == ["search"]


def test_block_without_name_is_not_a_call():
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>').tool_calls == ()


def test_a_failed_block_makes_the_whole_text_content_with_the_reason():
    """As vLLM's hermes parser: all blocks or none, so the gateway sees the failed call in the text."""
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"q": 1}</tool_call>')
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == () and parsed.content == text
    assert parsed.error.startswith("invalid JSON in <tool_call> block: Expecting ',' delimiter")
    assert parsed.error.endswith("(block 2 of 2)")


def test_reasons():
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x"').error.startswith(
        "unterminated <tool_call> block: ")
    assert parse_tool_calls('<tool_call>["f"]</tool_call>').error == \
        '<tool_call> block is not a JSON object with a string "name"'
    assert parse_tool_calls("plain text").error is None
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>').error is None
