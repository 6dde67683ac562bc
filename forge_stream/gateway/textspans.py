"""Tool spans of text-protocol agents: agents that run tools named in their own text and send the results back as
a user message, so no `tool` message answers a tool call id (smolagents' "Observation:" messages, mini-swe-agent's
bash blocks answered with `<returncode>`).

A rule maps (the text of an assistant turn, the user message that follows it) to the tool calls that turn made:
name, arguments, result and, where the text tells, whether it failed. Built-in rules are named in `RULES`; a user
rule is a plain function named by dotted path (`package.module:function`) returning `TextSpan`s or dicts with
those fields. A session chooses its rule with the metadata key `span_rule` (a built-in name or a dotted path), or
an agent with its `X-Forge-Agent` name (a built-in name, alone or before `/`, e.g. `smolagents/planner`); the
session's rule wins. Only the metadata (written by whoever opens sessions: the admin, when auth is on) may name code
to import; an agent's header selects built-in rules only.

When a request of the agent carries such a pair (its last assistant message followed by a user message), each
span becomes a ToolSpan recorded exactly like an inferred one (spans.inferred_span): the tool call the span names,
if the engine issued it and it is still pending, or else the agent's last completion gives the completion id and
start time. A span of an issued call has the span id an inferred span would have (from the call id); one of a call
only the text names gets its id from the agent, the position and text of the assistant turn (agents reuse their
own call ids, e.g. smolagents' CodeAgent's `call_1` in every run), so a request that repeats a pair already
recorded (a retry) records nothing new.
"""

from __future__ import annotations

import ast
import importlib
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import orjson

from forge_stream.events import deterministic_id
from forge_stream.gateway.protocol import invalid
from forge_stream.gateway.spans import PendingCall, SessionKeys, content_text, inferred_span, span_id

log = logging.getLogger(__name__)
METADATA_KEY = "span_rule"


@dataclass(frozen=True)
class TextSpan:
    """One tool call read from an agent's text: `is_error` None when the text does not tell (then the result is
    judged as a `tool` message's would be)."""

    name: str
    arguments: object = None  # a JSON value, or JSON text
    result: str = ""
    is_error: bool | None = None
    call_id: str | None = None  # the tool call id the agent's text names, if any


Rule = Callable[[str, str], Iterable["TextSpan | dict"]]


@dataclass(frozen=True)
class TextTurn:
    """An agent's last completion (its choices' ids and texts), which a later text pair answers."""

    issued_ms: int
    choices: tuple[tuple[str, str], ...]  # (completion_id, output text)

    def completion_for(self, assistant: str) -> str:
        """The choice the assistant turn continues: the one whose text it contains, else the first."""
        return next((cid for cid, text in self.choices if text.strip() and text.strip() in assistant),
                    self.choices[0][0])


_CALLING = "Calling tools:"
_CALL_ERROR = re.compile(r"^Call id: (?P<id>.*)\nError:\n", re.MULTILINE)


