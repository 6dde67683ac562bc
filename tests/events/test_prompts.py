"""Prompts by reference, without a broker: rebuilding chains, missing references, and what a session saves."""

import doctest
import random
import tracemalloc

import orjson
import pytest

from forge_stream.bench.codec import session_bytes
from forge_stream.events import prompts
from forge_stream.events.prompts import (
    PACKED_FROM, Lane, MissingReference, PromptIds, by_reference, ids_json, message_digest, resolve_prompt,
    whole_completions,
)


def test_doctests_hold():
    assert doctest.testmod(prompts).failed == 0


def _comp(cid, prompt, completion, messages, ref=None, ref_tokens=0, ref_messages=0):
    return {"completion_id": cid, "prompt_token_ids": prompt, "completion_token_ids": completion,
            "messages_json": messages, "prompt_ref": ref, "prompt_ref_tokens": ref_tokens,
            "prompt_ref_messages": ref_messages}


CHAIN = [
    _comp("a", [1, 2], [3, 4], '[{"role":"user","content":"hi"}]'),
    _comp("b", [5], [6], '[{"role":"assistant","content":"x"},{"role":"user","content":"é"}]', "a", 3, 1),
    _comp("c", [7], [8], '[{"role":"tool","content":"1.5"}]', "b", 5, 3),
    _comp("d", [], [9], "[]", "b", 4, 2),  # a retry of b's request from a shorter history: a prefix of b's
]


def test_a_chain_of_references_rebuilds_each_prompt_exactly():
    rebuilt = {r["completion_id"]: r for r in whole_completions(reversed(CHAIN))}
    assert rebuilt["b"]["prompt_token_ids"] == [1, 2, 3, 5]
    assert rebuilt["c"]["prompt_token_ids"] == [1, 2, 3, 5, 6, 7]
    assert rebuilt["d"]["prompt_token_ids"] == [1, 2, 3, 5]
    assert rebuilt["c"]["messages_json"] == ('[{"role":"user","content":"hi"},{"role":"assistant","content":"x"},'
                                             '{"role":"user","content":"é"},{"role":"tool","content":"1.5"}]')
    assert rebuilt["d"]["messages_json"] == '[{"role":"user","content":"hi"},{"role":"assistant","content":"x"}]'
    assert all(r["prompt_ref"] is None for r in rebuilt.values())
    by_id = {c["completion_id"]: c for c in CHAIN}
    cache = {}
    for cid in ("c", "b", "b"):  # a cached referenced completion is still rebuilt whole
        assert resolve_prompt(by_id[cid], by_id, cache) == (rebuilt[cid]["prompt_token_ids"],
                                                           rebuilt[cid]["messages_json"])


def test_a_missing_reference_is_an_error_that_names_it():
    with pytest.raises(MissingReference, match="extends b"):
        whole_completions(c for c in CHAIN if c["completion_id"] != "b")
    bad = _comp("e", [1], [], "[]", "a", 99, 0)
    with pytest.raises(MissingReference, match="takes 99 ids"):
        whole_completions([CHAIN[0], bad])


def test_a_50_turn_session_by_reference_is_an_order_of_magnitude_smaller():
    figures = session_bytes(turns=50)
    print(figures)
    assert figures["ratio"] > 10
    assert figures["largest_event_by_reference"] < 1024 * 1024 < figures["bytes_whole"]


