"""The batching generation loop: admit requests into a running batch, prefill, decode all sequences together.

One worker thread owns the models and the KV caches. Each admitted request is prefilled on its own (one
forward over the prompt, its KV cache shared read-only by its n choices), reusing the KV of the longest
block-aligned prefix it shares with a recent prompt (`PrefixCache`, as vLLM's automatic prefix caching: agents
resend the same system prompt and tools every call, and each turn extends the last one), then every decode step runs one
batched forward per policy version over all active sequences of that version: their caches are left-padded to
a common length and stacked, an attention mask hides the padding, and each row gets its own position id. The
stacked cache is kept while the batch membership stays the same and re-packed from per-sequence slices when a
sequence joins or finishes. A request with a grammar (`tool_choice`, `response_format`) gives each of its choices
a matcher that masks that row's logits before sampling (constraints.py). Each sequence is bound to the model that
admitted it, so after `swap()` new requests use the new weights while running ones finish on the old ones; the old
model is dropped when its last sequence ends.

Results go back through a per-request `sink` callable (the async side wraps an asyncio queue); the loop never
blocks on a client.
"""

import logging
import queue
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache, PreTrainedModel
from xgrammar import CompiledGrammar

from forge_stream.engine.torch_engine.constraints import Constraint
from forge_stream.engine.torch_engine.detok import IncrementalText
from forge_stream.engine.torch_engine.sampling import LogprobsMode, SamplingParams, choose, make_generator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model object and the policy version of its weights."""

    model: PreTrainedModel
    version: int
    path: str


@dataclass(frozen=True)
class Admitted:
    """First event of a request: the policy version that will produce all of its tokens."""

    policy_version: int


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one choice, with the text it releases and, on the last token, why it ended."""

    choice: int
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class Failed:
    """The request failed inside the engine; no more events follow. `message` is for the client: it names a
    request id under which the log has the error (never the error's own text)."""

    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "Failed":
        request_id = f"req_{uuid.uuid4().hex}"
        log.error("engine error (request id %s)", request_id, exc_info=exc)
        return cls(f"Internal engine error (request id {request_id}); its details are in the engine's log.")


Event = Admitted | TokenEvent | Failed
Sink = Callable[[Event], None]


@dataclass
class Request:
    """A prompt to continue n times."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int
    sink: Sink
    cancelled: threading.Event = field(default_factory=threading.Event)
    grammar: CompiledGrammar | None = None  # each choice's output must match it (constraints.py)


@dataclass(eq=False)
class _Sequence:
    request: Request
    index: int
    loaded: LoadedModel
    generator: torch.Generator
    text: IncrementalText
    cache: list[tuple[torch.Tensor, torch.Tensor]]
    cache_len: int
    constraint: Constraint | None = None
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class _Batch:
    """Stacked, left-padded caches of one decode group; valid while its membership is unchanged."""

    seqs: list[_Sequence]
    cache: DynamicCache
    mask: torch.Tensor
    pads: list[int]

    def split(self) -> None:
        """Write each sequence's own slice of the stacked cache back to it."""
        layers = [(layer.keys, layer.values) for layer in self.cache.layers]
        for row, (seq, pad) in enumerate(zip(self.seqs, self.pads)):
            seq.cache = [(k[row:row + 1, :, pad:], v[row:row + 1, :, pad:]) for k, v in layers]


def _pack(seqs: list[_Sequence]) -> _Batch:
    length = max(s.cache_len for s in seqs)
    pads = [length - s.cache_len for s in seqs]
    data = []
    for layer in range(len(seqs[0].cache)):
        keys, values = [], []
        for seq, pad in zip(seqs, pads):
            k, v = seq.cache[layer]
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
        data.append((torch.cat(keys), torch.cat(values)))
    mask = torch.ones(len(seqs), length, dtype=torch.long, device=data[0][0].device)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return _Batch(seqs=seqs, cache=DynamicCache(ddp_cache_data=data), mask=mask, pads=pads)


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, heads, tokens, dim]


