"""Prompts by reference, without a broker: rebuilding chains, missing references, and what a session saves."""

import pytest

from forge_stream.bench.codec import session_bytes
from forge_stream.events.prompts import MissingReference, resolve_prompt, whole_completions


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
