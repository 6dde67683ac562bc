"""The gateway records exactly what the (scripted) engine returned, on the real broker."""

import httpx
import orjson

from forge_stream.bench.scripted import EOS, decode, encode, logprob, render
from forge_stream.kafka.history import read_completions
from forge_stream.topics import TOPICS

from gateway_support import open_session
from helpers import read_events, since_this_test


def _completions(bootstrap, session_id):
    return sorted(read_completions(bootstrap, since_this_test(),
                                   keep=lambda r: r["session_id"] == session_id),  # prompts whole
                  key=lambda r: (r["turn"], r["choice_index"]))


def test_chat_completion_is_recorded_with_engine_token_ids(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id, "t1", metadata={"seed": "1"})
    assert session["base_url"].endswith(f"/s/{session['session_id']}/v1")
    messages = [{"role": "user", "content": "What is the weather?"}]
    response = httpx.post(f"{session['base_url']}/chat/completions", headers={"X-Forge-Agent": "planner"},
                          json={"model": "scripted", "messages": messages})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "Hello there, agent."

    [record] = _completions(kafka_bootstrap, session["session_id"])
    assert record["prompt_token_ids"] == encode(render(messages, None))
    assert record["completion_token_ids"] == encode("Hello there, agent.") + [EOS]
    assert len(record["completion_logprobs"]) == len(record["completion_token_ids"])
    assert all(abs(lp - logprob(t)) < 1e-6 for lp, t in zip(record["completion_logprobs"],
                                                           record["completion_token_ids"]))
    assert decode(record["completion_token_ids"]) == body["choices"][0]["message"]["content"]
    assert record["trainable"] and record["untrainable_reason"] is None
    assert (record["group_id"], record["task_id"], record["turn"], record["agent"]) == (run_id, "t1", 0, "planner")
    assert record["policy_version"] == 7 and record["finish_reason"] == "stop"
    assert orjson.loads(record["messages_json"]) == messages
    assert record["received_ms"] <= record["done_ms"]
    assert (record["temperature"], record["top_p"], record["logprobs_mode"]) == (1.0, 1.0, "processed")

    [started] = read_events(kafka_bootstrap, TOPICS.sessions,
                            lambda r: r["session_id"] == session["session_id"])
    assert started["metadata"] == {"seed": "1"} and started["base_url"] == session["base_url"]


TOOL_MESSAGES = [{"role": "user", "content": "Weather in Paris and Rome?"}]


def _chat(url, messages, **extra):
    response = httpx.post(f"{url}/chat/completions", json={"model": "scripted", "messages": messages, **extra},
                          headers=extra.pop("headers", None) or {})
    assert response.status_code == 200, response.text
    return response.json()


def _tool_turn(gateway_url, run_id, result_content):
    """Turn 0 answers a tool call; returns the session, the call, and turn 1's messages carrying its result."""
    session = open_session(gateway_url, run_id)
    url = session["base_url"]
    messages = list(TOOL_MESSAGES)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    first = _chat(url, messages, tools=tools)
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    call = first["choices"][0]["message"]["tool_calls"][0]
    messages += [first["choices"][0]["message"], {"role": "tool", "tool_call_id": call["id"],
                                                   "content": result_content}]
    return session, call, messages, tools


