"""The engine service: OpenAI requests in, batcher requests out, OpenAI responses and SSE chunks back.

No FastAPI here: the router in `api.py` calls these methods. The service owns the tokenizer, the chat
template, the batcher and the current policy version; `load_weights` is the one method both the admin
endpoint and a forge.policy watcher call to move to new weights.
"""

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from xgrammar import CompiledGrammar

from forge_stream import lora
from forge_stream.engine.shared.probe import model_logprobs, not_finite, probe_ids
from forge_stream.engine.torch_engine.batcher import Admitted, Batcher, Event, Failed, LoadedModel, Request, TokenEvent
from forge_stream.engine.torch_engine.constraints import Grammars
from forge_stream.engine.torch_engine.sampling import MIN_TEMPERATURE, SamplingParams
from forge_stream.engine.torch_engine.settings import EngineSettings
from forge_stream.files import in_store
from forge_stream.openai_protocol import (
    HealthResponse,
    LoadWeightsResponse,
    ModelCard,
    ModelList,
)


class EngineRequestError(Exception):
    """A request the engine refuses; the router turns it into an OpenAI error body with this status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


@dataclass
class ChoiceResult:
    """Everything one choice produced, accumulated from its token events."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, event: TokenEvent) -> None:
        self.token_ids.append(event.token_id)
        self.logprobs.append(event.logprob)
        self.tops.append(event.top)
        self.text += event.text
        self.finish_reason = event.finish_reason
        self.stop_reason = event.stop_reason


def _load_model(path: str, settings: EngineSettings):
    """Full weights, or a LoRA adapter merged into its base model (forge_stream.lora): the merged model runs at the
    base model's speed, and loading one (the base from disk, the merge) takes about what full weights take."""
    return lora.load_policy(path, getattr(torch, settings.dtype)).to(settings.device).eval()


def _load_proven(path: str, settings: EngineSettings):
    """A new version's model, once its log-probs of the probe sequence (forge_stream.engine.shared.probe) are finite; a
    version whose weights hold NaN or inf would answer with garbage, so it is refused (ValueError). The served model
    is this transformers model itself, so there is no second implementation to compare it with, as vLLM's probe
    does."""
    model = _load_model(path, settings)
    problem = not_finite(model_logprobs(model, probe_ids(model.config.vocab_size)))
    if problem is not None:
        raise ValueError(problem)
    return model


