"""Exact prefix-tree training: pack sequences into a DFS pre-order trie and score them in one forward pass.

Public API: `pack`, `merge`, `repack`, `from_arrays`, `subtree`, `PackedTree`, `sequence_logprobs`, `row_logprobs`.
"""

from forge_stream.tree.logprobs import row_logprobs, sequence_logprobs
from forge_stream.tree.pack import PackedTree, from_arrays, merge, pack, repack, subtree

__all__ = ["PackedTree", "from_arrays", "merge", "pack", "repack", "row_logprobs", "sequence_logprobs", "subtree"]
