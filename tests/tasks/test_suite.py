"""The shipped task suite: seeded, split by template into fixed train / validation / test sets, graded, and
demonstrable by the scripted teacher."""

import collections
import json
import re

import pytest

from forge_stream.engine.shared.tool_calls import parse_tool_calls
from forge_stream.rollout.graders import resolve
from forge_stream.rollout.sources import load_task_source
from forge_stream.tasks.suite import DOMAINS, SPLITS, iter_tasks, make_tasks, parse_mix, split_of, template_key
from forge_stream.tasks.teacher import demonstration


def keys(tasks):
    return {template_key(t.domain, t.graded) for t in tasks}


def test_streams_are_seeded():
    assert [t.prompt for t in make_tasks("train", 40, seed=3)] == [t.prompt for t in make_tasks("train", 40, seed=3)]
    assert [t.prompt for t in make_tasks("train", 40, seed=3)] != [t.prompt for t in make_tasks("train", 40, seed=4)]


def test_splits_are_disjoint_by_template_whatever_the_seed_and_mix():
    """Train, validation and test share no template (the numbers of a question whatever their order or operator,
    a lookup key with its value), across streams of any seed and mix: the split of a task is its template's."""
    streams = [(0, None), (7, {"agent": 2.0, "reasoning": 1.0}), (3, {"lookup": 1.0}), (11, {"reasoning": 1.0})]
    by_split = {split: set() for split in SPLITS}
    for split in SPLITS:
        for seed, mix in streams:
            tasks = make_tasks(split, 1500 if split == "train" else 400, seed=seed, mix=mix)
            assert all(split_of(t.domain, t.graded) == split for t in tasks)
            by_split[split] |= keys(tasks)
    assert all(by_split.values())
    assert not by_split["train"] & by_split["validation"]
    assert not by_split["train"] & by_split["test"]
    assert not by_split["validation"] & by_split["test"]


@pytest.mark.parametrize("domain", DOMAINS)
def test_a_task_and_its_mirror_share_a_template_and_a_split(domain):
    """"a or b" and "b or a", "a + b" and "b + a" (and "b - a") are one problem: one key, one split."""
    def mirror(question):
        numbers = re.findall(r"\d+", question)
        return re.sub(r"\d+", lambda m, rest=iter(numbers[::-1]): next(rest), question)

    tasks = make_tasks("test", 200, seed=5, mix={domain: 1.0})
    for task in tasks:
        mirrored = {**task.graded, "question": mirror(task.prompt["question"])}
        assert template_key(domain, mirrored) == template_key(domain, task.graded)
        assert split_of(domain, mirrored) == "test"
    if domain == "agent":
        plus = {"question": "What is 347 + 518?"}
        assert {template_key(domain, {"question": q}) for q in (
            "What is 518 + 347?", "What is 518 - 347?", "What is 347 * 518?")} == {template_key(domain, plus)}


def test_the_splits_are_fixed_shares_of_the_templates():
    """About a tenth of the templates are test, a tenth validation; heldout names the test split."""
    shares = collections.Counter(split_of("agent", {"question": f"What is {a} + {b}?"})
                                 for a in range(100, 160) for b in range(a, 160))
    total = sum(shares.values())
    assert 0.08 < shares["test"] / total < 0.12 and 0.08 < shares["validation"] / total < 0.12
    assert [t.prompt for t in make_tasks("heldout", 30)] == [t.prompt for t in make_tasks("test", 30)]
    assert next(iter(load_task_source("suite:heldout?seed=2"))).metadata["split"] == "test"
    assert next(iter(load_task_source("suite:validation?seed=2"))).metadata["split"] == "validation"
    with pytest.raises(ValueError, match="split must be one of train, validation, test"):
        next(iter_tasks("dev"))


def test_mixed_domains_follow_the_weights():
    tasks = make_tasks("train", 600, seed=1)
    counts = {d: sum(t.domain == d for t in tasks) for d in DOMAINS}
    assert all(150 <= c <= 250 for c in counts.values()), counts
    only = make_tasks("train", 50, seed=1, mix=parse_mix("lookup=1"))
    assert {t.domain for t in only} == {"lookup"}
    with pytest.raises(ValueError, match="unknown task domains"):
        next(iter_tasks("train", mix={"poetry": 1.0}))


