"""The tree-packed training step on decoded TrainSample dicts, checked against separate passes + the formula."""

import math
from dataclasses import replace

import pytest
import torch

from forge_stream.sampled_policy import processed_logprobs
from forge_stream.trainer.losses import Clip
from forge_stream.trainer.step import (
    StepConfig, accumulate_gradients, build_optimizer, micro_batch_plan, micro_batches, sample_tree, split_sequences,
    train_step,
)
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
                "rollout": f"s{i % 2}", "outcome_reward": float(i % 2), "temperature": 1.0,
                "top_p": 1.0, "logprobs_mode": "processed",
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
    config = StepConfig(clip=Clip(None, 0.3), token_budget=12, chunk_rows=4)
    ref = _direct_cispo_grads(model, samples, config.bounds.high)
    model.zero_grad()
    acc = accumulate_gradients(model, samples, config)
    assert acc["micro_batches"] >= 2
    for name, p in model.named_parameters():
        rel = float((p.grad - ref[name]).abs().max()) / float(ref[name].abs().max())
        assert rel < 1e-6, (name, rel)


def test_a_group_without_signal_counts_in_the_normalizer_but_is_not_run():
    """A group whose rollouts all scored alike (every advantage 0) leaves the gradient the whole batch gives (its
    tokens still in the normalizer), without a forward or backward pass of its own."""
    model = tiny_causal_lm("qwen2", dtype=torch.float64, seed=7)
    idle = _sample("g3", [[3, 1, 4, 1, 5], [3, 1, 4, 9, 2, 6]], [2, 2], [0.0, 0.0], 3, 3)
    samples = [*_samples(), idle]
    config = StepConfig(clip=Clip(None, 0.3), token_budget=12, chunk_rows=4)
    ref = _direct_cispo_grads(model, samples, config.bounds.high)
    model.zero_grad()
    acc = accumulate_gradients(model, samples, config)
    for name, p in model.named_parameters():
        rel = float((p.grad - ref[name]).abs().max()) / float(ref[name].abs().max())
        assert rel < 1e-6, (name, rel)
    trained = sum(r["length"] - r["prompt_len"] for s in samples[:3] for r in s["sequences"])
    assert (acc["tokens"], acc["loss_tokens"]) == (trained, trained + 3 + 4)
    stats = train_step(model, build_optimizer(model, config), samples, config, policy_version=5)
    assert (stats.groups, stats.groups_without_signal) == (4, 1)


def test_a_batch_without_signal_changes_no_weight():
    model = tiny_causal_lm("llama", seed=8)
    samples = [{**s, "sequences": [{**r, "advantage": 0.0} for r in s["sequences"]]} for s in _samples()]
    config = StepConfig(lr=1e-2, token_budget=20, updates=2)
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_step(model, build_optimizer(model, config), samples, config, policy_version=5)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert (stats.groups_without_signal, stats.grad_norm, stats.micro_batches) == (3, 0.0, 0)


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
    # one outcome per (group, rollout): s0 (0.0) and s1 (1.0) in each group; per sequence it would be 2/8
    assert (stats.rollouts, stats.outcome_reward) == (6, pytest.approx(0.5))
    assert stats.mean_reward == pytest.approx(sum(r["reward"] for s in samples for r in s["sequences"]) / 8)


def test_the_ppo_step_applies_its_dual_clip():
    """StepConfig.clip_ratio_c reaches the PPO loss: sequences with negative advantages whose tokens were sampled
    far less likely than the policy now makes them (ratio >> 3) add no gradient under the dual clip, and an
    unbounded one without it."""
    samples = _samples()
    for ref in (r for s in samples for r in s["sequences"]):
        ref["old_logprobs"] = [-40.0] * len(ref["old_logprobs"])  # ratios about e^35 or more
        ref["advantage"] = -abs(ref["advantage"])
    norms = {}
    for c in (3.0, None):
        model = tiny_causal_lm("llama", dtype=torch.float64, seed=8)
        acc = accumulate_gradients(model, samples, StepConfig(loss="ppo", clip_ratio_c=c))
        norms[c] = sum(float(p.grad.norm()) ** 2 for p in model.parameters() if p.grad is not None) ** 0.5
        assert acc["clip_fraction"] == 1.0
    assert norms[3.0] == 0.0 and norms[None] > 1e10


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


