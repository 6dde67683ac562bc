"""Per-sequence log-probabilities from one forward pass of a HuggingFace causal LM over a packed tree.

`sequence_logprobs(model, packed)` runs the model's decoder once over the U tree rows (position ids = depth,
attention restricted to ancestors), then `lp[u] = log_softmax(lm_head(h[parent_row[u]]))[token_ids[u]]` for
every non-root row, and returns, for each sequence, lp along its path without its first token: L_i - 1 values,
exactly what N separate forward passes would give. The LM head runs in checkpointed chunks of rows, so the
U x vocab logits are never held for backward. A branch row feeds several children; autograd sums their
gradients.

Supported: decoder-only models whose causal-LM forward is `lm_head(base_model(...).last_hidden_state)`
(Llama, Qwen2, Mistral and their relatives), RoPE with any GQA ratio. The model is not modified: its
attention implementation is switched to a registered tree function for the duration of the call.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Literal

import torch
from torch.utils.checkpoint import checkpoint

from forge_stream.tree import attention
from forge_stream.tree.pack import PackedTree

Backend = Literal["auto", "ancestor", "flex", "dense"]


def sequence_logprobs(
    model: torch.nn.Module,
    packed: PackedTree,
    *,
    backend: Backend = "auto",
    chunk_rows: int = 256,
    head_rows: int = 1024,
) -> list[torch.Tensor]:
    """Log-probs of tokens 1..L_i-1 of every packed sequence i given its prefix (element i has L_i - 1 values).

    backend: "ancestor" (CPU default, work ~ sum of row depths), "flex" (CUDA default, compiled flex_attention
    with a BlockMask), "dense" (U x U mask; a reference for tests). Differentiable w.r.t. the model parameters.
    """
    row_lp = row_logprobs(model, packed, backend=backend, chunk_rows=chunk_rows, head_rows=head_rows)
    rows = torch.cat([path[1:] for path in packed.paths]).to(row_lp.device)
    return list(row_lp[rows].split([len(path) - 1 for path in packed.paths]))


def row_logprobs(
    model: torch.nn.Module,
    packed: PackedTree,
    *,
    backend: Backend = "auto",
    chunk_rows: int = 256,
    head_rows: int = 1024,
) -> torch.Tensor:
    """(U,) log-prob of each row's token given its path prefix; 0 at root rows (which have no prefix)."""
    hidden = tree_hidden_states(model, packed, backend=backend, chunk_rows=chunk_rows)
    head = model.get_output_embeddings()
    device = hidden.device
    children = torch.nonzero(packed.parent_row >= 0).flatten().to(device)
    parents = packed.parent_row.to(device)[children]
    targets = packed.token_ids.to(device)[children]
    # One gather for all parent rows, then split (whose backward is a single concatenation), so no chunk
    # creates a U-sized gradient of its own.
    parent_hidden = hidden[parents].split(head_rows)
    pieces = []
    for h, t in zip(parent_hidden, targets.split(head_rows)):
        if h.requires_grad:
            pieces.append(checkpoint(_head_logprobs, head, h, t, use_reentrant=False))
        else:
            pieces.append(_head_logprobs(head, h, t))
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    row_lp = torch.zeros(packed.num_rows, dtype=out_dtype, device=device)
    if pieces:
        row_lp = row_lp.index_put((children,), torch.cat(pieces))
    return row_lp


def _head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(head(hidden))[targets] per row, computed in at least float32."""
    logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=1)


def tree_hidden_states(
    model: torch.nn.Module, packed: PackedTree, *, backend: Backend = "auto", chunk_rows: int = 256
) -> torch.Tensor:
    """(U, hidden) final hidden states of the decoder run once over the tree rows."""
    device = model.get_input_embeddings().weight.device
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "ancestor"
    ids = packed.token_ids.to(device)[None]
    pos = packed.position_ids.to(device)[None]
    extra: dict = {}
    if backend == "ancestor":
        impl = attention.ANCESTOR_IMPL
        extra[attention.PLAN_KWARG] = attention.ancestor_plan(packed, chunk_rows, device)
    elif backend == "flex":
        impl = attention.FLEX_IMPL
        extra[attention.BLOCK_MASK_KWARG] = attention.block_mask(packed, device)
    elif backend == "dense":
        impl = "sdpa"
        extra["attention_mask"] = attention.dense_mask(packed, device)
    else:
        raise ValueError(f"unknown tree attention backend {backend!r}")
    attention.register()
    with _attn_implementation(model, impl):
        out = model.base_model(input_ids=ids, position_ids=pos, use_cache=False, **extra)
    return out.last_hidden_state[0]


@contextmanager
def _attn_implementation(model: torch.nn.Module, impl: str) -> Iterator[None]:
    """Switch the attention function the model's layers look up in its config, and restore it afterwards."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = impl
    try:
        yield
    finally:
        config._attn_implementation = previous
