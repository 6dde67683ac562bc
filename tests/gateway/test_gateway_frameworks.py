"""The real frameworks are the tests: the openai SDK (chat completions and the Responses API), the OpenAI Agents SDK
in its default mode (Responses), the anthropic SDK (Messages), litellm, langchain-openai and smolagents (pinned in
the `dev` extra), unmodified, each run a small calculator agent against a real gateway in front of a scripted engine whose answers are tool calls,
whole and streamed. Every event the gateway recorded for the run is read back as an outside consumer reads it
(confluent-kafka's AvroDeserializer, schemas from the registry API): the session's start and finish, a Completion
per model call with the engine's tokens, and the calculator call's ToolSpan (inferred from litellm's and
langchain's `tool` messages, function_call_output items and tool_result blocks; from smolagents' `Observation:`
messages by the `smolagents` span rule)."""

import json
import os
import time

import httpx
import orjson
import pytest

from forge_stream.bench.scripted import EOS, encode
from forge_stream.gateway.spans import span_id

from gateway_support import open_session, read_recorded

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
FINAL = '<tool_call>{"name": "final_answer", "arguments": {"answer": "42"}}</tool_call>'
REPLY = "The answer is 42."
DESCRIPTION = "Evaluates an arithmetic expression."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": DESCRIPTION,
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculate(expression: str) -> str:
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and operators from the test script


def run_openai_chat(session: dict, stream: bool) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is 6*7?"}]
    for _ in range(3):
        if stream:
            with client.chat.completions.stream(model="scripted", messages=messages, tools=TOOLS) as events:
                message = events.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.create(model="scripted", messages=messages,
                                                     tools=TOOLS).choices[0].message
        if not message.tool_calls:
            return message.content
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(**json.loads(call.function.arguments))})
    raise AssertionError("no answer")


RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


def run_openai_responses(session: dict, stream: bool) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    items: list = [{"role": "user", "content": "What is 6*7?"}]
    for _ in range(3):
        if stream:
            with client.responses.stream(model="scripted", input=items, tools=RESPONSES_TOOLS) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(model="scripted", input=items, tools=RESPONSES_TOOLS)
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text
        for call in calls:  # the whole history each time (no previous_response_id): a stateless client
            items += [call.model_dump(exclude_none=True),
                      {"type": "function_call_output", "call_id": call.call_id,
                       "output": calculate(**json.loads(call.arguments))}]
    raise AssertionError("no answer")