def _long_conversation(rng, turns, first, appended, as_text=False):
    """A session's chat records with prompts whole (each extends the last one's prompt and completion), recorded as
    the gateway records them: by reference to the lane held after the turn before, each prompt given as a list or
    (`as_text`) as the engine's JSON text of it. Returns (whole, recorded, lane after each turn, prompts given)."""
    ids = [rng.randrange(257, 151_000) for _ in range(first)]
    messages = [b'{"role":"user","content":"go"}']
    whole, recorded, lanes, given = [], [], [], []
    for turn in range(turns):
        completion = [rng.randrange(257, 151_000) for _ in range(20)]
        record = _comp(f"c{turn}", ids, completion, (b"[" + b",".join(messages) + b"]").decode())
        digests = tuple(map(message_digest, messages))
        prompt = PromptIds.of_text(orjson.dumps(ids)) if as_text else PromptIds(ids=ids)
        whole.append(record)
        given.append(prompt)
        recorded.append(by_reference({**record, "prompt_token_ids": []}, messages, lanes[-1:], digests, prompt))
        lanes.append(Lane(record["completion_id"], prompt, completion, digests))
        ids = ids + completion + [rng.randrange(257, 151_000) for _ in range(appended)]
        messages = messages + [b'{"role":"assistant","content":"x"}', b'{"role":"tool","content":"%d"}' % turn]
    return whole, recorded, lanes, given


def test_long_prompts_are_referenced_through_a_digest_and_rebuilt_exactly():
    whole, recorded, lanes, _ = _long_conversation(random.Random(1), turns=5, first=PACKED_FROM + 10, appended=300)
    assert all(lane.prompt is None and lane.prompt_len == len(w["prompt_token_ids"]) for lane, w in zip(lanes, whole))
    assert recorded[0]["prompt_ref"] is None
    for turn, (before, record) in enumerate(zip(whole, recorded[1:]), start=1):
        assert record["prompt_ref"] == before["completion_id"]
        assert record["prompt_ref_tokens"] == len(before["prompt_token_ids"]) + 20
        assert len(record["prompt_token_ids"]) == 300 and record["prompt_ref_messages"] == 1 + 2 * (turn - 1)
    rebuilt = whole_completions(recorded)
    assert [r["prompt_token_ids"] for r in rebuilt] == [w["prompt_token_ids"] for w in whole]
    assert [r["messages_json"] for r in rebuilt] == [w["messages_json"] for w in whole]


@pytest.mark.parametrize("first", [PACKED_FROM - 300, PACKED_FROM + 10])
def test_a_prompt_held_as_the_engines_text_is_recorded_as_its_ids_are_without_being_parsed_whole(first):
    """The gateway keeps an engine's prompt ids as their JSON text: the records and lanes are those of the ids
    parsed, and a prompt that extends a lane is parsed only after the lane's prompt (short lanes crossing into
    long prompts included, from `PACKED_FROM - 300`)."""
    listed = _long_conversation(random.Random(6), turns=6, first=first, appended=100)
    text = _long_conversation(random.Random(6), turns=6, first=first, appended=100, as_text=True)
    assert text[1] == listed[1] and text[2] == listed[2]
    assert [r["prompt_ref"] is None for r in text[1]] == [True] + [False] * 5
    unparsed = [turn > 0 and len(prompt) >= PACKED_FROM for turn, prompt in enumerate(text[3])]
    assert [prompt._ids is None for prompt in text[3]] == unparsed  # short ones are parsed: their lanes keep ids
    assert unparsed.count(True) == (3 if first < PACKED_FROM else 5)  # 3796 + 120 a turn: turns 3-5 are long
    assert [len(prompt) for prompt in text[3]] == [len(w["prompt_token_ids"]) for w in text[0]]


