"""The probe both engines run on a policy version before they serve it: the log-probs of a fixed token sequence
(`probe_ids`), which must be finite (a version whose weights hold NaN or inf is refused), and in vLLM must also equal
the checkpoint's own under transformers within the tolerance of the served dtype
(forge_stream.engine.vllm_front.reference_probe).

The tolerance follows the dtype: two implementations of one model (vLLM's kernels and transformers') each round at
the dtype's precision. SmolLM2-135M on the probe sequence, transformers on a CPU against its own float32: up to
0.26 nats in bfloat16 (0.06 on average), 0.045 in float16; vLLM's float32 CPU kernels agree with transformers to
about 1e-5. Each tolerance is about twice the measured gap.
"""

from __future__ import annotations

import math

PROBE_TOKENS = 48  # prompt positions whose log-probs prove a load
TOLERANCE_NATS = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.5}


def probe_ids(vocab_size: int, n: int = PROBE_TOKENS) -> list[int]:
    """A fixed token sequence spread over the vocabulary (the same for every version)."""
    return [(17 + 7919 * i) % vocab_size for i in range(n)]


def tolerance(dtype: str) -> float:
    """The largest difference in nats allowed between two implementations' probe log-probs in `dtype`."""
    try:
        return TOLERANCE_NATS[dtype]
    except KeyError:
        raise ValueError(f"no probe tolerance for dtype {dtype!r}; serve one of {', '.join(TOLERANCE_NATS)}, or "
                         "turn the probe off (--no-probe)") from None


def model_logprob_rows(model, ids: list[int]):
    """log p(. | ids[:i]) for i in 1..len(ids) under a transformers causal LM (on its own device): a (len(ids),
    vocab) float32 tensor."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float().log_softmax(-1)


def logprobs_from_rows(rows, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, read from model_logprob_rows(model, ids)."""
    return [rows[i - 1, ids[i]].item() for i in range(1, len(ids))]


def model_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 under a transformers causal LM (on its own device)."""
    return logprobs_from_rows(model_logprob_rows(model, ids), ids)


def not_finite(logprobs: list[float]) -> str | None:
    """Why `logprobs` prove nothing (some are NaN or infinite), or None."""
    bad = [i + 1 for i, lp in enumerate(logprobs) if not math.isfinite(lp)]
    if bad:
        return (f"its probe log-probs are not finite at {len(bad)} of {len(logprobs)} positions (from position "
                f"{bad[0]}): its weights hold NaN or inf")
    return None


def worst_difference(got: list[float], expected: list[float], dtype: str) -> tuple[float, str | None]:
    """The largest difference between two implementations' probe log-probs, and why they do not match (None: they
    do): a non-finite value, or a difference past the dtype's tolerance."""
    problem = not_finite(got) or not_finite(expected)
    if problem is not None:
        return math.inf, problem
    worst = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    if worst > tolerance(dtype):
        return worst, (f"probe log-probs differ from the checkpoint's by up to {worst:.3g} nats (the {dtype} "
                       f"tolerance: {tolerance(dtype):g})")
    return worst, None
