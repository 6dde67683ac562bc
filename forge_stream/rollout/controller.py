"""The rollout controller: submit tasks, open G sessions per task on the gateway, run the agents, grade, reward,
finish.

Each task becomes a Task event on forge.tasks (its `seq` is the submission order the windowed FIFO follows) and a
group of G sessions. Session ids are derived from the task and rollout index, so re-running a task after a crash
addresses the same sessions (the gateway answers 409 for ones already finished, which are skipped).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from forge_stream.events import deterministic_id, now_ms
from forge_stream.kafka.producer import EventProducer
from forge_stream.rollout.agents import Agent, AgentContext
from forge_stream.rollout.graders import resolve
from forge_stream.topics import TOPICS


@dataclass(frozen=True)
class TaskSpec:
    task_id: str
    prompt: dict  # free-form payload for the agent and grader, e.g. {"question": ..., "answer": ...}
    domain: str = "agent"
    grader: str = "exact_match"
    group_size: int = 4
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: dict) -> "TaskSpec":
        return cls(raw["task_id"], raw["prompt"], raw.get("domain", "agent"), raw.get("grader", "exact_match"),
                   int(raw.get("group_size", 4)), {k: str(v) for k, v in raw.get("metadata", {}).items()})


@dataclass(frozen=True)
class RolloutSettings:
    gateway_url: str
    bootstrap: str
    admin_token: str | None = None
    concurrency: int = 8  # agents running at once
    attempt: int = 0  # part of the group id: the same task can be rolled out again as a new group


@dataclass(frozen=True)
class SessionOutcome:
    session_id: str
    reward: float
    ok: bool
    reason: str | None


class SequenceClock:
    """Monotonic submission numbers that also increase across controller restarts (microsecond clock)."""

    def __init__(self):
        self._last = 0

    def next(self) -> int:
        self._last = max(self._last + 1, time.time_ns() // 1000)
        return self._last


class RolloutController:
    def __init__(self, settings: RolloutSettings, agent: Agent, producer: EventProducer):
        self.settings = settings
        self.agent = agent
        self.producer = producer
        self.clock = SequenceClock()
        headers = {"Authorization": f"Bearer {settings.admin_token}"} if settings.admin_token else {}
        self.http = httpx.AsyncClient(base_url=settings.gateway_url, headers=headers, timeout=60)
        self.slots = asyncio.Semaphore(settings.concurrency)

    def group_id(self, task: TaskSpec) -> str:
        return deterministic_id("group", task.task_id, self.settings.attempt)

    async def submit(self, task: TaskSpec) -> dict:
        """Publish the Task event (acknowledged by Kafka) that puts the group in the training queue."""
        record = {"event_id": deterministic_id("task", task.task_id, self.settings.attempt), "event_time": now_ms(),
                  "task_id": task.task_id, "group_id": self.group_id(task), "seq": self.clock.next(),
                  "domain": task.domain, "grader": task.grader, "group_size": task.group_size,
                  "prompt_json": json.dumps(task.prompt), "metadata": task.metadata}
        await self.producer.send(TOPICS.tasks, record["group_id"], record)
        return record

    async def run_group(self, task: TaskSpec) -> list[SessionOutcome]:
        await self.submit(task)
        return list(await asyncio.gather(*(self._rollout(task, i) for i in range(task.group_size))))

    async def _rollout(self, task: TaskSpec, index: int) -> SessionOutcome:
        session_id = deterministic_id("session", self.group_id(task), index)
        created = await self.http.post("/v1/sessions", json={
            "task_id": task.task_id, "group_id": self.group_id(task), "session_id": session_id,
            "metadata": {**task.metadata, "rollout_index": str(index), "domain": task.domain}})
        if created.status_code == 409:  # finished in an earlier run of this controller
            return SessionOutcome(session_id, float("nan"), True, "already finished")
        created.raise_for_status()
        session = created.json()
        async with self.slots:
            result = await self.agent(AgentContext(session_id, session["base_url"], session["token"], task.prompt))
        grader = resolve(task.grader)
        reward = grader(task.prompt, result.output) if result.ok else 0.0
        await self._post(session_id, "reward", {"value": reward, "kind": "outcome", "name": task.grader,
                                                "source": "rollout-controller"})
        await self._post(session_id, "finish", {"status": "ok" if result.ok else "error", "reason": result.reason})
        return SessionOutcome(session_id, reward, result.ok, result.reason)

    async def _post(self, session_id: str, action: str, body: dict) -> None:
        response = await self.http.post(f"/v1/sessions/{session_id}/{action}", json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"gateway refused {action} for session {session_id}: "
                               f"{response.status_code} {response.text[:300]}")

    async def run(self, tasks: list[TaskSpec], progress=None) -> dict:
        """Roll out every task (groups in submission order, agents bounded by `concurrency`)."""
        outcomes: dict[str, list[SessionOutcome]] = {}

        async def one(task: TaskSpec):
            outcomes[task.task_id] = await self.run_group(task)
            if progress:
                progress(task.task_id, outcomes[task.task_id])

        await asyncio.gather(*(one(t) for t in tasks))
        await self.http.aclose()
        rewards = [o.reward for group in outcomes.values() for o in group if o.reward == o.reward]
        return {"groups": len(outcomes), "sessions": sum(map(len, outcomes.values())),
                "failed_sessions": sum(not o.ok for g in outcomes.values() for o in g),
                "mean_reward": sum(rewards) / len(rewards) if rewards else None}
