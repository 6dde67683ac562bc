"""Prefix-tree packing: N token sequences -> one trie laid out in DFS pre-order (a `PackedTree`).

Row u of a packed tree holds one unique (prefix, token) pair. Per row we keep the token id, its position id
(= depth on its own path, 0 at a root), `subtree_end` (last row of its subtree, inclusive) and `parent_row`
(-1 at a root). Several roots make a forest. Row q may attend to row k iff `k <= q <= subtree_end[k]`,
i.e. iff k is an ancestor of q (or q itself). Each input sequence is a root-to-node path, given by its
last row; `paths[i]` lists the rows of sequence i from its root down.

Everything here is iterative (no recursion per token), so paths of many thousands of tokens are fine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class PackedTree:
    """A token trie in DFS pre-order plus each packed sequence's path through it (all int64 CPU tensors)."""

    token_ids: torch.Tensor  # (U,)
    position_ids: torch.Tensor  # (U,) depth of the row on its path
    subtree_end: torch.Tensor  # (U,) last row of the row's subtree (inclusive)
    parent_row: torch.Tensor  # (U,) previous row on the path, -1 at a root
    last_row: torch.Tensor  # (N,) row of each sequence's last token
    paths: tuple[torch.Tensor, ...]  # N tensors, rows of sequence i from root to last_row

    @property
    def num_rows(self) -> int:
        """U: unique tokens (rows) in the tree."""
        return int(self.token_ids.numel())

    @property
    def num_sequences(self) -> int:
        return len(self.paths)

    @property
    def lengths(self) -> list[int]:
        return [int(p.numel()) for p in self.paths]

    @property
    def total_tokens(self) -> int:
        """T: tokens over all sequences, counted with repetition."""
        return sum(self.lengths)


def pack(sequences: Sequence[Sequence[int]]) -> PackedTree:
    """Merge token sequences into one trie (a forest when first tokens differ), in DFS pre-order.

    Children keep first-seen order, so packing is deterministic. Duplicate sequences share a path, and a
    sequence that is a prefix of another ends inside the other's path. Raises ValueError on an empty sequence.
    """
    if not sequences:
        raise ValueError("pack() needs at least one sequence")
    node_token: list[int] = []
    node_children: list[dict[int, int]] = []
    roots: dict[int, int] = {}
    node_paths: list[list[int]] = []
    previous: list[int] = []
    for seq in sequences:
        if len(seq) == 0:
            raise ValueError("pack() got an empty sequence")
        ids = seq.tolist() if hasattr(seq, "tolist") else list(seq)  # tensors and arrays become lists of ints
        # An agent's turn usually extends the one before it: the prefix it shares with the previous sequence is
        # already in the trie, so the walk starts at its end (work per sequence: its new tokens, not its length).
        shared = _common_prefix(previous, ids)
        path: list[int] = node_paths[-1][:shared] if shared else []
        children = node_children[path[-1]] if shared else roots
        previous = ids
        for tok in ids[shared:]:
            node = children.get(tok)
            if node is None:
                node = len(node_token)
                children[tok] = node
                node_token.append(tok)
                node_children.append({})
            path.append(node)
            children = node_children[node]
        node_paths.append(path)

    num_nodes = len(node_token)
    row_of = [0] * num_nodes
    token_ids = [0] * num_nodes
    depth = [0] * num_nodes
    parent = [-1] * num_nodes
    stack = [(node, -1) for node in reversed(list(roots.values()))]
    row = 0
    while stack:
        node, parent_r = stack.pop()
        row_of[node] = row
        token_ids[row] = node_token[node]
        parent[row] = parent_r
        depth[row] = 0 if parent_r < 0 else depth[parent_r] + 1
        stack.extend((child, row) for child in reversed(list(node_children[node].values())))
        row += 1

    row_index = torch.tensor(row_of, dtype=torch.long)
    paths = tuple(row_index[torch.tensor(p, dtype=torch.long)] for p in node_paths)
    return _finish(token_ids, depth, parent, paths)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading items `a` and `b` share (list comparisons run in C: a binary search over prefixes)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def from_arrays(
    token_ids: Sequence[int],
    parent_row: Sequence[int],
    last_rows: Sequence[int],
) -> PackedTree:
    """Rebuild a PackedTree from its row arrays (e.g. a decoded TrainSample); positions and ends are derived.

    Raises ValueError unless each row's parent lies on the path to the row before it (DFS pre-order).
    """
    parent = [int(p) for p in parent_row]
    if len(parent) != len(token_ids):
        raise ValueError("token_ids and parent_row differ in length")
    if not last_rows:
        raise ValueError("a tree needs at least one sequence")
    depth = [0] * len(parent)
    open_path: list[int] = []  # the path from a root to the previous row
    for row, p in enumerate(parent):
        while open_path and open_path[-1] != p:
            open_path.pop()
        if p >= 0 and not open_path:
            raise ValueError(f"row {row}: parent_row {p} is not on the path to row {row - 1} (not DFS pre-order)")
        depth[row] = 0 if p < 0 else depth[p] + 1
        open_path.append(row)
    paths = []
    for last in last_rows:
        last = int(last)
        if not 0 <= last < len(parent):
            raise ValueError(f"last_row {last} outside the tree")
        path = [last]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        paths.append(torch.tensor(path[::-1], dtype=torch.long))
    return _finish([int(t) for t in token_ids], depth, parent, tuple(paths))