class EngineService:
    """Generation, model listing and weight reloads for one served model."""

    def __init__(self, settings: EngineSettings, tokenizer: PreTrainedTokenizerBase, batcher: Batcher,
                 max_model_len: int, grammars: Grammars):
        self.settings = settings
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.batcher = batcher
        self.max_model_len = max_model_len
        self._reload_lock = asyncio.Lock()
        # one thread parses and tokenizes requests, so a large one never stalls the event loop (health, streams)
        self._prepare = ThreadPoolExecutor(1, thread_name_prefix="engine-prepare")

    async def off_loop(self, fn: Callable, *args):
        """`fn(*args)` on the engine's request-preparing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare, fn, *args)

    def check_choices(self, n: int, prompts: int) -> None:
        if n < 1:
            raise EngineRequestError("n must be at least 1.", param="n")
        if n * prompts > self.settings.max_choices:
            raise EngineRequestError(
                f"This request asks for {n * prompts} choices ({prompts} prompt(s) x n={n}); this engine allows at "
                f"most {self.settings.max_choices} per request: split it into several requests.",
                param="n" if prompts == 1 else "prompt")

    @classmethod
    def load(cls, settings: EngineSettings) -> "EngineService":
        """Load the model directory named by the settings and build a (not yet started) service."""
        tokenizer = AutoTokenizer.from_pretrained(settings.model)
        model = _load_model(settings.model, settings)
        max_len = settings.max_model_len or int(getattr(model.config, "max_position_embeddings", 4096))
        eos = {tokenizer.eos_token_id} | set(_as_list(getattr(model.generation_config, "eos_token_id", None)))
        eos = {i for i in eos if i is not None}
        batcher = Batcher(
            LoadedModel(model, settings.policy_version, settings.model),
            decode=lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip),
            eos_ids=eos,
            max_batch_size=settings.max_batch_size,
            max_model_len=max_len,
            logprobs_mode=settings.logprobs_mode,
            device=settings.device,
            prefix_cache_tokens=settings.prefix_cache_tokens,
        )
        return cls(settings, tokenizer, batcher, max_len, Grammars(tokenizer, model.config.vocab_size, eos))

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()

    @property
    def policy_version(self) -> int:
        return self.batcher.current.version

    # ----- generation ------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams, n: int,
                       grammar: CompiledGrammar | None = None) -> AsyncIterator[Event]:
        """Events of one request: Admitted, then TokenEvents until all n choices finished (or Failed); with a
        grammar, each choice's tokens match it.

        Leaving the iteration early (client gone) cancels the request in the batcher.
        """
        if not prompt_ids:
            raise EngineRequestError("The prompt is empty.", param="prompt")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise self.context_full(len(prompt_ids), params.max_tokens)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        request = Request(prompt_ids=prompt_ids, params=params, n=n, grammar=grammar,
                          sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        self.batcher.submit(request)
        running = n
        try:
            while running:
                event = await events.get()
                yield event
                if isinstance(event, Failed):
                    return
                if isinstance(event, TokenEvent) and event.finish_reason is not None:
                    running -= 1
        finally:
            request.cancelled.set()

    async def collect(self, prompt_ids: list[int], params: SamplingParams, n: int,
                      grammar: CompiledGrammar | None = None) -> tuple[int, list[ChoiceResult]]:
        """Run a request to the end: (policy version, one result per choice)."""
        version, results = self.policy_version, [ChoiceResult() for _ in range(n)]
        async for event in self.generate(prompt_ids, params, n, grammar):
            if isinstance(event, Admitted):
                version = event.policy_version
            elif isinstance(event, TokenEvent):
                results[event.choice].add(event)
            else:
                raise EngineRequestError(event.message, status=500)
        return version, results

    def context_full(self, prompt_len: int, max_tokens: int | None) -> EngineRequestError:
        """A request that does not fit the context, in vLLM's words (which clients and the gateway recognize)."""
        if max_tokens is None:
            return EngineRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len} tokens in the messages, Please reduce the length of the messages.", param="messages")
        return EngineRequestError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.", param="max_tokens")

    def sampling_params(self, *, max_tokens: int | None, prompt_len: int, temperature: float | None,
                        top_p: float | None, stop: str | list[str] | None, seed: int | None, top_logprobs: int,
                        ignore_eos: bool, stop_token_ids: list[int] | None, skip_special_tokens: bool,
                        include_stop_str_in_output: bool) -> SamplingParams:
        """Validate OpenAI sampling fields into SamplingParams (defaults as vLLM: temperature 1, top_p 1)."""
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                raise self.context_full(prompt_len, None)
            max_tokens = self.max_model_len - prompt_len
        if max_tokens < 1:
            raise EngineRequestError("max_tokens must be at least 1.", param="max_tokens")
        temperature = 1.0 if temperature is None else temperature
        top_p = 1.0 if top_p is None else top_p
        if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
            raise EngineRequestError(f"temperature must be 0 (greedy) or a finite number of at least "
                                     f"{MIN_TEMPERATURE}.", param="temperature")
        if not 0.0 < top_p <= 1.0:
            raise EngineRequestError("top_p must be in (0, 1].", param="top_p")
        if top_logprobs < 0:
            raise EngineRequestError("top_logprobs must be non-negative.", param="top_logprobs")
        stops = (stop,) if isinstance(stop, str) else tuple(s for s in (stop or []) if s)
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stops,
                              stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos, seed=seed,
                              top_logprobs=top_logprobs, skip_special_tokens=skip_special_tokens,
                              include_stop_str_in_output=include_stop_str_in_output)

    def token_text(self, token_id: int) -> str:
        """The text of one token as reported in logprobs (special tokens spelled out)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ----- models, health, weights -----------------------------------------------------------------------

    def models(self) -> ModelList:
        card = ModelCard(id=self.settings.model_name, max_model_len=self.max_model_len,
                         policy_version=self.policy_version)  # no root: agents are not told the engine's paths
        return ModelList(data=[card])

    def health(self) -> HealthResponse:
        stats = self.batcher.stats
        return HealthResponse(model=self.settings.model_name, policy_version=self.policy_version,
                              active_sequences=self.batcher.active_versions(),
                              stats={k: int(v) for k, v in vars(stats).items()})

    async def load_weights(self, path: str, version: int) -> LoadWeightsResponse:
        """Load checkpoint `path` as policy `version` and serve new requests with it, if it lies inside the engine's
        checkpoint store (`checkpoint_dir`, symbolic links resolved first: forge_stream.files.in_store; 403 if not)
        and its probe log-probs are finite (`_load_proven`).

        The new model is a separate object: requests already running finish on the old one (and report the
        old version); the old model is freed when its last sequence ends.
        """
        path = str(checkpoint_path(self.settings.checkpoint_dir, path))
        if not Path(path).is_dir():
            raise EngineRequestError(f"No checkpoint directory at {path!r}.", status=404, param="path")
        async with self._reload_lock:
            previous = self.policy_version
            started = time.perf_counter()
            try:
                model = await asyncio.to_thread(_load_proven, path, self.settings)
            except (OSError, ValueError) as exc:
                raise EngineRequestError(f"Cannot load {path!r}: {exc}", param="path") from exc
            self.batcher.swap(LoadedModel(model, version, path))
            return LoadWeightsResponse(policy_version=version, previous_version=previous, path=path,
                                       load_seconds=round(time.perf_counter() - started, 4))


def checkpoint_path(checkpoint_dir: str | None, path: str) -> Path:
    """`path` resolved, if it lies inside `checkpoint_dir`; EngineRequestError 403 otherwise."""
    if checkpoint_dir is None:
        raise EngineRequestError("This engine loads no weights: it was started without a checkpoint directory "
                                 "(--checkpoint-dir).", status=403, param="path")
    target = in_store(checkpoint_dir, path)
    if target is None:
        raise EngineRequestError("The path is outside the engine's checkpoint directory (--checkpoint-dir): load "
                                 "checkpoints from inside it.", status=403, param="path")
    return target


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
