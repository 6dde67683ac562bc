"""Policy-gradient losses on the per-sequence view: CISPO (MiniMax-M1) and the PPO/GRPO clipped surrogate.

Inputs are per sequence: the current policy's log-probs of its completion tokens (differentiable), the
log-probs recorded at rollout time for the same tokens (`old`), and one advantage per sequence (or one per
token). Both losses use token-mean normalisation: the sum over all completion tokens divided by
`normalizer` (default: the number of completion tokens passed in). Pass the step's total token count as
`normalizer` to accumulate micro-batches into exactly the full-batch gradient.

CISPO: `J = (1 / sum_i |o_i|) * sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) * A_it * log pi(o_it)`,
with `r = exp(logp - old)`. The clipped weight is detached, so every token keeps a gradient. One-sided by
default (`eps_low=None`: no lower bound), as in the paper.
PPO/GRPO: `J = (1 / sum_i |o_i|) * sum_i sum_t min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`, with the dual
clip (Ye et al. 2020; verl's `clip_ratio_c`, default 3.0) where A < 0: there the token's term is
`max(min(r A, clip(r) A), c A)`. Without it a token the policy has made far more likely than it was sampled (r
large) with a negative advantage weighs r A, without bound; with it a token past r = c adds no gradient, so no
token's gradient exceeds c |A|.
The returned loss is `-J` (to minimise). Each loss has its own clip defaults (`LOSS_CLIP`): CISPO (None, 4.0),
PPO (0.2, 0.2).

What `old` is. The engines record the log-probs of the distribution they actually sampled from (after
temperature and top-p: "processed" logprobs, forge_stream.engine.torch_engine.sampling; vLLM `--logprobs-mode
processed_logprobs`), and the gateway stamps that mode, the temperature and top_p on every Completion. So pi_old
is the behaviour policy. The trainer evaluates pi_theta at the same sampling settings (logits / temperature, the
top-p nucleus renormalised: forge_stream.sampled_policy, as verl, slime and prime-rl divide by the temperature), so
the policy optimised is the policy sampled: at the serving weights r = pi_theta / pi_old is 1 at any temperature,
and it measures staleness (weights older than the trainer's) and the engine's numerics alone. CISPO's clip at
1 + eps_high is truncated importance sampling of the behaviour distribution, and its gradient stays unbiased up
to the truncation. Every call also reports how far apart the two are: mean and max |logp - old| over its
tokens, the ratio's mean and max and the share of tokens at a clip bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Clip:
    """Clip bounds of the importance ratio: [1 - low, 1 + high]; low None = no lower bound."""

    low: float | None
    high: float


LOSS_CLIP = {"cispo": Clip(None, 4.0), "ppo": Clip(0.2, 0.2)}
DUAL_CLIP = 3.0  # PPO's dual clip c (verl's clip_ratio_c)


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # scalar, -J
    tokens: int  # completion tokens in this call
    clip_fraction: float  # share of tokens whose ratio hit a clip bound (the dual clip's included)
    ratio_mean: float
    ratio_max: float
    mismatch_mean: float  # mean |logp - old| (train-inference log-prob mismatch)
    mismatch_max: float


def _flatten(
    logprobs: Sequence[torch.Tensor], old_logprobs: Sequence[torch.Tensor], advantages
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate the per-sequence view into per-token tensors (advantages broadcast per sequence)."""
    if not len(logprobs) == len(old_logprobs) == len(advantages):
        raise ValueError("logprobs, old_logprobs and advantages must have one entry per sequence")
    lp = torch.cat([x.reshape(-1) for x in logprobs])
    old_parts, adv_parts = [], []
    for x, old, adv in zip(logprobs, old_logprobs, advantages):
        old = torch.as_tensor(old, dtype=lp.dtype, device=lp.device).reshape(-1)
        if old.numel() != x.numel():
            raise ValueError(f"sequence has {x.numel()} log-probs but {old.numel()} old log-probs")
        old_parts.append(old)
        adv = torch.as_tensor(adv, dtype=lp.dtype, device=lp.device)
        adv_parts.append(adv.expand(x.numel()) if adv.ndim == 0 else adv.reshape(-1))
    return lp, torch.cat(old_parts), torch.cat(adv_parts)


def _clip(ratio: torch.Tensor, eps_low: float | None, eps_high: float) -> torch.Tensor:
    return ratio.clamp(min=None if eps_low is None else 1.0 - eps_low, max=1.0 + eps_high)


def _output(objective_sum: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, gap: torch.Tensor,
            normalizer) -> LossOutput:
    n = ratio.numel()
    denom = float(normalizer if normalizer is not None else max(n, 1))
    return LossOutput(
        loss=-objective_sum / denom,
        tokens=n,
        clip_fraction=float(clipped.float().mean()) if n else 0.0,
        ratio_mean=float(ratio.mean()) if n else 1.0,
        ratio_max=float(ratio.max()) if n else 1.0,
        mismatch_mean=float(gap.mean()) if n else 0.0,
        mismatch_max=float(gap.max()) if n else 0.0,
    )


def cispo_loss(
    logprobs: Sequence[torch.Tensor],
    old_logprobs: Sequence,
    advantages: Sequence,
    *,
    eps_high: float = 4.0,
    eps_low: float | None = None,
    normalizer: int | None = None,
) -> LossOutput:
    """CISPO loss (-J) with a detached, clipped importance weight; one-sided unless eps_low is given."""
    lp, old, adv = _flatten(logprobs, old_logprobs, advantages)
    ratio = torch.exp(lp.detach() - old)
    weight = _clip(ratio, eps_low, eps_high)
    return _output((weight * adv * lp).sum(), ratio, weight != ratio, (lp.detach() - old).abs(), normalizer)


def ppo_clip_loss(
    logprobs: Sequence[torch.Tensor],
    old_logprobs: Sequence,
    advantages: Sequence,
    *,
    eps_low: float | None = 0.2,
    eps_high: float = 0.2,
    clip_ratio_c: float | None = DUAL_CLIP,
    normalizer: int | None = None,
) -> LossOutput:
    """PPO/GRPO clipped surrogate loss (-J) with the dual clip at `clip_ratio_c` for negative advantages (None: no
    dual clip); tokens whose clipped term is the minimum, or the dual clip's floor, get no gradient."""
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"the dual clip's ratio must be above 1, not {clip_ratio_c}")
    lp, old, adv = _flatten(logprobs, old_logprobs, advantages)
    ratio = torch.exp(lp - old)
    clipped_ratio = _clip(ratio, eps_low, eps_high)
    objective = torch.minimum(ratio * adv, clipped_ratio * adv)
    clipped = clipped_ratio.detach() != ratio.detach()
    if clip_ratio_c is not None:
        floor = clip_ratio_c * adv
        dual = (adv < 0) & (objective.detach() < floor)
        objective = torch.where(dual, floor, objective)
        clipped = clipped | dual
    return _output(objective.sum(), ratio.detach(), clipped, (lp.detach() - old).abs(), normalizer)
