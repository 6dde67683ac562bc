"""Whether a processors worker has folded what its input partitions held at a given time.

A group times out by wall time (its first event's time plus the timeout), and a closed group's marker is forgotten
by wall time too. A worker that is behind on its inputs (restarted after an outage longer than the timeout, or a new
app id reading topics that already hold records) would find those times passed while the group's later records are
still unread: acknowledged and in Kafka, yet the group would be closed without them (a sample with fewer rollouts
than were recorded, or a group skipped as failed), and a marker forgotten early lets the group's last records open it
again. So the topology acts on a group only once the worker has folded, on the group's partition of every input
topic, everything that partition held when the group fell due.

`EndsSeen` is what that takes: the read-marks sweep, which asks the broker for each assigned input partition's end
offset anyway, records each end with the time it was asked (`saw`); `read_past` compares the first end seen at or
after the group's due time with the offset the worker has folded up to. A worker that keeps up acts within one sweep
of the due time; one that is behind reads first.

>>> ends = EndsSeen()
>>> ends.saw("t", 0, at_ms=1_000, end=5)
>>> ends.saw("t", 0, at_ms=2_000, end=9)
>>> ends.end_since("t", 0, 1_500), ends.end_since("t", 0, 500), ends.end_since("t", 0, 2_500)
(9, 5, None)
>>> ends.read_past([("t", 0)], 1_500, folded_to=lambda topic, partition: 9)
True
>>> ends.read_past([("t", 0)], 1_500, folded_to=lambda topic, partition: 8)
False
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable


class EndsSeen:
    """The end offsets of input partitions, with when each was seen; the latest `keep` per partition (at the
    sweep's 10 s, about 3 hours: a due time older than every end kept is compared with the oldest, which asks more
    of the worker, never less)."""

    def __init__(self, keep: int = 1024):
        self.keep = keep
        self._times: dict[tuple[str, int], list[int]] = {}
        self._ends: dict[tuple[str, int], list[int]] = {}

    def saw(self, topic: str, partition: int, at_ms: int, end: int) -> None:
        """`end` was the partition's end offset at `at_ms` or later (ask the broker after taking the time)."""
        times = self._times.setdefault((topic, partition), [])
        ends = self._ends.setdefault((topic, partition), [])
        times.append(at_ms)
        ends.append(end)
        if len(times) > 2 * self.keep:  # trimmed in chunks: one copy per `keep` sightings
            del times[: -self.keep], ends[: -self.keep]

    def first(self, topic: str, partition: int) -> int | None:
        """The oldest end kept for the partition (None before the first sighting)."""
        ends = self._ends.get((topic, partition))
        return ends[0] if ends else None

    def end_since(self, topic: str, partition: int, since_ms: int) -> int | None:
        """The end seen first at or after `since_ms`; the oldest kept when `since_ms` is older than all of them;
        None while no end was seen since."""
        times = self._times.get((topic, partition))
        if not times or times[-1] < since_ms:
            return None
        return self._ends[(topic, partition)][bisect_left(times, since_ms)]

    def read_past(self, partitions: Iterable[tuple[str, int]], since_ms: int,
                  folded_to: Callable[[str, int], int | None]) -> bool:
        """Whether, for every (topic, partition), the worker folded every record the partition held at `since_ms`
        (`folded_to`: the next offset it would fold there, None if not known)."""
        for topic, partition in partitions:
            end = self.end_since(topic, partition, since_ms)
            if end is None:
                return False
            position = folded_to(topic, partition)
            if position is None or position < end:
                return False
        return True
