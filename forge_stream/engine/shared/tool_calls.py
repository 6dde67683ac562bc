"""Hermes-style tool-call parsing: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` -> OpenAI tool_calls.

The format is what the tiny model's chat template (and SmolLM2's as imported, Qwen2.5, Hermes, many others) asks
the model to emit. As vLLM's `hermes` parser does, a text parses as all of its blocks or as none: a block that is
not valid JSON with a string "name" makes the whole text stay content, so nothing the model wrote is lost, and the
parse says why (`ParsedMessage.error`, which the gateway records on the Completion: `tool_call_error`). An unclosed
last block (generation cut by max_tokens) is parsed too when its JSON is complete.
"""

import json
import re
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends function arguments


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    tool_calls: tuple[ParsedToolCall, ...]
    error: str | None = None  # why the text's <tool_call> blocks gave no calls (None: no block, or all parsed)


def _parse_block(body: str, closed: bool) -> ParsedToolCall | str:
    """The call one block holds, or why it holds none."""
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return f"{'invalid JSON in' if closed else 'unterminated'} <tool_call> block: {exc}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return '<tool_call> block is not a JSON object with a string "name"'
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(name=obj["name"], arguments=args if isinstance(args, str) else json.dumps(args))


def parse_tool_calls(text: str) -> ParsedMessage:
    """Split model output into content (text before the first tool call) and the tool calls.

    >>> m = parse_tool_calls('Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    >>> m.content, m.tool_calls[0].name, m.tool_calls[0].arguments, m.error
    ('Sure.', 'f', '{"x": 1}', None)
    >>> parse_tool_calls("no calls here").tool_calls
    ()
    >>> parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}').error
    "unterminated <tool_call> block: Expecting ',' delimiter: line 1 column 36 (char 35)"
    """
    if TOOL_CALL_START not in text:
        return ParsedMessage(content=text, tool_calls=())
    blocks = [_parse_block(m.group(1), bool(m.group(2))) for m in _BLOCK.finditer(text)]
    failed = [(k, b) for k, b in enumerate(blocks) if isinstance(b, str)]
    if failed:
        k, reason = failed[0]
        return ParsedMessage(content=text, tool_calls=(),
                             error=reason if len(blocks) == 1 else f"{reason} (block {k + 1} of {len(blocks)})")
    content = text[: text.index(TOOL_CALL_START)].strip()
    return ParsedMessage(content=content or None, tool_calls=tuple(blocks))
