"""Checks of what an agent sends, before it reaches an engine or Kafka: identifiers (`check_id`) and OpenAI requests
(`check_request`), each failure a 4xx whose message says what to change. `tool_choice`, `parallel_tool_calls` and
`response_format` are forwarded as sent (every engine enforces them: vLLM itself, the local engine with
grammar-constrained decoding); values no engine can enforce are a 400 naming the parameter. So is a sampling
parameter that would change the distribution the engine samples from beyond what each Completion records
(`temperature` and `top_p`): the trainer scores every token under the recorded settings, and a `top_k` or a penalty it
never saw would train it on a distribution no engine sampled (`UNRECORDED`)."""

from __future__ import annotations

import math
import re

from forge_stream.gateway.protocol import GatewayError, invalid
from forge_stream.gateway.recording import Kind
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.openai_protocol import structured_output_error

# sampling parameters of OpenAI's API and vLLM's extensions that reshape the distribution, and the values that leave
# it as it is (absent, or these): anything else is refused, since no Completion records it
UNRECORDED = {
    "top_k": (-1, 0), "min_p": (0,), "typical_p": (1,), "repetition_penalty": (1,), "frequency_penalty": (0,),
    "presence_penalty": (0,), "logit_bias": ({},), "min_tokens": (0,), "bad_words": ([],), "allowed_token_ids": (),
    "logits_processors": ([],), "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "vllm_xargs": (),
}
SESSION_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._:-]*")  # one URL path segment, never "." or ".."


def check_id(value: str, param: str, max_length: int, *, path_segment: bool = False) -> None:
    """An identifier recorded in events (and, for session ids, put in URLs): 1 to `max_length` printable
    characters; a session id only letters, digits and `_-.:`, not starting with a dot."""
    if not 0 < len(value) <= max_length:
        raise invalid(f"'{param}' must be 1 to {max_length} characters long.", param)
    if path_segment and not SESSION_ID.fullmatch(value):
        raise invalid(f"'{param}' may contain only letters, digits and '_', '-', '.', ':' and may not start with "
                      f"a dot.", param)
    if not value.isprintable():
        raise invalid(f"'{param}' may not contain control characters (CR, LF, tab...).", param)


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number.", name)
    return value


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value)


def _prompt_count(prompt) -> int:
    """The number of prompts in a completions `prompt` (a string, token ids, or a list of either)."""
    if isinstance(prompt, str) and prompt:
        return 1
    if _is_token_ids(prompt):
        return 1
    if isinstance(prompt, list) and prompt and all(
            (isinstance(p, str) and p) or _is_token_ids(p) for p in prompt):
        return len(prompt)
    raise invalid("'prompt' must be a non-empty string, a list of token ids (integers from 0), or a non-empty "
                  "list of either.", "prompt")


def _check_messages(body: dict) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of messages.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string 'role'.", f"messages.{i}")
        if not isinstance(message.get("tool_call_id", ""), (str, type(None))):
            raise invalid(f"messages[{i}].tool_call_id must be a string.", f"messages.{i}.tool_call_id")
        if not isinstance(message.get("tool_calls", []), (list, type(None))):
            raise invalid(f"messages[{i}].tool_calls must be a list.", f"messages.{i}.tool_calls")
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise invalid("'tools' must be a list.", "tools")


def check_request(kind: Kind, body, limits: GatewaySettings) -> int:
    """Check an OpenAI request body against what the gateway relies on and its limits; returns n."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    if kind == "chat":
        _check_messages(body)
        error = structured_output_error(body.get("tools"), body.get("tool_choice"), body.get("response_format"),
                                        body.get("parallel_tool_calls"))
        if error is not None:  # 400, as OpenAI and vLLM answer these
            raise GatewayError(400, error[1], "invalid_request_error", error[0])
        prompts = 1
    else:
        if body.get("response_format") is not None:
            raise GatewayError(400, "response_format is supported on chat completions only.",
                               "invalid_request_error", "response_format")
        prompts = _prompt_count(body.get("prompt"))
    n = body.get("n")
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise invalid("'n' must be a positive integer.", "n")
    if n * prompts > limits.max_choices:
        raise invalid(f"This request asks for {n * prompts} choices ({prompts} prompt(s) x n={n}); the gateway "
                      f"allows at most {limits.max_choices} per request: split it into several requests.",
                      "n" if prompts == 1 else "prompt")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= limits.max_tokens):
            raise invalid(f"'{name}' must be an integer from 1 to {limits.max_tokens}.", name)
    temperature = _number(body, "temperature")
    if temperature is not None and temperature != 0 and not (
            limits.min_temperature <= temperature <= limits.max_temperature):
        raise invalid(f"'temperature' must be 0 (greedy) or from {limits.min_temperature} to "
                      f"{limits.max_temperature}.", "temperature")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid("'top_p' must be greater than 0 and at most 1.", "top_p")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise invalid("'stream' must be a boolean.", "stream")
    _check_unrecorded(body)
    return n


def _check_unrecorded(body: dict) -> None:
    """A 400 naming the first sampling parameter set to a value that reshapes the distribution (UNRECORDED).

    >>> _check_unrecorded({"top_k": -1, "presence_penalty": 0.0, "logit_bias": {}, "min_p": None})
    >>> _check_unrecorded({"top_k": 20})
    Traceback (most recent call last):
    ...
    forge_stream.gateway.protocol.GatewayError: 'top_k' (20) changes the distribution the engine samples from, ...
    """
    for name, neutral in UNRECORDED.items():
        value = body.get(name)
        if value is None or (not isinstance(value, bool) and value in neutral):
            continue
        keep = f"leave it out or set it to {' or '.join(map(repr, neutral))}" if neutral else "leave it out"
        raise GatewayError(400, f"'{name}' ({value!r}) changes the distribution the engine samples from, and no "
                                f"Completion records it, so the trainer would score the tokens under another policy "
                                f"than the one that sampled them: {keep}. temperature and top_p are recorded and "
                                f"trained on as sampled.", "invalid_request_error", name)
