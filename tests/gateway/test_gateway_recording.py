"""The gateway records exactly what the (scripted) engine returned, on the real broker."""

import httpx
import orjson

from forge_stream.gateway.scripted import EOS, decode, encode, logprob, render
from forge_stream.topics import TOPICS

from conftest import open_session, read_events


def _completions(bootstrap, session_id):
    return sorted(read_events(bootstrap, TOPICS.completions, lambda r: r["session_id"] == session_id),
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

    [started] = read_events(kafka_bootstrap, TOPICS.sessions,
                            lambda r: r["session_id"] == session["session_id"])
    assert started["metadata"] == {"seed": "1"} and started["base_url"] == session["base_url"]
