"""Pure parts of the gateway: engine routing, stream folding, tool-result status (no servers)."""

import doctest

from forge_stream.gateway import engines, responses, serving, spans
from forge_stream.gateway.recording import StreamAccumulator
from forge_stream.gateway.engines import EnginePool, choose, preference


def test_doctests_hold():
    for module in (engines, spans, serving, responses):
        assert doctest.testmod(module).failed == 0


def test_groups_stick_to_their_engine_and_spread_over_engines():
    urls = [f"http://e{i}" for i in range(4)]
    homes = {g: preference(g, urls)[0] for g in (f"group-{i}" for i in range(200))}
    assert all(choose(g, urls, [0] * 4, 8)[0] == home for g, home in homes.items())
    assert set(homes.values()) == {0, 1, 2, 3}
    # removing an engine moves only the groups that lived on it
    moved = [g for g, home in homes.items() if preference(g, urls[:3])[0] != home]
    assert moved and all(homes[g] == 3 for g in moved)


def test_an_overloaded_home_sends_the_group_to_the_least_loaded_engine():
    urls = ["http://a", "http://b", "http://c"]
    home = preference("g", urls)[0]
    loads = [5, 5, 5]
    loads[home] = 20
    least = next(i for i in range(3) if i != home)
    loads[least] = 1
    assert choose("g", urls, loads, max_queue=8) == [least, 3 - home - least, home]
    assert choose("g", urls, loads, max_queue=32)[0] == home
    pool = EnginePool(tuple(urls), max_queue=8)
    for engine, load in zip(pool.engines, loads):
        engine.in_flight = load
    assert pool.order("g")[0].url == urls[least]


def test_stream_accumulator_joins_tool_call_deltas_and_tokens():
    acc = StreamAccumulator("chat", n=1)
    acc.feed({"prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
             100)
    assert acc.first_token_ms is None
    acc.feed({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {
        "name": "get_", "arguments": '{"a"'}}]}, "token_ids": [5], "logprobs": {"content": [{"logprob": -0.5}]}}]},
             101)
    acc.feed({"policy_version": 3, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "name": "weather", "arguments": ": 1}"}}]}, "token_ids": [6], "logprobs": {"content": [{"logprob": -0.25}]},
        "finish_reason": "tool_calls"}]}, 102)
    [choice] = acc.results()
    assert (choice.prompt_ids, choice.token_ids, choice.logprobs) == ([1, 2], [5, 6], [-0.5, -0.25])
    assert choice.tool_calls == [{"id": "c1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"a": 1}'}}]
    assert (acc.first_token_ms, acc.policy_version, choice.finish_reason) == (101, 3, "tool_calls")
    assert choice.trainability() == (True, None)


def test_trainability_reasons():
    acc = StreamAccumulator("completion")
    acc.feed({"choices": [{"index": 0, "text": "hi", "prompt_token_ids": [1], "token_ids": [2, 3],
                           "logprobs": {"token_logprobs": [-0.1]}}]}, 1)
    assert acc.results()[0].trainability() == (False, "engine returned 1 logprobs for 2 tokens")


def test_tool_result_status_reads_errors():
    assert spans.tool_result_status([{"type": "text", "text": "Error: timeout"}]) == ("error", "Error: timeout")
    assert spans.tool_result_status('{"result": 3, "error": null}') == ("ok", None)
    assert spans.tool_result_status("all good") == ("ok", None)
