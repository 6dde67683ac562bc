"""The rollout controller: take tasks from a source, submit each as a group, run its G agents through the gateway.

It runs for as long as it is asked to: over a task source once, or again and again (`loop`, each pass a new
cycle number), until `stop` is set; then it takes no new group and lets the sessions in flight finish.

- Bounded: at most `concurrency` sessions in flight. A group waits until G slots are free, then publishes its
  Task on forge.tasks (acknowledged by Kafka; its `seq` is the submission order the windowed FIFO follows) and
  opens its G sessions as its agents start (see `episode.run_episode`).
- Isolated failures: a failed session is finished as "error" with its reason; a Task Kafka does not acknowledge
  fails its group; the summary counts both. Nothing aborts the run.
- Restart safe: group ids and Task event ids derive from (controller name, cycle, position in the source,
  task_id). On start the controller reads back the Tasks it published (`recovery`), skips them, keeps `seq`
  increasing, and finishes the sessions the previous run left open as "error" ("rollout controller restarted").
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from forge_stream.events import deterministic_id, now_ms
from forge_stream.kafka.producer import EventProducer
from forge_stream.rollout.agents import Agent
from forge_stream.rollout.client import GatewayCallError, GatewayClient, RetryPolicy
from forge_stream.rollout.episode import SessionOutcome, Slots, run_episode
from forge_stream.rollout.recovery import CONTROLLER_KEY, published_tasks, unfinished_sessions
from forge_stream.rollout.sources import TaskSpec
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)
RESTARTED = "rollout controller restarted"

__all__ = ["RolloutController", "RolloutSettings", "SequenceClock", "SessionOutcome", "TaskSpec"]


@dataclass(frozen=True)
class RolloutSettings:
    gateway_url: str
    bootstrap: str
    name: str = "rollout"  # the controller's name: part of every id; a restart finds its own Tasks by it
    admin_token: str | None = None
    concurrency: int = 8  # sessions in flight
    attempt: int = 0  # the first cycle number: the same tasks rolled out again as new groups
    loop: bool = False  # start the source over (next cycle) when it ends, until stopped
    max_groups: int | None = None  # stop taking groups after this many (this run)
    retry: RetryPolicy = field(default_factory=RetryPolicy)


class SequenceClock:
    """Monotonic submission numbers that also increase across controller restarts (microsecond clock)."""

    def __init__(self, floor: int = 0):
        self._last = floor

    def next(self) -> int:
        self._last = max(self._last + 1, time.time_ns() // 1000)
        return self._last


@dataclass(frozen=True)
class GroupIds:
    group_id: str
    event_id: str  # of its Task


class RolloutController:
    def __init__(self, settings: RolloutSettings, agent: Agent, producer: EventProducer):
        self.settings = settings
        self.agent = agent
        self.producer = producer
        self.client = GatewayClient(settings.gateway_url, settings.admin_token, settings.retry)
        self.slots = Slots(settings.concurrency)
        self.clock = SequenceClock()
        self.counts: Counter = Counter()
        self.rewards: list[float] = []

    def ids(self, cycle: int, position: int, task: TaskSpec) -> GroupIds:
        identity = (self.settings.name, cycle, position, task.task_id)
        return GroupIds(deterministic_id("group", *identity), deterministic_id("task", *identity))

    async def recover(self) -> set[str]:
        """Read back what an earlier run published; finish its open sessions. Returns the published Task ids."""
        published = await asyncio.to_thread(published_tasks, self.settings.bootstrap, self.settings.name)
        self.clock = SequenceClock(published.max_seq)
        for session_id in await asyncio.to_thread(unfinished_sessions, self.settings.bootstrap, published):
            try:
                if await self.client.status(session_id) == "open":
                    await self.client.finish(session_id, "error", RESTARTED)
                    self.counts["recovered_sessions"] += 1
            except GatewayCallError as exc:
                log.warning("could not close session %s left open by an earlier run: %s", session_id, exc)
        return set(published.tasks)

    async def _submit(self, task: TaskSpec, cycle: int, position: int, ids: GroupIds) -> None:
        """Publish the Task event (acknowledged by Kafka) that puts the group in the training queue."""
        metadata = {**task.metadata, CONTROLLER_KEY: self.settings.name, "cycle": str(cycle),
                    "position": str(position)}
        record = {"event_id": ids.event_id, "event_time": now_ms(), "task_id": task.task_id,
                  "group_id": ids.group_id, "seq": self.clock.next(), "domain": task.domain, "grader": task.grader,
                  "group_size": task.group_size, "prompt_json": json.dumps(task.prompt), "metadata": metadata}
        await self.producer.send(TOPICS.tasks, ids.group_id, record)

    async def _group(self, task: TaskSpec, cycle: int, position: int, ids: GroupIds, slots: int,
                     progress: Callable | None) -> None:
        released = 0

        async def release() -> None:
            nonlocal released
            if released < slots:
                released += 1
                await self.slots.give()

        async def session(index: int) -> SessionOutcome:
            session_id = deterministic_id("session", ids.group_id, index)
            metadata = {**task.metadata, "rollout_index": str(index), "domain": task.domain}
            try:
                return await run_episode(self.client, self.agent, task, ids.group_id, session_id, metadata)
            finally:
                await release()

        try:
            await self._submit(task, cycle, position, ids)
        except Exception as exc:  # Kafka did not take the Task: this group fails, the run goes on
            log.error("task %s was not submitted: %s", task.task_id, exc)
            self.counts["failed_groups"] += 1
            await self.slots.give(slots)
            return
        outcomes = await asyncio.gather(*(session(i) for i in range(task.group_size)))
        self.counts["groups"] += 1
        self.counts["sessions"] += len(outcomes)
        self.counts["failed_sessions"] += sum(not o.ok for o in outcomes)
        self.rewards += [o.reward for o in outcomes if o.reward is not None]
        for failed in (o for o in outcomes if not o.ok):
            log.warning("session %s of task %s failed: %s", failed.session_id, task.task_id, failed.reason)
        if progress:
            progress(task.task_id, outcomes)

    async def _take(self, n: int, stopped: asyncio.Future) -> int:
        """Wait for n slots; 0 if `stop` came first."""
        take = asyncio.ensure_future(self.slots.take(n))
        await asyncio.wait({take, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if take.done():
            return take.result()
        take.cancel()
        return 0

    async def run(self, source: Iterable[TaskSpec], stop: asyncio.Event | None = None,
                  progress: Callable[[str, list[SessionOutcome]], None] | None = None) -> dict:
        """Roll out the source (again each cycle with `loop`) until it ends, `max_groups`, or `stop`."""
        stop = stop or asyncio.Event()
        stopped = asyncio.ensure_future(stop.wait())
        running: set[asyncio.Task] = set()
        published = await self.recover()
        cycle, taken = self.settings.attempt, 0
        try:
            while not stop.is_set():
                seen = 0
                for position, task in enumerate(source):
                    seen += 1
                    if stop.is_set() or taken == self.settings.max_groups:
                        break
                    ids = self.ids(cycle, position, task)
                    if ids.event_id in published:
                        self.counts["skipped_groups"] += 1
                        continue
                    slots = await self._take(task.group_size, stopped)
                    if not slots:
                        break
                    taken += 1
                    job = asyncio.create_task(self._group(task, cycle, position, ids, slots, progress))
                    running.add(job)
                    job.add_done_callback(running.discard)
                if not self.settings.loop or not seen or taken == self.settings.max_groups:
                    break
                cycle += 1
            if running:
                await asyncio.gather(*running)
        finally:
            stopped.cancel()
            await self.client.aclose()
        return {**{k: self.counts[k] for k in ("groups", "sessions", "failed_sessions", "failed_groups",
                                                "skipped_groups", "recovered_sessions")},
                "cycles": cycle - self.settings.attempt + 1,
                "mean_reward": sum(self.rewards) / len(self.rewards) if self.rewards else None}
