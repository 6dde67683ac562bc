"""The group fold: when a group completes or times out, and that outputs depend only on the events, not on
their order or on redeliveries."""

import random

import pytest

from forge_stream.events import encode
from forge_stream.processors import InvalidEvent, ProcessorSettings, expire, fold
from forge_stream.processors.synthetic import group_events

SETTINGS = ProcessorSettings(group_timeout_ms=60_000)


def run(events, state=None):
    outputs = []
    for schema, record in events:
        state, out = fold(state, schema, record, SETTINGS)
        outputs.extend(out)
    return state, outputs


def by_schema(outputs, schema):
    return [e.record for e in outputs if e.schema == schema]


def test_group_completes_once_all_sessions_finished_and_graded():
    events = group_events("g", group_size=3)
    state, out = run(events[:-1])
    assert out == [] and not state["closed"]
    state, out = run(events[-1:], state)
    assert state["closed"]
    [sample] = by_schema(out, "TrainSample")
    assert sample["group_complete"] and sample["task_seq"] == 0 and sample["domain"] == "agent"
    assert len(by_schema(out, "Trajectory")) == 3
    assert {r["kind"] for r in by_schema(out, "Reward")} == {"process", "time", "total"}
    for e in out:
        encode(e.schema, e.record)  # every output matches its Avro schema


def test_untrainable_completions_stay_out_of_the_tree():
    _, out = run(group_events("g", group_size=2, turns=3))
    [sample] = by_schema(out, "TrainSample")
    assert "g-s0-c0" not in {s["completion_id"] for s in sample["sequences"]}
    assert len(sample["sequences"]) == 5
    turns = {t["completion_id"]: t for tr in by_schema(out, "Trajectory") for t in tr["turns"]}
    assert turns["g-s0-c0"]["trainable"] is False


def test_finish_before_grade_waits_for_the_grade():
    events = group_events("g", group_size=1)
    finish = [e for e in events if e[0] == "SessionFinished"]
    grade = [e for e in events if e[0] == "Reward"]
    rest = [e for e in events if e[0] not in ("SessionFinished", "Reward")]
    state, out = run(rest + finish)
    assert out == []
    _, out = run(grade, state)
    assert len(by_schema(out, "TrainSample")) == 1


def test_outputs_do_not_depend_on_order_or_redelivery():
    events = group_events("g", group_size=4, turns=3)
    _, want = run(events)
    shuffled = events + random.Random(7).sample(events, 10)  # redeliveries
    random.Random(1).shuffle(shuffled)
    _, got = run(shuffled)
    assert [(e.schema, e.record) for e in got] == [(e.schema, e.record) for e in want]


def test_timeout_closes_with_what_finished():
    events = group_events("g", group_size=3)
    unfinished = "g-s2"
    partial = [e for e in events if not (e[0] == "SessionFinished" and e[1]["session_id"] == unfinished)]
    state, out = run(partial)
    assert out == []
    assert expire(state, state["last_ms"] + 59_999, SETTINGS) == (state, [])
    closed, out = expire(state, state["last_ms"] + 60_000, SETTINGS)
    assert closed["closed"]
    [sample] = by_schema(out, "TrainSample")
    assert not sample["group_complete"] and sample["event_time"] == state["last_ms"] + 60_000
    assert {s["session_id"] for s in sample["sequences"]} == {"g-s0", "g-s1"}
    assert all(t["missing_sessions"] == [unfinished] for t in by_schema(out, "Trajectory"))


def _long_session(group_id: str, turns: int, gap_ms: int) -> list[tuple[str, dict]]:
    """One session of `turns` turns, a completion every `gap_ms` (far apart: a slow agent over hours)."""
    events = group_events(group_id, group_size=1, turns=turns)
    start = events[0][1]["event_time"]
    order = [e for e in events if e[0] in ("Task", "SessionStarted")] + [e for e in events if e[0] == "Completion"]
    rest = [e for e in events if e not in order]
    timed = [(schema, {**r, "event_time": start + i * gap_ms}) for i, (schema, r) in enumerate(order)]
    end = timed[-1][1]["event_time"]
    return timed + [(schema, {**r, "event_time": end + 1 + i}) for i, (schema, r) in enumerate(rest)]


def test_a_group_whose_events_keep_coming_is_not_cut_however_long_it_runs():
    """Timed out by age (first event + timeout), this group would be cut at its second completion; it goes on as long
    as no gap between its events reaches the timeout, and completes whole."""
    events = _long_session("long", turns=40, gap_ms=50_000)  # 40 turns over half an hour, timeout 60 s
    assert events[-1][1]["event_time"] - events[0][1]["event_time"] > 30 * SETTINGS.group_timeout_ms
    state, out = None, []
    for schema, record in events:
        if state is not None and not state["closed"]:  # the timer fires at each event's time: nothing is due yet
            assert expire(state, record["event_time"], SETTINGS) == (state, [])
        state, emitted = fold(state, schema, record, SETTINGS)
        out.extend(emitted)
    [sample] = by_schema(out, "TrainSample")
    assert sample["group_complete"] and by_schema(out, "GroupSkipped") == []
    assert [len(t["turns"]) for t in by_schema(out, "Trajectory")] == [40]


