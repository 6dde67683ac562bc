"""Property tests of the windowed FIFO core against a plain reference model of the window."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge_stream.scheduler.window import WindowedFifo, WindowSpec, max_overtake, staleness_bound


class Reference:
    """The window stated directly: positions over the submitted, not-yet-consumed groups."""

    def __init__(self, window):
        self.window = window
        self.submitted: set[int] = set()
        self.finished: set[int] = set()
        self.consumed: set[int] = set()
        self.handed: list[int] = []
        self.was_head: list[bool] = []
        self.submitted_at: dict[int, int] = {}

    def head(self):
        live = sorted(self.submitted - self.consumed)
        return live[0] if live else None

    def position(self, seq):
        head = self.head()
        return sum(1 for s in self.submitted if head <= s < seq)

    def in_window(self, seq):
        return self.window is None or self.position(seq) < self.window

    def visible(self):
        return sorted(s for s in (self.submitted & self.finished) - self.consumed if self.in_window(s))

    def hand_out(self, seq):
        assert seq in self.submitted and seq in self.finished and seq not in self.consumed
        assert self.in_window(seq), f"group {seq} at position {self.position(seq)} beyond W={self.window}"
        self.was_head.append(seq == self.head())
        self.consumed.add(seq)
        self.handed.append(seq)


@st.composite
def scenarios(draw, late_submissions=True):
    n = draw(st.integers(1, 24))
    window = draw(st.one_of(st.none(), st.integers(1, n + 2)))
    seqs = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True))
    submit_order = sorted(seqs)
    late = draw(st.lists(st.integers(0, n - 1), max_size=3)) if late_submissions else []
    for i in late:
        j = draw(st.integers(0, n - 1))
        submit_order[i], submit_order[j] = submit_order[j], submit_order[i]
    finish_order = draw(st.permutations(seqs))
    merge = draw(st.lists(st.booleans(), min_size=2 * n, max_size=2 * n))
    takes = draw(st.lists(st.integers(0, 8), min_size=2 * n, max_size=2 * n))
    skips = draw(st.lists(st.sampled_from(seqs), max_size=2))
    submits, finishes = iter(submit_order), iter(finish_order)
    ops = []
    for first, take in zip(merge, takes):
        event = next(submits, None) if first else next(finishes, None)
        if event is None:
            event = next(finishes, None) if first else next(submits, None)
            first = not first
        ops.append(("submit" if first else "finish", event))
        if take:
            ops.append(("take", take))
        if skips and take == 8:
            ops.append(("skip", skips.pop()))
    return window, submit_order, ops


def replay(window, ops):
    """Run ops on the core and the reference side by side, checking every hand-out."""
    core, ref = WindowedFifo(window), Reference(window)
    for kind, arg in ops:
        if kind == "submit":
            core.submit(arg)
            ref.submitted_at.setdefault(arg, len(ref.handed))
            ref.submitted.add(arg)
        elif kind == "finish":
            core.finish(arg)
            ref.finished.add(arg)
        elif kind == "skip":
            expect = arg in ref.submitted and arg not in ref.consumed
            assert core.skip(arg) == expect
            if expect:
                ref.consumed.add(arg)
        else:
            assert core.available() == len(_drain_preview(ref))
            got = core.take(arg)
            for seq in got:
                ref.hand_out(seq)
            if len(got) < arg:
                assert ref.visible() == [], "take held back a group that was visible"
        assert core.head == ref.head()
    return core, ref


def _drain_preview(ref):
    """How many groups the reference would hand out, oldest visible first, until none is visible."""
    shadow = Reference(ref.window)
    shadow.submitted, shadow.finished, shadow.consumed = set(ref.submitted), set(ref.finished), set(ref.consumed)
    out = []
    while visible := shadow.visible():
        shadow.hand_out(visible[0])
        out.append(visible[0])
    return out


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_nothing_outside_the_window_is_handed_out(scenario):
    window, _, ops = scenario
    replay(window, ops)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_every_finished_group_is_eventually_handed_out(scenario):
    window, submit_order, ops = scenario
    core, ref = replay(window, ops)
    while got := core.take(5):
        for seq in got:
            ref.hand_out(seq)
    assert sorted(ref.consumed) == sorted(submit_order)
    assert len(ref.handed) == len(set(ref.handed))
    assert core.head is None and core.pending() == 0


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_strict_fifo_hands_out_in_submission_order(scenario):
    _, submit_order, ops = scenario
    _, ref = replay(1, ops)
    assert all(ref.was_head), "strict FIFO handed out a group that was not the head"
    if submit_order == sorted(submit_order):
        assert ref.handed == sorted(ref.handed)


@settings(max_examples=300, deadline=None)
@given(scenarios(late_submissions=False))
def test_overtaking_is_bounded_by_the_window(scenario):
    """With tasks submitted in seq order, at most W - 1 younger groups are handed out before a group."""
    window, _, ops = scenario
    core, ref = replay(window, ops)
    while got := core.take(7):
        for seq in got:
            ref.hand_out(seq)
    for i, seq in enumerate(ref.handed):
        overtakers = sum(1 for s in ref.handed[ref.submitted_at[seq] : i] if s > seq)
        assert overtakers <= max_overtake(window)


def test_window_edges_and_greedy():
    core = WindowedFifo(3)
    for seq in range(6):
        core.submit(seq)
    for seq in (1, 2, 3, 4):
        core.finish(seq)
    assert core.frontier == 0 and core.available() == 2
    assert core.take(10) == [1, 2]
    core.finish(0)
    assert core.take(10) == [0, 3, 4]
    assert core.head == 5
    greedy = WindowedFifo(None)
    for seq in range(6):
        greedy.submit(seq)
    greedy.finish(5)
    assert greedy.take(1) == [5]


def test_finish_before_submit_and_duplicates_are_idempotent():
    core = WindowedFifo(2)
    core.finish(1)
    core.submit(1)
    core.submit(1)
    core.finish(1)
    assert core.take(5) == [1]
    core.submit(1)
    core.finish(1)
    assert core.take(5) == [] and core.pending() == 0


def test_window_spec_resolves_count_fraction_and_greedy():
    assert WindowSpec().resolve(256) == math.ceil(0.3 * 256)
    assert WindowSpec(count=5).resolve(256) == 5
    assert WindowSpec(fraction=0.01).resolve(10) == 1
    assert WindowSpec(greedy=True).resolve(256) is None
    with pytest.raises(ValueError):
        WindowSpec(fraction=0.0)
    with pytest.raises(ValueError):
        WindowSpec(count=0)


def test_staleness_bound_grows_with_the_window():
    assert staleness_bound(256, 1, 32) == 8
    assert staleness_bound(256, 77, 32) == (256 + 77 - 2) // 32 + 1
    assert staleness_bound(256, None, 32) == math.inf
