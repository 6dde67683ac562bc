"""Graders: plain functions `grade(task, output) -> float`, named by dotted path on each Task.

`task` is the task as the grader sees it: the agent's payload (`TaskSpec.prompt`) with the grader's reference laid
over it (`TaskSpec.reference`, e.g. the `answer`, which the agent never gets); `output` is what the agent printed.

>>> exact_match({"answer": "42"}, " 42\\n")
1.0
>>> contains({"answer": "Paris"}, "It is paris.")
1.0
>>> numeric({"answer": "3.5"}, "the result is 3.50")
1.0
>>> numeric({"answer": "3.5"}, "no number")
0.0
>>> numbers({"answer": "82 64 37 15"}, "82, 64, 37, 15")
1.0
"""

from __future__ import annotations

import importlib
import re
from typing import Callable, Protocol


class Grader(Protocol):
    def __call__(self, task: dict, output: str) -> float: ...


def exact_match(task: dict, output: str) -> float:
    return float(output.strip() == str(task.get("answer", "")).strip())


def contains(task: dict, output: str) -> float:
    return float(str(task.get("answer", "")).strip().lower() in output.lower())


# a number as a reply or an answer writes it, an integer or a decimal (a question's integer operands:
# forge_stream.tasks.suite.INTEGER)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def numeric(task: dict, output: str, tolerance: float = 1e-6) -> float:
    """1 when the last number of the reply is the answer. Lenient: a reply that names every candidate of a question
    ("37 or 82? 82") passes when the right one comes last; the shipped suite grades with `numbers`."""
    found = NUMBER.findall(output)
    return float(bool(found) and abs(float(found[-1]) - float(task["answer"])) <= tolerance)


def numbers(task: dict, output: str, tolerance: float = 1e-6) -> float:
    """1 when the numbers of the reply, in order, are exactly those of the answer (one number or several); a reply
    that names other numbers too, such as the question's, scores 0.

    >>> numbers({"answer": "865"}, "The answer is 865."), numbers({"answer": "865"}, "347 + 518 = 865")
    (1.0, 0.0)
    >>> numbers({"answer": "82 64 37 15"}, "Order 37, 82, 15 and 64 from largest to smallest.")
    0.0
    >>> numbers({"answer": "82 64 37 15"}, "82 64 15 37"), numbers({"answer": "-171"}, "-171")
    (0.0, 1.0)
    """
    found, wanted = NUMBER.findall(output), NUMBER.findall(str(task["answer"]))
    return float(bool(wanted) and len(found) == len(wanted)
                 and all(abs(float(a) - float(b)) <= tolerance for a, b in zip(found, wanted)))


def resolve(name: str) -> Callable[[dict, str], float]:
    """A grader by short name (`exact_match`) or dotted path (`my_pkg.graders.unit_tests`)."""
    if "." not in name:
        name = f"{__name__}.{name}"
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"no grader {name!r}: give a function `grade(task, output) -> float` by dotted path") from exc
