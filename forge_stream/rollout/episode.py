"""One episode (one session) from open to finish, and the session slots that bound how many run at once.

Shared by the rollout controller and the evaluator. An episode opens its session right before its agent starts
and finishes it right after the agent ends (the reward is posted in between), so the gateway's SessionStarted ->
SessionFinished span measures the agent's own time. Whatever fails (the agent, the grader, a gateway call after its
retries) fails this episode alone: the session is finished with status "error" and the reason. The agent gets the
task's prompt; its reference (the answer) goes to the grader alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from forge_stream.rollout.agents import Agent, AgentContext, AgentResult
from forge_stream.rollout.client import GatewayCallError, GatewayClient
from forge_stream.rollout.graders import resolve
from forge_stream.tasks.spec import TaskSpec


@dataclass(frozen=True)
class SessionOutcome:
    session_id: str
    task_id: str
    domain: str
    reward: float | None  # None: no reward was recorded
    ok: bool
    reason: str | None = None
    opened: bool = True  # False: the gateway did not open the session (no agent ran)


class Slots:
    """Session slots. A group takes its G slots at once (waiting until G are free), and each of its sessions gives
    one back as it ends. A group larger than the whole pool waits for all of it and runs alone."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("concurrency must be at least 1")
        self.capacity = capacity
        self.free = capacity
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> int:
        n = min(n, self.capacity)
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= n)
            self.free -= n
        return n

    async def give(self, n: int = 1) -> None:
        async with self._changed:
            self.free += n
            self._changed.notify_all()


async def _run_agent(agent: Agent, ctx: AgentContext) -> AgentResult:
    try:
        return await agent(ctx)
    except Exception as exc:  # a broken agent runner fails this episode, not the run
        return AgentResult("", False, f"agent runner failed: {type(exc).__name__}: {exc}")


def _grade(task: TaskSpec, result: AgentResult) -> tuple[float, bool, str | None]:
    if not result.ok:
        return 0.0, False, result.reason
    try:
        return float(resolve(task.grader)(task.graded, result.output)), True, None
    except Exception as exc:  # the grader's failure is this episode's, reported with its reason
        return 0.0, False, f"grader {task.grader} failed: {type(exc).__name__}: {exc}"


async def _finish_failed(client: GatewayClient, session_id: str, reason: str) -> str:
    try:
        await client.finish(session_id, "error", reason)
        return reason
    except GatewayCallError as exc:
        return f"{reason}; the session could not be finished either: {exc}"


async def run_episode(client: GatewayClient, agent: Agent, task: TaskSpec, group_id: str, session_id: str,
                      metadata: dict[str, str]) -> SessionOutcome:
    """Open the session, run the agent, grade, post the outcome reward, finish the session."""

    def outcome(reward: float | None, ok: bool, reason: str | None, opened: bool = True) -> SessionOutcome:
        return SessionOutcome(session_id, task.task_id, task.domain, reward, ok, reason, opened)

    try:
        created = await client.open(session_id, task.task_id, group_id, metadata)
    except GatewayCallError as exc:  # it may exist all the same (an answer lost on the way back): close it if so
        with contextlib.suppress(GatewayCallError):  # a session that does not exist cannot be finished (404)
            await client.finish(session_id, "error", str(exc))
        return outcome(None, False, str(exc), opened=False)
    result = await _run_agent(agent, AgentContext(session_id, created["base_url"], created["token"], task.prompt))
    reward, ok, reason = _grade(task, result)
    try:
        await client.reward(session_id, {"value": reward, "kind": "outcome", "name": task.grader,
                                         "source": "rollout-controller"}, key=f"outcome:{task.grader}")
    except GatewayCallError as exc:
        return outcome(None, False, await _finish_failed(client, session_id, f"posting the reward failed: {exc}"))
    try:
        await client.finish(session_id, "ok" if ok else "error", reason)
    except GatewayCallError as exc:
        return outcome(reward, False, f"finishing failed: {exc}")
    return outcome(reward, ok, reason)
