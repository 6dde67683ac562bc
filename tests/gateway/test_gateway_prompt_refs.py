"""Prompts recorded by reference: the gateway records only what a prompt appends to an earlier completion of its
session, and the prompts rebuilt from the topic are byte for byte what the engine consumed and the agent sent."""

import itertools

import httpx
import orjson
import pytest

from forge_stream.events import encode
from forge_stream.events.prompts import Lane
from forge_stream.gateway import recording
from forge_stream.bench.scripted import ScriptedEngine
from forge_stream.kafka.history import read_completions
from forge_stream.topics import TOPICS

from gateway_support import open_session
from helpers import read_events, serving, since_this_test


REPLIES = ("Alpha one.", "Beta two, longer.", "Gamma three?")


@pytest.fixture(scope="module")
def engine():
    with serving(ScriptedEngine(REPLIES)) as url:
        yield url


def _ask(base_url, messages, agent="", **extra):
    response = httpx.post(f"{base_url}/chat/completions", headers={"X-Forge-Agent": agent},
                          json={"model": "scripted", "messages": messages, "return_token_ids": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _reply(body, index=0):
    return {"role": "assistant", "content": body["choices"][index]["message"]["content"]}


def conversation(*base_urls):
    """Appends, an n = 3 branch continued from its second choice, a sub-agent, and a rewritten history, each request
    sent to the next of `base_urls` in turn (gateway replicas); returns (messages sent, engine's prompt ids) per
    request, in order."""
    sent = []
    urls = itertools.cycle(base_urls)

    def ask(messages, agent="", **extra):
        body = _ask(next(urls), messages, agent, **extra)
        sent.append((orjson.dumps(messages).decode(), body["prompt_token_ids"]))
        return body

    main = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix utils.py, 中文 ok."}]
    body = ask(main)                                                              # turn 0: whole
    main += [_reply(body), {"role": "user", "content": "Run the tests."}]
    body = ask(main)                                                              # 1: extends 0
    main += [_reply(body), {"role": "user", "content": "Try three ways."}]
    branches = ask(main, n=3)                                                     # 2: extends 1, three choices
    main += [_reply(branches, 1), {"role": "user", "content": "Go on with that one.", "name": "x"}]
    body = ask(main)                                                              # 3: extends 2's choice 1
    helper = [{"role": "system", "content": "You search code."}, {"role": "user", "content": "Find foo."}]
    body_h = ask(helper, agent="searcher")                                        # 4: sub-agent, whole
    ask(helper + [_reply(body_h), {"role": "user", "content": "And bar?"}], agent="searcher")  # 5: extends 4
    main = [main[0], {"role": "user", "content": "Summary: tests run. Finish."}]
    body = ask(main)                                                              # 6: rewritten, whole
    ask(main + [_reply(body), {"role": "user", "content": "Done?"}])                 # 7: extends 6
    return sent


@pytest.mark.parametrize("packed", [False, True], ids=["lanes", "packed-lanes"])
def test_prompts_rebuilt_from_the_topic_are_exactly_what_was_sent(kafka_bootstrap, make_gateway, engine, run_id,
                                                                  packed, monkeypatch):
    """With `packed`, every lane keeps a digest of its prompt, as lanes of 4,096 ids or more do, and every prompt
    the engine returns is kept as its text (as those of 16 KB or more are)."""
    if packed:
        monkeypatch.setattr(Lane, "packed_from", 1)
        monkeypatch.setattr(recording, "TEXT_FROM", 0)
    with make_gateway(engines=(engine,)) as gateway:
        session = open_session(gateway, run_id)
        sent = conversation(session["base_url"])
    check_recorded(kafka_bootstrap, session["session_id"], sent)


def check_recorded(kafka_bootstrap, sid, sent):
    """The session's completions on the topic are the conversation's turns, by reference where expected, and their
    prompts rebuilt are byte for byte what was sent."""
    recorded = sorted(read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["session_id"] == sid),
                      key=lambda r: (r["turn"], r["choice_index"]))
    assert [(r["turn"], r["choice_index"]) for r in recorded] == [(0, 0), (1, 0), *((2, c) for c in range(3)),
                                                                 (3, 0), (4, 0), (5, 0), (6, 0), (7, 0)]
    ids = {(r["turn"], r["choice_index"]): r["completion_id"] for r in recorded}
    refs = [(r["turn"], r["prompt_ref"]) for r in recorded]
    assert refs == [(0, None), (1, ids[0, 0]), (2, ids[1, 0]), (2, ids[1, 0]), (2, ids[1, 0]), (3, ids[2, 1]),
                    (4, None), (5, ids[4, 0]), (6, None), (7, ids[6, 0])]
    for r in recorded:
        messages_json, prompt_ids = sent[r["turn"]]
        if r["prompt_ref"] is not None:  # only the appended part is on the topic
            assert r["prompt_ref_tokens"] > 0 and r["prompt_ref_tokens"] + len(r["prompt_token_ids"]) == len(prompt_ids)
            assert r["prompt_ref_messages"] == len(orjson.loads(messages_json)) - 2
            assert len(orjson.loads(r["messages_json"])) == 2

    rebuilt = sorted(read_completions(kafka_bootstrap, since_this_test(), keep=lambda r: r["session_id"] == sid),
                     key=lambda r: (r["turn"], r["choice_index"]))
    for r in rebuilt:
        messages_json, prompt_ids = sent[r["turn"]]
        assert r["messages_json"] == messages_json  # byte for byte
        assert r["prompt_token_ids"] == prompt_ids and r["prompt_ref"] is None
        encode("Completion", r)


def test_prompt_refs_can_be_turned_off_and_shrink_a_session(kafka_bootstrap, make_gateway, run_id):
    """The same conversation recorded whole and by reference: the same prompts, far fewer bytes."""
    sizes, prompts = {}, {}
    for refs in (False, True):  # each with a new engine, so that both get the same replies
        with serving(ScriptedEngine(REPLIES)) as engine, make_gateway(engines=(engine,), prompt_refs=refs) as gateway:
            session = open_session(gateway, run_id)
            conversation(session["base_url"])
        sid = session["session_id"]
        records = read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["session_id"] == sid)
        assert any(r["prompt_ref"] for r in records) == refs
        sizes[refs] = sum(len(encode("Completion", r)) for r in records)
        prompts[refs] = [(r["turn"], r["choice_index"], r["prompt_token_ids"], r["messages_json"]) for r in
                         sorted(read_completions(kafka_bootstrap, since_this_test(),
                                                 keep=lambda r: r["session_id"] == sid),
                                key=lambda r: (r["turn"], r["choice_index"]))]
    assert prompts[True] == prompts[False]
    assert sizes[True] < 0.75 * sizes[False], sizes
