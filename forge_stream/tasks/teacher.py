"""The scripted teacher: the ideal conversation for a suite task, in OpenAI chat format.

The conversation is what the example tool agent (examples/agents/tool_agent.py) would exchange with a model that
always acts right: the same system prompt and tools, a tool call where the domain needs one (arguments as the
engine's tool-call parser emits them), the tool's result as the agent reports it, and the bare answer. The teacher
reads the task as its grader does (`TaskSpec.graded`: the answer included), which the agent is never given.

>>> conv = demonstration({"question": "What is 12 + 30?", "answer": "42"}, "agent")
>>> [m["role"] for m in conv]
['system', 'user', 'assistant', 'tool', 'assistant']
>>> conv[2]["tool_calls"][0]["function"]["arguments"]
'{"expression": "12 + 30"}'
"""

from __future__ import annotations

import json

from forge_stream.tasks.suite import SYSTEM, lookup_key


def _call(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def demonstration(task: dict, domain: str) -> list[dict]:
    """The ideal messages for one task (as its grader sees it: `question`, `answer`, `store`, and the scaffold's
    `system` and `calls` where the task has them): [system, user, (tool call, tool result)?, answer]."""
    messages = [{"role": "system", "content": task.get("system", SYSTEM)}, {"role": "user", "content": task["question"]}]
    for call in task.get("calls") or []:  # the scaffold's own calls (copy): the calculator's result is the answer
        messages += [_call(call["name"], call["arguments"]),
                     {"role": "tool", "tool_call_id": "call_0", "content": task["answer"]}]
    if domain in ("agent", "calc"):
        expression = task["question"].removeprefix("What is ").removesuffix("?")
        messages += [_call("calculator", {"expression": expression}),
                     {"role": "tool", "tool_call_id": "call_0", "content": task["answer"]}]
    elif domain in ("lookup", "table"):
        key = lookup_key(task["question"])
        messages += [_call("lookup", {"key": key}),
                     {"role": "tool", "tool_call_id": "call_0", "content": task["store"][key]}]
    messages.append({"role": "assistant", "content": task["answer"]})
    return messages
