"""Token choice for one sequence: temperature, top-p, a per-sequence seeded generator, and the logprobs we report.

Decision: the reported logprobs are those of the distribution actually sampled from (`logprobs_mode=
"processed"`, the default): the log-softmax after temperature and top-p, like vLLM's `--logprobs-mode
processed_logprobs`, computed by the function the trainer scores tokens with (forge_stream.sampled_policy, vLLM's
top-p rule). They are the behaviour policy's probabilities, and the trainer scores each token at the same
settings, so at the serving weights pi_theta / pi_old is 1 and it measures staleness alone (see
forge_stream.trainer.losses). `logprobs_mode="raw"` reports the log-softmax of the model's raw logits
(temperature 1, no top-p), vLLM's default `raw_logprobs`. Greedy decoding (temperature 0) reports raw
logprobs in both modes.
"""

from dataclasses import dataclass, field
from typing import Literal

import torch

from forge_stream.sampled_policy import processed_logits

LogprobsMode = Literal["raw", "processed"]
# A positive temperature below this is refused: float32 logits divided by it overflow to inf, and softmax gives
# NaN. (0 means greedy decoding.)
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class SamplingParams:
    """What one choice may generate and how it picks tokens."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class Choice:
    """One sampled token with its logprob and the top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())


def make_generator(seed: int | None, choice_index: int) -> torch.Generator:
    """A CPU generator for one choice: `seed + choice_index` when seeded (vLLM's rule for n > 1)."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed((seed + choice_index) % (2**63))
    return gen


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           mode: LogprobsMode = "processed") -> Choice:
    """Pick the next token from one row of float32 logits and report its logprob (see module docstring)."""
    raw = torch.log_softmax(logits, dim=-1)
    if params.temperature == 0.0:
        token = int(torch.argmax(logits))
        reported = raw
    else:
        scaled = processed_logits(logits[None], params.temperature, params.top_p)
        probs = torch.softmax(scaled[0], dim=-1)
        token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        reported = raw if mode == "raw" else torch.log_softmax(scaled, dim=-1)[0]
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs > 0:
        values, ids = torch.topk(reported, min(params.top_logprobs, reported.numel()))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return Choice(token_id=token, logprob=float(reported[token]), top=top)
