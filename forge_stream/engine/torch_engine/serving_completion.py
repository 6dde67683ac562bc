"""`/v1/completions`: text or token-id prompts in, OpenAI completion responses (or vLLM-shaped chunks) out.

A prompt may be a string, a list of token ids (token in: used exactly), or a list of either; choice
`p * n + j` is the j-th sample of prompt p. With `return_token_ids` each choice carries its prompt's
`prompt_token_ids` and its own `token_ids` (in a stream: prompt ids on a choice's first chunk, then each
chunk's new token). `policy_version` is that of the oldest weights used by any of the prompts. Structured output
(`response_format`, vLLM's `guided_*`) is refused here with a 400: it is enforced on chat completions.
"""

import asyncio
from collections.abc import AsyncIterator

from forge_stream.engine.torch_engine.batcher import Admitted, Event, Failed, TokenEvent
from forge_stream.engine.torch_engine.constraints import VLLM_FIELDS, refused_field
from forge_stream.engine.torch_engine.sampling import SamplingParams
from forge_stream.engine.torch_engine.serving import ChoiceResult, EngineRequestError, EngineService
from forge_stream.openai_error import error_body
from forge_stream.openai_protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)


class CompletionServing:
    """Turns completion requests into engine requests and engine events into completion responses."""

    def __init__(self, engine: EngineService):
        self.engine = engine

    def prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise EngineRequestError("The prompt is empty.", param="prompt")
        vocab = len(self.engine.tokenizer)
        out = []
        for p in prompt:
            ids = self.engine.tokenizer.encode(p, add_special_tokens=request.add_special_tokens) \
                if isinstance(p, str) else list(p)
            if any(not 0 <= t < vocab for t in ids):
                raise EngineRequestError(f"Token ids must be in [0, {vocab}).", param="prompt")
            out.append(ids)
        return out

    def _params(self, request: CompletionRequest, prompt_len: int) -> SamplingParams:
        return self.engine.sampling_params(
            max_tokens=request.max_tokens, prompt_len=prompt_len, temperature=request.temperature,
            top_p=request.top_p, stop=request.stop, seed=request.seed, top_logprobs=request.logprobs or 0,
            ignore_eos=request.ignore_eos, stop_token_ids=request.stop_token_ids,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output)

    async def create(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        if request.echo:
            raise EngineRequestError("echo is not supported.", param="echo")
        refused = refused_field(request.model_extra, ("response_format",) + VLLM_FIELDS)
        if refused is not None:
            raise EngineRequestError(f"{refused} is not supported on /v1/completions by this engine (response_format "
                                     "is enforced on /v1/chat/completions).", param=refused)
        prompt = request.prompt
        self.engine.check_choices(request.n, 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
                                  else len(prompt))
        prompts = await self.engine.off_loop(self.prompts, request)
        params = [self._params(request, len(p)) for p in prompts]
        if request.stream:
            return self._stream(request, prompts, params)
        runs = await asyncio.gather(*(self.engine.collect(p, sp, request.n) for p, sp in zip(prompts, params)))
        choices = []
        for p_index, (_, results) in enumerate(runs):
            for j, result in enumerate(results):
                choices.append(self._choice(request, p_index * request.n + j, prompts[p_index], result))
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(r.token_ids) for _, results in runs for r in results)
        return CompletionResponse(
            model=self.engine.settings.model_name, choices=choices,
            usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                            total_tokens=prompt_tokens + completion),
            policy_version=min(version for version, _ in runs))

    def _logprobs(self, token_ids: list[int], logprobs: list[float], tops, offset: int) -> CompletionLogProbs:
        out = CompletionLogProbs()
        for token_id, logprob, top in zip(token_ids, logprobs, tops):
            text = self.engine.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(max(logprob, -9999.0))
            alternatives = {self.engine.token_text(t): max(lp, -9999.0) for t, lp in top}
            alternatives.setdefault(text, max(logprob, -9999.0))
            out.top_logprobs.append(alternatives)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _choice(self, request: CompletionRequest, index: int, prompt_ids: list[int], result: ChoiceResult
                ) -> CompletionResponseChoice:
        return CompletionResponseChoice(
            index=index, text=result.text, finish_reason=result.finish_reason, stop_reason=result.stop_reason,
            logprobs=(self._logprobs(result.token_ids, result.logprobs, result.tops, 0)
                      if request.logprobs is not None else None),
            token_ids=result.token_ids if request.return_token_ids else None,
            prompt_token_ids=prompt_ids if request.return_token_ids else None)

    async def _merged(self, prompts: list[list[int]], params: list[SamplingParams], n: int
                      ) -> AsyncIterator[tuple[int, Event]]:
        """Events of all prompts as they come, tagged with the prompt index."""
        queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

        async def pump(p_index: int) -> None:
            async for event in self.engine.generate(prompts[p_index], params[p_index], n):
                await queue.put((p_index, event))
            await queue.put((p_index, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
        try:
            running = len(tasks)
            while running:
                p_index, event = await queue.get()
                if event is None:
                    running -= 1
                else:
                    yield p_index, event
        finally:
            for task in tasks:
                task.cancel()

    async def _stream(self, request: CompletionRequest, prompts: list[list[int]], params: list[SamplingParams]
                      ) -> AsyncIterator[str]:
        response_id, model, n = random_id("cmpl"), self.engine.settings.model_name, request.n
        created = CompletionResponse(model=model, choices=[], usage=UsageInfo()).created
        versions: dict[int, int] = {}
        offsets = [0] * (len(prompts) * n)
        counts = [0] * (len(prompts) * n)
        async for p_index, event in self._merged(prompts, params, n):
            if isinstance(event, Admitted):
                versions[p_index] = event.policy_version
                continue
            if isinstance(event, Failed):
                yield f"data: {error_body(event.message, 'InternalServerError').decode()}\n\n"
                break
            assert isinstance(event, TokenEvent)
            index = p_index * n + event.choice
            logprobs = None
            if request.logprobs is not None:
                logprobs = self._logprobs([event.token_id], [event.logprob], [event.top], offsets[index])
                offsets[index] += len(logprobs.tokens[0])
            first = counts[index] == 0
            counts[index] += 1
            choice = CompletionResponseStreamChoice(
                index=index, text=event.text, logprobs=logprobs, finish_reason=event.finish_reason,
                stop_reason=event.stop_reason,
                prompt_token_ids=prompts[p_index] if request.return_token_ids and first else None,
                token_ids=[event.token_id] if request.return_token_ids else None)
            body = CompletionStreamResponse(id=response_id, created=created, model=model, choices=[choice],
                                            policy_version=versions[p_index])
            yield f"data: {body.model_dump_json()}\n\n"
        else:
            if request.stream_options and request.stream_options.include_usage:
                prompt_tokens = sum(len(p) for p in prompts)
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=sum(counts),
                                  total_tokens=prompt_tokens + sum(counts))
                body = CompletionStreamResponse(id=response_id, created=created, model=model, choices=[],
                                                usage=usage, policy_version=min(versions.values()))
                yield f"data: {body.model_dump_json(exclude_none=True)}\n\n"
        yield "data: [DONE]\n\n"
