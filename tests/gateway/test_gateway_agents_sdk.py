"""The OpenAI Agents SDK (`openai-agents`), unmodified and in its default mode (the Responses API), runs a small
tool-using agent against a real gateway in front of the scripted engine; the run is recorded as a chat agent's
would be: each model call a Completion with the engine's tokens, the tool call and its result an inferred span."""

import asyncio

import orjson
import pytest
from agents import Agent, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider
from openai import AsyncOpenAI

from forge_stream.bench.scripted import EOS, encode, render
from forge_stream.kafka.history import read_completions
from forge_stream.topics import TOPICS

from gateway_support import open_session
from helpers import read_events, since_this_test

REPLY = "Hello there, agent."


def _run(session, stream: bool, chained: bool = False):
    """Run the agent once against the session; returns its final output and the cities its tool was asked for."""
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        asked.append(city)
        return f"Sunny in {city}, 22 degrees."

    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model="scripted")
    config = RunConfig(model_provider=OpenAIProvider(openai_client=AsyncOpenAI(
        base_url=session["base_url"], api_key="unused", max_retries=0)), tracing_disabled=True)

    async def main():
        if stream:
            result = Runner.run_streamed(agent, "Weather in Paris?", run_config=config)
            async for _ in result.stream_events():
                pass
            return result.final_output
        return (await Runner.run(agent, "Weather in Paris?", run_config=config,
                                 auto_previous_response_id=chained)).final_output

    return asyncio.run(main()), asked


@pytest.mark.parametrize("stream,chained", [(False, False), (True, False), (False, True)],
                         ids=["whole", "streamed", "previous_response_id"])
def test_agents_sdk_tool_agent_is_recorded(kafka_bootstrap, gateway_url, run_id, stream, chained):
    session = open_session(gateway_url, run_id)
    output, asked = _run(session, stream, chained)
    assert output == REPLY and asked == ["paris"]

    sid = session["session_id"]
    records = sorted(read_completions(kafka_bootstrap, since_this_test(),
                                      keep=lambda r: r["session_id"] == sid),  # prompts whole
                     key=lambda r: r["turn"])
    assert [r["turn"] for r in records] == [0, 1]
    call, answer = records
    [tool_call] = orjson.loads(call["tool_calls_json"])
    assert tool_call["function"]["name"] == "get_weather" and call["finish_reason"] == "tool_calls"
    messages = orjson.loads(answer["messages_json"])
    assert messages[0] == {"role": "system", "content": "Answer with the weather."}
    assert messages[1] == {"role": "user", "content": "Weather in Paris?"}
    assert messages[2]["tool_calls"][0]["id"] == tool_call["id"]
    assert messages[3] == {"role": "tool", "tool_call_id": tool_call["id"], "content": "Sunny in paris, 22 degrees."}
    for record in records:
        assert record["trainable"], record["untrainable_reason"]
        assert record["prompt_token_ids"] == encode(render(orjson.loads(record["messages_json"]),
                                                           orjson.loads(record["tools_json"])))
        assert record["completion_token_ids"][-1] == EOS
    assert answer["completion_token_ids"] == encode(REPLY) + [EOS]

    [span] = read_events(kafka_bootstrap, TOPICS.tool_spans, lambda r: r["session_id"] == sid)
    assert (span["tool_call_id"], span["name"], span["status"]) == (tool_call["id"], "get_weather", "ok")
    assert span["completion_id"] == call["completion_id"]
