"""Grammar-constrained decoding of chat requests: `tool_choice` and `response_format`, enforced with xgrammar.

What a request asks for becomes one xgrammar structural tag (`chat_format`, a pure function of the request):

- `response_format` `json_object`: one JSON object, any keys; `json_schema`: JSON valid against `schema`
  (xgrammar's strict mode: an object schema that lists properties allows no others).
- `tool_choice` `"required"`: one or more Hermes tool calls, as the chat template shows them,
  `<tool_call>\\n{"name": "<function>", "arguments": <JSON>}\\n</tool_call>` (the markers as single tokens where
  the tokenizer has them), separated by a newline, each naming a listed function with arguments valid against
  its `parameters`; exactly one call when `parallel_tool_calls` is false. A named function (`{"type": "function", "function": {"name": ...}}`): one call of that function.
- `"auto"` with a JSON `response_format`: either such tool calls or the JSON. `"auto"` alone is not
  constrained. `"none"` with tools: any text without `<tool_call>` (xgrammar's `any_text` excluding the marker;
  the marker as a single special token is never text), and tool-call parsing is off, so the text is the content.

JSON is written with at most one whitespace character between its tokens: a model may otherwise spend its
whole budget on whitespace (vLLM's `disable_any_whitespace` exists for the same reason).

Each constrained choice has its own matcher (`Constraint`). Before every sampling step the tokens the grammar
does not allow get logit -inf, and the model's stop tokens (EOS) are allowed only where the grammar is
complete; after it the matcher advances with the token actually sampled. Unconstrained requests carry no
matcher and do no per-token work.

Log-probs under a constraint: the mask is applied to the logits before sampling, so every reported logprob
(the sampled token's and the top alternatives') is of the masked distribution actually sampled from, as in
vLLM, whose structured-output bitmask is applied before its sampler computes logprobs. With `logprobs_mode
"processed"` (the default) that is the masked distribution after temperature and top-p: the trainer's ratio
pi_theta / pi_old then compares against the exact sampling distribution. (A trainer that scores tokens
without the mask computes pi_theta over the full vocabulary; the mask is part of the behaviour policy.) With
`"raw"` it is the masked log-softmax at temperature 1.

Compiled grammars are cached by their structural tag's JSON text in xgrammar's compiler cache (bounded in
bytes), so agents that resend the same tools and schema every turn compile them once.
"""

import json

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from forge_stream.engine.shared.tool_calls import TOOL_CALL_END, TOOL_CALL_START
from forge_stream.openai_protocol import named_tool

# vLLM's own structured-output request fields: this engine enforces the OpenAI ones only, and refuses these
VLLM_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "guided_whitespace_pattern")
WHITESPACE = 1  # at most this many whitespace characters between JSON tokens


def refused_field(extra: dict | None, fields: tuple[str, ...] = VLLM_FIELDS) -> str | None:
    """The first of `fields` a request sets (in its extra, unmodelled fields), which this engine cannot honour."""
    return next((f for f in fields if (extra or {}).get(f) is not None), None)


def _json(schema) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": WHITESPACE}


def _call(function: dict, marker_tokens: bool) -> dict:
    """`<tool_call>\n{"name": "<name>", "arguments": <JSON>}\n</tool_call>` of one OpenAI function definition."""
    head = f'\n{{"name": {json.dumps(function["name"])}, "arguments": '
    arguments = _json(function.get("parameters") or {"type": "object", "properties": {}})
    if not marker_tokens:
        return {"type": "tag", "begin": TOOL_CALL_START + head, "content": arguments, "end": "}\n" + TOOL_CALL_END}
    return {"type": "tag", "begin": {"type": "token", "token": TOOL_CALL_START},
            "content": {"type": "sequence", "elements": [{"type": "const_string", "value": head}, arguments,
                                                         {"type": "const_string", "value": "}\n"}]},
            "end": {"type": "token", "token": TOOL_CALL_END}}


def _calls(functions: list[dict], single: bool, marker_tokens: bool) -> dict:
    """Hermes tool calls of `functions` (OpenAI function definitions): one, or one or more."""
    tags = [_call(f, marker_tokens) for f in functions]
    return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
            "stop_after_first": single}


def chat_format(tools: list[dict] | None, tool_choice, response_format: dict | None,
                parallel_tool_calls: bool | None, marker_tokens: bool = False) -> dict | None:
    """The structural tag a (validated) chat request's output must match, or None when it is unconstrained.
    With `marker_tokens`, `<tool_call>` and `</tool_call>` must be written as the tokenizer's single tokens for
    them (as the chat template's history has them), not spelled out in pieces.

    >>> chat_format(None, None, {"type": "text"}, None) is None
    True
    >>> chat_format(None, None, {"type": "json_object"}, None)["format"]["json_schema"]
    {'type': 'object'}
    """
    functions = [t["function"] for t in tools or ()]
    kind = (response_format or {}).get("type", "text")
    answer = None
    if kind == "json_object":
        answer = _json({"type": "object"})
    elif kind == "json_schema":
        answer = _json(response_format["json_schema"]["schema"])
    name = named_tool(tool_choice)
    if name is not None:
        fmt = _calls([f for f in functions if f["name"] == name], True, marker_tokens)
    elif tool_choice == "required":
        fmt = _calls(functions, parallel_tool_calls is False, marker_tokens)
    elif answer is not None and functions and tool_choice in (None, "auto"):
        fmt = {"type": "or", "elements": [_calls(functions, parallel_tool_calls is False, marker_tokens), answer]}
    elif answer is None and functions and tool_choice == "none":
        fmt = {"type": "any_text", "excludes": [TOOL_CALL_START]}
    else:
        fmt = answer
    return None if fmt is None else {"type": "structural_tag", "format": fmt}


class Grammars:
    """Compiles structural tags against one tokenizer; the model's stop tokens end every grammar."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: set[int],
                 cache_bytes: int = 256 << 20):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        # whether the tool-call markers are single tokens (Qwen2.5, Hermes, the tiny model): then calls use them
        self.marker_tokens = all(len(tokenizer.encode(t, add_special_tokens=False)) == 1
                                 for t in (TOOL_CALL_START, TOOL_CALL_END))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=cache_bytes)

    def compile(self, structural_tag: dict) -> xgr.CompiledGrammar:
        """Compile (or find in the cache) a grammar; raises xgrammar's errors for a schema it cannot compile.
        (Keys keep their order: an object's properties are written in the order its schema lists them.)"""
        return self._compiler.compile_structural_tag(json.dumps(structural_tag))


class Constraint:
    """The grammar state of one choice: masks its logits before sampling and advances with each sampled token."""

    def __init__(self, grammar: xgr.CompiledGrammar):
        self._matcher = xgr.GrammarMatcher(grammar)
        self._bitmask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of one row of logits (the model's vocabulary) with the tokens the grammar does not allow next
        at -inf."""
        row = logits.unsqueeze(0).clone()
        if self._matcher.fill_next_token_bitmask(self._bitmask):
            xgr.apply_token_bitmask_inplace(row, self._bitmask)
        return row[0]

    def accept(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} was sampled but the grammar does not allow it")
