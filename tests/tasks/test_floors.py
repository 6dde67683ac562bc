"""Graders with a floor: for every family of the shipped suite, replies that take no skill (the question echoed, its
first or last number, nothing) score about nothing, and the scripted teacher's answers score 1. The measured values
are in docs/learning/graders.md."""

import collections
import itertools
import re

import pytest

from forge_stream.rollout.graders import resolve
from forge_stream.tasks.suite import DOMAINS, FAMILIES, PRETRAINED_MIX, make_tasks, parse_mix
from forge_stream.tasks.teacher import demonstration

FLOOR = 0.05
NUMBER = re.compile(r"-?\d+")


def _numbers(question: str) -> list[str]:
    return NUMBER.findall(question)


TRIVIAL = {
    "echo the question": lambda question: question,
    "the first number of the question": lambda question: (_numbers(question) or [""])[0],
    "the last number of the question": lambda question: (_numbers(question) or [""])[-1],
    "the empty reply": lambda question: "",
}


def _tasks(domain: str) -> list:
    """Many tasks of one family, from the training stream and the test split."""
    return make_tasks("train", 1500, seed=0, mix={domain: 1.0}) + make_tasks("test", 500, seed=1, mix={domain: 1.0})


def mean_score(tasks, reply) -> float:
    return sum(resolve(t.grader)(t.graded, reply(t)) for t in tasks) / len(tasks)


def test_every_family_is_covered():
    """The default mix has every family but those for a pretrained model."""
    assert set(DOMAINS) | {"mental"} | set(parse_mix(PRETRAINED_MIX)) == set(FAMILIES)


@pytest.mark.parametrize("domain", FAMILIES)
def test_no_constant_answer_beats_the_floor(domain):
    """The best constant reply (the family's most common answer) is right at most 5% of the time."""
    answers = collections.Counter(t.graded["answer"] for t in _tasks(domain))
    assert answers.most_common(1)[0][1] / sum(answers.values()) <= FLOOR


def test_the_pretrained_families_shape_the_scaffold():
    """times offers no tool; copy offers the calculator and has the scaffold call it on the question's expression
    first, so the tool's result (the answer) is in the model's context before it is asked; neither tells the
    agent the answer in any other way."""
    for task in _tasks("times")[:50]:
        assert task.prompt["tools"] == [] and "calls" not in task.prompt and "answer" not in task.prompt
    for task in _tasks("copy")[:50]:
        (call,) = task.prompt["calls"]
        assert task.prompt["tools"] == ["calculator"] and call["name"] == "calculator"
        assert f"What is {call['arguments']['expression']}?" == task.prompt["question"]
        assert eval(call["arguments"]["expression"]) == int(task.graded["answer"])  # noqa: S307 - digits and '*'


@pytest.mark.parametrize("domain", FAMILIES)
@pytest.mark.parametrize("policy", TRIVIAL)
def test_a_trivial_reply_scores_at_most_the_floor(domain, policy):
    reply = TRIVIAL[policy]
    assert mean_score(_tasks(domain), lambda t: reply(t.prompt["question"])) <= FLOOR


@pytest.mark.parametrize("domain", FAMILIES)
def test_the_teacher_scores_the_ceiling(domain):
    tasks = _tasks(domain)
    assert mean_score(tasks, lambda t: demonstration(t.graded, t.domain)[-1]["content"]) == 1.0


def test_no_order_picked_without_comparing_beats_one_in_twenty_three():
    """A reasoning reply that lists the question's numbers in a fixed order of their positions (as asked, reversed,
    any of the 24) is right only when the question happened to ask them in that order: never for the order as
    asked, about 1 in 23 for any other."""
    tasks = _tasks("reasoning")
    scores = {order: mean_score(tasks, lambda t: " ".join(_numbers(t.prompt["question"])[i] for i in order))
              for order in itertools.permutations(range(4))}
    assert scores[(0, 1, 2, 3)] == 0.0
    assert max(scores.values()) < 0.065


def test_a_mental_reply_is_paid_only_when_it_ends_on_the_sum():
    """What a pretrained chat model writes: the sum inside an equation or a sentence is paid when it comes last; a
    reply that ends on anything else (an operand, a wrong sum, the sum followed by more numbers) is not."""
    tasks = _tasks("mental")

    def operands(t) -> str:
        return t.prompt["question"].removeprefix("What is ").removesuffix("?")

    assert mean_score(tasks, lambda t: f"{operands(t)} = {t.graded['answer']}") == 1.0
    assert mean_score(tasks, lambda t: f"The answer is {t.graded['answer']}.") == 1.0
    assert mean_score(tasks, lambda t: f"{t.graded['answer']} = {operands(t)}") == 0.0
    assert mean_score(tasks, lambda t: f"{operands(t)} = {int(t.graded['answer']) + 1}") == 0.0
