"""Process-reward rules: plain functions `rule(ctx: TurnContext) -> float`, named in settings by dotted path.

Each returns a raw value in [-1, 0] (0 = nothing to penalize); the settings weight scales it. A rule sees one
turn: its Completion record and the ToolSpans that turn's tool calls produced.

>>> ctx = TurnContext(completion={"output_text": "hello", "tool_calls_json": None, "tools_json": None}, spans=())
>>> tool_error(ctx), invalid_tool_call(ctx), language_mixing(ctx)
(0.0, 0.0, 0.0)
"""

from __future__ import annotations

import importlib
import json
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol


@dataclass(frozen=True)
class TurnContext:
    completion: dict  # the Completion record of this turn
    spans: tuple[dict, ...]  # the ToolSpans of this turn's tool calls (explicit spans replace inferred ones)


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
    """-1 when a tool call is malformed: unparsable, arguments not a JSON object, or a tool the request never offered.

    >>> tools = json.dumps([{"type": "function", "function": {"name": "search"}}])
    >>> call = lambda name, args: json.dumps([{"function": {"name": name, "arguments": args}}])
    >>> invalid_tool_call(TurnContext({"tools_json": tools, "tool_calls_json": call("search", '{"q": 1}')}, ()))
    0.0
    >>> invalid_tool_call(TurnContext({"tools_json": tools, "tool_calls_json": call("search", "{oops")}, ()))
    -1.0
    >>> invalid_tool_call(TurnContext({"tools_json": tools, "tool_calls_json": call("delete", "{}")}, ()))
    -1.0
    """
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