def _rows_and_path(sample, ref):
    return [sample["token_ids"][r] for r in _path(sample["parent_row"], ref["last_row"])]


def _with_old_logprobs(model, samples, temperature=1.0, top_p=1.0, offsets=None):
    """The samples with old log-probs computed by `model` itself, separately for each sequence, at `temperature`
    and `top_p` as an engine reports them (processed), plus per-token offsets."""
    out = []
    with torch.no_grad():
        for s in samples:
            refs = []
            for i, ref in enumerate(s["sequences"]):
                ids = torch.tensor(_rows_and_path(s, ref))
                old = processed_logprobs(model(input_ids=ids[None]).logits[0, :-1], ids[1:], temperature, top_p)
                old = old[ref["prompt_len"] - 1:]
                if offsets is not None:
                    old = old + torch.tensor([offsets[(i + t) % len(offsets)] for t in range(old.numel())])
                refs.append({**ref, "old_logprobs": old.tolist(), "temperature": temperature, "top_p": top_p,
                             "logprobs_mode": "processed"})
            out.append({**s, "sequences": refs})
    return out


def test_ppo_step_computes_the_clipped_surrogate():
    """`--loss ppo` with its own bounds (0.2, 0.2): gradients equal min(r A, clip(r, 0.8, 1.2) A) token-mean, and
    tokens whose ratio is far outside the clip (with the clipped term the minimum) get no gradient."""
    model = tiny_causal_lm("qwen2", dtype=torch.float64, seed=3)
    samples = _with_old_logprobs(model, _samples(), offsets=[1.0, 0.05, -1.0, -0.02])  # r = e^-1 ... e^1
    config = StepConfig(loss="ppo", token_budget=12, chunk_rows=4)
    assert config.bounds == Clip(0.2, 0.2)
    model.zero_grad()
    terms, n, clipped_zero = [], 0, 0
    for s in samples:
        seqs = [_rows_and_path(s, ref) for ref in s["sequences"]]
        for lp, ref in zip(separate_logprobs(model, seqs), s["sequences"]):
            lp = lp[ref["prompt_len"] - 1:]
            ratio = torch.exp(lp - torch.tensor(ref["old_logprobs"], dtype=lp.dtype))
            adv = ref["advantage"]
            unclipped, clipped = ratio * adv, ratio.clamp(0.8, 1.2) * adv
            clipped_zero += int(((clipped < unclipped) & ((ratio < 0.8) | (ratio > 1.2))).sum())
            terms.append(torch.minimum(unclipped, clipped).sum())
            n += lp.numel()
    assert clipped_zero >= 3  # the clip is active on several tokens
    (-sum(terms) / n).backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    acc = accumulate_gradients(model, samples, config)
    for name, p in model.named_parameters():
        scale = float(ref_grads[name].abs().max())
        assert float((p.grad - ref_grads[name]).abs().max()) <= 1e-6 * scale + 1e-12, name
    assert 0 < acc["clip_fraction"] < 1


def test_mismatch_is_visible_in_the_step_stats():
    model = tiny_causal_lm("llama", dtype=torch.float64, seed=5)
    config = StepConfig(lr=0.0, token_budget=20)
    same = train_step(model, build_optimizer(model, config), _with_old_logprobs(model, _samples()), config, 4)
    assert same.mismatch_mean < 1e-5 and same.mismatch_max < 1e-5
    assert same.ratio_mean == pytest.approx(1.0, abs=1e-5) and same.ratio_max == pytest.approx(1.0, abs=1e-5)
    assert same.clip_fraction == 0.0 and same.loss_name == "cispo"
    drifted = train_step(model, build_optimizer(model, config),
                         _with_old_logprobs(model, _samples(), offsets=[0.3, -0.2]), config, 4)
    assert 0.2 < drifted.mismatch_mean < 0.3 and drifted.mismatch_max == pytest.approx(0.3)
    assert abs(drifted.ratio_mean - 1.0) > 0.01 and drifted.ratio_max == pytest.approx(math.exp(0.2))


