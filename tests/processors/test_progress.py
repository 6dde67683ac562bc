"""EndsSeen: which end a due time is compared with, and when a worker counts as having read past it."""

import doctest

from forge_stream.processors import progress
from forge_stream.processors.progress import EndsSeen


def test_doctests():
    assert doctest.testmod(progress).failed == 0


def test_a_due_time_is_compared_with_the_first_end_seen_at_or_after_it():
    ends = EndsSeen()
    for at, end in ((1_000, 3), (2_000, 3), (3_000, 7)):
        ends.saw("forge.completions", 1, at, end)
    assert ends.end_since("forge.completions", 1, 2_000) == 3  # seen at that very time
    assert ends.end_since("forge.completions", 1, 2_001) == 7
    assert ends.end_since("forge.completions", 1, 3_001) is None  # not looked since: not known yet
    assert ends.end_since("forge.completions", 2, 0) is None  # never looked at


def test_every_partition_of_the_group_must_be_read_past():
    ends = EndsSeen()
    ends.saw("forge.tasks", 0, 1_000, 2)
    ends.saw("forge.sessions", 0, 1_000, 10)
    partitions = [("forge.tasks", 0), ("forge.sessions", 0)]
    folded = {("forge.tasks", 0): 2, ("forge.sessions", 0): 9}
    assert not ends.read_past(partitions, 500, lambda t, p: folded[(t, p)])
    folded[("forge.sessions", 0)] = 10
    assert ends.read_past(partitions, 500, lambda t, p: folded[(t, p)])
    assert not ends.read_past(partitions, 500, lambda t, p: None)  # where it starts is not known yet
    assert not ends.read_past(partitions + [("forge.rewards", 0)], 500, lambda t, p: 10**9)  # one never seen


def test_trimmed_history_asks_more_never_less():
    ends = EndsSeen(keep=4)
    for i in range(20):
        ends.saw("forge.rewards", 3, 1_000 * i, 10 * i)
    assert ends.first("forge.rewards", 3) >= 10 * (20 - 8)  # at most 2 x keep kept
    assert ends.end_since("forge.rewards", 3, 0) == ends.first("forge.rewards", 3)  # older than all kept
    assert ends.end_since("forge.rewards", 3, 19_000) == 190
