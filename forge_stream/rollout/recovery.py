"""What a restarted rollout controller reads back from Kafka: its own Tasks, and its sessions left open.

Every Task a controller publishes carries its name in `metadata["controller"]`, and its ids are deterministic, so
on start it knows which groups it already submitted (it does not submit them again) and the highest `seq` it used.
Sessions of those groups that forge.sessions shows started but not finished were cut off by the previous run's end.
Both reads go through `kafka.history` (assigned partitions, nothing committed).
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_stream.kafka.history import Slice, read_slice
from forge_stream.topics import TOPICS

CONTROLLER_KEY = "controller"  # the Task.metadata entry naming the controller that published it
CLOCK_SKEW_MS = 60_000  # the gateway's clock may run behind the controller's


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


def unfinished_sessions(bootstrap: str, published: Published) -> list[str]:
    """Ids of the sessions of `published` groups with a SessionStarted and no SessionFinished on forge.sessions."""
    if not published.tasks:
        return []
    groups = {t["group_id"] for t in published.tasks.values()}
    started, finished = set(), set()
    for event in read_slice(bootstrap, TOPICS.sessions, Slice(start_ms=published.since_ms)):
        if event.record["group_id"] in groups:
            (started if event.schema == "SessionStarted" else finished).add(event.record["session_id"])
    return sorted(started - finished)
