"""OpenAI-protocol request and response models shared by the rollout engine and the gateway.

Field names follow vLLM's OpenAI server (vllm/entrypoints/openai/*/protocol.py) where it extends OpenAI:
`return_token_ids` on requests; `prompt_token_ids` on chat responses (first stream chunk only) and on each
completion choice; `token_ids` per choice (per chunk: the chunk's new tokens); `stop_reason` beside
`finish_reason`; logprobs in OpenAI's format. Our one addition is `policy_version`: the version of the
weights that produced every token of the response (on every stream chunk too). Stream chunks are serialized
with `exclude_unset=True`, as vLLM does, so a field appears only where the server set it.
"""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class OpenAIBaseModel(BaseModel):
    """Unknown request fields are accepted and ignored, as by OpenAI-compatible servers."""

    model_config = ConfigDict(extra="allow")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ----- shared pieces -------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


# ----- chat completions ----------------------------------------------------------------------------------


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessageParam(OpenAIBaseModel):
    """One input message; content may be a string or a list of OpenAI content parts."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(OpenAIBaseModel):
    messages: list[ChatMessageParam]
    model: str | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # vLLM extensions
    return_token_ids: bool | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def tool_names(tools) -> list[str]:
    """The function names of a chat request's raw `tools` list (entries without a name are left out)."""
    names = []
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def named_tool(tool_choice) -> str | None:
    """The function a `tool_choice` names ({"type": "function", "function": {"name": ...}}), else None."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return None


def structured_output_error(tools, tool_choice, response_format, parallel_tool_calls=None) -> tuple[str, str] | None:
    """(param, message) for a chat request's `tool_choice` / `response_format` / `parallel_tool_calls` that cannot
    be enforced, else None. Takes the raw JSON values, so the gateway checks bodies it does not parse.

    >>> structured_output_error(None, "required", None)
    ('tool_choice', "tool_choice 'required' needs at least one function in 'tools'.")
    >>> structured_output_error(None, None, {"type": "json_object"}) is None
    True
    """
    names = tool_names(tools)
    if tool_choice is not None and tool_choice not in ("none", "auto", "required"):
        name = named_tool(tool_choice)
        if name is None:
            return "tool_choice", ("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                   f"'function': {{'name': ...}}}}, not {tool_choice!r}.")
        if name not in names:
            return "tool_choice", (f"tool_choice names the function {name!r}, which is not among the tools "
                                   f"({', '.join(map(repr, names)) or 'none given'}).")
    if tool_choice == "required" and not names:
        return "tool_choice", "tool_choice 'required' needs at least one function in 'tools'."
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        return "parallel_tool_calls", "parallel_tool_calls must be a boolean."
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in RESPONSE_FORMATS:
        return "response_format", (f"response_format type {kind!r} is not supported: use 'text', 'json_object' or "
                                   "'json_schema'.")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            return "response_format", ("response_format 'json_schema' needs a 'json_schema' object with the JSON "
                                       "schema under 'schema'.")
    return None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler):
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    policy_version: int | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    policy_version: int | None = None


# ----- completions ---------------------------------------------------------------------------------------


class CompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extensions
    return_token_ids: bool | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    policy_version: int | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    policy_version: int | None = None


# ----- models and admin ----------------------------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "forge-stream"
    root: str | None = None
    max_model_len: int | None = None
    policy_version: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadWeightsRequest(OpenAIBaseModel):
    """Load a HuggingFace checkpoint directory as policy `version` (the PolicyVersion event's fields)."""

    path: str
    version: int


class LoadWeightsResponse(OpenAIBaseModel):
    policy_version: int
    previous_version: int
    path: str
    load_seconds: float


class HealthResponse(OpenAIBaseModel):
    status: Literal["ok"] = "ok"
    model: str
    policy_version: int
    active_sequences: dict[int, int] = Field(default_factory=dict)
    stats: dict[str, int] = Field(default_factory=dict)
    loads: int | None = None  # with a policy follower (forge_stream.engine.shared.follower): versions loaded,
    failed_loads: int | None = None  # and versions not served (unreadable, refused by the probe),
    switch_s: dict[str, float] | None = None  # and publication to serving: median, max and versions counted
