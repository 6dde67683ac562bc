"""Process-reward rules: plain functions `rule(ctx: TurnContext) -> float`, named in settings by dotted path.

A penalty returns a raw value in [-1, 0] (0 = nothing to penalize), a subgoal reward one in [0, 1]; the settings
weight scales it. A rule sees one turn: its Completion record, the ToolSpans that turn's tool calls produced, and
the group's Task (whose `prompt_json` is the payload the agent got and `reference_json` what only the grader saw).

>>> ctx = TurnContext(completion={"output_text": "hello", "tool_calls_json": None, "tools_json": None}, spans=())
>>> tool_error(ctx), invalid_tool_call(ctx), language_mixing(ctx)
(0.0, 0.0, 0.0)
"""

from __future__ import annotations

import importlib
import json
import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol


@dataclass(frozen=True)
class TurnContext:
    completion: dict  # the Completion record of this turn
    spans: tuple[dict, ...]  # the ToolSpans of this turn's tool calls (explicit spans replace inferred ones)
    task: dict | None = None  # the group's Task record

    @property
    def payload(self) -> dict:
        """The agent's task payload (Task.prompt_json), or {} when there is none or it is not a JSON object."""
        return _object((self.task or {}).get("prompt_json"))

    @property
    def reference(self) -> dict:
        """What only the grader saw (Task.reference_json, e.g. the answer), or {}."""
        return _object((self.task or {}).get("reference_json"))


def _object(text: str | None) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Rule(Protocol):
    def __call__(self, ctx: TurnContext) -> float: ...


@lru_cache(maxsize=None)
def load_rule(path: str) -> Rule:
    """Import `package.module.function`; raises ImportError or AttributeError with the path in the message."""
    module, _, name = path.rpartition(".")
    if not module:
        raise ImportError(f"rule {path!r} is not a dotted path (package.module.function)")
    return getattr(importlib.import_module(module), name)


def tool_error(ctx: TurnContext) -> float:
    """Minus the share of this turn's tool spans that ended in an error.

    >>> tool_error(TurnContext({}, ({"status": "ok"}, {"status": "error"})))
    -0.5
    """
    if not ctx.spans:
        return 0.0
    return -sum(span["status"] != "ok" for span in ctx.spans) / len(ctx.spans)


def invalid_tool_call(ctx: TurnContext) -> float:
    """-1 when a tool call is malformed: a call in the model's format that did not parse (the Completion's
    `tool_call_error`, set by the gateway), unparsable, arguments not a JSON object, or a tool the request never
    offered.

    >>> tools = json.dumps([{"type": "function", "function": {"name": "search"}}])
    >>> call = lambda name, args: json.dumps([{"function": {"name": name, "arguments": args}}])
    >>> invalid_tool_call(TurnContext({"tools_json": tools, "tool_calls_json": call("search", '{"q": 1}')}, ()))
    0.0
    >>> invalid_tool_call(TurnContext({"tools_json": tools, "tool_calls_json": call("search", "{oops")}, ()))
    -1.0
    >>> invalid_tool_call(TurnContext({"tools_json": tools, "tool_calls_json": call("delete", "{}")}, ()))
    -1.0
    >>> invalid_tool_call(TurnContext({"tools_json": tools, "tool_calls_json": None,
    ...                                "tool_call_error": "unterminated <tool_call> block"}, ()))
    -1.0
    """
    if ctx.completion.get("tool_call_error"):
        return -1.0
    raw = ctx.completion.get("tool_calls_json")
    if not raw:
        return 0.0
    offered = _offered_tools(ctx.completion.get("tools_json"))
    try:
        calls = json.loads(raw)
        for call in calls:
            function = call["function"]
            args = function.get("arguments") or "{}"
            if not isinstance(json.loads(args) if isinstance(args, str) else args, dict):
                return -1.0
            if offered is not None and function["name"] not in offered:
                return -1.0
    except (ValueError, TypeError, KeyError):
        return -1.0
    return 0.0


