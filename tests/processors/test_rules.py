"""Process-reward rules: their doctests, loading by dotted path, and explicit spans replacing inferred ones."""

import doctest

import pytest

from forge_stream.processors import rewards, rules
from forge_stream.processors.rules import TurnContext, load_rule


@pytest.mark.parametrize("module", [rules, rewards])
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_rules_load_by_dotted_path():
    assert load_rule("forge_stream.processors.rules.tool_error") is rules.tool_error
    with pytest.raises(ImportError):
        load_rule("not_a_path")


def test_language_mixing_cyrillic_and_latin():
    assert rules.language_mixing(TurnContext({"output_text": "ответ is the answer"}, ())) == -1.0
    assert rules.language_mixing(TurnContext({"output_text": "только русский текст"}, ())) == 0.0


def test_invalid_tool_call_non_object_arguments():
    call = '[{"function": {"name": "search", "arguments": "[1, 2]"}}]'
    assert rules.invalid_tool_call(TurnContext({"tool_calls_json": call, "tools_json": None}, ())) == -1.0


def test_explicit_span_replaces_inferred():
    def span(sid, source, status):
        return {"span_id": sid, "completion_id": "c", "tool_call_id": "call-1", "source": source,
                "status": status, "start_ms": 0}
    state = {"spans": {"a": span("a", "inferred", "error"), "b": span("b", "explicit", "ok")}}
    assert [s["span_id"] for s in rewards.turn_spans(state, "c")] == ["b"]