def test_an_idle_group_is_cut_with_its_reason():
    events = _long_session("idle", turns=6, gap_ms=1_000)
    open_part = [e for e in events if e[0] in ("Task", "SessionStarted", "Completion")][:5]  # the agent went quiet
    state, out = run(open_part)
    assert out == [] and state["last_ms"] == open_part[-1][1]["event_time"]
    assert expire(state, state["last_ms"] + 59_999, SETTINGS) == (state, [])
    closed, out = expire(state, state["last_ms"] + 60_000, SETTINGS)
    [skipped] = by_schema(out, "GroupSkipped")
    assert closed["closed"] and skipped["cut"] == "idle_timeout" and not skipped["group_complete"]
    assert skipped["reason"] == "cut when idle (no event for 60 s): no session finished (1 started)"
    assert skipped["missing_sessions"] == ["idle-s0"] and skipped["event_time"] == state["last_ms"] + 60_000
    encode("GroupSkipped", skipped)


@pytest.mark.parametrize("bound", [{"group_max_completions": 3}, {"group_max_tokens": 100}])
def test_an_oversized_group_is_cut_at_the_event_that_passes_its_bound(bound):
    settings = ProcessorSettings(group_timeout_ms=60_000, **bound)
    events = _long_session("big", turns=8, gap_ms=10)
    state, out, held, passed = None, [], [], None
    for schema, record in events:
        state, emitted = fold(state, schema, record, settings)
        if schema == "Completion" and passed is None:
            held.append(len(record["prompt_token_ids"]) + len(record["completion_token_ids"]))
        if emitted:
            passed, out = passed or record, out + emitted
    [skipped] = [e.record for e in out]  # no session finished: no trajectory, no sample
    assert state["closed"] and skipped["cut"] == "size_bound" and not skipped["group_complete"]
    assert skipped["event_time"] == passed["event_time"] and passed["completion_id"] == f"big-s0-c{len(held) - 1}"
    if "group_max_completions" in bound:  # the 4th completion passes the bound of 3
        assert len(held) == 4 and skipped["reason"] == (
            "cut at its size bound (4 completions, over the bound of 3): no session finished (1 started)")
    else:  # the completion whose token ids take the group over 100
        assert sum(held[:-1]) <= 100 < sum(held)
        assert skipped["reason"] == (f"cut at its size bound ({sum(held)} token ids, over the bound of 100): "
                                     "no session finished (1 started)")
    assert fold(state, *events[-1], settings) == (state, [])  # later events of the group change nothing
    encode("GroupSkipped", skipped)


def test_within_its_bounds_a_group_is_not_cut():
    events = _long_session("fits", turns=8, gap_ms=10)
    tokens = sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for s, r in events if s == "Completion")
    _, out = run_with(events, ProcessorSettings(group_max_completions=8, group_max_tokens=tokens))
    [sample] = by_schema(out, "TrainSample")
    assert sample["group_complete"] and by_schema(out, "GroupSkipped") == []


def run_with(events, settings):
    state, outputs = None, []
    for schema, record in events:
        state, out = fold(state, schema, record, settings)
        outputs.extend(out)
    return state, outputs


def test_closed_group_ignores_late_events_then_is_forgotten():
    events = group_events("g", group_size=1)
    state, _ = run(events)
    again, out = run(events, state)
    assert again == state and out == []
    assert expire(state, state["closed_ms"] + SETTINGS.forget_closed_ms, SETTINGS) == (None, [])


def test_own_rewards_are_not_read_back():
    events = group_events("g", group_size=1)
    _, out = run(events)
    state, _ = run(events[:-1])
    for e in by_schema(out, "Reward"):
        state, extra = fold(state, "Reward", e, SETTINGS)
        assert extra == []
    assert not state["closed"]


@pytest.mark.parametrize("schema,patch", [
    ("Completion", {"completion_logprobs": [0.0]}),
    ("Completion", {"completion_logprobs": [float("nan")] * 4}),
    ("Reward", {"value": float("nan")}),
    ("Reward", {"value": float("-inf")}),
    ("Task", {"group_size": 0}),
    ("Task", {"group_id": ""}),
])
def test_invalid_events_are_rejected(schema, patch):
    record = next(r for s, r in group_events("g") if s == schema and r.get("completion_token_ids", [1]))
    if "completion_logprobs" in patch and len(patch["completion_logprobs"]) > 1:  # one per token, all NaN
        patch = {"completion_logprobs": [float("nan")] * len(record["completion_token_ids"])}
    with pytest.raises(InvalidEvent):
        fold(None, schema, {**record, **patch}, SETTINGS)


