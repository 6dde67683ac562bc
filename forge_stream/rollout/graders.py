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


def numeric(task: dict, output: str, tolerance: float = 1e-6) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", output)
    return float(bool(numbers) and abs(float(numbers[-1]) - float(task["answer"])) <= tolerance)


def resolve(name: str) -> Callable[[dict, str], float]:
    """A grader by short name (`exact_match`) or dotted path (`my_pkg.graders.unit_tests`)."""
    if "." not in name:
        name = f"{__name__}.{name}"
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"no grader {name!r}: give a function `grade(task, output) -> float` by dotted path") from exc
