"""The core of rebuilding a session: its recorded Completions and ToolSpans folded into the state the gateway that
recorded them held (turns, lanes for prompt references, pending tool calls, spans), collisions found; and the
directory of forge.sessions (read through a list standing in for the topic) reading only what was appended."""

import random
import tracemalloc

import orjson

from forge_stream.events import now_ms
from forge_stream.events.prompts import Lane, by_reference, message_digest
from forge_stream.gateway.fold import fold
from forge_stream.gateway.recording import ChoiceRecord, RequestContext, chat_messages_json, completion_record
from forge_stream.gateway.sessionreads import SessionDirectory
from forge_stream.gateway.sessions import SessionStore
from forge_stream.gateway.spans import SessionKeys

KEYS = SessionKeys("s1", "g1", "t1")


def _completion(request_id, turn, messages, prompt, completion, tool_calls=None, agent="", lanes=()):
    parts = tuple(orjson.dumps(m) for m in messages)
    ctx = RequestContext(session_id="s1", group_id="g1", task_id="t1", request_id=request_id, agent=agent,
                         received_ms=1, kind="chat", messages_json=chat_messages_json(parts), tools_json=None,
                         message_parts=parts)
    choice = ChoiceRecord(0, prompt, completion, [-0.5] * len(completion), text="", tool_calls=tool_calls,
                          finish_reason="stop")
    record = completion_record(ctx, choice, turn=turn, model="m", engine_id="e", policy_version=0,
                               first_token_ms=None, done_ms=10 + turn)
    lane = Lane(record["completion_id"], prompt, completion, tuple(map(message_digest, parts)))
    return by_reference(record, parts, lanes), lane


def _call(call_id):
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _span(call_id, source):
    return {"span_id": f"span-{call_id}", "tool_call_id": call_id, "source": source}


