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
