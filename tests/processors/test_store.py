"""Group state kept as a header plus one entry per record (forge_stream.processors.store): the fold's outputs
are the same as with the whole state, and what is written per event does not grow with the group."""

from __future__ import annotations

import json
import random

import pytest

from forge_stream.processors import InvalidEvent, ProcessorSettings, expire, fold
from forge_stream.processors.store import GroupStore, MissingEntry, entry_key, is_entry
from forge_stream.processors.synthetic import group_events

SETTINGS = ProcessorSettings(group_timeout_ms=60_000, forget_closed_ms=1_000)


class Recorded(dict):
    """A table that records the JSON size of every write (a changelog record) and every delete (a tombstone)."""

    def __init__(self):
        super().__init__()
        self.writes: list[int] = []
        self.deletes = 0

    def __setitem__(self, key, value):
        self.writes.append(len(json.dumps(value)))
        super().__setitem__(key, value)

    def pop(self, key, *default):
        self.deletes += key in self
        return super().pop(key, *default)


def whole_run(events):
    state, outputs = None, []
    for schema, record in events:
        state, out = fold(state, schema, record, SETTINGS)
        outputs.extend(out)
    return state, outputs


def stored_run(events, store: GroupStore):
    outputs = []
    for schema, record in events:
        state, snapshot = store.load(record["group_id"])
        state, out = fold(state, schema, record, SETTINGS)
        outputs.extend(out)
        if state is not None:
            store.save(record["group_id"], state, snapshot)
    return outputs


def test_outputs_equal_the_whole_state_fold_in_any_order_with_redeliveries():
    events = group_events("g", group_size=4, turns=3)
    rng = random.Random(7)
    shuffled = events + rng.sample(events, 10)  # redeliveries
    rng.shuffle(shuffled)
    headers, entries = Recorded(), Recorded()
    assert stored_run(shuffled, GroupStore(headers, entries)) == whole_run(shuffled)[1]
    assert headers["g"]["closed"] and not entries  # closing deleted every entry
    assert entries.deletes == len(entries.writes)


def test_headers_and_entries_may_share_one_table_as_in_the_topology():
    events = group_events("g", group_size=3, turns=3)
    table = Recorded()
    assert stored_run(events, GroupStore(table, table)) == whole_run(events)[1]
    assert list(table) == ["g"] and table["g"]["closed"]  # entries tombstoned, the marker kept
    assert not any(is_entry(k) for k in table) and is_entry(entry_key("g", 0)) and not is_entry("g")
    with pytest.raises(InvalidEvent, match="control character"):
        fold(None, "Task", {**events[0][1], "group_id": entry_key("g", 0)}, SETTINGS)


def test_an_explicit_span_replaces_an_inferred_one_in_the_store_too():
    events = group_events("g", group_size=2, turns=3)
    span = next(r for s, r in events if s == "ToolSpan")
    explicit = {**span, "event_id": "explicit", "source": "explicit", "status": "error", "error": "boom"}
    at = events.index(("ToolSpan", span))
    for order in (events[:at + 1] + [("ToolSpan", explicit)] + events[at + 1:],
                  events[:at] + [("ToolSpan", explicit)] + events[at:]):
        store = GroupStore({}, {})
        half = order[: len(order) - 3]
        stored_run(half, store)
        state, _ = store.load("g")
        assert state["spans"][span["span_id"]]["source"] == "explicit"
        assert stored_run(order[len(order) - 3:], store) == whole_run(order)[1][len(whole_run(half)[1]):]


def test_timeout_and_forgetting_the_marker_clear_the_tables():
    events = group_events("g", group_size=3)[:-4]  # one session never finishes
    headers, entries = {}, {}
    store = GroupStore(headers, entries)
    stored_run(events, store)
    state, snapshot = store.load("g")
    due = state["last_ms"] + SETTINGS.group_timeout_ms
    new, out = expire(state, due, SETTINGS)
    assert out == expire(whole_run(events)[0], due, SETTINGS)[1] and out
    store.save("g", new, snapshot)
    assert headers["g"]["closed"] and entries == {}
    marker, snapshot = store.load("g")
    gone, _ = expire(marker, due + SETTINGS.forget_closed_ms, SETTINGS)
    store.save("g", gone, snapshot)
    assert headers == {} and entries == {}


def test_a_whole_state_written_before_the_split_is_read_and_split_on_save():
    events = group_events("g", group_size=2, turns=3)
    legacy, _ = whole_run(events[:-2])
    headers, entries = {"g": legacy}, {}
    store = GroupStore(headers, entries)
    out = stored_run(events[-2:], store)
    assert out == whole_run(events)[1][-len(out):] and out
    headers, entries = {"g": whole_run(events[:-2])[0]}, {}
    GroupStore(headers, entries).save("g", *GroupStore(headers, entries).load("g"))
    assert "completions" not in headers["g"] and len(entries) == headers["g"]["entries"] > 0


def long_session(turns: int) -> list[tuple[str, dict]]:
    """One session of `turns` turns whose prompts are recorded by reference, as the gateway records them."""
    events = group_events("long", group_size=1, turns=turns, prompt_len=64, completion_len=16)
    previous = None
    for schema, record in events:
        if schema == "Completion":
            whole_prompt = record["prompt_token_ids"]
            if previous is not None:
                covered = len(previous[0]) + len(previous[1])
                assert whole_prompt[:covered] == previous[0] + previous[1]
                record.update(prompt_ref=previous[2], prompt_ref_tokens=covered, prompt_ref_messages=0,
                              prompt_token_ids=whole_prompt[covered:])
            previous = (whole_prompt, record["completion_token_ids"], record["completion_id"])
    return events


def test_what_a_long_session_writes_grows_linearly_with_its_events():
    """Kept whole, the group's state (every completion so far) would be rewritten on each event: the bytes would
    grow with the square of the turns. Split, each event writes its own record and a header that does not grow."""
    def written(turns: int) -> tuple[int, int, int]:
        headers, entries = Recorded(), Recorded()
        events = long_session(turns)
        stored_run(events[:-1], GroupStore(headers, entries))  # open: the session has not finished
        return sum(headers.writes) + sum(entries.writes), max(headers.writes), max(entries.writes)

    short_total, short_header, short_entry = written(100)
    long_total, long_header, long_entry = written(400)
    assert long_header == short_header  # independent of the number of turns
    assert long_entry <= short_entry + 16  # one record (appended ids only), not the history
    assert long_total < 4.4 * short_total  # linear in events (4x the turns), not quadratic (16x)
    whole_state = json.dumps(whole_run(long_session(400)[:-1])[0])
    assert long_header < 2_000 < len(whole_state) / 50  # what each event would rewrite, kept whole


def test_an_entry_lost_from_the_table_is_a_clear_error_not_a_half_state():
    store = GroupStore({}, {})
    state = None
    for schema, record in group_events("lost", seq=0, group_size=2, turns=2)[:6]:
        held, snapshot = store.load("lost")
        state, _ = fold(held, schema, record, SETTINGS)
        store.save("lost", state, snapshot)
    assert store.headers["lost"]["entries"] >= 2
    del store.entries[entry_key("lost", 1)]
    with pytest.raises(MissingEntry, match="entry 1 is not in the table"):
        store.load("lost")
