"""Graders are plain functions with doctests; `resolve` finds them by short name or dotted path."""

import doctest

import pytest

from forge_stream.rollout import graders


def test_doctests():
    result = doctest.testmod(graders)
    assert result.attempted >= 4 and result.failed == 0


def test_resolve():
    assert graders.resolve("numeric") is graders.numeric
    assert graders.resolve("forge_stream.rollout.graders.contains") is graders.contains
    with pytest.raises(ValueError, match="dotted path"):
        graders.resolve("no_such_grader")


def test_numbers_pays_the_order_asked_for_either_direction():
    """An ascending question's answer is graded like a descending one's: its numbers in its order, repeats counted."""
    ascending = {"question": "Order 7, 2, 9, 2 and 0 from smallest to largest.", "answer": "0 2 2 7 9"}
    assert graders.numbers(ascending, "0 2 2 7 9") == 1.0
    assert graders.numbers(ascending, "9 7 2 2 0") == 0.0  # largest first
    assert graders.numbers(ascending, "0 2 7 9") == 0.0  # a repeat left out
    assert graders.numbers(ascending, ascending["question"]) == 0.0
