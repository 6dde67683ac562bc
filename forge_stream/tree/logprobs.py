"""Per-sequence log-probabilities from one forward pass of a HuggingFace causal LM over a packed tree.

`sequence_logprobs(model, packed)` runs the model's decoder once over the U tree rows (position ids = depth,
attention restricted to ancestors), then `lp[u] = log_softmax(lm_head(h[parent_row[u]]))[token_ids[u]]` for
every non-root row, and returns, for each sequence, lp along its path without its first token: L_i - 1 values,
exactly what N separate forward passes would give. `path_logprobs(model, packed, rows)` scores only the given
rows (a trainer's completion tokens): the LM head runs on those rows alone, in checkpointed chunks, so the
U x vocab logits never exist at once, in forward or backward. A branch row feeds several children; autograd
sums their gradients. Given each row's sampling temperature and top_p, `path_logprobs` scores a token under the
distribution it was sampled from (forge_stream.sampled_policy.processed_logprobs: logits / temperature, then the
top-p nucleus renormalised); without them, and everywhere else here, at temperature 1.

Supported: decoder-only models whose causal-LM forward is `lm_head(base_model(...).last_hidden_state)`
(Llama, Qwen2, Mistral and their relatives), RoPE with any GQA ratio. The model is not modified: its
attention implementation is switched to a registered tree function for the duration of the call.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Iterator, Literal

import torch
from torch.utils.checkpoint import checkpoint

from forge_stream.sampled_policy import processed_logprobs
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
    rows = torch.cat([path[1:] for path in packed.paths])
    lp = path_logprobs(model, packed, rows, backend=backend, chunk_rows=chunk_rows, head_rows=head_rows)
    return list(lp.split([len(path) - 1 for path in packed.paths]))


def path_logprobs(
    model: torch.nn.Module,
    packed: PackedTree,
    rows: torch.Tensor,
    *,
    backend: Backend = "auto",
    chunk_rows: int = 256,
    head_rows: int = 1024,
    checkpoint_layers: bool = False,
    temperature: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """(len(rows),) log-prob of the token of each given non-root row given its path prefix; rows may repeat.

    `temperature`, `top_p`: (len(rows),) the sampling settings to score each entry at (default 1: the model's
    own distribution). The LM head runs on the distinct (row, settings) pairs only (a trainer asks for the
    completion rows, not the prompt's), and their values are indexed once into the result, so no per-sequence
    copy of anything U-sized is made. `checkpoint_layers`: see `tree_hidden_states`.
    """
    ones = torch.ones(len(rows), dtype=torch.float64)
    settings = torch.stack([ones if temperature is None else torch.as_tensor(temperature, dtype=torch.float64),
                            ones if top_p is None else torch.as_tensor(top_p, dtype=torch.float64)], dim=1)
    distinct, setting = torch.unique(settings, dim=0, return_inverse=True)
    keys, inverse = torch.unique(rows * len(distinct) + setting, return_inverse=True)
    unique, chosen = keys // len(distinct), distinct[keys % len(distinct)]
    if bool((packed.parent_row[unique] < 0).any()):
        raise ValueError("a root row has no prefix to score its token with")
    hidden = tree_hidden_states(model, packed, backend=backend, chunk_rows=chunk_rows,
                                checkpoint_layers=checkpoint_layers)
    lp = _head_logprobs_at(model, packed, hidden, unique, head_rows, chosen[:, 0], chosen[:, 1])
    return lp[inverse.to(hidden.device)]


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
    children = torch.nonzero(packed.parent_row >= 0).flatten()
    ones = torch.ones(len(children), dtype=torch.float64)
    lp = _head_logprobs_at(model, packed, hidden, children, head_rows, ones, ones)
    return lp.new_zeros(packed.num_rows).index_put((children.to(hidden.device),), lp)


def _head_logprobs_at(
    model: torch.nn.Module, packed: PackedTree, hidden: torch.Tensor, rows: torch.Tensor, head_rows: int,
    temperature: torch.Tensor, top_p: torch.Tensor,
) -> torch.Tensor:
    """Log-probs of the tokens of `rows` (non-root) from their parents' hidden states at each row's temperature
    and top_p, `head_rows` rows at a time through a checkpointed LM head, so at most head_rows x vocab logits
    exist, in forward and in backward."""
    head = model.get_output_embeddings()
    device = hidden.device
    parents = packed.parent_row[rows].to(device)
    targets = packed.token_ids[rows].to(device)
    # One gather for all parent rows, then split (whose backward is a single concatenation), so no chunk
    # creates a U-sized gradient of its own.
    parent_hidden = hidden[parents].split(head_rows)
    chunks = zip(parent_hidden, targets.split(head_rows), temperature.to(device).split(head_rows),
                 top_p.to(device).split(head_rows))
    pieces = []
    for h, t, temp, p in chunks:
        if h.requires_grad:
            pieces.append(checkpoint(_head_logprobs, head, h, t, temp, p, use_reentrant=False))
        else:
            pieces.append(_head_logprobs(head, h, t, temp, p))
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    # No rows: an empty slice of the hidden states, still on the graph, so a backward pass runs as usual.
    return torch.cat(pieces) if pieces else hidden[:0, 0].to(out_dtype)


def _head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the log-prob of the target under head(hidden) at the row's temperature and top_p, computed in at
    least float32."""
    return processed_logprobs(head(hidden), targets, temperature, top_p)


def tree_hidden_states(
    model: torch.nn.Module,
    packed: PackedTree,
    *,
    backend: Backend = "auto",
    chunk_rows: int = 256,
    checkpoint_layers: bool = False,
) -> torch.Tensor:
    """(U, hidden) final hidden states of the decoder run once over the tree rows.

    `checkpoint_layers`: keep only each decoder layer's input for backward and recompute the layer there
    (torch.utils.checkpoint), so saved activations are one layer's plus a hidden state per layer and row, for
    about one more forward pass.
    """
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
    with _attn_implementation(model, impl), _checkpointed_layers(model, impl, checkpoint_layers):
        out = model.base_model(input_ids=ids, position_ids=pos, use_cache=False, **extra)
    return out.last_hidden_state[0]


@contextmanager
def _checkpointed_layers(model: torch.nn.Module, impl: str, enabled: bool) -> Iterator[None]:
    """Run each decoder layer under torch.utils.checkpoint for the duration of the call. The recomputation in
    backward happens after the call, so it switches the attention implementation to the tree's again."""
    layers = list(model.base_model.layers) if enabled and torch.is_grad_enabled() else []
    shadowed = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        layer.forward = partial(checkpoint, partial(_layer_forward, model, impl, layer.forward), use_reentrant=False)
    try:
        yield
    finally:
        for layer, previous in zip(layers, shadowed):
            del layer.forward
            if previous is not None:
                layer.forward = previous


def _layer_forward(model: torch.nn.Module, impl: str, forward, *args, **kwargs):
    with _attn_implementation(model, impl):
        return forward(*args, **kwargs)


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