def smolagents(assistant: str, user: str) -> list[TextSpan]:
    """smolagents (ToolCallingAgent and CodeAgent): the calls are replayed as `Calling tools:` and a Python list of
    {'id', 'function': {'name', 'arguments'}}; the next user message is `Observation:\\n...` (one observation for
    all calls of the turn) or `Call id: ...\\nError:\\n...` (the step failed: every call of it is an error).

    >>> turn = "Calling tools:\\n[{'id': 'c1', 'function': {'name': 'calc', 'arguments': {'x': 2}}}]"
    >>> smolagents(turn, "Observation:\\n4")
    [TextSpan(name='calc', arguments={'x': 2}, result='4', is_error=False, call_id='c1')]
    >>> smolagents(turn, "Call id: c1\\nError:\\nboom\\nNow let's retry")[0].is_error
    True
    """
    at = assistant.rfind(_CALLING)
    if at < 0:
        return []
    try:
        calls = ast.literal_eval(assistant[at + len(_CALLING):].strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return []
    if not isinstance(calls, list):
        return []
    error = _CALL_ERROR.search(user)
    if error is not None:
        result, failed = user[error.end():], True
    elif "Observation:" in user:
        result, failed = user.split("Observation:", 1)[1].lstrip("\n"), False
    else:
        return []
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and function.get("name"):
            out.append(TextSpan(str(function["name"]), function.get("arguments"), result, failed,
                                str(call["id"]) if call.get("id") else None))
    return out


_BASH = re.compile(r"```(?:bash|sh)[ \t]*\n(.*?)\n?```", re.DOTALL)
_RETURNCODE = re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>")
_TIMEOUT = re.compile(r"timed out", re.IGNORECASE)


def mini_swe_agent(assistant: str, user: str) -> list[TextSpan]:
    """mini-swe-agent (text mode): exactly one ```bash block is run; the next user message holds
    `<returncode>N</returncode>` and the output (an error when N != 0), or says the command timed out. A turn with
    no block or several is answered with a format error and runs nothing.

    >>> [span] = mini_swe_agent("THOUGHT: look\\n```bash\\nls -a\\n```", "<returncode>2</returncode>\\nno such file")
    >>> span.name, span.arguments, span.is_error
    ('bash', {'command': 'ls -a'}, True)
    >>> mini_swe_agent("```bash\\nls\\n```\\n```bash\\npwd\\n```", "<returncode>0</returncode>")
    []
    """
    actions = _BASH.findall(assistant)
    if len(actions) != 1:
        return []
    code = _RETURNCODE.search(user)
    if code is not None:
        failed = int(code.group(1)) != 0
    elif _TIMEOUT.search(user):
        failed = True
    else:
        return []
    return [TextSpan("bash", {"command": actions[0].strip()}, user, failed)]


RULES: dict[str, Rule] = {"smolagents": smolagents, "mini-swe-agent": mini_swe_agent}


def load_rule(name: str) -> Rule:
    """A built-in rule by name, or a function by dotted path (`module:function`); 422 naming what is wrong."""
    if name in RULES:
        return RULES[name]
    module, _, function = name.partition(":")
    if not (module and function):
        raise invalid(f"Unknown span rule {name!r}: use one of {sorted(RULES)} or 'module:function'.",
                      f"metadata.{METADATA_KEY}")
    try:
        rule = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise invalid(f"Span rule {name!r} cannot be loaded: {exc}", f"metadata.{METADATA_KEY}") from exc
    if not callable(rule):
        raise invalid(f"Span rule {name!r} is not a function.", f"metadata.{METADATA_KEY}")
    return rule


def agent_rule(agent: str) -> Rule | None:
    """The built-in rule an `X-Forge-Agent` name selects (the name, or its part before `/`), if any.

    >>> agent_rule("mini-swe-agent") is mini_swe_agent, agent_rule("smolagents/planner") is smolagents
    (True, True)
    >>> agent_rule("planner") is None
    True
    """
    return RULES.get(agent.split("/", 1)[0])


def last_pair(messages: list) -> tuple[int, str, str] | None:
    """(index, text) of the last assistant message followed by a user message, and that user message's text."""
    for i in range(len(messages) - 2, -1, -1):
        message = messages[i]
        if isinstance(message, dict) and message.get("role") == "assistant":
            following = messages[i + 1]
            if isinstance(following, dict) and following.get("role") == "user":
                return i, content_text(message.get("content")), content_text(following.get("content"))
            return None
    return None


def _arguments_json(arguments) -> str:
    if isinstance(arguments, str):
        try:
            orjson.loads(arguments)
            return arguments
        except orjson.JSONDecodeError:
            pass
    return orjson.dumps(arguments if arguments is not None else {}, default=str).decode()


def text_spans(rule: Rule, keys: SessionKeys, messages: list, agent: str, turn: TextTurn | None,
               pending: dict[str, PendingCall], recorded: set[str], received_ms: int) -> tuple[list[dict], list]:
    """The ToolSpans `rule` reads from the last pair of `messages` that are not recorded yet, and the pending calls
    they answer. A rule that raises records nothing (logged): a rule's bug never fails the agent's call."""
    pair = last_pair(messages)
    if pair is None:
        return [], []
    index, assistant, user = pair
    try:
        found = [s if isinstance(s, TextSpan) else TextSpan(**s) for s in rule(assistant, user)]
    except Exception:  # a user rule is outside code: its failure costs the spans, not the call
        log.exception("span rule %r failed on session %s", rule, keys.session_id)
        return [], []
    spans, taken = [], []
    for k, found_span in enumerate(found):
        issued = pending.get(found_span.call_id or "")
        if issued is not None:  # a call the engine issued (its id): the span an inferred one would be
            sid, call = span_id(keys.session_id, issued.tool_call_id), issued
        elif found_span.call_id and span_id(keys.session_id, found_span.call_id) in recorded:
            continue  # an issued call whose span was recorded already
        elif turn is not None:  # a call only the text names: its id is the agent's, unique per pair
            sid = span_id(keys.session_id, deterministic_id("text-call", agent, index, assistant, k))
            call = PendingCall(found_span.call_id or sid, "", "", turn.issued_ms, turn.completion_for(assistant),
                               agent)
        else:
            continue  # no completion of this agent to attribute it to
        if sid in recorded or any(s["span_id"] == sid for s in spans):
            continue  # a pair recorded before (a retried request), or a call named twice
        if issued is not None:
            taken.append(issued)
        call = PendingCall(call.tool_call_id, found_span.name, _arguments_json(found_span.arguments),
                           call.issued_ms, call.completion_id, call.agent)
        span = inferred_span(keys, call, found_span.result, received_ms, sid)
        if found_span.is_error is not None:
            span["status"], span["error"] = (("error", (found_span.result or "error")[:1000])
                                             if found_span.is_error else ("ok", None))
        spans.append(span)
    return spans, taken
