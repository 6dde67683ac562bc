"""`/v1/chat/completions`: chat template in, OpenAI chat responses (or SSE chunks shaped like vLLM's) out.

With `return_token_ids` the response carries `prompt_token_ids` (the templated prompt, exactly as fed to the
model) and each choice its `token_ids` (every generated token, the final EOS included); in a stream the first
chunk of each choice carries `prompt_token_ids` and every later chunk the `token_ids` and `logprobs` of its
one new token. Tool calls (Hermes format) are parsed when the request lists tools and tool_choice is not
"none"; in a stream, text from the first `<tool_call>` on is held back and the calls arrive whole in the
choice's final chunk, with finish_reason "tool_calls" (only the first call when `parallel_tool_calls` is false).

`tool_choice` "required" or a named function, and `response_format` json_object / json_schema, are enforced by
grammar-constrained decoding (constraints.py, which also says which logprobs are reported); values that cannot be
enforced are refused with a 400 naming the parameter, as is `ignore_eos` with a grammar (a constrained choice ends
where its grammar does).
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass

from xgrammar import CompiledGrammar

from forge_stream.engine.shared.tool_calls import TOOL_CALL_START, parse_tool_calls
from forge_stream.engine.torch_engine.batcher import Admitted, Failed, TokenEvent
from forge_stream.engine.torch_engine.constraints import chat_format, refused_field
from forge_stream.engine.torch_engine.serving import ChoiceResult, EngineRequestError, EngineService
from forge_stream.openai_error import error_body
from forge_stream.openai_protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
    random_id,
    structured_output_error,
)


def _marker_prefix(text: str) -> int:
    """The length of the longest end of `text` that begins TOOL_CALL_START (without being all of it).

    >>> _marker_prefix("Sure. <tool_c"), _marker_prefix("a < b")
    (7, 0)
    """
    return next((k for k in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1)
                 if TOOL_CALL_START.startswith(text[-k:])), 0)


@dataclass
class _StreamState:
    text: str = ""
    sent: int = 0
    in_tool_call: bool = False
    tokens: int = 0


class ChatServing:
    """Turns chat requests into engine requests and engine events into chat responses."""

    def __init__(self, engine: EngineService):
        self.engine = engine

    def prompt_ids(self, request: ChatCompletionRequest) -> list[int]:
        """Apply the model's chat template (with tools) and tokenize without adding special tokens."""
        tokenizer = self.engine.tokenizer
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        try:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=request.add_generation_prompt, tokenize=False,
                **(request.chat_template_kwargs or {}))
        except Exception as exc:  # jinja errors, missing template: the request cannot be rendered
            raise EngineRequestError(f"Cannot apply the chat template: {exc}", param="messages") from exc
        return tokenizer.encode(text, add_special_tokens=False)

    def grammar(self, request: ChatCompletionRequest) -> CompiledGrammar | None:
        """The compiled grammar the request's `tool_choice` and `response_format` ask for (None: unconstrained)."""
        refused = refused_field(request.model_extra)
        if refused is not None:
            raise EngineRequestError(f"{refused} is not supported by this engine: use response_format or "
                                     "tool_choice.", param=refused)
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        error = structured_output_error(tools, request.tool_choice, request.response_format,
                                        request.parallel_tool_calls)
        if error is not None:
            raise EngineRequestError(error[1], param=error[0])
        spec = chat_format(tools, request.tool_choice, request.response_format, request.parallel_tool_calls,
                           self.engine.grammars.marker_tokens)
        if spec is None:
            return None
        if request.ignore_eos:
            raise EngineRequestError("ignore_eos cannot be combined with a constrained output (tool_choice "
                                     "'required' or a named function, response_format json_object or json_schema): "
                                     "a constrained choice ends where its grammar does.", param="ignore_eos")
        try:
            return self.engine.grammars.compile(spec)
        except Exception as exc:  # xgrammar's errors for a schema it cannot compile
            param = "response_format" if (request.response_format or {}).get("type") == "json_schema" else "tools"
            raise EngineRequestError(f"Cannot compile a grammar for this {param}: {exc}", param=param) from exc

    async def create(self, request: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        n = 1 if request.n is None else request.n
        self.engine.check_choices(n, 1)
        grammar = await self.engine.off_loop(self.grammar, request)
        prompt_ids = await self.engine.off_loop(self.prompt_ids, request)
        params = self.engine.sampling_params(
            max_tokens=request.max_completion_tokens or request.max_tokens, prompt_len=len(prompt_ids),
            temperature=request.temperature, top_p=request.top_p, stop=request.stop, seed=request.seed,
            top_logprobs=(request.top_logprobs or 0) if request.logprobs else 0, ignore_eos=request.ignore_eos,
            stop_token_ids=request.stop_token_ids, skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output)
        if request.stream:
            return self._stream(request, prompt_ids, params, n, grammar)
        version, results = await self.engine.collect(prompt_ids, params, n, grammar)
        choices = [self._choice(request, i, r) for i, r in enumerate(results)]
        completion = sum(len(r.token_ids) for r in results)
        return ChatCompletionResponse(
            model=self.engine.settings.model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                            total_tokens=len(prompt_ids) + completion),
            prompt_token_ids=prompt_ids if request.return_token_ids else None, policy_version=version)

    def _tools_enabled(self, request: ChatCompletionRequest) -> bool:
        return bool(request.tools) and request.tool_choice != "none"

    @staticmethod
    def _allowed(request: ChatCompletionRequest, calls):
        return calls[:1] if request.parallel_tool_calls is False else calls

    def _logprobs(self, token_ids: list[int], logprobs: list[float], tops) -> ChatCompletionLogProbs:
        def entry(token_id: int, logprob: float) -> ChatCompletionLogProb:
            text = self.engine.token_text(token_id)
            return ChatCompletionLogProb(token=text, logprob=max(logprob, -9999.0), bytes=list(text.encode()))

        content = []
        for token_id, logprob, top in zip(token_ids, logprobs, tops):
            main = entry(token_id, logprob)
            content.append(ChatCompletionLogProbsContent(
                **main.model_dump(), top_logprobs=[entry(t, lp) for t, lp in top]))
        return ChatCompletionLogProbs(content=content)

    def _choice(self, request: ChatCompletionRequest, index: int, result: ChoiceResult
                ) -> ChatCompletionResponseChoice:
        finish = result.finish_reason
        message = ChatMessage(role="assistant", content=result.text)
        if self._tools_enabled(request):
            parsed = parse_tool_calls(result.text)
            if parsed.tool_calls:
                message = ChatMessage(role="assistant", content=parsed.content, tool_calls=[
                    ToolCall(id=random_id("chatcmpl-tool"), function=FunctionCall(name=c.name, arguments=c.arguments))
                    for c in self._allowed(request, parsed.tool_calls)])
                finish = "tool_calls"
        return ChatCompletionResponseChoice(
            index=index, message=message, finish_reason=finish, stop_reason=result.stop_reason,
            logprobs=self._logprobs(result.token_ids, result.logprobs, result.tops) if request.logprobs else None,
            token_ids=result.token_ids if request.return_token_ids else None)

    async def _stream(self, request: ChatCompletionRequest, prompt_ids: list[int], params, n: int,
                      grammar: CompiledGrammar | None) -> AsyncIterator[str]:
        response_id, model = random_id("chatcmpl"), self.engine.settings.model_name
        created = ChatCompletionResponse(model=model, choices=[], usage=UsageInfo()).created
        version = self.engine.policy_version
        states = [_StreamState() for _ in range(n)]

        def chunk(choices, **extra) -> str:
            body = ChatCompletionStreamResponse(id=response_id, object="chat.completion.chunk", created=created,
                                                model=model, choices=choices, policy_version=version, **extra)
            return f"data: {body.model_dump_json(exclude_unset=True)}\n\n"

        async for event in self.engine.generate(prompt_ids, params, n, grammar):
            if isinstance(event, Admitted):
                version = event.policy_version
                for i in range(n):
                    first = ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                        finish_reason=None)
                    yield chunk([first], prompt_token_ids=prompt_ids if request.return_token_ids else None)
            elif isinstance(event, TokenEvent):
                yield chunk([self._stream_choice(request, event, states[event.choice])])
            elif isinstance(event, Failed):
                yield f"data: {error_body(event.message, 'InternalServerError').decode()}\n\n"
                break
        else:
            if request.stream_options and request.stream_options.include_usage:
                completion = sum(s.tokens for s in states)
                usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                                  total_tokens=len(prompt_ids) + completion)
                yield chunk([], usage=usage)
        yield "data: [DONE]\n\n"

    def _stream_choice(self, request: ChatCompletionRequest, event: TokenEvent, state: _StreamState
                       ) -> ChatCompletionResponseStreamChoice:
        state.tokens += 1
        state.text += event.text
        delta = DeltaMessage()
        finish = event.finish_reason
        if not self._tools_enabled(request):
            delta = DeltaMessage(content=event.text)
        elif not state.in_tool_call:
            end = state.text.find(TOOL_CALL_START)
            state.in_tool_call = end >= 0
            if end < 0:  # hold back a tail that may be the start of a tool call written in pieces
                end = len(state.text) - (0 if finish is not None else _marker_prefix(state.text))
            delta = DeltaMessage(content=state.text[state.sent:end])
            state.sent = end
        if finish is not None and state.in_tool_call:
            parsed = parse_tool_calls(state.text)
            if parsed.tool_calls:
                calls = [DeltaToolCall(index=k, id=random_id("chatcmpl-tool"), type="function",
                                       function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                         for k, c in enumerate(self._allowed(request, parsed.tool_calls))]
                delta = DeltaMessage(tool_calls=calls)
                finish = "tool_calls"
            else:
                delta = DeltaMessage(content=state.text[state.sent:])
        fields = dict(index=event.choice, delta=delta, finish_reason=finish,
                      logprobs=(self._logprobs([event.token_id], [event.logprob], [event.top])
                                if request.logprobs else None),
                      token_ids=[event.token_id] if request.return_token_ids else None)
        if finish is not None:
            fields["stop_reason"] = event.stop_reason
        return ChatCompletionResponseStreamChoice(**fields)