def test_fold_rebuilds_what_the_recording_gateway_held():
    first = [{"role": "user", "content": "a"}]
    c0, lane0 = _completion("r0", 0, first, [1, 2], [3, 4], [_call("c1")])
    second = first + [{"role": "assistant", "content": None, "tool_calls": [_call("c1")]},
                      {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    c1, lane1 = _completion("r1", 1, second, [1, 2, 3, 4, 5], [6], [_call("c2"), _call("c3")], lanes=[lane0])
    assert c1["prompt_ref"] == c0["completion_id"]  # recorded by reference: the fold must resolve it
    sub, lane_sub = _completion("r2", 2, [{"role": "user", "content": "b"}], [9], [8], agent="helper")
    session = SessionStore().new(KEYS, {})
    collided = fold(session, [c0, c1, sub], [_span("c1", "inferred"), _span("c3", "explicit")], prompt_refs=True)
    assert collided == []
    assert (session.turns, session.completions, session.requests) == (3, 3, {"r0", "r1", "r2"})
    assert session.lanes == {("", 0): lane1, ("helper", 0): lane_sub}
    assert list(session.pending) == ["c2"] and session.pending["c2"].completion_id == c1["completion_id"]
    assert session.explicit == {"c3"} and session.span_ids == {"span-c1", "span-c3"}

    fold(session, [c0, c1], [], prompt_refs=False)
    assert session.lanes == {} and sorted(session.pending) == ["c1", "c2", "c3"]


def test_fold_reports_a_turn_two_requests_recorded():
    a, _ = _completion("ra", 0, [{"role": "user", "content": "a"}], [1], [2])
    b, _ = _completion("rb", 0, [{"role": "user", "content": "b"}], [1], [3])
    c, _ = _completion("rc", 1, [{"role": "user", "content": "c"}], [1], [4])
    session = SessionStore().new(KEYS, {})
    assert fold(session, [a, b, c], [], prompt_refs=True) == [0]
    # counted one per (request, choice), as the processors count them: two requests at turn 0 are two turns there
    assert session.turns == 2 and session.completions == 3


class _Log:
    """forge.sessions as a list per partition, read as PartitionReader reads it (the Kafka edge of the directory)."""

    def __init__(self):
        self.parts: list[list[tuple[int, str, dict]]] = [[], []]
        self.reads: list[tuple[int, int, int]] = []

    def append(self, p, ms, schema, session_id):
        self.parts[p].append((ms, schema, {"session_id": session_id, "group_id": "g", "task_id": "t",
                                           "metadata": {}}))

    def partitions(self, topic):
        return len(self.parts)

    def high(self, topic, p):
        return len(self.parts[p])

    def offset_at(self, topic, p, ms):
        return next((i for i, (t, _, _) in enumerate(self.parts[p]) if t >= ms), len(self.parts[p]))

    def read(self, topic, p, start, end, key=None):
        if start < end:
            self.reads.append((p, start, end))
        return [(i, t, schema, record) for i, (t, schema, record) in enumerate(self.parts[p]) if start <= i < end]


def test_the_directory_reads_only_what_was_appended_and_forgets_old_and_finished_sessions():
    now = now_ms()
    log = _Log()
    log.append(0, now - 10_000_000, "SessionStarted", "ancient")  # before the lookback: never read
    log.append(0, now - 1000, "SessionStarted", "a")
    log.append(1, now - 900, "SessionStarted", "b")
    directory = SessionDirectory(log, lookback_s=3600, finished_kept=1)
    assert directory.find("ancient") is None
    assert directory.find("a").started["session_id"] == "a" and directory.find("b").finished is None
    assert log.reads == [(0, 1, 2), (1, 0, 1)]  # later finds read nothing new
    log.append(1, now - 800, "SessionFinished", "b")
    log.append(0, now - 700, "SessionStarted", "c")
    log.append(0, now - 600, "SessionFinished", "c")
    assert directory.find("b", [1]).finished is not None
    assert directory.find("b") is None and directory.find("c").finished is not None  # one finished session kept
    assert directory.find("a").finished is None


def test_the_directory_forgets_sessions_left_open_past_the_lookback():
    log = _Log()
    log.append(0, now_ms() - 1500, "SessionStarted", "stale")
    directory = SessionDirectory(log, lookback_s=2, finished_kept=10)
    assert directory.find("stale") is not None
    directory.lookback_s = 1  # as if a second went by
    assert directory.find("stale") is None


def test_a_long_session_is_rebuilt_from_its_references_without_its_prompts_whole():
    """220 turns growing to 220K tokens of context, recorded by reference: the fold builds each lane from the one it
    extends (a digest of the prompt, extended by the ids each turn appends), so rebuilding the session never holds
    a prompt whole; its lane is the lane the recording gateway held. Rebuilding every prompt whole first would peak
    at about 200 MB, with 9 MB of ids held by the lane."""
    rng = random.Random(5)
    ids = [rng.randrange(257, 151_000) for _ in range(1000)]
    messages = [{"role": "user", "content": "go"}]
    recorded, lane = [], None
    for turn in range(220):
        completion = [rng.randrange(257, 151_000) for _ in range(50)]
        record, lane = _completion(f"r{turn}", turn, messages, ids, completion, lanes=[lane] if lane else [])
        assert turn == 0 or record["prompt_ref"] is not None
        recorded.append(record)
        ids = ids + completion + [rng.randrange(257, 151_000) for _ in range(950)]
        messages = messages + [{"role": "assistant", "content": "x"}, {"role": "tool", "content": str(turn)}]
    session = SessionStore().new(KEYS, {})
    tracemalloc.start()
    try:
        fold(session, recorded, [], prompt_refs=True)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"fold of {len(recorded)} turns ({lane.prompt_len} tokens of context): peak {peak / 1e6:.1f} MB, "
          f"{held / 1e6:.2f} MB held")
    assert session.lanes == {("", 0): lane} and lane.prompt is None
    assert peak < 16e6 and held < 1e6


def test_a_rebuild_keeps_only_the_lanes_a_later_turn_can_extend():
    """A 300-turn session of short prompts (ids kept whole), each turn extending the one before: the fold holds the
    lanes a later request can extend (the session's current ones), not every turn's, so its peak stays near one
    lane's size."""
    ids, messages, recorded, lane = list(range(300, 3300)), [{"role": "user", "content": "go"}], [], None
    for turn in range(300):
        record, lane = _completion(f"r{turn}", turn, messages, ids, [5, 6], lanes=[lane] if lane else [])
        assert turn == 0 or record["prompt_ref"] is not None
        recorded.append(record)
        ids = ids + [5, 6, 7 + turn]
        messages = messages + [{"role": "assistant", "content": "x"}, {"role": "user", "content": str(turn)}]
    session = SessionStore().new(KEYS, {})
    tracemalloc.start()
    try:
        fold(session, recorded, [], prompt_refs=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert session.lanes == {("", 0): lane} and lane.prompt is not None and lane.prompt_len == 3897
    assert peak < 2e6, peak  # all 300 lanes of 3,000-3,900 ids: 8 MB of lists
