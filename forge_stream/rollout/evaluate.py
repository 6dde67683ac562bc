"""Held-out evaluation: run tasks through the gateway with the agent, grade, and report the mean outcome reward per
domain with a 95% confidence interval, as EvalResult events on forge.evals.

It reuses the controller's episode machinery (sessions opened right before the agent starts, bounded concurrency,
isolated failures) but publishes no Task on forge.tasks and marks every session `{"purpose": "eval"}`, so the
processors never turn them into training samples. An episode whose agent fails scores 0 and is counted as failed.

The policy version evaluated is read from the Completions the gateway recorded for the eval's own sessions
(forge.completions, from the eval's start): the engine stamps every completion with the weights that produced it.
If the engine switched weights mid-eval, the oldest version is reported and all are listed in the metadata. With
no completion recorded (every agent failed before asking), it falls back to the run's latest PolicyVersion on
forge.policy, else 0 (the initial weights).

The same Completions say how each session acted (`acting`): whether the model wrote a tool call, whether every call
it wrote parsed into a call of an offered tool with a JSON object of arguments, and how many turns it took.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from forge_stream.events import deterministic_id, now_ms
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.processors.rules import TurnContext, invalid_tool_call
from forge_stream.rollout.agents import Agent
from forge_stream.rollout.client import GatewayClient, RetryPolicy
from forge_stream.rollout.episode import SessionOutcome, Slots, run_episode
from forge_stream.tasks.spec import TaskSpec
from forge_stream.topics import TOPICS

Z95 = 1.959963984540054
EVAL_METADATA = {"purpose": "eval"}


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a 0/1 mean.

    >>> [round(x, 3) for x in wilson(8, 10)]
    [0.49, 0.943]
    >>> wilson(0, 5)[0]
    0.0
    """
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% interval: Wilson for 0/1 rewards, the normal approximation otherwise.

    >>> [round(x, 3) for x in interval([0.5, 1.0, 0.0, 0.5])]
    [0.5, 0.1, 0.9]
    >>> interval([1.0, 0.0])[0]
    0.5
    """
    n = len(values)
    if n == 0:
        return 0.0, 0.0, 0.0
    mean = sum(values) / n
    if all(v in (0.0, 1.0) for v in values):
        return (mean, *wilson(round(sum(values)), n))
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = Z95 * sd / math.sqrt(n)
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class DomainScore:
    domain: str
    episodes: int
    failed: int
    mean: float
    low: float
    high: float


def score(outcomes: list[SessionOutcome]) -> list[DomainScore]:
    """One score per domain (sorted), then "all"; a failed episode counts as reward 0."""
    by_domain: dict[str, list[SessionOutcome]] = {}
    for o in outcomes:
        by_domain.setdefault(o.domain, []).append(o)
    scores = []
    for domain, group in [*sorted(by_domain.items()), ("all", outcomes)]:
        mean, low, high = interval([o.reward if o.ok and o.reward is not None else 0.0 for o in group])
        scores.append(DomainScore(domain, len(group), sum(not o.ok for o in group), mean, low, high))
    return scores


@dataclass(frozen=True)
class EvalSettings:
    gateway_url: str
    bootstrap: str
    eval_id: str
    run: str = "default"
    split: str = "heldout"
    agent_name: str = ""
    admin_token: str | None = None
    concurrency: int = 8
    samples: int = 1  # episodes per task
    limit: int | None = None  # tasks to take from the source (an endless suite needs one)
    retry: RetryPolicy = field(default_factory=RetryPolicy)


async def run_eval(settings: EvalSettings, agent: Agent, tasks: Iterable[TaskSpec],
                   progress=None) -> list[SessionOutcome]:
    """Every task's episodes, at most `concurrency` at once; sessions carry `{"purpose": "eval"}`."""
    client = GatewayClient(settings.gateway_url, settings.admin_token, settings.retry)
    slots = Slots(settings.concurrency)
    jobs: list[asyncio.Task] = []

    async def episode(task: TaskSpec, group_id: str, index: int) -> SessionOutcome:
        try:
            metadata = {**task.metadata, **EVAL_METADATA, "eval_id": settings.eval_id, "domain": task.domain,
                        "rollout_index": str(index)}
            outcome = await run_episode(client, agent, task, group_id,
                                        deterministic_id("session", group_id, index), metadata)
            if progress:
                progress(outcome)
            return outcome
        finally:
            await slots.give()

    try:
        for position, task in enumerate(tasks):
            if position == settings.limit:
                break
            group_id = deterministic_id("eval-group", settings.eval_id, position, task.task_id)
            for index in range(settings.samples):
                await slots.take(1)
                jobs.append(asyncio.create_task(episode(task, group_id, index)))
        return list(await asyncio.gather(*jobs))
    finally:
        await client.aclose()