def test_tokens_are_scored_at_the_temperature_and_top_p_they_were_sampled_at():
    """Log-probs recorded at temperature 0.5 (and top_p 0.8) by the same weights: the step scores each token at its
    sequence's settings, so every ratio is 1 and nothing is clipped. The same numbers recorded as raw, or scored at
    temperature 1 as the trainer once did, are far off."""
    model = tiny_causal_lm("llama", dtype=torch.float64, seed=5)
    config = StepConfig(lr=0.0, token_budget=20)
    for top_p in (1.0, 0.8):
        hot = _with_old_logprobs(model, _samples(), 0.5, top_p)
        stats = train_step(model, build_optimizer(model, config), hot, config, 4)
        assert stats.mismatch_max < 1e-9 and stats.ratio_max == pytest.approx(1.0, abs=1e-9), top_p
        assert stats.clip_fraction == 0.0
        as_raw = [{**s, "sequences": [{**r, "logprobs_mode": "raw"} for r in s["sequences"]]} for s in hot]
        off = train_step(model, build_optimizer(model, config), as_raw, config, 4)
        assert off.mismatch_mean > 0.05 and abs(off.ratio_mean - 1.0) > 0.01, top_p


def test_a_non_finite_gradient_changes_no_weight():
    """One NaN advantage that slipped through would make every weight NaN after the optimizer step."""
    model = tiny_causal_lm("llama", seed=8)
    samples = _samples()
    samples[0]["sequences"][0]["advantage"] = float("nan")
    config = StepConfig(lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    stats = train_step(model, build_optimizer(model, config), samples, config, policy_version=5)
    assert stats.grad_norm != stats.grad_norm  # reported as NaN
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_updates_per_batch_reuse_the_batch_weighed_by_the_importance_ratio():
    """`updates=2` is two optimizer updates on one batch: the same weights as two single-update steps in a row, the
    second of which sees ratios away from 1 (the first moved the policy; the recorded log-probs stay the sampling
    policy's). The step's own stats are the first update's (what was sampled against what trained) and
    `per_update` reports each update's: the second's drift shows."""
    base = tiny_causal_lm("llama", dtype=torch.float64, seed=8)
    samples = _with_old_logprobs(base, _samples())
    reused, stepped = (tiny_causal_lm("llama", dtype=torch.float64, seed=8) for _ in range(2))
    two = StepConfig(lr=1e-2, token_budget=20, updates=2)
    one = StepConfig(lr=1e-2, token_budget=20)
    stats = train_step(reused, build_optimizer(reused, two), samples, two, policy_version=5)
    optimizer = build_optimizer(stepped, one)
    first = train_step(stepped, optimizer, samples, one, policy_version=5)
    second = train_step(stepped, optimizer, samples, one, policy_version=5)
    for a, b in zip(reused.parameters(), stepped.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert stats == replace(first, per_update=first.per_update + second.per_update)
    assert first.ratio_mean == pytest.approx(1.0) and first.mismatch_max < 1e-9  # on-policy at the first update
    assert second.mismatch_max > 1e-4 and second.ratio_max > 1.0  # the reuse is off-policy, and weighed so
    assert [u["ratio_max"] for u in stats.per_update] == [first.ratio_max, second.ratio_max]
    assert [u["mismatch_max"] for u in stats.per_update] == [first.mismatch_max, second.mismatch_max]
    assert [u["clip_fraction"] for u in stats.per_update] == [first.clip_fraction, second.clip_fraction]
    assert stats.per_update[1]["grad_norm"] == second.grad_norm and stats.per_update[1]["loss"] == second.loss
    with pytest.raises(ValueError, match="updates must be at least 1"):
        train_step(reused, build_optimizer(reused, one), samples, StepConfig(updates=0), policy_version=5)


def test_a_group_over_the_token_budget_is_split_across_micro_batches_exactly():
    """A budget smaller than a group's tree splits its sequences into runs whose tries fit (a path longer than
    the budget alone, whole); the weights after one step equal those of the unsplit step (float64). The step is
    SGD: HF's RMSNorm rounds through float32, which leaves float64 gradients agreeing to about 1e-9 relative, and
    AdamW's first step (about lr * sign(g)) would turn that rounding in gradients near 0 into differences of lr."""
    prompt = [5, 9, 2, 7, 1, 1]
    big = _sample("big", [prompt + [1, 2, 3], prompt + [1, 2, 4, 4], prompt + [8, 8], prompt + [8, 9], [3] * 13],
                  [6, 6, 6, 6, 2], [1.0, -0.5, -0.5, 0.4, 0.2], 3, 9)
    samples = [big] + _samples()
    tree = sample_tree(big)
    assert tree.num_rows == 27
    runs = split_sequences(tree, 12)
    assert runs == [[0, 1], [2, 3], [4]]  # 11 and 9 rows; the 13-token path alone
    assert [pack([tree.token_ids[tree.paths[i]].tolist() for i in run]).num_rows for run in runs] == [11, 9, 13]
    plan = micro_batch_plan(samples, 12)
    assert [ref["completion_id"] for _, refs in plan for ref in refs][:5] == [f"big-{i}" for i in range(5)]
    assert [forest.num_rows for forest, _ in plan][:3] == [11, 9, 13]
    weights, norms = [], []
    for budget in (12, 10**6):
        model = tiny_causal_lm("qwen2", dtype=torch.float64, seed=7)
        config = StepConfig(lr=1e-2, token_budget=budget, chunk_rows=4, grad_clip=0.0)
        stats = train_step(model, torch.optim.SGD(model.parameters(), lr=config.lr), samples, config, 5)
        assert stats.micro_batches == (len(plan) if budget == 12 else 1)
        weights.append([p.detach().clone() for p in model.parameters()])
        norms.append(stats.grad_norm)
    assert norms[0] == pytest.approx(norms[1], rel=1e-7) and norms[0] > 0.05
    for split, whole in zip(*weights):
        assert float((split - whole).abs().max()) < 1e-10


def test_the_turns_of_a_session_longer_than_the_budget_share_its_longest_turns_pass():
    """A long agent session's turns each extend the last, so they lie on one path. With a budget below that path's
    length, they must not go to micro-batches of their own (each would run the whole prefix again, the square of
    the turns): every turn rides on the pass of the longest, a second session gets its own, and the short turns
    that context management left behind (another branch) theirs. The weights equal the unsplit step's (float64)."""
    prompt = [5, 9, 2, 7, 1, 1]
    body = [3, 8, 4, 4, 6, 2, 9, 9, 1, 5, 7, 3, 3, 8, 2, 6, 4]
    session_a = [prompt + body[:k] for k in (3, 7, 12, 17)]  # each turn a prefix of the next
    session_b = [prompt + [6] + body[:k] for k in (5, 16)]
    summary = [prompt + [2, 2, 9], prompt + [2, 2, 9, 4, 1]]  # a restart after a summary: its own branch
    sequences = session_a + summary + session_b
    sample = _sample("long", sequences, [len(prompt) + 1] * len(sequences),
                     [0.9, -0.3, 0.5, -0.8, 0.2, -0.4, 0.6, -0.1], 3, 11)
    tree = sample_tree(sample)
    assert tree.num_rows == 6 + 17 + 5 + 17 and max(tree.lengths) == 23
    runs = split_sequences(tree, 16)
    assert runs == [[0, 1, 2, 3], [4, 5], [6, 7]]  # each run is one path's rows: no row twice
    plan = micro_batch_plan([sample], 16)
    assert [forest.num_rows for forest, _ in plan] == [23, 11, 23]
    for (forest, refs), run in zip(plan, runs):
        assert [ref["completion_id"] for ref in refs] == [f"long-{i}" for i in run]
        assert [forest.token_ids[forest.paths[j]].tolist() for j in range(len(run))] == [sequences[i] for i in run]
    weights, heard = [], []
    for budget in (16, 10**6):
        model = tiny_causal_lm("llama", dtype=torch.float64, seed=3)
        config = StepConfig(lr=1e-2, token_budget=budget, chunk_rows=5, grad_clip=0.0)
        stats = train_step(model, torch.optim.SGD(model.parameters(), lr=config.lr), [sample], config, 5,
                           progress=heard.append)
        assert stats.micro_batches == (3 if budget == 16 else 1) and stats.grad_norm > 0.01
        weights.append([p.detach().clone() for p in model.parameters()])
    # a long step reports each micro-batch it finished, with the tree rows done so far
    assert [line.split(" s")[0].rsplit(", ", 1)[0] for line in heard] == [
        "micro-batch 1/3 done: 23/57 tree rows", "micro-batch 2/3 done: 34/57 tree rows",
        "micro-batch 3/3 done: 57/57 tree rows", "micro-batch 1/1 done: 45/45 tree rows"]
    for split, whole in zip(*weights):
        assert float((split - whole).abs().max()) < 1e-10