def _offered_tools(tools_json: str | None) -> set[str] | None:
    if not tools_json:
        return None
    try:
        return {tool["function"]["name"] for tool in json.loads(tools_json)}
    except (ValueError, TypeError, KeyError):
        return None


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def tool_result_answers(ctx: TurnContext) -> float:
    """1 when a tool call of this turn returned the task's expected `answer` (a subgoal: what is left is to report
    it), else 0. For tasks whose reference names an `answer` (the shipped suite's do; a Task from before the
    reference carried it in its payload); a number matches as a number.

    It credits the turn that got the answer, not the final copy: reward-to-go (or a rollout's return) then tells a
    rollout that called the tool right but reported it wrong from one that never got there.

    >>> task = {"prompt_json": json.dumps({"question": "What is 347 * 12?"}), "reference_json": '{"answer": "4164"}'}
    >>> ok = lambda result: TurnContext({}, ({"status": "ok", "result": result},), task)
    >>> tool_result_answers(ok("4164")), tool_result_answers(ok("4165")), tool_result_answers(ok("value: 4164."))
    (1.0, 0.0, 1.0)
    >>> tool_result_answers(TurnContext({}, ({"status": "error", "result": "4164"},), task))
    0.0
    >>> tool_result_answers(TurnContext({}, (), task)), tool_result_answers(ok("4164").__class__({}, (), None))
    (0.0, 0.0)
    >>> tool_result_answers(ok("4164").__class__({}, ok("4164").spans, {"prompt_json": '{"answer": "4164"}'}))
    1.0
    """
    answer = ctx.reference.get("answer", ctx.payload.get("answer"))
    if answer is None or not ctx.spans:
        return 0.0
    answer = str(answer).strip()
    for span in ctx.spans:
        result = span.get("result") or ""
        if span.get("status") != "ok":
            continue
        if result.strip() == answer or (NUMBER.fullmatch(answer) and answer in NUMBER.findall(result)):
            return 1.0
    return 0.0


def answer_prefix(ctx: TurnContext) -> float:
    """Partial credit for an answer turn (one without tool calls): the share of the task's `answer`, written as its
    numbers separated by single spaces, that the reply's numbers written the same way get right from the start,
    over the longer of the two (so a reply that adds numbers earns less). 1 for the exact answer, 0 when the first
    character is wrong. A dense signal where the outcome is all-or-nothing: a group whose rollouts all failed
    still tells a reply that got "8 6 1" right from one that got nothing, and a copy right up to its last digit
    from one wrong at its first. A shaping reward for training; what is reported is the grader's outcome.

    >>> task = {"reference_json": '{"answer": "8 6 3 1"}'}
    >>> credit = lambda text: round(answer_prefix(TurnContext({"output_text": text}, (), task)), 3)
    >>> credit("8 6 3 1"), credit("8, 6, 1, 3"), credit("3 8 1 6"), credit("8 6 3 1 5"), credit("")
    (1.0, 0.571, 0.0, 0.778, 0.0)
    >>> answer_prefix(TurnContext({"output_text": "8 6 3 1", "tool_calls_json": '[{"function": {}}]'}, (), task))
    0.0
    >>> answer_prefix(TurnContext({"output_text": "865"}, (), {"reference_json": '{"answer": "865"}'}))
    1.0
    """
    answer = ctx.reference.get("answer")
    if answer is None or ctx.completion.get("tool_calls_json"):
        return 0.0
    wanted = " ".join(NUMBER.findall(str(answer)))
    got = " ".join(NUMBER.findall(ctx.completion.get("output_text") or ""))
    if not wanted:
        return 0.0
    shared = 0
    for a, b in zip(wanted, got):
        if a != b:
            break
        shared += 1
    return shared / max(len(wanted), len(got))


SCRIPTS = ("LATIN", "CYRILLIC", "CJK", "HIRAGANA", "KATAKANA", "HANGUL", "GREEK", "ARABIC")
MIN_LETTERS = 3  # a script counts as present from this many letters on, so a stray symbol is not "mixing"


def language_mixing(ctx: TurnContext) -> float:
    """-1 when the output text mixes writing systems (e.g. Latin with CJK or Cyrillic), else 0.

    Letters are classified by their Unicode name's first word (LATIN, CYRILLIC, CJK, HIRAGANA, ...); Japanese
    kana and Han count as one system. Code, numbers and punctuation are ignored.

    >>> language_mixing(TurnContext({"output_text": "The answer is 42."}, ()))
    0.0
    >>> language_mixing(TurnContext({"output_text": "The answer 答案是四十二 is 42."}, ()))
    -1.0
    """
    counts: dict[str, int] = {}
    for char in ctx.completion.get("output_text") or "":
        if not char.isalpha():
            continue
        script = unicodedata.name(char, "").split(" ", 1)[0]
        if script in SCRIPTS:
            family = "CJK" if script in ("HIRAGANA", "KATAKANA") else script
            counts[family] = counts.get(family, 0) + 1
    present = [s for s, n in counts.items() if n >= MIN_LETTERS]
    return -1.0 if len(present) > 1 else 0.0
