"""The example agents (examples/agents/) as black boxes: real processes on the OpenAI SDK, through the real
gateway and the scripted engine, one process per episode and pooled (`--serve`)."""

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from forge_stream.kafka.history import read_completions
from forge_stream.kafka.producer import EventProducer
from forge_stream.rollout.client import RetryPolicy
from forge_stream.rollout.controller import RolloutController, RolloutSettings
from forge_stream.rollout.pool import PooledCommandAgent
from forge_stream.tasks.spec import TaskSpec
from forge_stream.topics import TOPICS

from helpers import since_this_test

AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"

# What the warm-start SFT renders its demonstrations with: the agent must use exactly these.
SYSTEM = "Answer with numbers only. Use a tool when useful."
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}, {"type": "function", "function": {"name": "lookup", "description": "Read the value stored under a key.", "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]  # noqa: E501


def load(name):
    sys.path.insert(0, str(AGENTS))
    try:
        spec = importlib.util.spec_from_file_location(name, AGENTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(AGENTS))


def test_prompt_and_tools_are_the_warm_start_ones():
    agent = load("tool_agent")
    assert agent.SYSTEM == SYSTEM and agent.TOOLS == TOOLS


def test_tools_and_tool_errors():
    agent = load("tool_agent")
    task = {"store": {"tern": "417"}}
    assert agent.run_tool(task, "calculator", '{"expression": "347 + 518"}') == "865"
    assert agent.run_tool(task, "calculator", '{"expression": "7 / 2"}') == "3.5"
    assert agent.run_tool(task, "lookup", '{"key": "tern"}') == "417"
    assert agent.run_tool(task, "lookup", '{"key": "wren"}') == "error: no value stored under 'wren'"
    assert agent.run_tool({}, "lookup", '{"key": "tern"}').startswith("error:")
    assert agent.run_tool(task, "calculator", '{"expression": "__import__(1)"}').startswith("error: ValueError")
    assert agent.run_tool(task, "calculator", "{not json").startswith("error: JSONDecodeError")
    assert agent.run_tool(task, "shell", "{}") == "error: unknown tool 'shell'"


def completions(bootstrap, session_id):
    found = read_completions(bootstrap, since_this_test(),
                             keep=lambda r: r["session_id"] == session_id)  # prompts whole
    return sorted(found, key=lambda r: r["turn"])


def open_session(gateway, run_id, name):
    response = httpx.post(f"{gateway}/v1/sessions", json={"task_id": name, "group_id": f"{run_id}-{name}"})
    assert response.status_code == 201
    return response.json()


def single_shot(script, session, task):
    env = {**os.environ, "OPENAI_BASE_URL": session["base_url"], "OPENAI_API_KEY": session["token"],
           "FORGE_TASK_JSON": json.dumps(task)}
    out = subprocess.run([sys.executable, str(AGENTS / script)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_tool_agent_single_shot_calls_the_tool_and_answers(kafka_bootstrap, gateway, run_id):
    session = open_session(gateway, run_id, "tool")
    task = {"question": "What is 6 * 7?", "max_tokens": 100}
    assert single_shot("tool_agent.py", session, task) == "The answer is 42.\n"
    turns = completions(kafka_bootstrap, session["session_id"])
    assert len(turns) == 2
    first, second = (json.loads(t["messages_json"]) for t in turns)
    assert first == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 6 * 7?"}]
    assert second[-1]["role"] == "tool" and second[-1]["content"] == "42"
    assert json.loads(turns[0]["tools_json"]) == TOOLS


def test_summarizing_agent_rewrites_its_context(kafka_bootstrap, gateway, run_id):
    session = open_session(gateway, run_id, "summary")
    single_shot("summarizing_agent.py", session, {"question": "What is 6 * 7?", "context_budget": 1,
                                                  "max_tokens": 100, "max_turns": 2})
    turns = completions(kafka_bootstrap, session["session_id"])
    asks = [json.loads(t["messages_json"]) for t in turns]
    assert len(turns) == 4  # ask, summarize, ask (rewritten), summarize
    assert asks[1][-1]["role"] == "user" and asks[1][-1]["content"].startswith("Summarize")
    assert turns[1]["tools_json"] is None
    assert asks[2] == [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": "What is 6 * 7?\nSummary so far: The answer is 42."}]
    # the rewritten prompt does not extend the earlier turns: a new branch of the group's prefix tree
    history = turns[0]["prompt_token_ids"] + turns[0]["completion_token_ids"]
    assert turns[2]["prompt_token_ids"][:len(history)] != history


def test_controller_runs_the_tool_agent_pooled(kafka_bootstrap, gateway, run_id):
    prompt = {"question": "What is 6 * 7?", "answer": "42", "max_tokens": 100}
    tasks = [TaskSpec(f"{run_id}-{i}", prompt, "agent", "numeric", 2) for i in range(3)]
    settings = RolloutSettings(gateway, kafka_bootstrap, name=run_id, concurrency=6,
                               retry=RetryPolicy(attempts=2, backoff_s=0.01))

    async def main():
        agent = PooledCommandAgent(f"{sys.executable} {AGENTS / 'tool_agent.py'} --serve", workers=1, per_worker=6)
        producer = EventProducer(kafka_bootstrap)
        try:
            return await RolloutController(settings, agent, producer).run(tasks)
        finally:
            await agent.aclose()
            producer.close()

    result = asyncio.run(main())
    assert result == {**result, "groups": 3, "sessions": 6, "failed_sessions": 0, "mean_reward": 1.0}
