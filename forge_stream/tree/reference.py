"""What the tree is checked and benchmarked against: unshared forward passes, and tiny random models.

* `separate_logprobs`: N separate forward passes of the HuggingFace model, one per sequence (the definition of
  exact).
* `padded_logprobs`: the fastest unshared baseline: sequences sorted by length and run in right-padded batches
  under a token budget, with the model's own causal attention and full logits.
* `tiny_causal_lm`: a randomly initialised Llama/Qwen2/Mistral model built from a config (no weights
  downloaded), dropout off, for tests and benchmarks.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from forge_stream.sampled_policy import processed_logprobs

Family = Literal["llama", "qwen2", "mistral"]


def tiny_causal_lm(
    family: Family = "llama",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 32768,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> torch.nn.Module:
    """A random-init causal LM of the given family (GQA when num_kv_heads < num_heads), in eval mode."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[family]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return model_cls(config).to(dtype).eval()


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits[t]) at tokens[t + 1], in at least float32: (L - 1,) from (L, V) and (L,)."""
    logits = logits[:-1].to(torch.promote_types(logits.dtype, torch.float32))
    return logits.gather(1, tokens[1:, None]).squeeze(1) - torch.logsumexp(logits, dim=1)


def separate_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Log-probs of tokens 1..L_i-1 of each sequence from its own forward pass (N passes, no sharing)."""
    device = model.get_input_embeddings().weight.device
    out = []
    for seq in sequences:
        ids = torch.tensor(list(seq), dtype=torch.long, device=device)
        out.append(_token_logprobs(model(input_ids=ids[None], use_cache=False).logits[0], ids))
    return out


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length, cut into batches whose padded size (count x longest) fits `batch_tokens`."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def padded_batch_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0,
                          top_p: float = 1.0) -> list[torch.Tensor]:
    """One right-padded batch through the model's own causal attention with full logits. No padding mask is
    needed: pads come after every real token, and causal attention never lets a real token see them, so SDPA
    keeps its fastest (is_causal, mask-free) kernel. At a `temperature` or `top_p` other than 1, each token is
    scored under the processed distribution it was sampled from (forge_stream.sampled_policy), as the trainer does."""
    device = model.get_input_embeddings().weight.device
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    for j, seq in enumerate(sequences):
        ids[j, : len(seq)] = torch.tensor(list(seq), device=device)
    logits = model(input_ids=ids, use_cache=False).logits
    if temperature == 1.0 and top_p == 1.0:
        return [_token_logprobs(logits[j, : len(seq)], ids[j, : len(seq)]) for j, seq in enumerate(sequences)]
    return [processed_logprobs(logits[j, : len(seq) - 1], ids[j, 1: len(seq)], temperature, top_p)
            for j, seq in enumerate(sequences)]


def padded_logprobs(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, batch_tokens: int = 16384
) -> list[torch.Tensor]:
    """Unshared baseline: length-sorted, right-padded batches of at most `batch_tokens` padded tokens."""
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for batch in length_batches([len(s) for s in sequences], batch_tokens):
        for i, lp in zip(batch, padded_batch_logprobs(model, [sequences[i] for i in batch])):
            out[i] = lp
    return out