def test_unknown_schema_is_rejected():
    with pytest.raises(InvalidEvent):
        fold(None, "TrainStep", {"group_id": "g"}, SETTINGS)


def test_finish_read_before_last_completion_waits_for_it():
    events = group_events("g", group_size=1, turns=3)
    last = [e for e in events if e[0] == "Completion"][-1]
    state, out = run([e for e in events if e is not last])
    assert out == [] and not state["closed"]
    state, out = run([last], state)
    assert len(by_schema(out, "TrainSample")[0]["sequences"]) == 2  # turn 0 of session 0 is untrainable


def _failed_sessions(events, sessions):
    """The group's Task and SessionStarted events, and each session finished with status error, no completion."""
    kept = [e for e in events if e[0] in ("Task", "SessionStarted")]
    return kept + [("SessionFinished", {
        "event_id": f"finish-{sid}", "event_time": 1_700_000_000_500, "group_id": "g", "task_id": "task-g",
        "session_id": sid, "status": "error", "num_completions": 0, "num_tool_spans": 0,
        "reason": "agent crashed"}) for sid in sessions]


def test_a_group_whose_sessions_all_failed_is_skipped_at_once_with_the_reason():
    events = group_events("g", seq=7, group_size=2)
    state, out = run(_failed_sessions(events, ["g-s0", "g-s1"]))
    assert state["closed"] and by_schema(out, "TrainSample") == []
    [skipped] = by_schema(out, "GroupSkipped")
    assert skipped["group_complete"] and skipped["task_seq"] == 7 and skipped["missing_sessions"] == []
    assert "2 finished sessions (2 failed" in skipped["reason"] and skipped["cut"] == ""
    assert [e.topic.name for e in out if e.schema == "GroupSkipped"] == ["forge.samples"]
    for e in out:
        encode(e.schema, e.record)


def test_a_group_whose_sessions_were_lost_is_skipped_when_it_times_out():
    events = group_events("g", seq=3, group_size=2)
    state, out = run([e for e in events if e[0] in ("Task", "SessionStarted")])
    assert out == []
    _, out = expire(state, state["last_ms"] + 60_000, SETTINGS)
    [skipped] = by_schema(out, "GroupSkipped")
    assert not skipped["group_complete"] and skipped["missing_sessions"] == ["g-s0", "g-s1"]
    assert "no session finished" in skipped["reason"] and skipped["task_seq"] == 3
    assert skipped["cut"] == "idle_timeout" and skipped["reason"].startswith("cut when idle (no event for 60 s)")
    encode("GroupSkipped", skipped)


def test_a_group_without_its_task_is_skipped_when_it_times_out():
    state, _ = run([e for e in group_events("g", group_size=1) if e[0] != "Task"])
    _, out = expire(state, state["last_ms"] + 60_000, SETTINGS)
    assert by_schema(out, "TrainSample") == []
    [skipped] = by_schema(out, "GroupSkipped")
    assert skipped["task_seq"] == -1 and "Task never" in skipped["reason"]


def test_a_session_started_twice_keeps_its_first_start():
    """A session open retried after a gateway restart writes a second, later SessionStarted; the session's wall
    time (and its time reward) still counts from the first, whatever order the two are read in."""
    events = group_events("g", group_size=3)
    starts = [(i, r) for i, (s, r) in enumerate(events) if s == "SessionStarted"]
    i, first = starts[0]
    again = {**first, "event_id": "started-again", "event_time": first["event_time"] + 5}  # before the group ends
    _, want = run(events)
    for order in (events[:i + 1] + [("SessionStarted", again)] + events[i + 1:],
                  events[:i] + [("SessionStarted", again)] + events[i:]):
        _, out = run(order)
        assert by_schema(out, "Trajectory") == by_schema(want, "Trajectory")
        assert by_schema(out, "Reward") == by_schema(want, "Reward")


def test_trajectories_count_prompts_that_do_not_extend_the_previous_turn():
    """Session 1's last turn rewrites its history (a context reset keeps 12 of the system prompt's 24 ids): its
    prompt repeats 12 of the 43 ids of the turn before (35 prompt + 8 completion), a break of 31; every other turn
    extends its predecessor token for token (the untrainable first turn of session 0 has no completion ids to
    repeat)."""
    _, out = run(group_events("g", group_size=2, turns=3))
    trajectories = {t["session_id"]: t for t in by_schema(out, "Trajectory")}
    assert [t["prefix_break_tokens"] for t in trajectories["g-s0"]["turns"]] == [0, 0, 0]
    assert trajectories["g-s0"]["prefix_breaks"] == 0
    assert [t["prefix_break_tokens"] for t in trajectories["g-s1"]["turns"]] == [0, 0, 31]
    assert trajectories["g-s1"]["prefix_breaks"] == 1
    for e in out:
        encode(e.schema, e.record)
