"""Tree attention for HuggingFace models: attention functions registered in transformers' AttentionInterface.

Three ways to attend over a packed tree (row q sees row k iff `k <= q <= subtree_end[k]`):

* `ancestor` (CPU default): rows are cut into chunks [a, b). In DFS pre-order every key a row of the chunk
  may see is either an ancestor of row a or a row of the chunk itself, so each chunk gathers K/V of
  `ancestors(a) + [a, b)` and runs masked SDPA on that small block. Work is about sum(depth + chunk) over
  rows, never U x U; a chunk's key rows and mask are derived when it runs, so memory beyond the activations
  is one chunk's, at most chunk x (depth + chunk). A custom autograd function recomputes each chunk in
  backward and scatters its K/V gradients into one buffer, so saved activations stay O(U) per layer.
* `flex` (GPU default): `flex_attention` with a BlockMask built once per batch from the same predicate, compiled
  on CUDA. It also runs eagerly on CPU (dense, slow), which is how its logic is tested without a GPU.
* `dense`: a 4D boolean U x U mask handed to the model's own SDPA; the reference in tests.

The tree layout reaches the attention function as a keyword argument of the model's forward (transformers
passes unknown kwargs down to the attention interface).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

import torch
import torch.nn.functional as F

from forge_stream.tree.pack import PackedTree

ANCESTOR_IMPL = "forge_tree_ancestor"
FLEX_IMPL = "forge_tree_flex"
PLAN_KWARG = "forge_tree_plan"
BLOCK_MASK_KWARG = "forge_tree_block_mask"


@dataclass(frozen=True)
class AncestorPlan:
    """Chunks of query rows [a, b); each chunk's keys (the ancestors of its first row + its own rows) and their
    visibility for each query row are derived when the chunk runs (`chunks`), never stored: on one long path
    they add up to about U^2 / 2 key rows, while one chunk's are at most chunk x (depth + chunk) booleans."""

    starts: tuple[int, ...]
    num_rows: int
    subtree_end: torch.Tensor  # (U,) CPU
    position_ids: torch.Tensor  # (U,) CPU: a row's depth is its number of ancestors
    device: torch.device

    def chunks(self) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(a, b, key rows, visible (b - a, keys)) of each chunk, on the plan's device."""
        end = self.subtree_end
        for a, b in zip(self.starts, self.starts[1:] + (self.num_rows,)):
            rows = torch.cat([torch.nonzero(end[:a] >= a).flatten(), torch.arange(a, b)])
            q_rows = torch.arange(a, b)
            visible = (rows[None, :] <= q_rows[:, None]) & (end[rows][None, :] >= q_rows[:, None])
            yield a, b, rows.to(self.device), visible.to(self.device)

    @property
    def attended_pairs(self) -> int:
        """(query row, key row) pairs scored: the work measure, about sum(depth + chunk) over rows."""
        stops = self.starts[1:] + (self.num_rows,)
        return sum((b - a) * (int(self.position_ids[a]) + b - a) for a, b in zip(self.starts, stops))


def ancestor_plan(packed: PackedTree, chunk_rows: int, device: torch.device) -> AncestorPlan:
    """Cut the rows into chunks of `chunk_rows` (each chunk's keys are found when it runs)."""
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be >= 1")
    starts = tuple(range(0, packed.num_rows, chunk_rows))
    return AncestorPlan(starts, packed.num_rows, packed.subtree_end, packed.position_ids, device)


def _chunk_attention(q, k, v, visible, scaling, gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scaling, enable_gqa=gqa)


class _AncestorAttention(torch.autograd.Function):
    """Chunked ancestor attention whose backward recomputes each chunk and scatters its K/V gradients into
    one buffer (index_add_), so neither gathered K/V nor attention weights are kept, and no chunk creates a
    U-sized gradient of its own."""

    @staticmethod
    def forward(ctx, query, key, value, plan, scaling, gqa):
        ctx.save_for_backward(query, key, value)
        ctx.plan, ctx.scaling, ctx.gqa = plan, scaling, gqa
        return _forward_chunks(query, key, value, plan, scaling, gqa)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value = ctx.saved_tensors
        plan = ctx.plan
        dq = torch.empty_like(query)
        dk = torch.zeros_like(key)
        dv = torch.zeros_like(value)
        for a, b, rows, visible in plan.chunks():
            with torch.enable_grad():
                q = query[:, :, a:b].detach().requires_grad_()
                k = key[:, :, rows].detach().requires_grad_()
                v = value[:, :, rows].detach().requires_grad_()
                out = _chunk_attention(q, k, v, visible, ctx.scaling, ctx.gqa)
                gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad_out[:, :, a:b])
            dq[:, :, a:b] = gq
            dk.index_add_(2, rows, gk)
            dv.index_add_(2, rows, gv)
        return dq, dk, dv, None, None, None


def _forward_chunks(query, key, value, plan, scaling, gqa):
    outputs = [
        _chunk_attention(query[:, :, a:b], key[:, :, rows], value[:, :, rows], visible, scaling, gqa)
        for a, b, rows, visible in plan.chunks()
    ]
    return torch.cat(outputs, dim=2)


def ancestor_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query (1, H, U, D), key/value (1, Hkv, U, D) -> output (1, U, H, D)."""
    plan: AncestorPlan = kwargs[PLAN_KWARG]
    if query.shape[0] != 1 or dropout:
        raise ValueError("tree attention takes one packed row batch and no attention dropout")
    gqa = query.shape[1] != key.shape[1]
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        out = _AncestorAttention.apply(query, key, value, plan, scaling, gqa)
    else:
        out = _forward_chunks(query, key, value, plan, scaling, gqa)
    return out.transpose(1, 2).contiguous(), None


def block_mask(packed: PackedTree, device: torch.device):
    """flex_attention BlockMask of the tree predicate, built once per batch and shared by all layers."""
    from torch.nn.attention.flex_attention import create_block_mask

    end = packed.subtree_end.to(device)

    def tree_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx <= end[kv_idx])

    n = packed.num_rows
    return create_block_mask(tree_mask, None, None, n, n, device=device)


@lru_cache(maxsize=None)
def _flex_kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


def flex_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function running flex_attention with the batch's tree BlockMask (compiled on CUDA)."""
    if dropout:
        raise ValueError("tree attention takes no attention dropout")
    kernel = _flex_kernel(query.is_cuda)
    out = kernel(
        query,
        key,
        value,
        block_mask=kwargs[BLOCK_MASK_KWARG],
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def dense_mask(packed: PackedTree, device: torch.device) -> torch.Tensor:
    """The tree predicate as a 4D boolean (1, 1, U, U) mask: the U x U reference, for tests only."""
    rows = torch.arange(packed.num_rows, device=device)
    end = packed.subtree_end.to(device)
    visible = (rows[None, :] <= rows[:, None]) & (end[None, :] >= rows[:, None])
    return visible[None, None]


@lru_cache(maxsize=None)
def register() -> None:
    """Register the tree attention functions with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ANCESTOR_IMPL, ancestor_attention)
    AttentionInterface.register(FLEX_IMPL, flex_tree_attention)
