import math

import torch

from forge_stream.engine.torch_engine.sampling import MIN_TEMPERATURE, SamplingParams, choose, make_generator
from forge_stream.sampled_policy import processed_logits, processed_logprobs


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(processed_logits(logits, 1.0, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(processed_logits(logits, 1.0, 0.01)).tolist() == [[True, False, False, False]]
    # a token is in exactly when the mass of the tokens more likely than it is below top_p
    assert torch.isfinite(processed_logits(logits, 1.0, 0.79)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(processed_logits(logits, 1.0, 0.81)).tolist() == [[True, True, True, False]]


def test_the_trainers_log_probs_are_exactly_the_ones_the_engine_reports():
    """The trainer's scoring (`processed_logprobs`, many rows with their own settings at once) gives, bit for bit,
    the log-prob `choose` reports for the token it sampled from the same logits: temperature 0.7, with and without
    top_p 0.9; and not the model's own (temperature 1) log-prob."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(24, 4000, generator=gen) * 4
    settings = [(0.7, 1.0), (0.7, 0.9)] * 12
    picked = [choose(row, SamplingParams(max_tokens=1, temperature=t, top_p=p, seed=i), make_generator(i, 0))
              for i, (row, (t, p)) in enumerate(zip(logits, settings))]
    tokens = torch.tensor([c.token_id for c in picked])
    trainer = processed_logprobs(logits, tokens, torch.tensor([t for t, _ in settings]),
                                 torch.tensor([p for _, p in settings]))
    assert trainer.tolist() == [c.logprob for c in picked]
    raw = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    assert (trainer - raw).abs().min() > 1e-3
    nucleus = torch.isfinite(processed_logits(logits[1::2], 0.7, 0.9))
    assert nucleus.sum(-1).max() < 4000  # top_p 0.9 cut tokens off every row

def test_greedy_picks_argmax_and_reports_raw_logprob():
    logits = torch.tensor([0.1, 2.0, -1.0])
    picked = choose(logits, SamplingParams(max_tokens=1, temperature=0.0, top_logprobs=2), make_generator(0, 0))
    assert picked.token_id == 1
    assert math.isclose(picked.logprob, torch.log_softmax(logits, -1)[1].item(), rel_tol=1e-6)
    assert [t for t, _ in picked.top] == [1, 0]


def test_seeded_sampling_is_reproducible_and_choices_differ():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=7)

    def draw(choice_index):
        gen = make_generator(params.seed, choice_index)
        return [choose(logits, params, gen).token_id for _ in range(20)]

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)


def test_raw_logprobs_ignore_temperature_processed_ones_do_not():
    logits = torch.tensor([1.0, 0.5, 0.0])
    params = SamplingParams(max_tokens=1, temperature=0.5, seed=1)
    raw = choose(logits, params, make_generator(1, 0), "raw")
    processed = choose(logits, params, make_generator(1, 0), "processed")
    assert raw.token_id == processed.token_id
    assert math.isclose(raw.logprob, torch.log_softmax(logits, -1)[raw.token_id].item(), rel_tol=1e-6)
    assert math.isclose(processed.logprob, torch.log_softmax(logits / 0.5, -1)[raw.token_id].item(), rel_tol=1e-6)


def test_default_logprobs_are_those_of_the_sampled_distribution():
    """Temperature 0.5, default mode: the logprob is log_softmax(logits / 0.5), not the raw model's."""
    from forge_stream.engine.torch_engine.settings import EngineSettings

    assert EngineSettings(model="m").logprobs_mode == "processed"
    logits = torch.tensor([2.0, 0.5, -1.0, 0.0])
    params = SamplingParams(max_tokens=1, temperature=0.5, seed=4)
    picked = choose(logits, params, make_generator(4, 0))
    want = torch.log_softmax(logits / 0.5, -1)[picked.token_id].item()
    assert math.isclose(picked.logprob, want, rel_tol=1e-6)
    assert not math.isclose(picked.logprob, torch.log_softmax(logits, -1)[picked.token_id].item(), rel_tol=1e-3)


def test_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([0.1, 3.0, -1.0])
    for top_p in (1e-320, 5e-324, 1e-30):
        picked = choose(logits, SamplingParams(max_tokens=1, top_p=top_p, seed=0), make_generator(0, 0))
        assert picked.token_id == 1 and math.isfinite(picked.logprob)


def test_temperature_edges_sample_finite_logprobs():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 30
    for temperature in (MIN_TEMPERATURE, 1e6, 1e300):
        picked = choose(logits, SamplingParams(max_tokens=1, temperature=temperature), make_generator(0, 0))
        assert math.isfinite(picked.logprob)