class PrefixCache:
    """The KV of recently prefilled prompts of one model, found again by any prompt that starts with one of them.

    Prompts are cut in blocks of `block` tokens; block boundary k of a prompt is named by a chained hash of its
    first k blocks, so a lookup costs one pass over the prompt whatever its length. An entry keeps one prompt's
    KV tensors (never written to: a cache built on a slice of them concatenates into new tensors) and every
    boundary name points at it. Entries are evicted least recently used past `max_tokens` tokens in all.
    """

    def __init__(self, max_tokens: int, block: int = 16):
        self.max_tokens, self.block = max_tokens, block
        self._entries: OrderedDict[int, tuple[KV, list[int]]] = OrderedDict()  # entry id -> (kv, boundary names)
        self._names: dict[int, tuple[int, int]] = {}  # boundary name -> (entry id, prefix length)
        self._tokens = 0
        self._next = 0
        self.owner: object | None = None  # the model the entries were computed with

    def _boundaries(self, ids: list[int], limit: int) -> list[tuple[int, int]]:
        """(name, length) of each block boundary of `ids` up to `limit` tokens."""
        out, name = [], 0
        for end in range(self.block, limit + 1, self.block):
            name = hash((name, tuple(ids[end - self.block:end])))
            out.append((name, end))
        return out

    def clear(self, owner: object) -> None:
        self._entries.clear()
        self._names.clear()
        self._tokens = 0
        self.owner = owner

    def lookup(self, ids: list[int]) -> tuple[int, KV | None]:
        """The longest cached prefix of `ids` that leaves at least one token to compute: (length, its KV)."""
        for name, length in reversed(self._boundaries(ids, len(ids) - 1)):
            found = self._names.get(name)
            if found is None or found[1] != length:
                continue
            entry, _ = found
            self._entries.move_to_end(entry)
            kv = self._entries[entry][0]
            return length, [(k[:, :, :length], v[:, :, :length]) for k, v in kv]
        return 0, None

    def insert(self, ids: list[int], kv: KV) -> None:
        if self.max_tokens <= 0 or len(ids) < self.block or len(ids) > self.max_tokens:
            return
        entry, self._next = self._next, self._next + 1
        names = []
        for name, length in self._boundaries(ids, len(ids)):
            self._names[name] = (entry, length)
            names.append(name)
        self._entries[entry] = (kv, names)
        self._tokens += len(ids)
        while self._tokens > self.max_tokens:
            old, (old_kv, old_names) = self._entries.popitem(last=False)
            self._tokens -= old_kv[0][0].shape[2]
            for name in old_names:
                if self._names.get(name, (None,))[0] == old:
                    del self._names[name]


@dataclass
class BatcherStats:
    """Counters that show batching happened (read by /health and tests)."""

    requests: int = 0
    prefills: int = 0
    prefill_tokens: int = 0  # prompt tokens computed
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    decode_steps: int = 0
    decode_rows: int = 0
    max_batch: int = 0