def test_tool_call_and_its_result_become_an_inferred_span(kafka_bootstrap, gateway_url, run_id):
    session, call, messages, tools = _tool_turn(gateway_url, run_id, '{"error": "city not found"}')
    _chat(session["base_url"], messages, tools=tools)
    sid = session["session_id"]
    [span] = read_events(kafka_bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    completions = _completions(kafka_bootstrap, sid)
    issuer = next(c for c in completions if c["tool_calls_json"])
    assert orjson.loads(issuer["tool_calls_json"])[0]["id"] == call["id"]
    assert (span["tool_call_id"], span["name"], span["source"]) == (call["id"], "get_weather", "inferred")
    assert orjson.loads(span["arguments_json"]) == {"city": "paris"}
    assert (span["status"], span["error"]) == ("error", "city not found")
    assert span["completion_id"] == issuer["completion_id"]
    assert issuer["done_ms"] == span["start_ms"] <= span["end_ms"] == completions[-1]["received_ms"]
    assert [c["turn"] for c in completions] == list(range(len(completions)))


def test_explicit_span_replaces_the_inferred_one(kafka_bootstrap, gateway_url, run_id):
    session, call, messages, tools = _tool_turn(gateway_url, run_id, "22 degrees")
    sid = session["session_id"]
    posted = httpx.post(f"{gateway_url}/v1/sessions/{sid}/spans", json={"spans": [{
        "tool_call_id": call["id"], "status": "ok", "start_ms": 1000, "end_ms": 1500}]})
    assert posted.status_code == 200, posted.text
    _chat(session["base_url"], messages, tools=tools)  # carries the result: no inferred span any more
    [span] = read_events(kafka_bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    assert (span["source"], span["name"], span["start_ms"], span["end_ms"]) == ("explicit", "get_weather", 1000, 1500)
    assert span["event_id"] == posted.json()["event_ids"][0]
    assert orjson.loads(span["arguments_json"]) == {"city": "paris"}


def test_streamed_chat_with_n_2_records_one_event_per_choice(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    messages = [{"role": "user", "content": "stream please"}]
    events = []
    with httpx.stream("POST", f"{session['base_url']}/chat/completions",
                      json={"model": "scripted", "messages": messages, "stream": True, "n": 2, "temperature": 0.5,
                            "top_p": 0.9}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for data in events[:-1]:
        for choice in orjson.loads(data)["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    records = _completions(kafka_bootstrap, session["session_id"])
    assert [r["choice_index"] for r in records] == [0, 1]
    assert {r["turn"] for r in records} == {0}
    for record in records:
        assert record["trainable"]
        assert record["prompt_token_ids"] == encode(render(messages, None))
        assert decode(record["completion_token_ids"]) == texts[record["choice_index"]] == record["output_text"]
        assert record["completion_token_ids"][-1] == EOS
        assert record["first_token_ms"] is not None and record["received_ms"] <= record["first_token_ms"]
        assert (record["temperature"], record["top_p"]) == (0.5, 0.9)


def test_completions_endpoint_records_each_prompt_of_a_batch(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id)
    response = httpx.post(f"{gateway_url}/v1/completions", headers={"X-Forge-Session": session["session_id"]},
                          json={"model": "scripted", "prompt": ["one", "two"], "max_tokens": 4})
    assert response.status_code == 200, response.text
    records = _completions(kafka_bootstrap, session["session_id"])
    assert [r["prompt_token_ids"] for r in records] == [encode("one"), encode("two")]
    assert [orjson.loads(r["messages_json"]) for r in records] == ["one", "two"]
    assert all(len(r["completion_token_ids"]) == 4 and r["finish_reason"] == "length" for r in records)
    assert [decode(r["completion_token_ids"]) for r in records] == [c["text"] for c in response.json()["choices"]]


def test_engine_without_token_ids_is_served_and_recorded_untrainable(kafka_bootstrap, make_gateway, run_id):
    from helpers import serving
    from forge_stream.bench.scripted import ScriptedEngine

    with serving(ScriptedEngine(token_ids=False)) as engine, make_gateway(engines=(engine,)) as gateway:
        session = open_session(gateway, run_id)
        body = _chat(session["base_url"], [{"role": "user", "content": "hi"}])
        assert body["choices"][0]["message"]["content"] == "Hello from the scripted engine."
    [record] = _completions(kafka_bootstrap, session["session_id"])
    assert not record["trainable"]
    assert record["untrainable_reason"] == "engine returned no prompt_token_ids"
    assert record["output_text"] == "Hello from the scripted engine."


def test_rewards_and_finish_are_recorded_and_finish_closes_the_session(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id, "t9")
    sid = session["session_id"]
    _chat(session["base_url"], [{"role": "user", "content": "hi"}])
    assert httpx.post(f"{gateway_url}/v1/sessions/{sid}/reward", json={"value": 1.0}).status_code == 200
    finished = httpx.post(f"{gateway_url}/v1/sessions/{sid}/finish", json={"status": "ok"})
    assert finished.status_code == 200
    late = httpx.post(f"{session['base_url']}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert late.status_code == 409 and late.json()["error"]["code"] is None
    assert httpx.post(f"{gateway_url}/v1/sessions/{sid}/finish", json={}).status_code == 409
    [reward] = read_events(kafka_bootstrap, TOPICS.rewards, lambda r: r["session_id"] == sid)
    assert (reward["kind"], reward["value"], reward["group_id"], reward["task_id"]) == ("outcome", 1.0, run_id, "t9")
    records = read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
    assert [r.get("status") for r in records] == [None, "ok"]
    assert records[1]["num_completions"] == 1


def test_finish_reports_the_sessions_distinct_tool_spans(kafka_bootstrap, gateway_url, run_id):
    """An inferred span, an explicit span replacing it (same span id) and an explicit span of its own: 2."""
    session, call, messages, tools = _tool_turn(gateway_url, run_id, "22 degrees")
    sid = session["session_id"]
    _chat(session["base_url"], messages, tools=tools)  # infers the span of `call`
    posted = httpx.post(f"{gateway_url}/v1/sessions/{sid}/spans", json={"spans": [
        {"tool_call_id": call["id"], "status": "ok", "start_ms": 1000, "end_ms": 1500},
        {"name": "browse", "status": "ok", "start_ms": 1600, "end_ms": 1700}]})
    assert posted.status_code == 200, posted.text
    assert httpx.post(f"{gateway_url}/v1/sessions/{sid}/finish", json={"status": "ok"}).status_code == 200
    spans = read_events(kafka_bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    assert len(spans) == 3 and len({s["span_id"] for s in spans}) == 2
    [finished] = [r for r in read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["session_id"] == sid)
                  if r.get("status")]
    assert finished["num_tool_spans"] == 2


def _choice_fields(data):
    return [set(c) & {"token_ids", "prompt_token_ids"} for c in data["choices"]], "prompt_token_ids" in data


def test_logprobs_and_token_ids_reach_the_client_only_when_asked(kafka_bootstrap, gateway_url, run_id):
    """The gateway always asks the engine for them (to record them), and hands them on only if the client asked."""
    session = open_session(gateway_url, run_id)
    url, hi = session["base_url"], [{"role": "user", "content": "hi"}]
    plain = _chat(url, hi)
    assert _choice_fields(plain) == ([set()], False) and plain["choices"][0]["logprobs"] is None
    with_logprobs = _chat(url, hi, logprobs=True)
    assert _choice_fields(with_logprobs) == ([set()], False)
    assert [e["logprob"] for e in with_logprobs["choices"][0]["logprobs"]["content"]] == [
        logprob(t) for t in encode("Hello there, agent.") + [EOS]]
    with_ids = _chat(url, hi, return_token_ids=True)
    assert with_ids["choices"][0]["token_ids"] == encode("Hello there, agent.") + [EOS]
    assert with_ids["prompt_token_ids"] == encode(render(hi, None)) and with_ids["choices"][0]["logprobs"] is None

    chunks = []
    with httpx.stream("POST", f"{url}/chat/completions", json={"messages": hi, "stream": True}) as response:
        chunks = [orjson.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert all(_choice_fields(c) == ([set()] * len(c["choices"]), False) for c in chunks)
    assert all(choice["logprobs"] is None for c in chunks for choice in c["choices"])

    completion = httpx.post(f"{url}/completions", json={"prompt": "one", "max_tokens": 3}).json()
    assert _choice_fields(completion) == ([set()], False) and completion["choices"][0]["logprobs"] is None
    asked = httpx.post(f"{url}/completions", json={"prompt": "one", "max_tokens": 3, "logprobs": 0}).json()
    assert asked["choices"][0]["logprobs"]["token_logprobs"] == [logprob(t) for t in encode("Hel")]

    records = _completions(kafka_bootstrap, session["session_id"])
    assert len(records) == 6 and all(r["trainable"] for r in records)


def test_streamed_usage_comes_last_when_asked_as_vllm_sends_it(kafka_bootstrap, gateway_url, run_id):
    from openai import OpenAI

    session = open_session(gateway_url, run_id)
    client = OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "count"}]
    chunks = list(client.chat.completions.create(model="scripted", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    *tokens, last = chunks
    assert last.choices == [] and all(c.usage is None and c.choices for c in tokens)
    prompt = len(encode(render(messages, None)))
    completion = len(encode("Hello there, agent.")) + 1
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        prompt, completion, prompt + completion)
    without = list(client.chat.completions.create(model="scripted", messages=messages, stream=True))
    assert all(c.choices and c.usage is None for c in without)
    [record, _] = _completions(kafka_bootstrap, session["session_id"])
    assert len(record["prompt_token_ids"]) == prompt and len(record["completion_token_ids"]) == completion


def test_a_retried_reward_with_an_idempotency_key_is_one_event(kafka_bootstrap, gateway_url, run_id):
    session = open_session(gateway_url, run_id, "t-idem")
    sid = session["session_id"]
    url = f"{gateway_url}/v1/sessions/{sid}/reward"
    first = httpx.post(url, json={"value": 1.0}, headers={"Idempotency-Key": "outcome:grader"})
    again = httpx.post(url, json={"value": 1.0}, headers={"Idempotency-Key": "outcome:grader"})
    other = httpx.post(url, json={"value": 0.5, "name": "bonus"}, headers={"Idempotency-Key": "outcome:bonus"})
    plain = [httpx.post(url, json={"value": 0.1, "name": "x"}) for _ in range(2)]
    assert all(r.status_code == 200 for r in (first, again, other, *plain))
    assert first.json()["event_ids"] == again.json()["event_ids"] != other.json()["event_ids"]
    assert plain[0].json()["event_ids"] != plain[1].json()["event_ids"]  # no key: every post is its own event
    bad = httpx.post(url, json={"value": 1.0}, headers={"Idempotency-Key": "x" * 300})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "Idempotency-Key"
    rewards = read_events(kafka_bootstrap, TOPICS.rewards, lambda r: r["session_id"] == sid)
    assert len(rewards) == 5 and len({r["event_id"] for r in rewards}) == 4
