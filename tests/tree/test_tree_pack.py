"""Packing sequences into a DFS pre-order trie: layout, paths, the visibility predicate, round trips."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forge_stream.tree import from_arrays, merge, pack


def _ancestors(tree, row):
    out = []
    while row >= 0:
        out.append(row)
        row = int(tree.parent_row[row])
    return set(out)


def test_small_tree_layout_is_dfs_preorder():
    tree = pack([[1, 2, 3], [1, 2, 4, 5], [1, 6], [7]])
    assert tree.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert tree.position_ids.tolist() == [0, 1, 2, 2, 3, 1, 0]
    assert tree.parent_row.tolist() == [-1, 0, 1, 1, 3, 0, -1]
    assert tree.subtree_end.tolist() == [5, 4, 2, 4, 4, 5, 6]
    assert [p.tolist() for p in tree.paths] == [[0, 1, 2], [0, 1, 3, 4], [0, 5], [6]]
    assert tree.last_row.tolist() == [2, 4, 5, 6]
    assert (tree.num_rows, tree.total_tokens, tree.num_sequences) == (7, 10, 4)


def test_duplicates_and_prefixes_share_rows():
    tree = pack([[5, 6, 7], [5, 6, 7], [5, 6], [5]])
    assert tree.num_rows == 3
    assert [p.tolist() for p in tree.paths] == [[0, 1, 2], [0, 1, 2], [0, 1], [0]]


sequences = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(sequences)
def test_paths_rebuild_sequences_and_predicate_means_ancestor(seqs):
    tree = pack(seqs)
    prefixes = {tuple(s[: i + 1]) for s in seqs for i in range(len(s))}
    assert tree.num_rows == len(prefixes)
    assert tree.total_tokens == sum(len(s) for s in seqs)
    for seq, path in zip(seqs, tree.paths):
        assert tree.token_ids[path].tolist() == list(seq)
        assert tree.position_ids[path].tolist() == list(range(len(seq)))
        assert tree.parent_row[path].tolist() == [-1] + path[:-1].tolist()
    for q in range(tree.num_rows):
        visible = {k for k in range(tree.num_rows) if k <= q <= int(tree.subtree_end[k])}
        assert visible == _ancestors(tree, q)


@settings(max_examples=50, deadline=None)
@given(sequences, sequences)
def test_from_arrays_and_merge_round_trip(a, b):
    ta, tb = pack(a), pack(b)
    again = from_arrays(ta.token_ids.tolist(), ta.parent_row.tolist(), ta.last_row.tolist())
    for name in ("token_ids", "position_ids", "subtree_end", "parent_row", "last_row"):
        assert torch.equal(getattr(again, name), getattr(ta, name))
    forest = merge([ta, tb])
    assert forest.num_rows == ta.num_rows + tb.num_rows
    for i, seq in enumerate(list(a) + list(b)):
        path = forest.paths[i]
        assert forest.token_ids[path].tolist() == list(seq)
        assert int(forest.parent_row[path[0]]) == -1
        assert forest.position_ids[path].tolist() == list(range(len(seq)))


def test_deep_path_packs_without_recursion():
    deep = list(range(50_000))
    tree = pack([deep, deep[:30_000] + [7]])
    assert tree.num_rows == 50_001
    assert int(tree.position_ids.max()) == 49_999
    assert int(tree.subtree_end[0]) == 50_000
    assert from_arrays(tree.token_ids.tolist(), tree.parent_row.tolist(), tree.last_row.tolist()).num_rows == 50_001


def test_rejects_empty_sequences_and_non_preorder_arrays():
    with pytest.raises(ValueError):
        pack([[1], []])
    with pytest.raises(ValueError):
        pack([])
    with pytest.raises(ValueError):  # row 3's parent (1) is not on the path to row 2
        from_arrays([1, 2, 3, 4], [-1, 0, 0, 1], [3])
    with pytest.raises(ValueError):
        from_arrays([1, 2], [-1, 1], [1])


def test_repack_shares_prefixes_across_trees_and_keeps_sequence_order():
    from forge_stream.tree import merge, repack

    a = pack([[1, 2, 3, 4], [1, 2, 5]])
    b = pack([[1, 2, 3, 9], [7]])
    forest, trie = merge([a, b]), repack([a, b])
    assert forest.num_rows == 10 and trie.num_rows == 7  # [1, 2, 3] is stored once
    for f_path, t_path in zip(forest.paths, trie.paths):
        assert forest.token_ids[f_path].tolist() == trie.token_ids[t_path].tolist()


def _walked_from_the_root(sequences):
    """The trie as a walk from the root for every token of every sequence builds it (what `pack` skips for the
    prefix a sequence shares with the one before): rows as (token, parent token path) in DFS pre-order."""
    trie: dict = {}
    for seq in sequences:
        node = trie
        for tok in seq:
            node = node.setdefault(tok, {})
    rows, stack = [], [(tok, child, ()) for tok, child in reversed(list(trie.items()))]
    while stack:
        tok, children, prefix = stack.pop()
        rows.append(prefix + (tok,))
        stack.extend((t, c, prefix + (tok,)) for t, c in reversed(list(children.items())))
    return rows


def test_agent_turns_that_extend_the_previous_one_pack_as_a_walk_from_the_root_would():
    rng = random.Random(3)
    sequences, history = [], [1, 2, 3]
    for turn in range(40):
        if turn % 13 == 12:
            history = history[:2] + [rng.randrange(9)]  # a context reset: a new branch near the root
        history = history + [rng.randrange(9) for _ in range(rng.randrange(1, 6))]
        sequences.append(list(history))
        if turn % 7 == 3:
            sequences.append(history[:-1] + [9])  # a sibling choice
            sequences.append(list(history))  # a repeat
    tree = pack(sequences)
    rows = [tuple(tree.token_ids[p].tolist()) for p in tree.paths]
    assert rows == [tuple(s) for s in sequences]
    walked = _walked_from_the_root(sequences)
    assert tree.num_rows == len(walked)
    assert tree.token_ids.tolist() == [r[-1] for r in walked]
    assert tree.position_ids.tolist() == [len(r) - 1 for r in walked]
    assert [walked[p] if p >= 0 else () for p in tree.parent_row.tolist()] == [r[:-1] for r in walked]
    assert pack([torch.tensor(s) for s in sequences]).token_ids.tolist() == tree.token_ids.tolist()
