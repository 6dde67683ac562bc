"""Warm start: the SFT loss is the NLL of assistant tokens only, computed through the tree-packed forward pass."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.tasks.suite import make_tasks
from forge_stream.tasks.teacher import demonstration
from forge_stream.trainer import sft
from forge_stream.trainer.sft import SftSettings, render_turns, run_sft, sft_loss
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
    result = run_sft(SftSettings(base_model=tiny_model_dir, out=out, examples=32, steps=30, batch_size=8, lr=3e-3),
                     progress=lines.append)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert lines[0].startswith("sft step 1/30") and result["final_loss"] < 1.5
    first = float(lines[0].split("loss ")[1].split()[0])
    assert result["final_loss"] < first / 3