def merge(trees: Sequence[PackedTree]) -> PackedTree:
    """Concatenate packed trees into one forest (row offsets shifted; no sharing across trees)."""
    if not trees:
        raise ValueError("merge() needs at least one tree")
    offsets = [0]
    for t in trees:
        offsets.append(offsets[-1] + t.num_rows)

    def shifted(name: str, keep_negative: bool = False) -> torch.Tensor:
        parts = []
        for off, t in zip(offsets, trees):
            x = getattr(t, name)
            parts.append(torch.where(x < 0, x, x + off) if keep_negative else x + off)
        return torch.cat(parts)

    return PackedTree(
        token_ids=torch.cat([t.token_ids for t in trees]),
        position_ids=torch.cat([t.position_ids for t in trees]),
        subtree_end=shifted("subtree_end"),
        parent_row=shifted("parent_row", keep_negative=True),
        last_row=shifted("last_row"),
        paths=tuple(p + off for off, t in zip(offsets, trees) for p in t.paths),
    )


def repack(trees: Sequence[PackedTree]) -> PackedTree:
    """One trie over every sequence of the trees, sharing prefixes across trees too (sequence order is kept).

    Groups of one batch usually share their system prompt and tool definitions: `merge` keeps one copy per
    tree, `repack` keeps one in all.
    """
    if not trees:
        raise ValueError("repack() needs at least one tree")
    return pack([t.token_ids[path].tolist() for t in trees for path in t.paths])


def subtree(tree: PackedTree, sequences: Sequence[int]) -> PackedTree:
    """The tree restricted to the rows of the given sequences' paths, those sequences in the given order.

    The kept rows are closed under ancestors, so in the tree's DFS pre-order they are the sub-trie's own pre-order
    and every row keeps its depth; everything is derived with tensor ops (O(U)), no token list is rebuilt. It is
    the trie `pack` would build of those sequences, up to the order of siblings.

    >>> t = subtree(pack([[1, 2, 3], [1, 4], [1, 2, 5]]), [2, 1])
    >>> t.token_ids.tolist(), t.parent_row.tolist(), t.subtree_end.tolist(), [p.tolist() for p in t.paths]
    ([1, 2, 5, 4], [-1, 0, 1, 0], [3, 2, 2, 3], [[0, 1, 2], [0, 3]])
    """
    if not sequences:
        raise ValueError("subtree() needs at least one sequence")
    keep = torch.zeros(tree.num_rows, dtype=torch.bool)
    for i in sequences:
        keep[tree.paths[i]] = True
    new_index = torch.cumsum(keep, 0) - 1  # a kept row's index in the sub-trie
    parent = tree.parent_row[keep]
    return PackedTree(
        token_ids=tree.token_ids[keep],
        position_ids=tree.position_ids[keep],
        # a kept row's kept descendants are the kept rows of its old subtree range, contiguous in the new order
        subtree_end=new_index[tree.subtree_end[keep]],
        parent_row=torch.where(parent >= 0, new_index[parent.clamp(min=0)], parent),
        last_row=new_index[tree.last_row[list(sequences)]],
        paths=tuple(new_index[tree.paths[i]] for i in sequences),
    )


def _finish(token_ids: list[int], depth: list[int], parent: list[int], paths: tuple) -> PackedTree:
    """Derive subtree ends (sizes accumulated bottom-up over rows in reverse order) and build the tree."""
    size = [1] * len(parent)
    for row in range(len(parent) - 1, 0, -1):
        if parent[row] >= 0:
            size[parent[row]] += size[row]
    end = [row + s - 1 for row, s in enumerate(size)]
    return PackedTree(
        token_ids=torch.tensor(token_ids, dtype=torch.long),
        position_ids=torch.tensor(depth, dtype=torch.long),
        subtree_end=torch.tensor(end, dtype=torch.long),
        parent_row=torch.tensor(parent, dtype=torch.long),
        last_row=torch.stack([p[-1] for p in paths]),
        paths=paths,
    )

