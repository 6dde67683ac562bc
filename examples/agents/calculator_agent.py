"""An ordinary OpenAI-SDK agent with one tool; forge-stream trains it without changing a line.

It reads its task from FORGE_TASK_JSON (or stdin), talks to whatever OPENAI_BASE_URL points at, runs the
`calculator` tool when the model calls it, and prints its final answer on stdout.
"""

import json
import os
import sys

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]


def calculator(expression: str) -> str:
    if not set(expression) <= set("0123456789+-*/(). "):
        raise ValueError(f"unsupported characters in {expression!r}")
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - the character set above is arithmetic only


def main() -> None:
    task = json.loads(os.environ.get("FORGE_TASK_JSON") or sys.stdin.read())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    messages = [{"role": "system", "content": "Answer with a number. Use the calculator tool when useful."},
                {"role": "user", "content": task["question"]}]
    reply = None
    for _ in range(int(task.get("max_turns", 3))):
        reply = client.chat.completions.create(model=os.environ.get("OPENAI_MODEL", "default"), messages=messages,
                                               tools=TOOLS, max_tokens=int(task.get("max_tokens", 24)),
                                               temperature=1.0)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculator(json.loads(call.function.arguments)["expression"])
            except Exception as exc:  # a tool error is part of the episode, reported back to the model
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(reply.choices[0].message.content or "")


if __name__ == "__main__":
    main()
