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


def test_a_tool_call_that_returned_the_answer_earns_its_turn_the_subgoal_reward():
    """`tool_result_answers` (opt-in, e.g. `processors run --rule ...tool_result_answers=0.5`): the turn whose tool
    returned the task's answer gets the weight as a process reward; a wrong result, a failed call, or a run without
    the rule gets nothing, and a rollout that got there scores higher than one that did not."""
    import json

    from forge_stream.processors import ProcessorSettings, fold
    from forge_stream.processors.settings import DEFAULT_RULES, parse_rule
    from forge_stream.processors.synthetic import group_events

    events = group_events("g", group_size=4, turns=2)
    results = {"g-s0": "42", "g-s1": "41", "g-s2": "it is 42.", "g-s3": "42"}
    for schema, record in events:
        if schema == "Task":
            record["prompt_json"] = json.dumps({"question": "What is 6 * 7?"})
            record["reference_json"] = json.dumps({"answer": "42"})
        if schema == "ToolSpan":
            record["result"] = results[record["session_id"]]

    def process(settings):
        state, outputs = None, []
        for schema, record in events:
            state, out = fold(state, schema, record, settings)
            outputs += out
        return {(e.record["session_id"], e.record["turn"]): e.record["value"] for e in outputs
                if e.schema == "Reward" and e.record["name"] == "tool_result_answers"}

    rule = parse_rule("forge_stream.processors.rules.tool_result_answers=0.5")
    got = process(ProcessorSettings(group_timeout_ms=60_000, rules=DEFAULT_RULES + (rule,)))
    spans = {r["session_id"]: r["status"] for s, r in events if s == "ToolSpan"}
    want = {(sid, 0): 0.5 if spans[sid] == "ok" and sid != "g-s1" else 0.0 for sid in results}
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in want.items() if v}
    assert any(v == 0.5 for v in got.values()) and got.get(("g-s1", 0), 0.0) == 0.0
    assert process(ProcessorSettings(group_timeout_ms=60_000)) == {}


def test_partial_credit_gives_a_group_of_failed_answers_a_signal_ordered_by_how_much_each_got_right():
    """`answer_prefix` (bench learning --partial-credit W): four replies to "order 3, 8, 1 and 6", none of them right,
    so the grader's outcome is 0 for all and the group has no signal; with the rule the Trajectory advantages rank
    the replies by how much of "8 6 3 1" each got right from the start, and the outcome stays the grader's."""
    import json

    from forge_stream.processors import ProcessorSettings, fold
    from forge_stream.processors.settings import DEFAULT_RULES, parse_rule
    from forge_stream.processors.synthetic import group_events

    replies = {"g-s0": "8 6 1 3", "g-s1": "3 8 1 6", "g-s2": "8 1 6 3", "g-s3": "8 6 3 2"}
    events = group_events("g", group_size=4, turns=1)
    for schema, record in events:
        if schema == "Task":
            record["reference_json"] = json.dumps({"answer": "8 6 3 1"})
        if schema == "Completion":
            record["output_text"] = replies[record["session_id"]]
        if schema == "Reward" and record["kind"] == "outcome":
            record["value"] = 0.0

    def trajectories(settings):
        state, outputs = None, []
        for schema, record in events:
            state, out = fold(state, schema, record, settings)
            outputs += out
        return {e.record["session_id"]: e.record for e in outputs if e.schema == "Trajectory"}

    plain = trajectories(ProcessorSettings(group_timeout_ms=60_000))
    assert {sid: t["turns"][-1]["advantage"] for sid, t in plain.items()} == dict.fromkeys(replies, 0.0)
    rule = parse_rule("forge_stream.processors.rules.answer_prefix=0.5")
    shaped = trajectories(ProcessorSettings(group_timeout_ms=60_000, rules=DEFAULT_RULES + (rule,)))
    advantage = {sid: t["turns"][-1]["advantage"] for sid, t in shaped.items()}
    assert advantage["g-s3"] > advantage["g-s0"] > advantage["g-s2"] > advantage["g-s1"]
    assert all(t["outcome_reward"] == 0.0 for t in shaped.values())
