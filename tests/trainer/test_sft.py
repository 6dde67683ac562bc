"""Warm start: the SFT loss is the NLL of assistant tokens only, computed through the tree-packed forward pass."""

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.tasks.suite import make_tasks
from forge_stream.tasks.teacher import demonstration
from forge_stream.trainer import sft
from forge_stream.trainer.sft import SftSettings, criterion, render_turns, run_sft, sft_loss
from forge_stream.tree import sequence_logprobs


def test_loss_is_assistant_token_nll_of_separate_passes(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval().requires_grad_(False)
    batch = [render_turns(tokenizer, demonstration(t.graded, t.domain)) for t in make_tasks("train", 6, seed=1)]
    nll, count = 0.0, 0
    for demo in batch:
        for turn in demo:
            ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            start = len(turn.prompt_ids)
            targets = ids[0, start:]
            nll -= float(logp[start - 1: -1].gather(1, targets[:, None]).sum())
            count += len(targets)
    assert abs(float(sft_loss(model, batch)) - nll / count) < 1e-9


def test_prompt_tokens_carry_no_loss(tiny_model_dir, monkeypatch):
    """The loss is the mean NLL of the completion tokens: its gradient reaches every completion token's log-prob
    with -1/n and no prompt token's log-prob at all (the user's words and the template are context only)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    task = make_tasks("train", 1, seed=1, mix={"reasoning": 1.0})[0]
    turns = render_turns(tokenizer, demonstration(task.graded, task.domain))
    assert len(turns) == 1 and len(turns[0].completion_ids) == len(tokenizer.encode(task.reference["answer"])) + 1
    scored = []

    def keep_grads(model, packed):
        logprobs = sequence_logprobs(model, packed)
        for lp in logprobs:
            lp.retain_grad()
        scored.extend(logprobs)
        return logprobs

    monkeypatch.setattr(sft, "sequence_logprobs", keep_grads)
    loss = sft_loss(model, [turns])
    loss.backward()
    [lp] = scored  # lp[j]: log-prob of token j + 1 given tokens 0..j
    prompt, n = len(turns[0].prompt_ids), len(turns[0].completion_ids)
    assert len(lp) == prompt + n - 1 and prompt > n
    assert torch.equal(lp.grad[: prompt - 1], torch.zeros(prompt - 1, dtype=lp.dtype))
    assert torch.allclose(lp.grad[prompt - 1:], torch.full((n,), -1.0 / n, dtype=lp.dtype), rtol=0, atol=1e-15)
    assert float(loss) == pytest.approx(-float(lp[prompt - 1:].mean()), rel=1e-12)
    assert float(loss) != pytest.approx(-float(lp.mean()), rel=1e-3)  # with the prompt's NLL it would differ


def test_sft_learns_the_demonstrations(tiny_model_dir, tmp_path):
    out = tmp_path / "warm"
    lines = []
    result = run_sft(SftSettings(base_model=tiny_model_dir, out=out, examples=32, max_steps=30, target=None,
                                 check_every=10, check_examples=8, batch_size=8, lr=3e-3), progress=lines.append)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert lines[0].startswith("sft step 10/30") and result["final_loss"] < 1.5 and result["steps"] == 30
    assert [c["step"] for c in result["curve"]] == [0, 10, 20, 30] and not result["reached"]
    assert result["curve"][-1]["nll"] < result["curve"][0]["nll"] / 2  # held-out demonstrations, never trained on


def test_criterion_is_the_chance_of_sampling_each_demonstration(tiny_model_dir):
    """predicted_reward is the mean over demonstrations of the product of their assistant tokens' probabilities
    (every turn of a demonstration), from separate forward passes; nll is the mean per-token NLL."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    tasks = make_tasks("validation", 6, seed=2)
    demos = [render_turns(tokenizer, demonstration(t.graded, t.domain)) for t in tasks]
    assert any(len(demo) == 2 for demo in demos)  # tool-calling demonstrations have two assistant turns
    probabilities, token_lps = [], []
    for demo in demos:
        total = 0.0
        for turn in demo:
            ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
            start = len(turn.prompt_ids)
            lps = logp[start - 1: -1].gather(1, ids[0, start:, None]).squeeze(1)
            total += float(lps.sum())
            token_lps += lps.tolist()
        probabilities.append(math.exp(total))
    measured = criterion(model, demos, [t.domain for t in tasks])
    assert measured["predicted_reward"] == pytest.approx(sum(probabilities) / len(demos), rel=1e-9)
    assert measured["nll"] == pytest.approx(-sum(token_lps) / len(token_lps), rel=1e-9)
    families = sorted({t.domain for t in tasks})
    assert len(families) == 3 and sorted(measured["by_family"]) == families
    for family in families:
        own = [p for p, t in zip(probabilities, tasks) if t.domain == family]
        assert measured["by_family"][family] == pytest.approx(sum(own) / len(own), rel=1e-9)


def test_sft_stops_at_the_target_and_says_so(tiny_model_dir, tmp_path, monkeypatch):
    """Training stops at the first check at or above the target, not at the budget; a target never reached runs
    the whole budget and reports reached: false."""
    readings = iter([0.0, 0.05, 0.2, 0.35, 0.6, 0.7])
    monkeypatch.setattr(sft, "criterion", lambda model, demos, families: {"predicted_reward": next(readings),
                                                                          "nll": 1.0, "by_family": {}})
    settings = SftSettings(base_model=tiny_model_dir, out=tmp_path / "warm", examples=16, max_steps=100,
                           target=0.3, check_every=2, check_examples=4, batch_size=4)
    result = run_sft(settings, progress=lambda line: None)
    assert (result["steps"], result["reached"], result["predicted_reward"]) == (6, True, 0.35)
    assert [c["step"] for c in result["curve"]] == [0, 2, 4, 6]
    readings = iter([0.0, 0.01, 0.02, 0.03])
    result = run_sft(replace(settings, max_steps=5, target=0.9), progress=lambda line: None)
    assert (result["steps"], result["reached"], result["predicted_reward"]) == (5, False, 0.03)


def test_sft_with_a_family_target_goes_on_until_every_family_reaches_it(tiny_model_dir, tmp_path, monkeypatch):
    """The overall criterion can pass its target through one easy family: with family_target, SFT goes on until
    the weakest family reaches it too, and reports every family."""
    readings = iter([(0.0, 0.0, 0.0), (0.6, 0.02, 0.03), (0.7, 0.08, 0.2), (0.8, 0.12, 0.1), (0.9, 0.3, 0.3)])

    def measured(model, demos, families):
        assert set(families) <= {"agent", "lookup", "reasoning"} and len(families) == len(demos) == 6
        lookup, agent, reasoning = next(readings)
        return {"predicted_reward": (lookup + agent + reasoning) / 3, "nll": 1.0,
                "by_family": {"agent": agent, "lookup": lookup, "reasoning": reasoning}}

    monkeypatch.setattr(sft, "criterion", measured)
    settings = SftSettings(base_model=tiny_model_dir, out=tmp_path / "warm", examples=16, max_steps=100,
                           target=0.2, family_target=0.1, check_every=2, check_examples=6, batch_size=4)
    lines = []
    result = run_sft(settings, progress=lines.append)
    assert (result["steps"], result["reached"]) == (6, True)  # the overall target alone would stop at step 2
    assert result["by_family"] == {"agent": 0.12, "lookup": 0.8, "reasoning": 0.1}
    assert "agent 0.080, lookup 0.700, reasoning 0.200; target 0.2, each family 0.1" in lines[1]


def test_sft_stops_at_the_ceiling_with_a_family_still_short(tiny_model_dir, tmp_path, monkeypatch):
    """A warm start must stay below its band's top: once the overall criterion reaches the ceiling, SFT stops even
    though a family is still short of its target, and says it did not reach it."""
    readings = iter([(0.0, 0.0), (0.5, 0.02), (0.8, 0.05), (0.95, 0.09), (0.99, 0.2)])

    def measured(model, demos, families):
        easy, hard = next(readings)
        return {"predicted_reward": (easy + hard) / 2, "nll": 1.0, "by_family": {"lookup": easy, "reasoning": hard}}

    monkeypatch.setattr(sft, "criterion", measured)
    settings = SftSettings(base_model=tiny_model_dir, out=tmp_path / "warm", examples=16, max_steps=100,
                           target=0.2, family_target=0.1, ceiling=0.5, check_every=2, check_examples=6, batch_size=4)
    result = run_sft(settings, progress=lambda line: None)
    assert (result["steps"], result["reached"]) == (6, False) and result["predicted_reward"] == pytest.approx(0.52)
    assert result["by_family"] == {"lookup": 0.95, "reasoning": 0.09}


def test_balanced_sft_draws_half_of_each_batch_from_the_families_short_of_their_target(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    """With balanced, at least half of each batch comes from the families still short of their target (a family
    that falls back is among them again) and the rest from every family, so a family with its foothold keeps being
    trained a little; once every family is at its target, batches come from all of them alike."""
    readings = iter([(0.0, 0.0, 0.0), (0.3, 0.02, 0.03), (0.4, 0.05, 0.2), (0.08, 0.12, 0.15), (0.3, 0.11, 0.12),
                     (0.5, 0.2, 0.2)])
    family_of, trained = {}, []
    real_demonstrations, real_loss = sft.demonstrations, sft.sft_loss

    def demonstrations(tokenizer, settings):
        demos, families = real_demonstrations(tokenizer, settings)
        family_of.update({id(d): f for d, f in zip(demos, families)})
        return demos, families

    def measured(model, demos, families):
        lookup, agent, reasoning = next(readings)
        return {"predicted_reward": (lookup + agent + reasoning) / 3, "nll": 1.0,
                "by_family": {"agent": agent, "lookup": lookup, "reasoning": reasoning}}

    def loss(model, batch):
        trained.append(Counter(family_of[id(d)] for d in batch))
        return real_loss(model, batch)

    monkeypatch.setattr(sft, "demonstrations", demonstrations)
    monkeypatch.setattr(sft, "criterion", measured)
    monkeypatch.setattr(sft, "sft_loss", loss)
    settings = SftSettings(base_model=tiny_model_dir, out=tmp_path / "warm", examples=24, max_steps=100,
                           target=0.2, family_target=0.1, balanced=True, check_every=2, check_examples=6,
                           batch_size=6)
    lines = []
    result = run_sft(settings, progress=lines.append)
    assert (result["steps"], result["reached"], result["balanced"]) == (10, True, True)
    assert all(sum(batch.values()) == 6 for batch in trained)
    assert all(batch["agent"] + batch["reasoning"] >= 3 for batch in trained[2:4])  # lookup has its foothold
    assert all(batch["agent"] >= 3 for batch in trained[4:6])
    assert all(batch["lookup"] >= 3 for batch in trained[6:8])  # lookup fell back under its target
    assert sum(batch["lookup"] for batch in trained[2:6]) > 0  # but was never left out altogether
    assert len(trained[8] | trained[9]) > 1  # all at their target, the overall one not yet: every family again
    assert "next: half of each batch from agent, reasoning)" in lines[0]
    assert "next: half of each batch from lookup)" in lines[2] and "next:" not in lines[3]
