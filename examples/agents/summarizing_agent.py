"""The tool agent (tool_agent.py) managing its own context: past a budget it summarizes and starts over.

Same tools, same loop, same two modes (single shot, `--serve`). After a turn's tool results, when the
conversation is over the budget it asks the model, through the same endpoint, for a summary (a separate chat
call ending with a "Summarize ..." instruction, no tools) and continues from
`[system, user: question + "\\nSummary so far: " + summary]`. Its prompts then stop extending one another: the
trainer sees a tree of shared prefixes rather than one growing history.

The budget counts prompt tokens: the `usage` of the last response (its prompt plus its completion), or the
conversation's characters / 4 when the endpoint reports no usage. It comes from `task["context_budget"]`, else
the CONTEXT_BUDGET environment variable, else 2048.
"""

from __future__ import annotations

import json
import os

from openai import OpenAI
from tool_agent import SYSTEM, ask, main, run_tools

SUMMARIZE = "Summarize the conversation so far in one short paragraph. Keep every number and tool result."
DEFAULT_BUDGET = int(os.environ.get("CONTEXT_BUDGET", "2048"))


def size(messages: list[dict], usage) -> int:
    if usage is not None and usage.prompt_tokens is not None:
        return usage.prompt_tokens + (usage.completion_tokens or 0)
    return len(json.dumps(messages)) // 4


def summarize(client: OpenAI, task: dict, messages: list[dict]) -> str:
    reply = client.chat.completions.create(
        model=os.environ.get("OPENAI_MODEL", "default"), messages=[*messages, {"role": "user", "content": SUMMARIZE}],
        max_tokens=int(task.get("summary_max_tokens", 64)), temperature=float(task.get("temperature", 1.0)))
    return reply.choices[0].message.content or ""


def solve(client: OpenAI, task: dict) -> str:
    budget = int(task.get("context_budget", DEFAULT_BUDGET))
    start = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    messages, content = list(start), ""
    for _ in range(int(task.get("max_turns", 3))):
        reply = ask(client, task, messages)
        message = reply.choices[0].message
        content = message.content or ""
        if not run_tools(task, messages, message):
            break
        if size(messages, reply.usage) > budget:
            summary = summarize(client, task, messages)
            messages = [start[0], {"role": "user", "content": task["question"] + "\nSummary so far: " + summary}]
    return content


if __name__ == "__main__":
    main(solve)
