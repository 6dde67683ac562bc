"""Hermes-style tool-call parsing: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` -> OpenAI tool_calls.

The format is what the tiny model's chat template (and Qwen2.5, Hermes, many others) asks the model to emit.
A block that is not valid JSON with a string "name" is not a tool call: if no block parses, the whole text
stays content, so nothing the model wrote is lost. An unclosed last block (generation cut by max_tokens) is
parsed too when its JSON is complete.
"""

import json
import re
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends function arguments


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    tool_calls: tuple[ParsedToolCall, ...]


def _parse_block(body: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(name=obj["name"], arguments=args if isinstance(args, str) else json.dumps(args))


def parse_tool_calls(text: str) -> ParsedMessage:
    """Split model output into content (text before the first tool call) and the tool calls.

    >>> m = parse_tool_calls('Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    >>> m.content, m.tool_calls[0].name, m.tool_calls[0].arguments
    ('Sure.', 'f', '{"x": 1}')
    >>> parse_tool_calls("no calls here").tool_calls
    ()
    """
    if TOOL_CALL_START not in text:
        return ParsedMessage(content=text, tool_calls=())
    calls = tuple(c for c in (_parse_block(m.group(1)) for m in _BLOCK.finditer(text)) if c is not None)
    if not calls:
        return ParsedMessage(content=text, tool_calls=())
    content = text[: text.index(TOOL_CALL_START)].strip()
    return ParsedMessage(content=content or None, tool_calls=calls)
