"""The rollout controller: take tasks from a source, submit each as a group, run its G agents through the gateway.

It runs for as long as it is asked to: over a task source once, or again and again (`loop`, each pass a new
cycle number), until `stop` is set; then it takes no new group and lets the sessions in flight finish.

- Bounded: at most `concurrency` sessions in flight. A group waits until G slots are free, then publishes its
  Task on forge.tasks (acknowledged by Kafka; its `seq` is the submission order the windowed FIFO follows) and
  opens its G sessions as its agents start (see `episode.run_episode`).
- Isolated failures: a failed session is finished as "error" with its reason; a Task Kafka does not acknowledge
  fails its group; the summary counts both, and each distinct reason once with its count (`failures`), rather than
  a line per session. Nothing aborts the run.
- A group none of whose sessions opened (the gateway went away) is closed at once: the controller publishes its
  GroupSkipped (forge.samples, the id the processors would give it) with the reason, so the windowed FIFO retires
  it instead of waiting for the processors to cut it idle.
- Restart safe: group ids and Task event ids derive from (controller name, cycle, position in the source,
  task_id). On start the controller reads back the Tasks it published (`recovery`), skips them, keeps `seq`
  increasing, and finishes the sessions the previous run left open as "error" ("rollout controller restarted").
  A published group in which no session ran (none opened, or every one failed) does not count as submitted: its
  task is rolled out again as a new group, whose ids add how many times that happened (`again`, in its metadata).
- Rollouts where they teach (`replay_edge`, off by default): a group whose rewards differ is the only kind that
  carries a gradient (GRPO-style advantages are zero in a group scored alike), and on the shipped suite tasks are
  nearly always solved or nearly never, so most groups carry none. With `replay_edge` = r, before each task of the
  source the controller re-runs, with probability r (again and again: about a share r of all groups), the most
  recent task at the edge (its last group's rewards differed) as a new group (prioritized level replay, Jiang et
  al. 2021). A replayed group is tagged `replay_of` (the group it follows) in its Task metadata; its position is
  `edge:<that group's id>`, so its ids are deterministic too. The edge queue lives in memory: a restart starts it
  empty.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from forge_stream.events import deterministic_id, now_ms
from forge_stream.kafka.producer import EventProducer
from forge_stream.rollout.agents import Agent
from forge_stream.rollout.client import GatewayCallError, GatewayClient, RetryPolicy
from forge_stream.rollout.episode import SessionOutcome, Slots, run_episode
from forge_stream.rollout.recovery import CONTROLLER_KEY, RESTARTED, published_sessions, published_tasks
from forge_stream.tasks.spec import TaskSpec
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)

__all__ = ["ProgressLog", "RolloutController", "RolloutSettings", "SequenceClock", "SessionOutcome"]


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
    replay_edge: float = 0.0  # share of groups that re-run a recent task whose group's rewards differed
    edge_capacity: int = 256  # tasks at the edge kept for replay (the most recent)

    def __post_init__(self):
        if not 0.0 <= self.replay_edge < 1.0:
            raise ValueError(f"replay_edge is a share of the groups, at least 0 and below 1, not {self.replay_edge}")


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


class Mean:
    """A running mean; `value` is None before anything was added."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def add(self, values: Iterable[float]) -> None:
        for v in values:
            self.total += v
            self.count += 1

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


def _mean(m: Mean) -> str:
    return "no reward yet" if m.value is None else f"mean reward {m.value:.3f}"


def failure(outcome: SessionOutcome) -> str:
    """Why a session failed, on one line and without its own id, so that sessions that failed alike read alike.

    >>> failure(SessionOutcome("s9", "t", "qa", None, False, "gateway refused opening session s9:\\n HTTP 409"))
    'gateway refused opening session <session>: HTTP 409'
    """
    return " ".join((outcome.reason or "no reason given").replace(outcome.session_id, "<session>").split())