def run_anthropic(session: dict, stream: bool) -> str:
    import anthropic

    client = anthropic.Anthropic(base_url=session["base_url"].removesuffix("/v1"), api_key="unused", max_retries=0)
    tools = [{"name": "calculator", "description": DESCRIPTION,
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages: list = [{"role": "user", "content": "What is 6*7?"}]
    for _ in range(3):
        if stream:
            with client.messages.stream(model="scripted", max_tokens=200, tools=tools, messages=messages) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(model="scripted", max_tokens=200, tools=tools, messages=messages)
        uses = [block for block in message.content if block.type == "tool_use"]
        if not uses:
            return message.content[0].text
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": calculate(**use.input)} for use in uses]}]
    raise AssertionError("no answer")


def run_agents_sdk(session: dict, stream: bool) -> str:
    import asyncio

    from agents import Agent, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluates an arithmetic expression."""
        return calculate(expression)

    agent = Agent(name="calc", instructions="Use the calculator.", tools=[calculator], model="scripted")
    config = RunConfig(model_provider=OpenAIProvider(openai_client=AsyncOpenAI(
        base_url=session["base_url"], api_key="unused", max_retries=0)), tracing_disabled=True)

    async def main():
        if stream:
            result = Runner.run_streamed(agent, "What is 6*7?", run_config=config)
            async for _ in result.stream_events():
                pass
            return result.final_output
        return (await Runner.run(agent, "What is 6*7?", run_config=config)).final_output

    return asyncio.run(main())


def run_litellm(session: dict, stream: bool) -> str:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the model price list
    import litellm

    messages = [{"role": "user", "content": "What is 6*7?"}]
    options = {"model": "openai/scripted", "api_base": session["base_url"], "api_key": "unused", "tools": TOOLS,
               "num_retries": 0}
    for _ in range(3):
        if stream:
            chunks = list(litellm.completion(messages=messages, stream=True, **options))
            message = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
        else:
            message = litellm.completion(messages=messages, **options).choices[0].message
        if not message.tool_calls:
            return message.content
        messages.append(message)
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": calculate(**json.loads(call.function.arguments))})
    raise AssertionError("no answer")


def run_langchain(session: dict, stream: bool) -> str:
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool(description=DESCRIPTION)
    def calculator(expression: str) -> str:
        return calculate(expression)

    model = ChatOpenAI(model="scripted", base_url=session["base_url"], api_key="unused", max_retries=0,
                       streaming=stream).bind_tools([calculator])
    messages = [HumanMessage("What is 6*7?")]
    for _ in range(3):
        answer = model.invoke(messages)
        messages.append(answer)
        if not answer.tool_calls:
            return answer.content
        messages += [calculator.invoke(call) for call in answer.tool_calls]
    raise AssertionError("no answer")


def run_smolagents(session: dict, stream: bool) -> str:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def calculator(expression: str) -> str:
        """Evaluates an arithmetic expression.

        Args:
            expression: The expression, e.g. "6*7".
        """
        return calculate(expression)

    model = OpenAIServerModel(model_id="scripted", api_base=session["base_url"], api_key="unused",
                              client_kwargs={"max_retries": 0})
    agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=4, verbosity_level=0, stream_outputs=stream)
    return str(agent.run("What is 6*7?"))


# name -> (run, tool calls the engine answers in turn, session metadata, answer, model calls)
FRAMEWORKS = {
    "openai-chat": (run_openai_chat, CALL, {}, REPLY, 2),
    "openai-responses": (run_openai_responses, CALL, {}, REPLY, 2),
    "openai-agents": (run_agents_sdk, CALL, {}, REPLY, 2),
    "anthropic": (run_anthropic, CALL, {}, REPLY, 2),
    "litellm": (run_litellm, CALL, {}, REPLY, 2),
    "langchain-openai": (run_langchain, CALL, {}, REPLY, 2),
    "smolagents": (run_smolagents, (CALL, FINAL), {"span_rule": "smolagents"}, "42", 2),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_tool_agent_is_recorded(kafka_bootstrap, registry_url, scripted_gateway, run_id, framework,
                                          stream):
    run, calls, metadata, expected, model_calls = FRAMEWORKS[framework]
    began_ms = int(time.time() * 1000) - 1000  # a second of slack for the clock's steps
    with scripted_gateway((REPLY,), calls) as gateway:
        session = open_session(gateway, run_id, metadata=metadata)
        assert run(session, stream) == expected
        finished = httpx.post(f"{gateway}/v1/sessions/{session['session_id']}/finish", json={"status": "ok"})
        assert finished.status_code == 200, finished.text

    recorded = read_recorded(kafka_bootstrap, registry_url, run_id, since_ms=began_ms)
    started, finish = recorded["forge.sessions"]
    assert started["base_url"] == session["base_url"] and started["metadata"] == metadata
    assert (finish["status"], finish["num_completions"], finish["num_tool_spans"]) == ("ok", model_calls, 1)

    completions = sorted(recorded["forge.completions"], key=lambda r: r["turn"])
    assert [c["turn"] for c in completions] == list(range(model_calls))
    for completion in completions:
        assert completion["trainable"], completion["untrainable_reason"]
        assert completion["session_id"] == session["session_id"] and completion["prompt_token_ids"]
        assert len(completion["completion_logprobs"]) == len(completion["completion_token_ids"])
        assert orjson.loads(completion["tools_json"])[0]["function"]["name"] == "calculator"
    first = completions[0]
    [call] = orjson.loads(first["tool_calls_json"])
    assert call["function"]["name"] == "calculator" and first["finish_reason"] == "tool_calls"
    assert first["completion_token_ids"] == encode(CALL) + [EOS]
    last = completions[-1]
    assert last["completion_token_ids"] == encode(calls[-1] if framework == "smolagents" else REPLY) + [EOS]
    assert last["prompt_ref"] == first["completion_id"]  # the history extends the first call: recorded by reference

    [span] = recorded["forge.tool_spans"]
    assert (span["name"], orjson.loads(span["arguments_json"]), span["status"]) == (
        "calculator", {"expression": "6*7"}, "ok")
    assert "42" in span["result"]  # the tool's output as the agent sent it back (smolagents wraps it in text)
    assert (span["tool_call_id"], span["span_id"]) == (call["id"], span_id(session["session_id"], call["id"]))
    assert span["completion_id"] == first["completion_id"] and span["source"] == "inferred"
    assert span["start_ms"] <= span["end_ms"] <= last["received_ms"]
