"""A tool call the model wrote that did not parse reaches the Trajectory: each turn keeps its Completion's
`tool_call_error`, each rollout counts them in `tool_call_failures` (never a silent zero)."""

from forge_stream.events import encode
from forge_stream.processors import ProcessorSettings, fold
from forge_stream.processors.synthetic import group_events

SETTINGS = ProcessorSettings(group_timeout_ms=60_000)
REASON = "invalid JSON in <tool_call> block: Expecting ',' delimiter: line 1 column 40 (char 39)"


def trajectories(events) -> dict[str, dict]:
    state, out = None, []
    for schema, record in events:
        state, emitted = fold(state, schema, record, SETTINGS)
        out.extend(emitted)
    for e in out:
        encode(e.schema, e.record)  # every output matches its Avro schema
    return {e.record["session_id"]: e.record for e in out if e.schema == "Trajectory"}


def test_failed_tool_calls_are_carried_per_turn_and_counted_per_rollout():
    events = group_events("g", group_size=2, turns=3)
    for schema, record in events:
        if schema == "Completion" and record["session_id"] == "g-s1" and record["turn"] in (1, 2):
            record.update(tool_call_error=REASON, tool_calls_json=None, finish_reason="stop",
                          output_text='<tool_call>{"name": "search", "arguments": {"q"</tool_call>')
    by_session = trajectories(events)
    assert [t["tool_call_error"] for t in by_session["g-s1"]["turns"]] == [None, REASON, REASON]
    assert by_session["g-s1"]["tool_call_failures"] == 2
    # g-s0's Completions are recorded without the field, as before Completion v5: no failure
    assert [t["tool_call_error"] for t in by_session["g-s0"]["turns"]] == [None, None, None]
    assert by_session["g-s0"]["tool_call_failures"] == 0