class Failures:
    """The reasons sessions failed for, each once with its count: at most `kinds` distinct ones (a run that loops for
    days keeps a bounded tally), the rest counted under OTHER."""

    OTHER = "(other reasons)"

    def __init__(self, kinds: int = 20):
        self.kinds = kinds
        self.counts: Counter = Counter()

    def add(self, outcomes: Iterable[SessionOutcome]) -> None:
        for o in outcomes:
            if not o.ok:
                reason = failure(o)
                self.counts[reason if reason in self.counts or len(self.counts) < self.kinds else self.OTHER] += 1

    def top(self) -> str | None:
        return self.counts.most_common(1)[0][0] if self.counts else None


class ProgressLog:
    """What a controller without a terminal says in its log (a `forge-stream up learn` service, a piped run):
    every `every_s` seconds, one INFO line with the groups, sessions (failed, and the commonest reason) and mean
    outcome reward (per domain) of the last interval and of the whole run, and the sessions in flight; a stalled run
    says "0 groups" rather than nothing.

    >>> p = ProgressLog(30.0, capacity=8, now=lambda: 100.0)
    >>> p.add([SessionOutcome("s1", "t", "agent", 1.0, True), SessionOutcome("s2", "t", "agent", 0.0, False, "x")])
    >>> p.line(in_flight=6, now=130.0)
    'last 30 s: 1 groups, 2 sessions (1 failed: x), mean reward 0.500 (agent 0.500); in all: 1 groups, 2 sessions, \
mean reward 0.500; 6 of 8 sessions in flight'
    >>> p.line(in_flight=8, now=160.0)
    'last 30 s: 0 groups, 0 sessions (0 failed), no reward yet; in all: 1 groups, 2 sessions, mean reward 0.500; \
8 of 8 sessions in flight'
    """

    def __init__(self, every_s: float, capacity: int, now: Callable[[], float] = time.monotonic):
        self.every_s, self.capacity, self._now = every_s, capacity, now
        self.groups = self.sessions = 0
        self.rewarded = Mean()
        self._since = now()
        self._reset()

    def _reset(self) -> None:
        self._groups = self._sessions = 0
        self._failed = Failures(kinds=5)
        self._rewarded = Mean()
        self._domains: dict[str, Mean] = {}

    def add(self, outcomes: list[SessionOutcome]) -> None:
        rewards = [o.reward for o in outcomes if o.reward is not None]
        self.groups, self._groups = self.groups + 1, self._groups + 1
        self.sessions, self._sessions = self.sessions + len(outcomes), self._sessions + len(outcomes)
        self._failed.add(outcomes)
        self.rewarded.add(rewards)
        self._rewarded.add(rewards)
        for o in outcomes:
            if o.reward is not None:
                self._domains.setdefault(o.domain or "-", Mean()).add([o.reward])

    def line(self, in_flight: int, now: float | None = None) -> str:
        now = self._now() if now is None else now
        domains = ", ".join(f"{d} {m.value:.3f}" for d, m in sorted(self._domains.items()))
        failed, why = sum(self._failed.counts.values()), self._failed.top()
        text = (f"last {now - self._since:.0f} s: {self._groups} groups, {self._sessions} sessions ({failed} "
                f"failed{f': {why}' if why else ''}), {_mean(self._rewarded)}{f' ({domains})' if domains else ''}; "
                f"in all: {self.groups} groups, {self.sessions} sessions, {_mean(self.rewarded)}; {in_flight} of "
                f"{self.capacity} sessions in flight")
        self._since = now
        self._reset()
        return text

    async def run(self, in_flight: Callable[[], int]) -> None:
        """Log a line every `every_s` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.every_s)
            log.info("%s", self.line(in_flight()))


class RolloutController:
    def __init__(self, settings: RolloutSettings, agent: Agent, producer: EventProducer):
        self.settings = settings
        self.agent = agent
        self.producer = producer
        self.client = GatewayClient(settings.gateway_url, settings.admin_token, settings.retry)
        self.slots = Slots(settings.concurrency)
        self.clock = SequenceClock()
        self.counts: Counter = Counter()
        self.failures = Failures()
        self.published: set[str] = set()  # Task event ids of the groups earlier runs submitted
        self.idle: frozenset[str] = frozenset()  # ...of those, the groups in which no session ran
        self.rewarded = Mean()  # the outcome rewards of this run (a sum and a count: `loop` runs for days)
        self.edge: deque[tuple[TaskSpec, str]] = deque(maxlen=settings.edge_capacity)  # (task, its group's id)
        self.rng = random.Random(f"{settings.name}:{settings.attempt}")

    def ids(self, cycle: int, position: int | str, task: TaskSpec, again: int = 0) -> GroupIds:
        identity = (self.settings.name, cycle, position, task.task_id, *((again,) if again else ()))
        return GroupIds(deterministic_id("group", *identity), deterministic_id("task", *identity))

    def fresh(self, cycle: int, position: int | str, task: TaskSpec) -> tuple[GroupIds, int] | None:
        """The ids of the group to roll this task out as, and how many earlier groups of it no session ran in; None
        when an earlier run submitted it (and a session of it ran)."""
        again = 0
        while (ids := self.ids(cycle, position, task, again)).event_id in self.idle:
            again += 1
        return None if ids.event_id in self.published else (ids, again)

    async def recover(self) -> None:
        """Read back what an earlier run published and in which of its groups no session ran; finish its open
        sessions."""
        published = await asyncio.to_thread(published_tasks, self.settings.bootstrap, self.settings.name)
        self.clock = SequenceClock(published.max_seq)
        sessions = await asyncio.to_thread(published_sessions, self.settings.bootstrap, published)
        self.published, self.idle = set(published.tasks), sessions.idle_tasks
        for session_id in sessions.unfinished:
            try:
                if await self.client.status(session_id) == "open":
                    await self.client.finish(session_id, "error", RESTARTED)
                    self.counts["recovered_sessions"] += 1
            except GatewayCallError as exc:
                log.warning("could not close session %s left open by an earlier run: %s", session_id, exc)

    async def _submit(self, task: TaskSpec, cycle: int, position: int | str, ids: GroupIds, again: int,
                      replay_of: str | None = None) -> int:
        """Publish the Task event (acknowledged by Kafka) that puts the group in the training queue; its seq."""
        metadata = {**task.metadata, CONTROLLER_KEY: self.settings.name, "cycle": str(cycle),
                    "position": str(position), **({"replay_of": replay_of} if replay_of else {}),
                    **({"again": str(again)} if again else {})}
        record = {"event_id": ids.event_id, "event_time": now_ms(), "task_id": task.task_id,
                  "group_id": ids.group_id, "seq": self.clock.next(), "domain": task.domain, "grader": task.grader,
                  "group_size": task.group_size, "prompt_json": json.dumps(task.prompt), "metadata": metadata,
                  "reference_json": json.dumps(task.reference)}
        await self.producer.send(TOPICS.tasks, ids.group_id, record)
        return record["seq"]

    async def _close_unopened(self, task: TaskSpec, ids: GroupIds, seq: int, outcomes: list[SessionOutcome]) -> None:
        """Publish the GroupSkipped of a group none of whose sessions opened, so the windowed FIFO does not wait on it
        (were Kafka to refuse it too, the processors' idle cut closes the group later)."""
        record = {"event_id": deterministic_id("group_skipped", ids.group_id), "event_time": now_ms(),
                  "group_id": ids.group_id, "task_id": task.task_id, "task_seq": seq, "group_complete": False,
                  "reason": f"none of its {len(outcomes)} sessions opened: {failure(outcomes[0])}",
                  "missing_sessions": [o.session_id for o in outcomes], "cut": ""}
        try:
            await self.producer.send(TOPICS.samples, ids.group_id, record, "GroupSkipped")
        except Exception as exc:  # the group is closed later, by the processors
            log.error("the group of task %s (no session opened) could not be closed: %s", task.task_id, exc)
            return
        self.counts["unopened_groups"] += 1

    async def _group(self, task: TaskSpec, cycle: int, position: int | str, ids: GroupIds, again: int, slots: int,
                     progress: Callable | None, replay_of: str | None = None) -> None:
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
            seq = await self._submit(task, cycle, position, ids, again, replay_of)
        except Exception as exc:  # Kafka did not take the Task: this group fails, the run goes on
            log.error("task %s was not submitted: %s", task.task_id, exc)
            self.counts["failed_groups"] += 1
            await self.slots.give(slots)
            return
        outcomes = await asyncio.gather(*(session(i) for i in range(task.group_size)))
        if not any(o.opened for o in outcomes):
            await self._close_unopened(task, ids, seq, outcomes)
        self.counts["groups"] += 1
        self.counts["sessions"] += len(outcomes)
        self.counts["failed_sessions"] += sum(not o.ok for o in outcomes)
        self.rewarded.add(o.reward for o in outcomes if o.reward is not None)
        self.counts["replayed_groups"] += replay_of is not None
        self.counts["rerun_groups"] += again > 0
        self.failures.add(outcomes)
        if self.settings.replay_edge and all(o.ok for o in outcomes) and len({o.reward for o in outcomes}) > 1:
            self.edge.append((task, ids.group_id))
            self.counts["edge_groups"] += 1
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

    async def _start(self, task: TaskSpec, cycle: int, position: int | str, ids: GroupIds, again: int,
                     stopped: asyncio.Future, running: set, progress: Callable | None,
                     replay_of: str | None = None) -> bool:
        """Take the group's slots and start it; False if `stop` came first."""
        slots = await self._take(task.group_size, stopped)
        if not slots:
            return False
        job = asyncio.create_task(self._group(task, cycle, position, ids, again, slots, progress, replay_of))
        running.add(job)
        job.add_done_callback(running.discard)
        return True

    def _replay(self) -> tuple[TaskSpec, str] | None:
        """The most recent task at the edge, with probability `replay_edge` (None otherwise, or with none)."""
        if self.edge and self.rng.random() < self.settings.replay_edge:
            return self.edge.pop()
        return None

    async def run(self, source: Iterable[TaskSpec], stop: asyncio.Event | None = None,
                  progress: Callable[[str, list[SessionOutcome]], None] | None = None) -> dict:
        """Roll out the source (again each cycle with `loop`) until it ends, `max_groups`, or `stop`."""
        stop = stop or asyncio.Event()
        stopped = asyncio.ensure_future(stop.wait())
        running: set[asyncio.Task] = set()
        await self.recover()
        cycle, taken = self.settings.attempt, 0

        def full() -> bool:
            return stop.is_set() or taken == self.settings.max_groups

        try:
            while not stop.is_set():
                seen = 0
                for position, task in enumerate(source):
                    seen += 1
                    while not full() and (replay := self._replay()) is not None:
                        task_again, origin = replay
                        edge = f"edge:{origin}"
                        if (group := self.fresh(cycle, edge, task_again)) is None:
                            self.counts["skipped_groups"] += 1
                            continue
                        if not await self._start(task_again, cycle, edge, *group, stopped, running, progress, origin):
                            break
                        taken += 1
                    if full():
                        break
                    if (group := self.fresh(cycle, position, task)) is None:
                        self.counts["skipped_groups"] += 1
                        continue
                    if not await self._start(task, cycle, position, *group, stopped, running, progress):
                        break
                    taken += 1
                if not self.settings.loop or not seen or taken == self.settings.max_groups:
                    break
                cycle += 1
            if running:
                await asyncio.gather(*running)
        finally:
            stopped.cancel()
            await self.client.aclose()
        return {**{k: self.counts[k] for k in ("groups", "sessions", "failed_sessions", "failed_groups",
                                                "skipped_groups", "recovered_sessions", "replayed_groups",
                                                "edge_groups", "rerun_groups", "unopened_groups")},
                "cycles": cycle - self.settings.attempt + 1,
                "mean_reward": self.rewarded.value,
                "failures": dict(self.failures.counts.most_common())}
