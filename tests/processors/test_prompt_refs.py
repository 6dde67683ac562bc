"""The processors read prompts recorded by reference as if they had been recorded whole: the same bytes out."""

import random

from forge_stream.events import decode, encode
from forge_stream.events.prompts import Lane, by_reference, whole_completions
from forge_stream.processors import ProcessorSettings, expire, fold
from forge_stream.processors.fold import whole_prompts
from forge_stream.processors.synthetic import group_events

SETTINGS = ProcessorSettings(group_timeout_ms=60_000)


def by_ref(events):
    """The events with each Completion recorded as the gateway records it: by reference to the last completion
    of its session's lanes that its prompt extends."""
    lanes: dict[str, dict] = {}
    out = []
    for schema, record in events:
        if schema == "Completion":
            held = lanes.setdefault(record["session_id"], {})
            whole = record
            record = by_reference(whole, [], held.values())
            held[whole["agent"], whole["choice_index"]] = Lane(
                whole["completion_id"], whole["prompt_token_ids"], whole["completion_token_ids"], ())
        out.append((schema, record))
    return out


def outputs(events, now_ms=None):
    state, out = None, []
    for schema, record in events:
        state, emitted = fold(state, schema, record, SETTINGS)
        out.extend(emitted)
    if now_ms is not None:
        state, emitted = expire(state, now_ms, SETTINGS)
        out.extend(emitted)
    return [(e.topic.name, e.key, encode(e.schema, e.record)) for e in out]


def test_synthetic_group_by_reference_rebuilds_whole():
    events = group_events("g", group_size=4, turns=4)
    whole = [r for s, r in events if s == "Completion"]
    referenced = [r for s, r in by_ref(events) if s == "Completion"]
    refs = {r["completion_id"]: r.get("prompt_ref") for r in referenced}
    assert refs["g-s0-c0"] is None and refs["g-s0-c1"] == "g-s0-c0" and refs["g-s0-c3"] == "g-s0-c2"
    assert refs["g-s1-c3"] is None  # session 1 rewrites its history at its last turn
    assert sum(map(len, (r["prompt_token_ids"] for r in referenced))) < sum(map(len, (r["prompt_token_ids"]
                                                                                        for r in whole))) / 2
    rebuilt = whole_completions(random.Random(1).sample(referenced, len(referenced)))
    assert sorted((r["completion_id"], r["prompt_token_ids"]) for r in rebuilt) == sorted(
        (r["completion_id"], r["prompt_token_ids"]) for r in whole)


def test_train_samples_are_byte_identical_with_references():
    for seed in range(3):
        events = group_events(f"g{seed}", group_size=4, turns=5, seed=seed)
        expected = outputs(events)
        assert any(name == "forge.samples" for name, _, _ in expected)
        assert outputs(by_ref(events)) == expected
        shuffled = random.Random(seed).sample(by_ref(events), len(events))  # a reference may come after its user
        assert sorted(outputs(shuffled)) == sorted(outputs(random.Random(seed).sample(events, len(events))))


def test_a_timed_out_group_missing_a_referenced_completion_trains_the_rest():
    events = by_ref(group_events("g", group_size=2, turns=3))
    kept = [(s, r) for s, r in events if r.get("completion_id") != "g-s1-c1"]  # g-s1-c2 extends it
    out = outputs(kept, now_ms=events[0][1]["event_time"] + 10 * SETTINGS.group_timeout_ms)
    [sample] = [decode(b)[1] for name, _, b in out if name == "forge.samples"]
    assert {s["completion_id"] for s in sample["sequences"]} == {"g-s0-c1", "g-s0-c2"}  # g-s0-c0 is untrainable
    assert not sample["group_complete"]


def test_a_completion_whose_reference_is_missing_is_kept_untrainable():
    events = by_ref(group_events("g", group_size=1, turns=3))
    held = {r["completion_id"]: r for s, r in events if s == "Completion" and r["completion_id"] != "g-s0-c1"}
    out = whole_prompts(held)
    assert not out["g-s0-c2"]["trainable"] and "g-s0-c1" in out["g-s0-c2"]["untrainable_reason"]
    assert out["g-s0-c0"]["prompt_token_ids"] == held["g-s0-c0"]["prompt_token_ids"]
