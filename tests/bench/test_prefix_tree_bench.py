"""`forge-stream bench prefix-tree`: the tree step and the unshared baseline score the same log-probs, at the
model's own distribution and at a sampling temperature with top-p (the trainer's path), and the JSON says which."""

from __future__ import annotations

from dataclasses import replace

import torch

from forge_stream.bench import prefix_tree

SAMPLED = replace(prefix_tree.QUICK, temperature=0.7, top_p=0.9)


def _step(step, s):
    torch.manual_seed(0)
    model = prefix_tree._model(s)
    seqs = prefix_tree.workloads(s)["grpo"]
    weights = [1.0] * len(seqs)
    lps = torch.cat(step(model, seqs, weights, s))
    grad = model.get_input_embeddings().weight.grad.clone()
    return lps, grad


def test_tree_and_unshared_steps_agree_at_a_sampling_temperature_with_top_p():
    tree, tree_grad = _step(prefix_tree.tree_step, SAMPLED)
    unshared, unshared_grad = _step(prefix_tree.baseline_step, SAMPLED)
    assert (tree - unshared).abs().max() < 1e-4
    assert torch.allclose(tree_grad, unshared_grad, atol=1e-4, rtol=1e-3)
    own, _ = _step(prefix_tree.tree_step, prefix_tree.QUICK)
    assert (tree - own).abs().max() > 1e-2  # scored at T = 0.7 within the nucleus, not at the model's own
    assert (tree <= 0).all() and torch.isfinite(tree).all()  # the sampled token is always kept in the nucleus


def test_the_json_says_what_distribution_was_scored():
    assert prefix_tree.scored_at(SAMPLED) == {
        "temperature": 0.7, "top_p": 0.9,
        "path": "logits / temperature, then the top-p nucleus (a sort of each scored row's whole vocabulary)"}
    assert prefix_tree.scored_at(prefix_tree.QUICK)["path"] == "the model's own distribution"
