"""Synthetic rollout groups: the events an ingress and grader would emit for one task, for tests and benchmarks.

`group_events(group_id, seed=...)` returns (schema, record) pairs: a Task, G sessions of several turns each
(append-only histories with tool calls and results), tool spans (some failing), an untrainable completion, a
session that rewrites its history (a later prompt that is not an extension of the earlier one), outcome
rewards and SessionFinished events. Everything is derived from the seed, so the same call gives the same events.
"""

from __future__ import annotations

import json
import random

from forge_stream.events import deterministic_id

TOOLS = json.dumps([{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}])


VOCAB = 900  # token ids stay below the tiny model's vocabulary, so its trainer can take these samples


def group_events(group_id: str, *, seq: int = 0, group_size: int = 4, turns: int = 3, prompt_len: int = 24,
                 completion_len: int = 8, seed: int = 0, start_ms: int = 1_700_000_000_000,
                 domain: str = "agent") -> list[tuple[str, dict]]:
    rng = random.Random(f"{group_id}/{seed}")
    task_id = f"task-{group_id}"
    t = start_ms
    base = {"group_id": group_id, "task_id": task_id}
    events: list[tuple[str, dict]] = [("Task", {
        **base, "event_id": deterministic_id("task", group_id), "event_time": t, "seq": seq, "domain": domain,
        "grader": "exact_match", "group_size": group_size, "prompt_json": "{}", "metadata": {}})]
    system = [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
    for g in range(group_size):
        sid = f"{group_id}-s{g}"
        sbase = {**base, "session_id": sid}
        events.append(("SessionStarted", {**sbase, "event_id": deterministic_id("start", sid), "event_time": t + g,
                                          "base_url": f"http://gateway/s/{sid}/v1", "metadata": {}}))
        history = list(system)
        now = t + 10 + g
        for k in range(turns):
            if g == 1 and k == turns - 1 and k > 0:
                history = system[: prompt_len // 2] + [rng.randrange(1, VOCAB) for _ in range(4)]  # rewrite
            out = [rng.randrange(1, VOCAB) for _ in range(completion_len)]
            cid = f"{sid}-c{k}"
            calls_tool = k < turns - 1
            call = {"id": f"{cid}-call", "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "x"}' if g != 2 else "{broken"}}
            text = "Let me search." if g != 3 else "Let me search 让我搜索一下 for it."
            took = 20 * (g + 1) + rng.randrange(10)
            untrainable = g == 0 and k == 0 and turns > 1
            events.append(("Completion", {
                **sbase, "event_id": deterministic_id("completion", cid), "event_time": now + took,
                "completion_id": cid, "turn": k, "choice_index": 0, "request_id": f"req-{cid}", "model": "tiny",
                "engine_id": "local-0", "policy_version": 3 + (g % 2), "prompt_token_ids": list(history),
                "completion_token_ids": [] if untrainable else out,
                "completion_logprobs": [] if untrainable else [-rng.random() for _ in out],
                "messages_json": "[]", "tools_json": TOOLS, "output_text": text,
                "tool_calls_json": json.dumps([call]) if calls_tool else None,
                "finish_reason": "tool_calls" if calls_tool else "stop", "trainable": not untrainable,
                "untrainable_reason": "engine returned no token ids" if untrainable else None,
                "received_ms": now, "first_token_ms": now + 1, "done_ms": now + took, "agent": "",
                "temperature": 1.0, "top_p": 1.0, "logprobs_mode": "processed"}))
            now += took
            history = history + out
            if calls_tool:
                status = "error" if (g + k) % 3 == 0 else "ok"
                events.append(("ToolSpan", {
                    **sbase, "event_id": deterministic_id("span", cid), "event_time": now + 5,
                    "span_id": f"{cid}-span", "tool_call_id": call["id"], "name": "search",
                    "arguments_json": call["function"]["arguments"], "status": status,
                    "error": "timeout" if status == "error" else None, "start_ms": now, "end_ms": now + 5,
                    "source": "inferred", "completion_id": cid, "agent": ""}))
                now += 5
                history = history + [rng.randrange(1, VOCAB) for _ in range(3)]  # the tool result
        outcome = 1.0 if g % 2 == 0 or g == 3 else 0.0
        events.append(("Reward", {
            **sbase, "event_id": deterministic_id("outcome", sid), "event_time": now + 1, "kind": "outcome",
            "name": "exact_match", "value": outcome, "turn": None, "source": "grader", "metadata": {}}))
        events.append(("SessionFinished", {
            **sbase, "event_id": deterministic_id("finish", sid), "event_time": now + 2, "status": "ok",
            "num_completions": turns, "reason": None,
            "num_tool_spans": sum(schema == "ToolSpan" and r["session_id"] == sid for schema, r in events)}))
    return events
