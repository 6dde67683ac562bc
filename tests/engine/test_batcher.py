"""The batching loop on its own (no HTTP): batched decoding equals one-at-a-time, logprobs are exact,
weight swaps leave running sequences on the model that admitted them."""

import threading

import pytest
from transformers import AutoModelForCausalLM

from forge_stream.engine.torch_engine.batcher import Admitted, Batcher, LoadedModel, Request, TokenEvent
from forge_stream.engine.torch_engine.sampling import SamplingParams

PROMPTS = ["hello world", "The agent reads the weather report before noon.", "def add(a, b):", "x"]


@pytest.fixture
def batcher(hf_model, tokenizer, tiny_model_dir):
    batcher = Batcher(LoadedModel(hf_model, 0, str(tiny_model_dir)),
                      decode=lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip),
                      eos_ids={tokenizer.eos_token_id}, max_batch_size=8, max_model_len=2048)
    batcher.start()
    yield batcher
    batcher.stop()


class Collector:
    """Gathers the events of one request; `wait()` returns when all its choices finished."""

    def __init__(self, n: int = 1):
        self.events, self.left, self.done = [], n, threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, TokenEvent) and event.finish_reason:
            self.left -= 1
            if self.left == 0:
                self.done.set()

    def wait(self) -> "Collector":
        assert self.done.wait(60)
        return self

    def tokens(self, choice: int = 0) -> list[TokenEvent]:
        return [e for e in self.events if isinstance(e, TokenEvent) and e.choice == choice]

    def version(self) -> int:
        return next(e.policy_version for e in self.events if isinstance(e, Admitted))


def _submit(batcher, tokenizer, prompt, params, n=1) -> Collector:
    sink = Collector(n)
    batcher.submit(Request(tokenizer.encode(prompt), params, n, sink))
    return sink


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_batched_greedy_decoding_equals_one_at_a_time(batcher, tokenizer):
    alone = [_submit(batcher, tokenizer, p, GREEDY).wait() for p in PROMPTS]
    assert batcher.stats.max_batch == 1
    together = [_submit(batcher, tokenizer, p, GREEDY) for p in PROMPTS]
    together = [c.wait() for c in together]
    assert batcher.stats.max_batch > 1
    for a, b in zip(alone, together):
        assert [e.token_id for e in a.tokens()] == [e.token_id for e in b.tokens()]
        assert [e.logprob for e in a.tokens()] == pytest.approx([e.logprob for e in b.tokens()], abs=1e-4)


def test_logprobs_match_a_plain_forward_pass(batcher, tokenizer, hf_model, reference_logprobs):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    runs = [_submit(batcher, tokenizer, p, params, n=2) for p in PROMPTS[:3]]
    for prompt, run in zip(PROMPTS, runs):
        run.wait()
        for choice in range(2):
            ids = [e.token_id for e in run.tokens(choice)]
            expected = reference_logprobs(hf_model, tokenizer.encode(prompt), ids)
            assert [e.logprob for e in run.tokens(choice)] == pytest.approx(expected, abs=1e-4)


def test_swap_keeps_running_sequences_on_the_old_model(batcher, tokenizer, hf_model, tiny_model_dir_v1,
                                                       reference_logprobs):
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_v1).eval()
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    old_run = _submit(batcher, tokenizer, PROMPTS[1], long)
    while not old_run.tokens():
        threading.Event().wait(0.01)
    batcher.swap(LoadedModel(new_model, 1, str(tiny_model_dir_v1)))
    new_run = _submit(batcher, tokenizer, PROMPTS[1], long)
    old_run.wait(), new_run.wait()
    assert (old_run.version(), new_run.version()) == (0, 1)
    assert len(old_run.tokens()) == len(new_run.tokens()) == 60
    prompt = tokenizer.encode(PROMPTS[1])
    for run, model in ((old_run, hf_model), (new_run, new_model)):
        ids = [e.token_id for e in run.tokens()]
        assert [e.logprob for e in run.tokens()] == pytest.approx(reference_logprobs(model, prompt, ids), abs=1e-4)


def test_prompts_sharing_a_prefix_reuse_its_kv_exactly(batcher, tokenizer, hf_model, tiny_model_dir_v1,
                                                       reference_logprobs):
    """A prompt that starts with an earlier one (the same system prompt and tools; the previous turn) computes
    only its new tokens, and its log-probs are those of a plain forward pass over the whole prompt; after a
    weight swap nothing of the old model's KV is reused."""
    system = "You are a careful agent. Use the calculator for arithmetic and answer with the number only. " * 3
    first = system + "What is 12 + 30?"
    second = first + " The calculator said 42. What is 42 * 2?"
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    runs = [_submit(batcher, tokenizer, p, params).wait() for p in (first, second, system + "Which is larger?")]
    assert batcher.stats.prefix_hit_tokens >= 2 * (len(tokenizer.encode(system)) // 16) * 16
    assert batcher.stats.prefill_tokens < sum(len(tokenizer.encode(p)) for p in (first, second))
    for prompt, run in zip((first, second, system + "Which is larger?"), runs):
        ids = [e.token_id for e in run.tokens()]
        assert [e.logprob for e in run.tokens()] == pytest.approx(
            reference_logprobs(hf_model, tokenizer.encode(prompt), ids), abs=1e-4)
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_v1).eval()
    batcher.swap(LoadedModel(new_model, 1, str(tiny_model_dir_v1)))
    hits = batcher.stats.prefix_hit_tokens
    run = _submit(batcher, tokenizer, second, params).wait()
    assert batcher.stats.prefix_hit_tokens == hits
    ids = [e.token_id for e in run.tokens()]
    assert [e.logprob for e in run.tokens()] == pytest.approx(
        reference_logprobs(new_model, tokenizer.encode(second), ids), abs=1e-4)
