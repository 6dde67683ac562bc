"""An ordinary OpenAI-SDK agent with two tools; forge-stream trains it without changing a line.

Tools: `calculator(expression)` (arithmetic only) and `lookup(key)`, which reads the task's own key-value store
(`task["store"]`). The agent asks the model, runs the tools it calls, feeds the results back, and stops when the
model answers without a tool call (or after `max_turns`); its answer is the last assistant message.

A task may shape the scaffold (the suite's families for a pretrained model do): `system` replaces the system prompt,
`tools` names the tools offered (`[]`: none, the model answers directly), and `calls` lists tool calls the scaffold
makes itself before it asks the model, as a planner's first step or a retriever does: each runs, and its call and
result join the conversation as an assistant tool call and its tool message, so the model answers from the result.

Two modes, nothing forge-specific in either:

- single shot: the task JSON comes from FORGE_TASK_JSON (or stdin), the endpoint from OPENAI_BASE_URL and
  OPENAI_API_KEY; the answer is printed on stdout.
- `--serve`: JSON lines on stdin, `{"id", "base_url", "api_key", "task"}` per episode; episodes run concurrently
  in a thread pool (FORGE_AGENT_THREADS, default 64) and each answers `{"id", "output"}` or `{"id", "error"}`
  on stdout. The process lives until stdin ends.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI

SYSTEM = "Answer with numbers only. Use a tool when useful."
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}, {"type": "function", "function": {"name": "lookup", "description": "Read the value stored under a key.", "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]  # noqa: E501 - verbatim: the warm-start demonstrations use exactly these
MODEL = os.environ.get("OPENAI_MODEL", "default")
ARITHMETIC = set("0123456789+-*/(). ")


def calculator(expression: str) -> str:
    if not set(expression) <= ARITHMETIC:
        raise ValueError(f"unsupported characters in {expression!r}")
    value = eval(expression, {"__builtins__": {}})  # noqa: S307 - the character set above is arithmetic only
    return str(int(value)) if float(value).is_integer() else str(value)


def run_tool(task: dict, name: str, arguments: str) -> str:
    """A tool's result, or "error: ..." for bad arguments, an unknown tool or a failing tool."""
    try:
        args = json.loads(arguments or "{}")
        if name == "calculator":
            return calculator(str(args["expression"]))
        if name == "lookup":
            store = task.get("store") or {}
            key = str(args["key"])
            if key not in store:
                return f"error: no value stored under {key!r}"
            return str(store[key])
        return f"error: unknown tool {name!r}"
    except Exception as exc:  # a tool error is part of the episode, reported back to the model
        return f"error: {type(exc).__name__}: {exc}"


def offered(task: dict) -> list[dict]:
    """The tools the task's scaffold offers the model: all of them unless the task names some (or none)."""
    names = task.get("tools")
    return TOOLS if names is None else [t for t in TOOLS if t["function"]["name"] in names]


def ask(client: OpenAI, task: dict, messages: list[dict]):
    tools = offered(task)
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=int(task.get("max_tokens", 32)),
        temperature=float(task.get("temperature", 1.0)), **({"tools": tools} if tools else {}))


def scaffold_calls(task: dict, messages: list[dict]) -> None:
    """The tool calls the scaffold makes itself before the model is asked (`task["calls"]`), with their results."""
    for index, call in enumerate(task.get("calls") or []):
        arguments = json.dumps(call.get("arguments") or {})
        call_id = f"call_scaffold_{index}"
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": run_tool(task, call["name"], arguments)})


def run_tools(task: dict, messages: list[dict], message) -> bool:
    """Append the assistant message and its tool results; False when the model called no tool."""
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": run_tool(task, call.function.name, call.function.arguments)})
    return bool(message.tool_calls)


def solve(client: OpenAI, task: dict) -> str:
    messages = [{"role": "system", "content": task.get("system", SYSTEM)}, {"role": "user", "content": task["question"]}]
    scaffold_calls(task, messages)
    content = ""
    for _ in range(int(task.get("max_turns", 3))):
        message = ask(client, task, messages).choices[0].message
        content = message.content or ""
        if not run_tools(task, messages, message):
            break
    return content


def serve(solve_one) -> None:
    """The JSON-lines protocol: one episode per stdin line, answered on stdout as it ends."""
    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
    write = threading.Lock()

    def episode(request: dict) -> None:
        try:
            client = OpenAI(base_url=request["base_url"], api_key=request["api_key"], max_retries=3,
                            http_client=http)
            reply = {"id": request["id"], "output": solve_one(client, request["task"])}
        except Exception as exc:  # the episode fails, the server goes on
            reply = {"id": request.get("id"), "error": f"{type(exc).__name__}: {exc}"}
        with write:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()

    with ThreadPoolExecutor(int(os.environ.get("FORGE_AGENT_THREADS", "64"))) as pool:
        for line in sys.stdin:
            if line.strip():
                pool.submit(episode, json.loads(line))


def main(solve_one=solve) -> None:
    if "--serve" in sys.argv[1:]:
        serve(solve_one)
        return
    task = json.loads(os.environ.get("FORGE_TASK_JSON") or sys.stdin.read())
    print(solve_one(OpenAI(max_retries=3), task))  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment


if __name__ == "__main__":
    main()
