"""The distribution a token is sampled from, computed once for the engine that samples it and the trainer that
scores it: the logits divided by the temperature, then, for top_p < 1, only the top-p nucleus, renormalised.

vLLM 0.32 (`vllm/v1/sample`) does the same in float32: `logits / temperature`, then its top-p rule (sort the
row ascending, softmax, cumulative sum, drop every token whose cumulative mass is at most 1 - top_p, always keep
the most likely one) and, with `--logprobs-mode processed_logprobs`, reports `log_softmax` of what is left.
`nucleus_logits` follows that rule and that arithmetic (the same sort, the same comparison against `1 - top_p`
in float32), so a token at the nucleus's edge falls on the same side in both. A token is kept exactly when the
mass of the tokens more likely than it is below top_p.

`recorded_settings` says at which settings a recorded log-prob was computed: a 'processed' one at the request's
temperature and top_p, a 'raw' one (or any greedy one: temperature below vLLM's 1e-5, our engine's 0) at
temperature 1 with no nucleus. The trainer scores each token at those settings, so at the serving weights its
log-probs are the recorded ones and every importance ratio starts at 1, whatever the temperature.

Gradients: the division by the temperature is differentiable; the nucleus is chosen without gradient, so the
logits it drops get none (they are -inf in the softmax) and the kept ones get that of the renormalised softmax:
the nucleus is a constant set for the backward pass, as it is for the sampler.
"""

from __future__ import annotations

import torch

# vLLM's _SAMPLING_EPS: a request with a lower temperature is decoded greedily (its top_p is set to 1).
GREEDY_BELOW = 1e-5


def recorded_settings(temperature: float, top_p: float, logprobs_mode: str) -> tuple[float, float]:
    """The (temperature, top_p) of the distribution whose log-probs an engine recorded for a completion.

    >>> recorded_settings(0.7, 0.9, "processed"), recorded_settings(0.7, 0.9, "raw")
    ((0.7, 0.9), (1.0, 1.0))
    >>> recorded_settings(0.0, 0.9, "processed")
    (1.0, 1.0)
    """
    if logprobs_mode != "processed" or temperature < GREEDY_BELOW:
        return 1.0, 1.0
    return temperature, top_p


def processed_logits(logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor = 1.0,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, vocab) logits over each row's temperature, -inf outside each row's top-p nucleus (top_p < 1).

    temperature, top_p: one value, or one per row. `keep`: one token per row kept whatever the nucleus says (a
    trainer scoring a sampled token: at weights other than the sampling ones the token may fall outside; it is
    then scored against the nucleus plus itself, a finite log-prob, instead of -inf).
    """
    temperature = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device)
    if bool((temperature == 1.0).all()):  # x / 1 is x: no copy of the logits
        scaled = logits
    else:
        scaled = logits / (temperature[:, None] if temperature.ndim else temperature)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device).expand(logits.shape[0])
    rows = torch.nonzero(top_p < 1.0).flatten()
    if rows.numel() == 0:
        return scaled
    with torch.no_grad():
        dropped = torch.zeros_like(scaled, dtype=torch.bool)
        dropped[rows] = outside_nucleus(scaled[rows], top_p[rows])
        if keep is not None:
            dropped[rows, keep.to(logits.device)[rows]] = False
    return scaled.masked_fill(dropped, float("-inf"))


def outside_nucleus(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) True where a token of temperature-scaled logits is outside its row's top-p nucleus: its
    cumulative probability, summed from the least likely token up, is at most 1 - top_p (float32 top_p). The most
    likely token is always in."""
    ascending, order = scaled.sort(dim=-1, descending=False)
    mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = mass <= (1.0 - top_p.to(torch.float32))[:, None]
    drop[:, -1] = False
    return torch.empty_like(drop).scatter_(-1, order, drop)


def processed_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor,
                       top_p: float | torch.Tensor = 1.0) -> torch.Tensor:
    """(rows,) log-prob of each row's target token under its processed distribution (`processed_logits`, the
    target always kept), computed in at least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scored = processed_logits(logits, temperature, top_p, keep=targets)
    return torch.log_softmax(scored, dim=-1).gather(1, targets[:, None]).squeeze(1)