def recorded_completions(bootstrap: str, session_ids: set[str], since_ms: int) -> list[dict]:
    """The Completions recorded for `session_ids` (forge.completions from `since_ms`)."""
    return [e.record for e in read_slice(bootstrap, TOPICS.completions, Slice(start_ms=since_ms))
            if e.record["session_id"] in session_ids]


def recorded_versions(completions: list[dict]) -> Counter:
    """How many of the Completions each policy version produced."""
    return Counter(c["policy_version"] for c in completions)


def _valid_calls(completion: dict) -> bool:
    """Every tool call of the completion parsed, names a tool the request offered, and has a JSON object of
    arguments: the processors' `invalid_tool_call` rule does not fire on it."""
    return invalid_tool_call(TurnContext(completion, ())) == 0.0


def acting(outcomes: list[SessionOutcome], completions: list[dict]) -> dict[str, dict]:
    """Per domain, then "all": `tool_call_rate` (the share of sessions in which the model wrote a tool call, parsed
    or not), `valid_call_rate` (of those, the share whose every call parsed into a call of an offered tool with JSON
    object arguments) and `mean_turns` (the model's completions per session).

    >>> outcomes = [SessionOutcome("s1", "t1", "calc", 1.0, True), SessionOutcome("s2", "t2", "calc", 0.0, True)]
    >>> tools = json.dumps([{"type": "function", "function": {"name": "calculator"}}])
    >>> call = json.dumps([{"function": {"name": "calculator", "arguments": '{"expression": "2 * 3"}'}}])
    >>> completions = [{"session_id": "s1", "tools_json": tools, "tool_calls_json": call},
    ...                {"session_id": "s1", "tools_json": tools}, {"session_id": "s2", "tools_json": tools}]
    >>> acting(outcomes, completions)["calc"]
    {'sessions': 2, 'tool_call_rate': 0.5, 'valid_call_rate': 1.0, 'mean_turns': 1.5}
    """
    by_session: dict[str, list[dict]] = {}
    for completion in completions:
        by_session.setdefault(completion["session_id"], []).append(completion)
    by_domain: dict[str, list[SessionOutcome]] = {}
    for outcome in outcomes:
        by_domain.setdefault(outcome.domain, []).append(outcome)
    rates = {}
    for domain, group in [*sorted(by_domain.items()), ("all", outcomes)]:
        turns = [by_session.get(o.session_id, []) for o in group]
        called = [t for t in turns if any(c.get("tool_calls_json") or c.get("tool_call_error") for c in t)]
        valid = [t for t in called if all(_valid_calls(c) for c in t)]
        rates[domain] = {"sessions": len(group), "tool_call_rate": len(called) / len(group) if group else 0.0,
                         "valid_call_rate": len(valid) / len(called) if called else 0.0,
                         "mean_turns": sum(map(len, turns)) / len(group) if group else 0.0}
    return rates


def latest_policy(bootstrap: str, run: str) -> int:
    """The run's newest PolicyVersion on forge.policy, 0 without one."""
    return max((e.record["version"] for e in read_slice(bootstrap, TOPICS.policy, Slice()) if e.key == run),
               default=0)


def eval_records(settings: EvalSettings, scores: list[DomainScore], policy_version: int,
                 metadata: dict[str, str]) -> list[dict]:
    """EvalResult events, one per domain and one for "all", with ids derived from the eval and the domain."""
    return [{"event_id": deterministic_id("eval", settings.eval_id, s.domain), "event_time": now_ms(),
             "eval_id": settings.eval_id, "run": settings.run, "policy_version": policy_version,
             "domain": s.domain, "split": settings.split, "episodes": s.episodes, "failed": s.failed,
             "mean_reward": s.mean, "ci_low": s.low, "ci_high": s.high, "agent": settings.agent_name,
             "metadata": metadata} for s in scores]