class Batcher:
    """Runs the generation loop in a worker thread; `submit` and `swap` are safe from any thread."""

    def __init__(self, loaded: LoadedModel, decode: Callable[[list[int], bool], str], eos_ids: set[int],
                 max_batch_size: int, max_model_len: int, logprobs_mode: LogprobsMode = "processed",
                 device: str = "cpu", prefix_cache_tokens: int = 65536):
        self.current = loaded
        self._device = torch.device(device)
        self._decode = decode
        self._eos_ids = eos_ids
        self._max_batch_size = max_batch_size
        self._max_model_len = max_model_len
        self._logprobs_mode = logprobs_mode
        self._inbox: queue.Queue[Request | None] = queue.Queue()
        self._waiting: list[Request] = []
        self._active: list[_Sequence] = []
        self._batches: dict[int, _Batch] = {}
        self._prefixes = PrefixCache(prefix_cache_tokens)
        self._thread = threading.Thread(target=self._run, name="forge-engine-batcher", daemon=True)
        self.stats = BatcherStats()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def submit(self, request: Request) -> None:
        self._inbox.put(request)

    def swap(self, loaded: LoadedModel) -> None:
        """Serve new requests with `loaded`; running sequences keep the model that admitted them."""
        self.current = loaded

    def active_versions(self) -> dict[int, int]:
        """Policy version -> number of running sequences."""
        counts: dict[int, int] = {}
        for seq in list(self._active):
            counts[seq.loaded.version] = counts.get(seq.loaded.version, 0) + 1
        return counts

    def _run(self) -> None:
        with torch.inference_mode():
            while self._receive():
                self._admit()
                if self._active:
                    self._step()

    def _receive(self) -> bool:
        """Move new requests to the waiting list; block only when there is nothing to do."""
        block = not self._active and not self._waiting
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if item is None:
                return False
            self._waiting.append(item)
            block = False

    def _admit(self) -> None:
        while self._waiting:
            request = self._waiting[0]
            if self._active and len(self._active) + request.n > self._max_batch_size:
                return
            self._waiting.pop(0)
            if request.cancelled.is_set():
                continue
            try:
                self._prefill(request)
            except Exception as exc:  # a bad request must not stop the loop
                request.sink(Failed.of(exc))

    def _prefill(self, request: Request) -> None:
        loaded = self.current
        self.stats.requests += 1
        self.stats.prefills += 1
        request.sink(Admitted(loaded.version))
        if self._prefixes.owner is not loaded:
            self._prefixes.clear(loaded)
        cached, prefix = self._prefixes.lookup(request.prompt_ids)
        ids = torch.tensor([request.prompt_ids[cached:]], dtype=torch.long, device=self._device)
        past = DynamicCache(ddp_cache_data=prefix) if prefix else DynamicCache()
        out = loaded.model(input_ids=ids, past_key_values=past, use_cache=True)
        cache = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        self._prefixes.insert(request.prompt_ids, cache)
        self.stats.prefill_tokens += len(request.prompt_ids) - cached
        self.stats.prefix_hit_tokens += cached
        logits = out.logits[0, -1].float().cpu()
        params = request.params
        for index in range(request.n):
            seq = _Sequence(
                request=request, index=index, loaded=loaded,
                generator=make_generator(params.seed, index),
                text=IncrementalText(
                    decode=lambda t, skip=params.skip_special_tokens: self._decode(t, skip),
                    stop=params.stop, include_stop=params.include_stop_str_in_output),
                cache=cache, cache_len=len(request.prompt_ids),
                constraint=None if request.grammar is None else Constraint(request.grammar),
            )
            self._active.append(seq)
            self._accept(seq, logits)

    def _step(self) -> None:
        self._active = [s for s in self._active if not s.finished]
        groups: dict[int, list[_Sequence]] = {}
        for seq in self._active:
            groups.setdefault(seq.loaded.version, []).append(seq)
        for version in list(self._batches):
            if version not in groups:
                del self._batches[version]
        for version, seqs in groups.items():
            batch = self._batches.get(version)
            if batch is None or batch.seqs != seqs:
                if batch is not None:
                    batch.split()
                batch = _pack(seqs)
            try:
                self._decode_group(batch)
            except Exception as exc:
                for request in {id(s.request): s.request for s in seqs}.values():
                    request.sink(Failed.of(exc))
                for seq in seqs:
                    seq.finished = True
                self._batches.pop(version, None)
                continue
            self._batches[version] = batch
        self._active = [s for s in self._active if not s.finished]

    def _decode_group(self, batch: _Batch) -> None:
        seqs = batch.seqs
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.long, device=self._device)
        positions = torch.tensor([[s.cache_len] for s in seqs], dtype=torch.long, device=self._device)
        ones = torch.ones(len(seqs), 1, dtype=torch.long, device=self._device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        out = seqs[0].loaded.model(input_ids=ids, attention_mask=batch.mask, position_ids=positions,
                                   past_key_values=batch.cache, use_cache=True)
        batch.cache = out.past_key_values
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(seqs)
        self.stats.max_batch = max(self.stats.max_batch, len(seqs))
        logits = out.logits[:, -1].float().cpu()
        for row, seq in enumerate(seqs):
            seq.cache_len += 1
            self._accept(seq, logits[row])

    def _accept(self, seq: _Sequence, logits: torch.Tensor) -> None:
        """Sample one token for `seq`, decide whether it ends the choice, and emit it."""
        request = seq.request
        if request.cancelled.is_set():
            seq.finished = True
            return
        params = request.params
        if seq.constraint is not None:
            logits = seq.constraint.mask(logits)
        picked = choose(logits, params, seq.generator, self._logprobs_mode)
        if seq.constraint is not None:
            seq.constraint.accept(picked.token_id)
        seq.token_ids.append(picked.token_id)
        finish, stop_reason = None, None
        if picked.token_id in params.stop_token_ids:
            finish, stop_reason = "stop", picked.token_id
        elif picked.token_id in self._eos_ids and not params.ignore_eos:
            finish = "stop"
        elif len(seq.token_ids) >= params.max_tokens or seq.cache_len + 1 >= self._max_model_len:
            finish = "length"
        text = seq.text.step(seq.token_ids, final=finish is not None)
        if seq.text.stop_hit is not None and finish is None:
            finish, stop_reason = "stop", seq.text.stop_hit
        seq.finished = finish is not None
        request.sink(TokenEvent(choice=seq.index, token_id=picked.token_id, logprob=picked.logprob,
                                top=picked.top, text=text, finish_reason=finish, stop_reason=stop_reason))