@pytest.mark.parametrize("domain", DOMAINS)
def test_teacher_solves_every_family_and_the_grader_agrees(domain):
    for task in make_tasks("train", 20, seed=2, mix={domain: 1.0}):
        conv = demonstration(task.graded, task.domain)
        grade = resolve(task.grader)
        assert grade(task.graded, conv[-1]["content"]) == 1.0
        assert grade(task.graded, "I do not know") == 0.0
        if domain == "reasoning":
            assert [m["role"] for m in conv] == ["system", "user", "assistant"]
        else:
            call = conv[2]["tool_calls"][0]["function"]
            assert call["name"] == {"agent": "calculator", "lookup": "lookup"}[domain]
            if domain == "agent":  # the calculator's result is the answer: the tool is the only way
                expression = json.loads(call["arguments"])["expression"]
                assert str(eval(expression)) == task.reference["answer"]  # noqa: S307 - generated arithmetic


def test_reasoning_asks_either_direction_and_grades_the_order_asked():
    """Five digits that may repeat (never all equal), to order from largest to smallest or from smallest to largest,
    never asked already in the order wanted; the grader pays the order asked for and no other."""
    grade = resolve("numbers")
    tasks = make_tasks("train", 300, seed=4, mix={"reasoning": 1.0})
    asked = collections.Counter()
    for task in tasks:
        question, answer = task.prompt["question"], task.reference["answer"]
        numbers = list(map(int, re.findall(r"\d+", question)))
        descending = question.endswith(" from largest to smallest.")
        assert descending or question.endswith(" from smallest to largest.")
        asked[descending] += 1
        assert len(numbers) == 5 and len(set(numbers)) > 1 and all(0 <= n <= 9 for n in numbers)
        assert answer == " ".join(map(str, sorted(numbers, reverse=descending)))
        assert numbers != sorted(numbers, reverse=descending)
        assert grade(task.graded, answer) == 1.0
        assert grade(task.graded, " ".join(answer.split()[::-1])) == 0.0  # the other direction
    assert min(asked.values()) > 100
    assert any(len(set(re.findall(r"\d+", t.prompt["question"]))) < 5 for t in tasks)
    up, down = ("Order 7, 2, 9, 2 and 0 from smallest to largest.", "Order 7, 2, 9, 2 and 0 from largest to smallest.")
    assert template_key("reasoning", {"question": up}) != template_key("reasoning", {"question": down})  # two answers


def test_difficulty_widens_the_operands():
    easy = make_tasks("train", 30, seed=0, mix={"agent": 1.0}, difficulty=1)
    hard = make_tasks("train", 30, seed=0, mix={"agent": 1.0}, difficulty=3)
    width = lambda ts: max(len(t.prompt["question"].split()[2]) for t in ts)  # noqa: E731
    assert width(hard) > width(easy)


def test_the_example_agent_uses_the_suite_prompt_and_tools():
    """SFT renders demonstrations with the suite's SYSTEM and TOOLS; the black-box agent must send the same."""
    import importlib.util
    from pathlib import Path

    from forge_stream.tasks.suite import SYSTEM, TOOLS

    path = Path(__file__).resolve().parents[2] / "examples" / "agents" / "tool_agent.py"
    spec = importlib.util.spec_from_file_location("tool_agent", path)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    assert agent.SYSTEM == SYSTEM and agent.TOOLS == TOOLS


def test_teacher_tool_calls_parse_as_the_engine_parses_them(tiny_model_dir):
    from transformers import AutoTokenizer

    from forge_stream.trainer.sft import render_turns

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for task in make_tasks("train", 12, seed=5):
        conv = demonstration(task.graded, task.domain)
        turns = render_turns(tokenizer, conv)
        assert len(turns) == sum(m["role"] == "assistant" for m in conv)
        first = tokenizer.decode(turns[0].completion_ids, skip_special_tokens=True)
        parsed = parse_tool_calls(first)
        if task.domain == "reasoning":
            assert parsed.content == task.reference["answer"] and not parsed.tool_calls
        else:
            assert parsed.tool_calls[0].arguments == conv[2]["tool_calls"][0]["function"]["arguments"]
        assert turns[-1].completion_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