@pytest.mark.parametrize("as_text", [False, True])
def test_a_long_prompt_that_differs_anywhere_is_recorded_whole(as_text):
    rng = random.Random(2)
    prompt = [rng.randrange(257, 151_000) for _ in range(PACKED_FROM + 50)] + [12]
    lane = Lane("c0", prompt, [7, 8], ())
    assert lane.prompt is None

    def recorded(ids):
        given = PromptIds.of_text(ids_json(ids)) if as_text else None
        return by_reference(_comp("c1", ids, [1], "[]"), [], [lane], None, given)

    assert recorded(prompt + [7, 8, 5])["prompt_ref_tokens"] == len(prompt) + 2
    assert recorded(prompt + [7, 9])["prompt_ref_tokens"] == len(prompt) + 1
    assert recorded(prompt)["prompt_ref_tokens"] == len(prompt)
    changed = list(prompt)
    changed[len(prompt) // 2] += 1
    assert recorded(changed + [7, 8])["prompt_ref"] is None
    assert recorded(prompt[:-1] + [123, 7, 8])["prompt_ref"] is None  # "...,12" is where "...,123" starts
    assert recorded(prompt[:-1] + [1, 2])["prompt_ref"] is None
    assert recorded(prompt[:-1])["prompt_ref"] is None


def test_a_long_lane_holds_a_digest_not_its_ids():
    prompt = [random.Random(3).randrange(257, 151_000) for _ in range(200_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        packed = Lane("c0", prompt, [1, 2], ())
        held_packed = tracemalloc.get_traced_memory()[0] - before
        Lane.packed_from, kept = len(prompt) + 1, Lane.packed_from
        try:
            before = tracemalloc.get_traced_memory()[0]
            listed = Lane("c0", orjson.loads(orjson.dumps(prompt)), [1, 2], ())  # as parsed from the engine's answer
            held_listed = tracemalloc.get_traced_memory()[0] - before
        finally:
            Lane.packed_from = kept
    finally:
        tracemalloc.stop()
    print(f"a lane of a 200K-id prompt holds {held_packed} bytes packed, {held_listed / 1e6:.1f} MB as a list")
    assert packed.prompt is None and listed.prompt is not None
    assert held_packed < 4096 < 1_000_000 < held_listed, (held_packed, held_listed)


def test_a_lane_holds_a_long_completion_packed():
    """A 32K-token reasoning turn's ids, as the engine's answer gives them (a list of ints), held by its lane until
    the next turn: 8 bytes an id, not a Python int object and a pointer each (the answer's list is not kept)."""
    text = orjson.dumps([random.Random(7).randrange(257, 151_000) for _ in range(32_768)])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        completion = orjson.loads(text)
        listed = tracemalloc.get_traced_memory()[0] - before
        lane = Lane("c0", [1, 2, 3], completion, ())
        del completion
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    print(f"a lane of a 32K-token completion holds {held / 1e3:.0f} KB; its ids as a list of ints {listed / 1e6:.2f} MB")
    assert held < 300_000 < 1_000_000 < listed
    next_prompt = [1, 2, 3] + orjson.loads(text) + [5]
    assert by_reference(_comp("c1", next_prompt, [], "[]"), [], [lane])["prompt_ref_tokens"] == 3 + 32_768


def test_a_lane_extended_by_a_reference_equals_the_lane_of_the_whole_prompt():
    rng = random.Random(4)
    short = [rng.randrange(257, 151_000) for _ in range(PACKED_FROM - 5)]
    first = Lane("c0", short, [1, 2, 3], ("m0",))
    assert first.prompt is not None
    appended = [rng.randrange(257, 151_000) for _ in range(40)]
    crossed = first.extended("c1", len(short) + 2, appended, [4, 5], ("m0", "m1"))  # short -> packed
    assert crossed.prompt is None and crossed == Lane("c1", short + [1, 2] + appended, [4, 5], ("m0", "m1"))
    longer = crossed.extended("c2", crossed.prompt_len + 2, [6], [9], ("m0", "m1", "m2"))  # packed -> packed
    assert longer == Lane("c2", short + [1, 2] + appended + [4, 5, 6], [9], ("m0", "m1", "m2"))
    assert longer != Lane("c2", short + [1, 2] + appended + [4, 5, 7], [9], ("m0", "m1", "m2"))
    assert crossed.extended("c3", crossed.prompt_len, [], [], ()).prompt_len == crossed.prompt_len
    with pytest.raises(ValueError, match=f"takes {len(short) + 4} ids"):
        first.extended("c4", len(short) + 4, [], [], ())
    with pytest.raises(ValueError, match="at least its whole prompt"):
        crossed.extended("c4", crossed.prompt_len - 1, [], [], ())
    assert first.extended("c5", 3, [8], [], ()) == Lane("c5", short[:3] + [8], [], ())  # a shorter history
