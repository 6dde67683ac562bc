"""The shipped task suite: seeded task families with a difficulty, their graders, and fixed train / validation /
test splits.

Three domains, mixed in one run (unified mixed-domain training):

- reasoning: "Order 3, 8, 1, 8 and 6 from largest to smallest." or "... from smallest to largest." (difficulty d:
  d-digit numbers, digits 0-9 at 1, which may repeat but are never all equal), answered directly ("8 8 6 3 1"): the
  model has to compare the numbers itself. Five numbers, never asked in the order wanted, so that copying the
  question, or a number of it, earns nothing, and an order picked without comparing is right about once in 48 (two
  numbers, "which is larger?", paid a policy that always copied the second one half the time).
- agent: "What is 347 + 518?" (difficulty d: (d + 2)-digit operands, + - *): the model can only get it right by
  calling the `calculator` tool and copying its result.
- lookup: "What is stored under tern?": the value sits in the task's own key-value store, which the agent exposes
  as the `lookup` tool; the model must call it with the right key and copy the value.

Three more families are in no default mix: they are for a pretrained chat model (`bench learning --model`, the
`PRETRAINED_MIX`), which the tiny model cannot learn. Each task of them shapes the example agent's scaffold: the system
prompt is "Answer with numbers only." (`PLAIN_SYSTEM`), and only the tools the family needs are offered. They are graded
by the last number of the reply (`numeric`): a chat model restates the question ("8 * 17 = 136"), and none of the
question's numbers is ever the answer, so no trivial reply scores. Their measured baselines, and why each was chosen:
docs/learning/graders.md.

- times: "What is 8 * 17?" (difficulty d: a one-digit number and one of 2 to 100 (d + 1) - 1, in either order),
  answered directly with no tools offered. SmolLM2-135M-Instruct got about one in six right at temperature 0.7 when
  the larger number ran to 29 (before 2026-12-07), and rambled ("To solve 8 * 17, we need to perform...") until its
  tokens ran out on many more; on the wider range (to 199, products up to 1,791) its rate is not measured. One-digit
  plus two-digit sums, which look easier, it gets 2-3% right: its multiplication table is better than its addition.
- copy: "What is 4821 * 3907?" where the scaffold has already called the `calculator` on the question's expression (a
  planner's first step: the task's `calls`), so the model answers with the tool's result in its context, or not:
  SmolLM2 often restates it wrongly or redoes the arithmetic itself. The one tool-using family a small pretrained
  model can start on (it writes no tool call of its own).
- mental: "What is 34 + 58?" (difficulty d: two (d + 1)-digit numbers), answered directly: SmolLM2 gets 2-8% of them
  right, too few groups with a signal to learn from (kept for comparison).

Two families make a pretrained model act (the `tools` mix, MIXES): only a tool call the model writes itself, with the
right arguments, leads to the answer. Both offer both tools with the suite's system prompt, and the chat template
shows the call format; a session is the call, the tool's result and the reply. Graded by the last number.

- calc: "What is 4821 * 3907?" (difficulty d: (d + 3)-digit operands): the calculator's result is the answer.
- table: "What is stored under gold-heron?": the value (four digits) sits in the task's own table of 3 + d keys,
  which only the `lookup` tool reads.

The agent gets what it needs to act (`TaskSpec.prompt`): the `question`, and for lookup the `store` its tool reads.
The `answer` is the grader's alone (`TaskSpec.reference`). The grader of every family of the default mix is `numbers`: the
numbers of the reply, in order, must be exactly the answer's, so a reply that names other numbers too (an echo of the
question, every candidate) scores 0. What trivial policies score, and the teacher: docs/learning/graders.md.

Splits are by template, not by instance: `template_key` names what makes two tasks one problem whatever their
wording or order ("order 3, 8, 1, 8 and 6" and "order 6, 8, 1, 8 and 3" from largest to smallest, though not from
smallest to largest; "347 + 518", "518 + 347" and "518 - 347": one operand pair; a lookup key and the value stored
under it), and a hash of the key puts every task of that template in one split: test (one key in ten), validation
(one in ten) or train. So the splits are disjoint by template and fixed: a task's split depends on nothing else,
whatever a stream's seed, mix or difficulty. `heldout` is another name for test. At difficulty 1 every family has
at least 100 templates in the test split, so that no one answer is right often there: times 183 of 1,556, mental
409 of 4,095, reasoning 440 of 3,984, lookup 1,797 of 18,000; agent, copy, calc and table have far more.
`iter_tasks` is an endless seeded stream of one split; `make_tasks` takes the first n of it.

>>> a = make_tasks("train", 50, seed=1)
>>> b = make_tasks("test", 50, seed=2, mix={"agent": 1.0})
>>> not {template_key(t.domain, t.graded) for t in a} & {template_key(t.domain, t.graded) for t in b}
True
>>> all(split_of(t.domain, t.graded) == "test" for t in b)
True
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from typing import Callable, Iterator

from forge_stream.tasks.spec import TaskSpec

SYSTEM = "Answer with numbers only. Use a tool when useful."
TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Read the value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}},
]
DOMAINS = ("reasoning", "agent", "lookup")
SPLITS = ("train", "validation", "test")
ALIASES = {"heldout": "test"}
HELD_OUT_TENTHS = {0: "test", 1: "validation"}  # a template key's hash mod 10 -> its split (train otherwise)
KEYS = ("tern", "wren", "kite", "lark", "crow", "dove", "hawk", "swan", "rook", "owl", "jay", "teal",
        "finch", "robin", "heron", "egret", "stork", "crane", "gull", "raven")


REASONING_NUMBERS = 5  # how many numbers a reasoning question orders
DIRECTIONS = {"descending": "from largest to smallest", "ascending": "from smallest to largest"}


def reasoning(rng: random.Random, difficulty: int) -> dict:
    """Five difficulty-digit numbers (digits 0-9 at difficulty 1 or below), drawn independently, so they may repeat
    (never all five equal), to order from largest to smallest or from smallest to largest, asked in any order but the
    wanted one.

    At difficulty 1 the tiny model learned the family's earlier shape, four different single digits from largest to
    smallest: 800 SFT steps on it alone reached a held-out predicted reward of 0.23, where two-digit numbers (which
    difficulty 1 gave until 2026-12-03) stayed at 0.001 and RL never saw a success. That shape had 210 templates, 21
    in the test split, where one constant answer was right 0.068 of the time. Five numbers, not four: with four
    single digits that may repeat (1,410 templates) a fixed order of the question's numbers would be right 0.079 of
    the time (expected), since a set with a repeated digit has fewer orders to ask it in; with five it is 0.021,
    about 1 in 48 (four different digits: 1 in 23).
    Single digits stay (the tiny model's numbers), and it gets a foothold on five: its balanced warm start reached
    reasoning's 0.1 criterion (0.11) in 2,075 SFT steps, and validation reasoning was 0.10 before 5 minutes of RL and
    0.13 after, on 78 tasks, within their noise (benchmarks/results/learning-2026-12-07-55a701458f.json). 3,984 templates
    (a set of five digits and a direction), 440 of them in the test split."""
    digits = max(1, difficulty)
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits
    numbers = [rng.randrange(low, high) for _ in range(REASONING_NUMBERS)]
    while len(set(numbers)) == 1:
        numbers = [rng.randrange(low, high) for _ in range(REASONING_NUMBERS)]
    direction = rng.choice(sorted(DIRECTIONS))
    wanted = sorted(numbers, reverse=direction == "descending")
    while numbers == wanted:
        rng.shuffle(numbers)
    listed = ", ".join(map(str, numbers[:-1]))
    return {"question": f"Order {listed} and {numbers[-1]} {DIRECTIONS[direction]}.",
            "answer": " ".join(map(str, wanted))}


def agent(rng: random.Random, difficulty: int) -> dict:
    """Arithmetic on (difficulty + 2)-digit operands: right only through the calculator."""
    digits = max(1, difficulty) + 2
    a, b = rng.randrange(10 ** (digits - 1), 10 ** digits), rng.randrange(10 ** (digits - 1), 10 ** digits)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"question": f"What is {a} {op} {b}?", "answer": str(value)}


def lookup(rng: random.Random, difficulty: int) -> dict:
    """A store of 2 + difficulty keys with 3-digit values; the question names one key."""
    keys = rng.sample(KEYS, min(len(KEYS), 2 + max(1, difficulty)))
    store = {k: str(rng.randrange(100, 1000)) for k in keys}
    key = rng.choice(keys)
    return {"question": f"What is stored under {key}?", "answer": store[key], "store": store}


def lookup_key(question: str) -> str:
    """The key a lookup question asks for.

    >>> lookup_key("What is stored under tern?")
    'tern'
    """
    return question.removeprefix("What is stored under ").removesuffix("?")


PLAIN_SYSTEM = "Answer with numbers only."


def mental(rng: random.Random, difficulty: int) -> dict:
    """The sum of two (difficulty + 1)-digit numbers, answered directly, no tools offered."""
    digits = max(1, difficulty) + 1
    a, b = (rng.randrange(10 ** (digits - 1), 10 ** digits) for _ in range(2))
    return {"question": f"What is {a} + {b}?", "answer": str(a + b), "system": PLAIN_SYSTEM, "tools": []}


def times(rng: random.Random, difficulty: int) -> dict:
    """A one-digit number (2-9) times one of 2 to 100 * (difficulty + 1) - 1 (2-199 at difficulty 1), in either
    order, answered directly, no tools offered. 1,556 templates (a pair of operands), 183 of them in the test split.
    The large operand ran to 10 * (difficulty + 1) + 9 (2-29) until 2026-12-07: 224 templates, 22 in the test split,
    where the constant answer 32 was right 0.132 of the time. Products of three digits or more, which SmolLM2 got
    under one in ten right before RL, are 89% of the tasks now (35% then)."""
    small, large = rng.randint(2, 9), rng.randint(2, 100 * (max(1, difficulty) + 1) - 1)
    a, b = (small, large) if rng.random() < 0.5 else (large, small)
    return {"question": f"What is {a} * {b}?", "answer": str(a * b), "system": PLAIN_SYSTEM, "tools": []}


def copy(rng: random.Random, difficulty: int) -> dict:
    """A product of two (difficulty + COPY_DIGITS)-digit numbers that the scaffold has the calculator work out before
    the model is asked (`calls`): the model must copy the tool's result."""
    digits = max(1, difficulty) + COPY_DIGITS
    a, b = (rng.randrange(10 ** (digits - 1), 10 ** digits) for _ in range(2))
    expression = f"{a} * {b}"
    return {"question": f"What is {expression}?", "answer": str(a * b), "system": PLAIN_SYSTEM,
            "tools": ["calculator"], "calls": [{"name": "calculator", "arguments": {"expression": expression}}]}


COPY_DIGITS = 3  # copy's operands at difficulty 1: four digits each, a seven- or eight-digit product
DEFAULT_MAX_TOKENS = 32  # a turn's limit, unless the family or the stream sets one
ACTING_MAX_TOKENS = 64  # a turn of calc or table: SmolLM2's calculator call is 39 tokens with its end of turn


def calc(rng: random.Random, difficulty: int) -> dict:
    """A product of two (difficulty + 3)-digit numbers, with both tools offered and no call made for the model: it
    has to call the calculator itself (no small model multiplies four-digit numbers in its head), read the result
    and answer it. The acting twin of copy, where the scaffold makes the call."""
    digits = max(1, difficulty) + 3
    a, b = (rng.randrange(10 ** (digits - 1), 10 ** digits) for _ in range(2))
    return {"question": f"What is {a} * {b}?", "answer": str(a * b), "max_tokens": ACTING_MAX_TOKENS}


TABLE_KEYS = tuple(f"{colour}-{bird}" for colour in ("red", "blue", "green", "grey", "gold", "pink", "black", "white")
                   for bird in KEYS)


def table(rng: random.Random, difficulty: int) -> dict:
    """A table of 3 + difficulty keys (a colour and a bird: "gold-heron") with distinct four-digit values, which only
    the `lookup` tool reads; the question names one key. Both tools offered; the model has to call lookup with the
    key as asked, read the value and answer it. A call with another key returns another value, never the answer."""
    keys = rng.sample(TABLE_KEYS, 3 + max(1, difficulty))
    store = dict(zip(keys, map(str, rng.sample(range(1000, 10000), len(keys)))))
    key = rng.choice(keys)
    return {"question": f"What is stored under {key}?", "answer": store[key], "store": store,
            "max_tokens": ACTING_MAX_TOKENS}


FAMILIES: dict[str, Callable[[random.Random, int], dict]] = {"reasoning": reasoning, "agent": agent,
                                                            "lookup": lookup, "mental": mental, "times": times,
                                                            "copy": copy, "calc": calc, "table": table}
GRADERS = {"mental": "numeric", "times": "numeric", "copy": "numeric", "calc": "numeric",
           "table": "numeric"}  # a family's grader when it is not `numbers`
PRETRAINED_MIX = "times=1,copy=1"  # bench learning --model's default: the families a pretrained chat model starts on
MIXES = {"tools": "calc=1,table=1",  # the acting families: only a call the model makes itself succeeds
         "pretrained": PRETRAINED_MIX, "default": ",".join(f"{d}=1" for d in DOMAINS)}


# a question's operands, all integers (template_key sorts them as ints); a reply's numbers, decimals too, are
# read with forge_stream.rollout.graders.NUMBER
INTEGER = re.compile(r"-?\d+")


def template_key(domain: str, task: dict) -> str:
    """The task's template (`task` as its grader sees it): the question's numbers, sorted, whatever their order or
    operator; for reasoning the direction asked too; for lookup the key asked and the value stored under it (the
    only value an agent sees).

    >>> template_key("reasoning", {"question": "Order 8, 3, 1, 3 and 6 from largest to smallest."})
    'reasoning:descending:1,3,3,6,8'
    >>> template_key("reasoning", {"question": "Order 8, 3, 1, 3 and 6 from smallest to largest."})
    'reasoning:ascending:1,3,3,6,8'
    >>> [template_key("agent", {"question": q}) for q in ("What is 347 + 518?", "What is 518 - 347?")]
    ['agent:347,518', 'agent:347,518']
    >>> template_key("lookup", {"question": "What is stored under tern?", "answer": "532"})
    'lookup:tern=532'
    """
    if domain in ("lookup", "table"):
        return f"{domain}:{lookup_key(task['question'])}={task['answer']}"
    numbers = ','.join(sorted(INTEGER.findall(task['question']), key=int))
    if domain == "reasoning":
        return f"{domain}:{reasoning_direction(task['question'])}:{numbers}"
    return f"{domain}:{numbers}"


def reasoning_direction(question: str) -> str:
    """'descending' or 'ascending': the order a reasoning question asks for.

    >>> reasoning_direction("Order 8, 3, 1, 3 and 6 from smallest to largest.")
    'ascending'
    """
    return next(name for name, words in DIRECTIONS.items() if question.endswith(f" {words}."))


def task_kind(domain: str, task: dict) -> str:
    """A coarser grouping than the template, for reading where RL wins and loses: for lookup the key asked, for
    agent the operator and the answer's digit count, for reasoning the template. A small policy tends to solve a
    kind all or nothing (one key's call, a six-digit result's copy), so a result broken down by kind shows which
    skills RL gained and which it lost.

    >>> task_kind("lookup", {"question": "What is stored under tern?", "answer": "532"})
    'lookup:tern'
    >>> task_kind("agent", {"question": "What is 951 * 305?", "answer": "290055"})
    'agent:*6'
    >>> task_kind("reasoning", {"question": "Order 8, 3, 1, 3 and 6 from largest to smallest."})
    'reasoning:descending:1,3,3,6,8'
    """
    if domain in ("lookup", "table"):
        return f"{domain}:{lookup_key(task['question'])}"
    if domain == "agent":
        operator = next(op for op in "+-*" if f" {op} " in task["question"])
        return f"agent:{operator}{len(task['answer'].lstrip('-'))}"
    if domain in ("times", "copy", "mental", "calc"):
        return f"{domain}:{len(task['answer'])}"
    return template_key(domain, task)


def split_of(domain: str, task: dict) -> str:
    """'train', 'validation' or 'test', from a hash of the task's template key."""
    digest = int.from_bytes(hashlib.sha256(template_key(domain, task).encode()).digest()[:8], "big")
    return HELD_OUT_TENTHS.get(digest % 10, "train")


def _mix(mix: dict[str, float] | None) -> tuple[list[str], list[float]]:
    mix = mix or {d: 1.0 for d in DOMAINS}
    unknown = set(mix) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown task domains {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    names = sorted(mix)
    return names, [float(mix[n]) for n in names]


def iter_tasks(split: str, seed: int = 0, mix: dict[str, float] | None = None, difficulty: int = 1,
               group_size: int = 8, max_tokens: int | None = None,
               temperature: float | None = None) -> Iterator[TaskSpec]:
    """An endless seeded stream of tasks of one split ('train', 'validation' or 'test'; 'heldout' is 'test'), domains
    drawn by `mix` weights. `max_tokens`: a turn's limit (default: the family's own, else 32); `temperature`: what the
    agent samples at (the example agent's default is 1)."""
    split = ALIASES.get(split, split)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)} (or heldout, the test split), not {split!r}")
    names, weights = _mix(mix)
    rng = random.Random(f"{seed}:{split}")
    for index in itertools.count():
        domain = rng.choices(names, weights)[0]
        while True:
            instance = FAMILIES[domain](rng, difficulty)
            if split_of(domain, instance) == split:
                break
        answer = instance.pop("answer")
        limit = max_tokens if max_tokens is not None else instance.pop("max_tokens", DEFAULT_MAX_TOKENS)
        instance.pop("max_tokens", None)
        sampling = {"max_tokens": limit, **({} if temperature is None else {"temperature": temperature})}
        yield TaskSpec(task_id=f"{split}-{seed}-{index}", prompt={**instance, **sampling},
                       domain=domain, grader=GRADERS.get(domain, "numbers"), group_size=group_size,
                       metadata={"difficulty": str(difficulty), "split": split}, reference={"answer": answer})


