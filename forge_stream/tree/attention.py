"""Tree attention for HuggingFace models: attention functions registered in transformers' AttentionInterface.

Three ways to attend over a packed tree (row q sees row k iff `k <= q <= subtree_end[k]`):

* `ancestor` (CPU default): rows are cut into chunks [a, b). In DFS pre-order every key a row of the chunk
  may see is either an ancestor of row a or a row of the chunk itself. The ancestors every row of the chunk
  sees (on a long path, the whole prefix) are attended without a mask by the CPU flash-attention kernel; the
  others and the chunk's own rows with a small mask; the two parts merge exactly by their logsumexps. Work is
  about sum(depth + chunk) over rows, never U x U; a chunk's key rows and mask are derived when it runs, so
  memory beyond the activations is one chunk's. A custom autograd function keeps the output and logsumexp
  (O(U) per layer) and runs the flash backward kernel per chunk and part, scattering K/V gradients into one
  buffer.
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

from forge_stream.tree.pack import PackedTree

ANCESTOR_IMPL = "forge_tree_ancestor"
FLEX_IMPL = "forge_tree_flex"
PLAN_KWARG = "forge_tree_plan"
BLOCK_MASK_KWARG = "forge_tree_block_mask"


@dataclass(frozen=True)
class Chunk:
    """Query rows [a, b) and their keys in two parts: `shared` rows every query row sees (the ancestors of a that
    are ancestors of b - 1 too: on a long path, the whole prefix), attended without a mask; `rest` rows (the
    other ancestors of a, then the chunk's own rows) with `visible` (b - a, len(rest))."""

    a: int
    b: int
    shared: torch.Tensor | slice
    rest: torch.Tensor
    visible: torch.Tensor


@dataclass(frozen=True)
class AncestorPlan:
    """Chunks of query rows [a, b); each chunk's keys (the ancestors of its first row + its own rows) and their
    visibility for each query row are derived when the chunk runs (`chunks`), never stored: on one long path
    they add up to about U^2 / 2 key rows, while one chunk's mask is at most chunk x (branch rows + chunk)."""

    starts: tuple[int, ...]
    num_rows: int
    subtree_end: torch.Tensor  # (U,) CPU
    position_ids: torch.Tensor  # (U,) CPU: a row's depth is its number of ancestors
    device: torch.device

    def chunks(self) -> Iterator[Chunk]:
        """Each chunk's key rows and masks, on the plan's device."""
        end = self.subtree_end
        for a, b in zip(self.starts, self.starts[1:] + (self.num_rows,)):
            ancestors = torch.nonzero(end[:a] >= a).flatten()
            everyone = end[ancestors] >= b - 1  # an ancestor of a whose subtree holds the chunk's last row
            shared = ancestors[everyone]
            n = len(shared)
            if n and int(shared[-1]) - int(shared[0]) + 1 == n:  # a run of rows (a path's prefix): a view, no gather
                shared = slice(int(shared[0]), int(shared[0]) + n)
            else:
                shared = shared.to(self.device)
            rest = torch.cat([ancestors[~everyone], torch.arange(a, b)])
            q_rows = torch.arange(a, b)
            visible = (rest[None, :] <= q_rows[:, None]) & (end[rest][None, :] >= q_rows[:, None])
            yield Chunk(a, b, shared, rest.to(self.device), visible.to(self.device))

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


# The flash-attention kernels behind F.scaled_dot_product_attention on CPU, called directly because they also
# return (and take back) each query row's logsumexp: the two key parts of a chunk are attended separately and
# merged exactly, and backward reuses the saved output and logsumexp instead of recomputing the chunk. Both take
# any GQA ratio (fewer key/value heads) and an additive float mask.
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _parts(chunk: Chunk, key: torch.Tensor, value: torch.Tensor):
    """(key, value, additive mask or None) of each non-empty key part of the chunk, and where its rows are."""
    shared = chunk.shared
    if isinstance(shared, slice) or len(shared):
        yield shared, key[:, :, shared], value[:, :, shared], None
    mask = torch.zeros(chunk.visible.shape, dtype=key.dtype, device=key.device)
    mask.masked_fill_(~chunk.visible, float("-inf"))
    yield chunk.rest, key[:, :, chunk.rest], value[:, :, chunk.rest], mask


def _chunk_forward(query, key, value, chunk: Chunk, scaling):
    """(output, logsumexp) of the chunk's query rows over both key parts (merged by their logsumexps)."""
    q = query[:, :, chunk.a:chunk.b]
    out = lse = None
    for _, k, v, mask in _parts(chunk, key, value):
        o, l = _FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=scaling)
        if out is None:
            out, lse = o, l
            continue
        merged = torch.logaddexp(lse, l)
        out = torch.exp(lse - merged)[..., None] * out + torch.exp(l - merged)[..., None] * o
        lse = merged
    return out, lse


def _forward_chunks(query, key, value, plan: AncestorPlan, scaling):
    """(1, H, U, D) output and (1, H, U) logsumexp of every row."""
    out = torch.empty_like(query)
    lse = query.new_empty(query.shape[:3], dtype=torch.promote_types(query.dtype, torch.float32))
    for chunk in plan.chunks():
        out[:, :, chunk.a:chunk.b], lse[:, :, chunk.a:chunk.b] = _chunk_forward(query, key, value, chunk, scaling)
    return out, lse


class _AncestorAttention(torch.autograd.Function):
    """Chunked ancestor attention that keeps its output and each row's logsumexp (O(U) per layer), so backward
    runs the flash backward kernel on each key part with them, as flash attention does, never recomputing the
    forward; K/V gradients are scattered into one buffer (index_add_), so no chunk creates a U-sized gradient."""

    @staticmethod
    def forward(ctx, query, key, value, plan, scaling):
        out, lse = _forward_chunks(query, key, value, plan, scaling)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scaling = plan, scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        dq = torch.zeros_like(query)
        dk = torch.zeros_like(key)
        dv = torch.zeros_like(value)
        grad_out = grad_out.contiguous()
        for chunk in ctx.plan.chunks():
            span = slice(chunk.a, chunk.b)
            q, g, o, l = query[:, :, span], grad_out[:, :, span], out[:, :, span], lse[:, :, span]
            for rows, k, v, mask in _parts(chunk, key, value):
                gq, gk, gv = _FLASH_BACKWARD(g, q, k, v, o, l, 0.0, False, attn_mask=mask, scale=ctx.scaling)
                dq[:, :, span] += gq
                if isinstance(rows, slice):
                    dk[:, :, rows] += gk
                    dv[:, :, rows] += gv
                else:
                    dk.index_add_(2, rows, gk)
                    dv.index_add_(2, rows, gv)
        return dq, dk, dv, None, None


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
    if query.device.type != "cpu":
        raise ValueError(f"the ancestor backend runs on the CPU; on {query.device.type} use backend='flex'")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        out = _AncestorAttention.apply(query, key, value, plan, scaling)
    else:
        out = _forward_chunks(query, key, value, plan, scaling)[0]
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
