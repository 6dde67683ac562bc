"""Watermarks: the one rule by which every consumer of the package commits (forge_stream.kafka.consumer)."""

from forge_stream.kafka.consumer import Watermarks

T = ("forge.tasks", 0)


def test_a_held_record_stops_the_mark_until_it_is_released():
    marks = Watermarks()
    for offset in range(5):
        marks.passed(*T, offset)
    marks.hold(*T, 1)
    marks.hold(*T, 3)
    assert marks.due() == {T: 1}
    marks.release(*T, 1)
    assert marks.due() == {T: 3}
    marks.release(*T, 3)
    assert marks.due() == {T: 5}


def test_positions_only_move_forward_and_nothing_is_due_at_the_start():
    marks = Watermarks()
    marks.moved_to(*T, 0)
    assert marks.due() == {}
    marks.passed(*T, 7)
    marks.moved_to(*T, 3)  # a late look at the consumer's position never moves it back
    marks.hold(*T, 9)  # a record beyond the position holds nothing back
    assert marks.read == {T: 8} and marks.due() == {T: 8}
