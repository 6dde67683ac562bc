"""The shipped task suite: seeded task families with a difficulty, their graders, and a train/held-out split.

Three domains, mixed in one run (unified mixed-domain training):

- reasoning: "Which is larger, 37 or 82?", answered directly: the model has to compare the numbers itself.
- agent: "What is 347 + 518?" (difficulty d: (d + 2)-digit operands, + - *): the model can only get it right by
  calling the `calculator` tool and copying its result.
- lookup: "What is stored under tern?": the value sits in the task's own key-value store, which the agent exposes
  as the `lookup` tool; the model must call it with the right key and copy the value.

The agent gets what it needs to act (`TaskSpec.prompt`): the `question`, and for lookup the `store` its tool reads.
The `answer` is the grader's alone (`TaskSpec.reference`). The grader of every family is `numeric` (the last
number of the reply must equal the answer).

The split is by construction: an instance belongs to the held-out set when a hash of its canonical form falls in
the held-out fifth, so the two sets are disjoint whatever the seeds. `iter_tasks` is an endless seeded stream;
`make_tasks` takes the first n of it.

>>> a = make_tasks("train", 50, seed=1)
>>> b = make_tasks("heldout", 50, seed=1)
>>> not {canonical(t.graded) for t in a} & {canonical(t.graded) for t in b}
True
>>> all(split_of(t.graded) == "heldout" for t in b)
True
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from typing import Callable, Iterator

from forge_stream.rollout.controller import TaskSpec

SYSTEM = "Answer with a number. Use a tool when useful."
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
HELDOUT_SHARE = 5  # one instance in five is held out
KEYS = ("tern", "wren", "kite", "lark", "crow", "dove", "hawk", "swan", "rook", "owl", "jay", "teal",
        "finch", "robin", "heron", "egret", "stork", "crane", "gull", "raven")


def reasoning(rng: random.Random, difficulty: int) -> dict:
    """The larger of two different (difficulty + 1)-digit numbers, to answer directly."""
    low, high = 10 ** max(0, difficulty), 10 ** (max(0, difficulty) + 1)
    a, b = rng.sample(range(low, high), 2)
    return {"question": f"Which is larger, {a} or {b}?", "answer": str(max(a, b))}


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


FAMILIES: dict[str, Callable[[random.Random, int], dict]] = {"reasoning": reasoning, "agent": agent,
                                                            "lookup": lookup}


def canonical(prompt: dict) -> str:
    """The instance itself (question, answer, store), whatever the delivery settings."""
    return json.dumps({k: prompt[k] for k in ("question", "answer", "store") if k in prompt}, sort_keys=True)


def split_of(prompt: dict) -> str:
    """'heldout' or 'train', from a hash of the instance's canonical form."""
    digest = int.from_bytes(hashlib.sha256(canonical(prompt).encode()).digest()[:8], "big")
    return "heldout" if digest % HELDOUT_SHARE == 0 else "train"


def _mix(mix: dict[str, float] | None) -> tuple[list[str], list[float]]:
    mix = mix or {d: 1.0 for d in DOMAINS}
    unknown = set(mix) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown task domains {sorted(unknown)}; known: {', '.join(DOMAINS)}")
    names = sorted(mix)
    return names, [float(mix[n]) for n in names]


def iter_tasks(split: str, seed: int = 0, mix: dict[str, float] | None = None, difficulty: int = 1,
               group_size: int = 8, max_tokens: int = 32) -> Iterator[TaskSpec]:
    """An endless seeded stream of tasks of one split ('train' or 'heldout'), domains drawn by `mix` weights."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    names, weights = _mix(mix)
    rng = random.Random(f"{seed}:{split}")
    for index in itertools.count():
        domain = rng.choices(names, weights)[0]
        while True:
            instance = FAMILIES[domain](rng, difficulty)
            if split_of(instance) == split:
                break
        answer = instance.pop("answer")
        yield TaskSpec(task_id=f"{split}-{seed}-{index}", prompt={**instance, "max_tokens": max_tokens},
                       domain=domain, grader="numeric", group_size=group_size,
                       metadata={"difficulty": str(difficulty), "split": split}, reference={"answer": answer})


def make_tasks(split: str, n: int, seed: int = 0, mix: dict[str, float] | None = None, difficulty: int = 1,
               group_size: int = 8) -> list[TaskSpec]:
    return list(itertools.islice(iter_tasks(split, seed, mix, difficulty, group_size), n))


def parse_mix(text: str | None) -> dict[str, float] | None:
    """'reasoning=1,agent=2' -> {'reasoning': 1.0, 'agent': 2.0}; None or '' -> every domain equally.

    >>> parse_mix("agent=2,lookup=1")
    {'agent': 2.0, 'lookup': 1.0}
    """
    if not text:
        return None
    return {name.strip(): float(weight) for name, weight in (part.split("=") for part in text.split(","))}


def to_jsonl(tasks: list[TaskSpec]) -> str:
    return "".join(json.dumps({"task_id": t.task_id, "prompt": t.prompt, "reference": t.reference, "domain": t.domain,
                               "grader": t.grader, "group_size": t.group_size, "metadata": t.metadata}) + "\n"
                   for t in tasks)
