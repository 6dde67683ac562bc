"""What a restarted rollout controller reads back from Kafka: its own Tasks, their sessions left open, and the groups
in which no session ran.

Every Task a controller publishes carries its name in `metadata["controller"]`, and its ids are deterministic, so
on start it knows which groups it already submitted (it does not submit them again) and the highest `seq` it used.
Sessions of those groups that forge.sessions shows started but not finished were cut off by the previous run's end.
A group none of whose sessions ran (none opened, or every one failed: none finished ok, none was cut off by a
restart) taught nothing, so it is no reason to skip its task: the next run of the same name rolls the task out again.
Both reads go through `kafka.history` (assigned partitions, nothing committed).
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_stream.kafka.history import Slice, read_slice
from forge_stream.topics import TOPICS

CONTROLLER_KEY = "controller"  # the Task.metadata entry naming the controller that published it
CLOCK_SKEW_MS = 60_000  # the gateway's clock may run behind the controller's
RESTARTED = "rollout controller restarted"  # the reason of a session a restart found open and finished


@dataclass(frozen=True)
class Published:
    tasks: dict[str, dict]  # Task event_id -> the Task record

    @property
    def max_seq(self) -> int:
        return max((t["seq"] for t in self.tasks.values()), default=0)

    @property
    def since_ms(self) -> int | None:
        first = min((t["event_time"] for t in self.tasks.values()), default=None)
        return None if first is None else first - CLOCK_SKEW_MS


def published_tasks(bootstrap: str, controller: str) -> Published:
    """The Tasks on forge.tasks that the controller named `controller` published, by event id."""
    return Published({e.record["event_id"]: e.record for e in read_slice(bootstrap, TOPICS.tasks, Slice())
                      if e.record["metadata"].get(CONTROLLER_KEY) == controller})


@dataclass(frozen=True)
class Sessions:
    """What forge.sessions shows of the published groups."""

    unfinished: list[str]  # ids of the sessions with a SessionStarted and no SessionFinished
    idle_tasks: frozenset[str]  # Task event ids of the groups in which no session ran


def published_sessions(bootstrap: str, published: Published) -> Sessions:
    """The sessions of `published` groups left open, and the groups none of whose sessions ran: none finished ok,
    none is open, none was finished by a restart (a group cut off by a restart counts as submitted)."""
    groups = {t["group_id"] for t in published.tasks.values()}
    started, finished, ran = set(), set(), set()
    for event in read_slice(bootstrap, TOPICS.sessions, Slice(start_ms=published.since_ms)) if groups else ():
        record = event.record
        if record["group_id"] not in groups:
            continue
        if event.schema == "SessionStarted":
            started.add((record["group_id"], record["session_id"]))
            continue
        finished.add((record["group_id"], record["session_id"]))
        if record["status"] == "ok" or record["reason"] == RESTARTED:
            ran.add(record["group_id"])
    unfinished = started - finished
    ran |= {group for group, _ in unfinished}
    return Sessions(sorted(session for _, session in unfinished),
                    frozenset(event_id for event_id, t in published.tasks.items() if t["group_id"] not in ran))
