"""The tree-packed training step on decoded TrainSample dicts, checked against separate passes + the formula."""

import pytest
import torch

from forge_stream.trainer.step import StepConfig, accumulate_gradients, build_optimizer, micro_batches, train_step
from forge_stream.tree import pack
from forge_stream.tree.reference import separate_logprobs, tiny_causal_lm


def _sample(group_id, sequences, prompt_lens, advantages, policy_version, seed):
    """A TrainSample-shaped dict (the fields the trainer reads) for a group of token sequences."""
    tree = pack(sequences)
    gen = torch.Generator().manual_seed(seed)
    refs = []
    for i, (seq, plen, adv) in enumerate(zip(sequences, prompt_lens, advantages)):
        old = (-torch.rand(len(seq) - plen, generator=gen) * 3).tolist()
        refs.append(
            {
                "completion_id": f"{group_id}-{i}", "session_id": f"s{i}", "turn": 0,
                "last_row": int(tree.last_row[i]), "length": len(seq), "prompt_len": plen,
                "old_logprobs": old, "advantage": adv, "reward": adv + 1.0, "policy_version": policy_version,
            }
        )
    return {
        "event_id": group_id, "group_id": group_id, "policy_version": policy_version,
        "token_ids": tree.token_ids.tolist(), "position_ids": tree.position_ids.tolist(),
        "subtree_end": tree.subtree_end.tolist(), "parent_row": tree.parent_row.tolist(), "sequences": refs,
    }


def _samples():
    prompt = [5, 9, 2, 7]
    return [
        _sample("g0", [prompt + [1, 2, 3], prompt + [1, 2, 4, 4], prompt + [8]], [4, 4, 4], [1.0, -0.5, -0.5], 3, 0),
        _sample("g1", [[6, 6, 1], [6, 6, 1], [6, 3, 3, 3, 3]], [2, 2, 1], [0.3, 0.3, -0.6], 2, 1),
        _sample("g2", [[4, 4, 4, 4, 4, 4, 4], [4, 4, 4, 9]], [3, 3], [0.7, -0.7], 4, 2),
    ]


def _direct_cispo_grads(model, samples, eps_high):
    """CISPO written out: sum over tokens of sg(min(r, 1 + eps_high)) * A * logp / N, from separate passes."""
    model.zero_grad()
    terms, n = [], 0
    for s in samples:
        seqs = [
            [s["token_ids"][r] for r in _path(s["parent_row"], ref["last_row"])] for ref in s["sequences"]
        ]
        for lp, ref in zip(separate_logprobs(model, seqs), s["sequences"]):
            lp = lp[ref["prompt_len"] - 1 :]
            old = torch.tensor(ref["old_logprobs"], dtype=lp.dtype)
            w = torch.exp(lp.detach() - old).clamp(max=1 + eps_high)
            terms.append((w * ref["advantage"] * lp).sum())
            n += lp.numel()
    (-sum(terms) / n).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _path(parent, last):
    path = [last]
    while parent[path[-1]] >= 0:
        path.append(parent[path[-1]])
    return path[::-1]


def test_micro_batched_gradient_equals_direct_cispo_on_separate_passes():
    model = tiny_causal_lm("qwen2", dtype=torch.float64, seed=7)
    samples = _samples()
    config = StepConfig(eps_high=0.3, token_budget=12, chunk_rows=4)
    ref = _direct_cispo_grads(model, samples, config.eps_high)
    model.zero_grad()
    acc = accumulate_gradients(model, samples, config)
    assert acc["micro_batches"] >= 2
    for name, p in model.named_parameters():
        rel = float((p.grad - ref[name]).abs().max()) / float(ref[name].abs().max())
        assert rel < 1e-6, (name, rel)


def test_train_step_updates_the_model_and_reports_counts():
    model = tiny_causal_lm("llama", seed=8)
    samples = _samples()
    config = StepConfig(lr=1e-2, token_budget=20)
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_step(model, build_optimizer(model, config), samples, config, policy_version=5)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert stats.total_tokens == 7 + 8 + 5 + 3 + 3 + 5 + 7 + 4
    assert stats.unique_tokens == sum(len(s["token_ids"]) for s in samples)
    assert stats.loss_tokens == sum(r["length"] - r["prompt_len"] for s in samples for r in s["sequences"])
    assert (stats.groups, stats.sequences) == (3, 8)
    assert stats.tree_ratio == pytest.approx(stats.total_tokens / stats.unique_tokens)
    assert (stats.staleness_mean, stats.staleness_max) == (pytest.approx(2.0), 3)
    assert stats.grad_norm > 0


def test_micro_batches_respect_the_budget():
    trees = [pack([[1] * n]) for n in (5, 5, 3, 12, 1)]
    assert micro_batches(trees, 10) == [[0, 1], [2], [3], [4]]


def test_inconsistent_sample_is_rejected():
    bad = _samples()[0]
    bad["sequences"][0]["old_logprobs"] = bad["sequences"][0]["old_logprobs"][:-1]
    with pytest.raises(ValueError):
        accumulate_gradients(tiny_causal_lm("llama"), [bad], StepConfig())
    bad = _samples()[1]
    bad["subtree_end"][0] = 0
    with pytest.raises(ValueError):
        accumulate_gradients(tiny_causal_lm("llama"), [bad], StepConfig())
