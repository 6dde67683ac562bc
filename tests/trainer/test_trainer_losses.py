"""CISPO and PPO/GRPO losses: values and gradients against the formulas written out token by token."""

import math

import pytest
import torch

from forge_stream.trainer.losses import cispo_loss, ppo_clip_loss

OLD = [[-1.0, -2.0, -0.5], [-0.1], [-3.0, -0.2]]
NEW = [[-0.2, -2.1, -4.0], [-0.05], [-1.0, -0.3]]  # ratios from e^-3.5 to e^2
ADV = [1.5, -0.7, 0.4]


def _leaves():
    return [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in NEW]


def _tokens():
    for i, (new, old) in enumerate(zip(NEW, OLD)):
        for t, (n, o) in enumerate(zip(new, old)):
            yield i, t, n, o, ADV[i]


N_TOKENS = sum(len(x) for x in NEW)


@pytest.mark.parametrize("eps_low,eps_high", [(None, 4.0), (None, 0.5), (0.2, 0.28)])
def test_cispo_value_and_gradient_match_formula(eps_low, eps_high):
    leaves = _leaves()
    out = cispo_loss(leaves, OLD, ADV, eps_low=eps_low, eps_high=eps_high)
    out.loss.backward()
    lo = -math.inf if eps_low is None else 1 - eps_low
    expected, clipped = 0.0, 0
    for i, t, n, o, a in _tokens():
        r = math.exp(n - o)
        w = min(max(r, lo), 1 + eps_high)
        clipped += w != r
        expected -= w * a * n / N_TOKENS
        # the weight is detached: d(-J)/d logp = -w * A / N, never zero
        assert leaves[i].grad[t].item() == pytest.approx(-w * a / N_TOKENS, rel=1e-12)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.tokens == N_TOKENS
    assert out.clip_fraction == pytest.approx(clipped / N_TOKENS)


def test_cispo_is_one_sided_by_default():
    tiny = math.exp(-3.5)  # third token of the first sequence: ratio far below 1
    leaves = _leaves()
    cispo_loss(leaves, OLD, ADV).loss.backward()
    assert leaves[0].grad[2].item() == pytest.approx(-tiny * ADV[0] / N_TOKENS, rel=1e-12)
    leaves = _leaves()
    cispo_loss(leaves, OLD, ADV, eps_low=0.2).loss.backward()
    assert leaves[0].grad[2].item() == pytest.approx(-0.8 * ADV[0] / N_TOKENS, rel=1e-12)


@pytest.mark.parametrize("eps,c", [(0.2, 3.0), (0.1, 3.0), (0.2, 1.01), (0.2, None)])
def test_ppo_clip_value_and_gradient_match_formula(eps, c):
    leaves = _leaves()
    out = ppo_clip_loss(leaves, OLD, ADV, eps_low=eps, eps_high=eps, clip_ratio_c=c)
    out.loss.backward()
    expected, clipped = 0.0, 0
    for i, t, n, o, a in _tokens():
        r = math.exp(n - o)
        rc = min(max(r, 1 - eps), 1 + eps)
        term = min(r * a, rc * a)
        dual = c is not None and a < 0 and term < c * a
        expected -= (c * a if dual else term) / N_TOKENS
        clipped += rc != r or dual
        grad = -r * a / N_TOKENS if r * a <= rc * a and not dual else 0.0
        assert leaves[i].grad[t].item() == pytest.approx(grad, rel=1e-12, abs=1e-15)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.clip_fraction == pytest.approx(clipped / N_TOKENS)


def test_ppo_dual_clip_bounds_the_gradient_of_a_negative_advantage():
    """A < 0 and a ratio far past the clip: the plain clipped surrogate takes r * A (its min), whose gradient grows
    with r without bound; the dual clip holds the term at c * A, so that token adds no gradient and none exceeds
    c * |A| / N."""
    old = [[-8.0, -1.0, -1.0]]
    new = [[-1.0, -0.9, -1.5]]  # ratios e^7 ~ 1097 (>> 3), e^0.1 (inside the clip), e^-0.5 (< 1 - eps)
    advantage = [-1.0]

    def grads(**kwargs):
        leaves = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in new]
        out = ppo_clip_loss(leaves, old, advantage, **kwargs)
        out.loss.backward()
        return leaves[0].grad, out

    unbounded, _ = grads(clip_ratio_c=None)
    assert unbounded[0].item() == pytest.approx(math.exp(7.0) / 3, rel=1e-12)  # -(r * A) / N: about 366
    bounded, out = grads()
    assert bounded[0].item() == 0.0
    assert bounded[1].item() == pytest.approx(math.exp(0.1) / 3, rel=1e-12)  # the ordinary PPO gradient
    assert bounded.abs().max().item() <= 3.0 * 1.0 / 3
    assert out.loss.item() == pytest.approx(-(3.0 * -1.0 + math.exp(0.1) * -1.0 + 0.8 * -1.0) / 3, rel=1e-12)
    assert out.clip_fraction == pytest.approx(2 / 3)  # the dual-clipped token and the one under 1 - eps
    with pytest.raises(ValueError, match="above 1"):
        grads(clip_ratio_c=1.0)


def test_per_token_advantages_and_external_normalizer():
    leaves = _leaves()
    per_token = [torch.full((len(x),), a, dtype=torch.float64) for x, a in zip(NEW, ADV)]
    a = cispo_loss(leaves, OLD, per_token, normalizer=100).loss
    b = cispo_loss(_leaves(), OLD, ADV).loss
    assert a.item() == pytest.approx(b.item() * N_TOKENS / 100, rel=1e-12)


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError):
        cispo_loss(_leaves(), [[-1.0], [-0.1], [-3.0, -0.2]], ADV)
    with pytest.raises(ValueError):
        ppo_clip_loss(_leaves(), OLD, ADV[:2])