def make_tasks(split: str, n: int, seed: int = 0, mix: dict[str, float] | None = None, difficulty: int = 1,
               group_size: int = 8) -> list[TaskSpec]:
    return list(itertools.islice(iter_tasks(split, seed, mix, difficulty, group_size), n))


def parse_mix(text: str | None) -> dict[str, float] | None:
    """'reasoning=1,agent=2' -> {'reasoning': 1.0, 'agent': 2.0}, or a named mix (MIXES: `tools`, `pretrained`,
    `default`); None or '' -> every domain equally.

    >>> parse_mix("agent=2,lookup=1")
    {'agent': 2.0, 'lookup': 1.0}
    >>> parse_mix("tools")
    {'calc': 1.0, 'table': 1.0}
    """
    if not text:
        return None
    text = MIXES.get(text.strip(), text)
    if "=" not in text:
        raise ValueError(f"a mix is DOMAIN=WEIGHT,... or one of {', '.join(MIXES)}, not {text!r}")
    return {name.strip(): float(weight) for name, weight in (part.split("=") for part in text.split(","))}


def to_jsonl(tasks: list[TaskSpec]) -> str:
    return "".join(json.dumps({"task_id": t.task_id, "prompt": t.prompt, "reference": t.reference, "domain": t.domain,
                               "grader": t.grader, "group_size": t.group_size, "metadata": t.metadata}) + "\n"
                   for t in tasks)
