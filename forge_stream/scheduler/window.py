"""The windowed FIFO scheduler core (DESIGN section 6), pure: no I/O, no clock, no Kafka.

The queue is the groups in submission order (Task `seq`). With window W the scheduler hands out any
*finished* group whose position lies in `[head, head + W)`, where `head` is the oldest group not yet handed
out; a finished group beyond the window stays invisible. Handing a group out consumes it, so the head moves
only past consumed (or skipped) groups. W=1 is strict FIFO, W=None (unbounded) is greedy.

Positions count every submitted group, consumed ones included, so a group consumed out of order keeps its
place in the window until the head passes it. A group submitted late (an older `seq` seen after younger
ones) takes its place in order and may become the head again. The queue forgets consumed groups once 4,096
of them lie behind the head; a late group older than those sees a window larger by at most that many.

Among the visible groups `take` hands out the oldest first. That choice keeps every hand-out inside the
window as the head slides: the groups before the first unfinished one (the *frontier*) are handed out in
order, and after them the finished groups in `[frontier, frontier + W)`. Hence `available()` is simply the
number of finished groups that precede `frontier + W`.

Worst-case lag: while a group g waits, every group handed out ahead of it that was submitted after it lies
in `(g, g + W)`, so at most W - 1 groups overtake g (`max_overtake`). With batches of B groups and at most C
groups submitted but not yet consumed (rollout slots), a group trains at most `staleness_bound(C, W, B)`
policy versions after the version it started under.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class WindowSpec:
    """A window setting: an absolute `count`, or a `fraction` of a basis (queue size or rollout slots).

    `greedy=True` means an unbounded window (W = N). The default is 0.3 of the basis (DESIGN section 6).
    """

    count: int | None = None
    fraction: float = 0.3
    greedy: bool = False

    def __post_init__(self) -> None:
        if self.count is not None and self.count < 1:
            raise ValueError(f"window count must be >= 1, got {self.count}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"window fraction must be in (0, 1], got {self.fraction}")

    def resolve(self, basis: int) -> int | None:
        """The window in groups for a basis of `basis` groups; None means unbounded (greedy)."""
        if self.greedy:
            return None
        if self.count is not None:
            return self.count
        return max(1, math.ceil(self.fraction * basis))


class _State(Enum):
    PENDING = 0
    READY = 1
    DONE = 2


class WindowedFifo:
    """Bounded-disorder queue of groups keyed by their submission sequence number.

    `submit(seq)` appends a group to the queue (an older seq arriving late is inserted in order),
    `finish(seq)` marks it finished (before or after its submission), `take(n)` hands out and consumes up
    to n visible groups, oldest first, and `skip(seq)` consumes a group without handing it out (a timeout).
    Duplicate calls are no-ops, so redelivered events change nothing.
    """

    _TRIM = 4096

    def __init__(self, window: int | None) -> None:
        self.window = window
        self._order: list[int] = []
        self._state: dict[int, _State] = {}
        self._head = 0
        self._frontier = 0
        self._ready: list[int] = []
        self._early: set[int] = set()
        self._closed: set[int] = set()

    @property
    def window(self) -> int | None:
        return self._window

    @window.setter
    def window(self, window: int | None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self._window = window

    def submit(self, seq: int) -> None:
        """Add group `seq` to the queue in submission order."""
        if seq in self._state or seq in self._closed:
            return
        ready = seq in self._early
        self._early.discard(seq)
        i = bisect_right(self._order, seq)
        self._order.insert(i, seq)
        self._state[seq] = _State.READY if ready else _State.PENDING
        if ready:
            insort(self._ready, seq)
        self._head = min(self._head, i)
        if i <= self._frontier:
            self._frontier = self._frontier + 1 if ready else i
        self._advance()

    def finish(self, seq: int) -> None:
        """Mark group `seq` finished; it becomes visible once the window reaches it."""
        state = self._state.get(seq)
        if state is None:
            if seq not in self._closed:
                self._early.add(seq)
            return
        if state is not _State.PENDING:
            return
        self._state[seq] = _State.READY
        insort(self._ready, seq)
        self._advance()

    def skip(self, seq: int) -> bool:
        """Consume a submitted group without handing it out; False if it was already consumed or unknown."""
        state = self._state.get(seq)
        if state is None or state is _State.DONE:
            return False
        if state is _State.READY:
            del self._ready[bisect_left(self._ready, seq)]
        self._state[seq] = _State.DONE
        self._advance()
        return True

    def available(self) -> int:
        """How many groups `take` would hand out now if asked for as many as possible."""
        return bisect_left(self._ready, self._bound())

    def take(self, n: int) -> list[int]:
        """Hand out (and consume) up to n visible groups, oldest first."""
        k = min(n, self.available())
        out = self._ready[:k]
        del self._ready[:k]
        for seq in out:
            self._state[seq] = _State.DONE
        self._advance()
        return out

    @property
    def head(self) -> int | None:
        """The oldest group not yet consumed, or None when the queue is drained."""
        return self._order[self._head] if self._head < len(self._order) else None

    @property
    def frontier(self) -> int | None:
        """The oldest unfinished, unconsumed group: the one that bounds the window; None if there is none."""
        return self._order[self._frontier] if self._frontier < len(self._order) else None

    def pending(self) -> int:
        """Groups submitted and not yet consumed (finished or not)."""
        return len(self._order) - self._head

    def _bound(self) -> float:
        if self._window is None:
            return math.inf
        end = self._frontier + self._window
        return self._order[end] if end < len(self._order) else math.inf

    def _advance(self) -> None:
        order, state = self._order, self._state
        while self._head < len(order) and state[order[self._head]] is _State.DONE:
            self._head += 1
        self._frontier = max(self._frontier, self._head)
        while self._frontier < len(order) and state[order[self._frontier]] is not _State.PENDING:
            self._frontier += 1
        if self._head >= self._TRIM:
            for seq in order[: self._head]:
                del state[seq]
                self._closed.add(seq)
            del order[: self._head]
            self._frontier -= self._head
            self._head = 0


def max_overtake(window: int | None) -> float:
    """Most groups submitted after a group g that can be handed out before g: W - 1 (unbounded if greedy)."""
    return math.inf if window is None else window - 1


def staleness_bound(slots: int, window: int | None, batch: int) -> float:
    """Worst-case staleness (trainer version minus the version a group started under), in versions.

    When g starts, at most `slots - 1` older groups are still unconsumed; at most W - 1 younger ones can
    overtake it. Every batch trained before g's is made of those, and the batch in progress when g started
    also counts, so the bound is floor((slots - 1 + W - 1) / batch) + 1.
    """
    if window is None:
        return math.inf
    return (slots + window - 2) // batch + 1
