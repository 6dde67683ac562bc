"""Pure parts of the gateway: engine routing, stream folding, tool-result status (no servers)."""

import doctest

import orjson
import pytest

from forge_stream.events.prompts import PromptIds
from forge_stream.gateway import engines, recording, responses, spans
from forge_stream.gateway.recording import StreamAccumulator, chat_choices, client_json, engine_json
from forge_stream.gateway.engines import EnginePool, choose, preference


@pytest.mark.parametrize("module", [engines, spans, responses, recording], ids=lambda m: m.__name__)
def test_doctests_hold(module):
    result = doctest.testmod(module)
    assert result.attempted > 0, f"{module.__name__} has no doctest to run"
    assert result.failed == 0


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
    assert (choice.prompt.ids(), choice.token_ids, choice.logprobs) == ([1, 2], [5, 6], [-0.5, -0.25])
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


def _answer(prompt_ids, **extra):
    return orjson.dumps({"id": "c", "object": "chat.completion", "prompt_token_ids": prompt_ids, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": 'says "prompt_token_ids":[9]'}, "token_ids": [5],
         "logprobs": {"content": [{"token": "a", "logprob": -0.5}]}, "finish_reason": "stop"}], **extra})


@pytest.mark.parametrize("raw, as_text", [
    (_answer(list(range(3000))), True),
    (_answer([]), True),
    (_answer(None), False),
    (orjson.dumps({"choices": [{"index": i, "text": "]", "prompt_token_ids": [i, 10 + i]} for i in range(3)]}), True),
    (b'{"prompt_token_ids": [1, 2], "choices": []}', False),  # not compact: parsed as usual
    (b'{"usage":{"prompt_token_ids":[1]},"choices":[]}', False),  # where no prompt's ids go: parsed as usual
    (b'{"prompt_token_ids":[[1],[2]],"choices":[]}', False),
])
def test_an_engine_answer_parses_to_the_same_answer_with_its_prompt_ids_kept_as_text(raw, as_text):
    """`engine_json` keeps each prompt_token_ids array as its text: what it gives is the parsed answer, ids and all,
    and `client_json` writes that answer back byte for byte as orjson writes the parsed one."""
    parsed, kept = orjson.loads(raw), engine_json(raw, text_from=0)
    assert engine_json(raw) == parsed or len(raw) >= recording.TEXT_FROM  # short answers: parsed as they are

    def plain(value):
        if isinstance(value, PromptIds):
            return value.ids()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, list) else value

    assert client_json(kept) == orjson.dumps(parsed)
    assert plain(kept) == parsed
    texts = [kept.get("prompt_token_ids")] + [c.get("prompt_token_ids") for c in kept.get("choices", [])]
    assert any(isinstance(t, PromptIds) for t in texts) == as_text


def test_a_long_prompt_from_the_engine_stays_text_until_asked_for():
    ids = list(range(100, 5100))
    [choice] = chat_choices(engine_json(_answer(ids)))
    assert choice.prompt._ids is None and choice.prompt.text() == orjson.dumps(ids)
    assert len(choice.prompt) == 5000 and choice.prompt.after(4998, len(orjson.dumps(ids[:4998])) - 1) == ids[4998:]
    assert choice.prompt.ids() == ids


def test_the_choices_of_a_chat_stream_share_one_prompt():
    acc = StreamAccumulator("chat", 2)
    for index in (0, 1):  # each choice's first chunk carries the prompt again
        acc.feed(engine_json(orjson.dumps({"prompt_token_ids": list(range(5000)), "choices": [
            {"index": index, "delta": {"content": "a"}, "token_ids": [7], "logprobs": {"content": [{"logprob": -1}]}}
        ]})), 100)
    first, second = acc.results()
    assert first.prompt is second.prompt and first.prompt.ids() == list(range(5000))
