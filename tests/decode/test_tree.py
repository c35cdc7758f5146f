"""Tests for decode/tree.py: static trees in index form, validation, EAGLE-2 rerank and DynamicTree specs."""

import pytest
import torch

from decode.tree import DEFAULT_TREES, DraftTree, DynamicTree, build_tree, chain, select_nodes


def test_four_node_tree_by_hand():
    tree = build_tree([(0, 0), (1,), (0,)])  # input order does not matter
    # node 0 = root, 1 = (0,), 2 = (1,), 3 = (0, 0)
    assert tree.paths == ((0,), (1,), (0, 0))
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.ranks.tolist() == [0, 0, 1, 0]
    assert tree.position_ids.tolist() == [0, 1, 1, 2]
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert tree.attn_mask.dtype == torch.bool
    assert torch.equal(tree.attn_mask, expected_mask)
    assert tree.retrieve_indices.tolist() == [[0, 2, -1], [0, 1, 3]]
    assert len(tree) == 4 and tree.depth == 2


def test_chain_tree():
    tree = build_tree(chain(3))
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(tree.attn_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert tree.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    assert tree.depth == 3


@pytest.mark.parametrize(
    "paths, message",
    [
        ([(0,), (0, 0, 0)], r"not prefix-closed: path \(0, 0, 0\) needs its prefix \(0, 0\)"),
        ([(0,), (1, 0)], r"not prefix-closed: path \(1, 0\) needs its prefix \(1,\)"),
        ([(0,), (2,)], r"path \(2,\) skips sibling rank 1"),
        ([(0,), (0, 1)], r"path \(0, 1\) skips sibling rank 0"),
        ([(0,), (0,)], r"path \(0,\) appears twice"),
        ([(0,), ()], "must be non-empty"),
        ([(0,), (0, -1)], r"ranks must be >= 0, got \(0, -1\)"),
    ],
)
def test_invalid_trees_raise(paths, message):
    with pytest.raises(ValueError, match=message):
        build_tree(paths)


@pytest.mark.parametrize("name", sorted(DEFAULT_TREES))
def test_default_trees_build(name):
    paths = DEFAULT_TREES[name]
    tree = build_tree(paths)
    n = len(paths) + 1
    assert len(tree) == n and tree.attn_mask.shape == (n, n)
    assert tree.depth == max(len(p) for p in paths)
    # every node's mask row is exactly its root path: the rank path's prefixes
    index = {(): 0} | {p: i + 1 for i, p in enumerate(tree.paths)}
    for p, i in index.items():
        ancestors = {index[p[:k]] for k in range(len(p) + 1)}
        assert set(torch.nonzero(tree.attn_mask[i]).flatten().tolist()) == ancestors, (name, p)
    # every node lies on some retrieve path; paths end at leaves
    covered = set(tree.retrieve_indices.flatten().tolist()) - {-1}
    assert covered == set(range(n))


def test_node_order_is_depth_then_ranks():
    tree = build_tree(DEFAULT_TREES["tree8"])
    keys = [(len(p), p) for p in tree.paths]
    assert keys == sorted(keys)
    assert (tree.position_ids[1:] == torch.tensor([len(p) for p in tree.paths])).all()


def test_select_nodes_keeps_the_best_prefix_closed_set():
    #               0     1     2     3     4     5     6     7
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]
    scores = [0.0, -0.1, -0.5, -0.3, -1.2, -0.6, -0.35, -2.0]
    assert select_nodes(scores, parents, 3) == [0, 1, 3, 6]
    assert select_nodes(scores, parents, 4) == [0, 1, 2, 3, 6]
    assert select_nodes(scores, parents, 100) == list(range(8))
    assert select_nodes(scores, parents, 0) == [0]
    for budget in range(8):
        kept = set(select_nodes(scores, parents, budget))
        assert all(parents[i] in kept for i in kept if i), budget
        dropped = set(range(1, 8)) - kept
        assert all(scores[i] >= scores[j] for i in kept - {0} for j in dropped), budget


def test_select_nodes_breaks_ties_towards_earlier_nodes():
    assert select_nodes([0.0, -1.0, -1.0, -1.0], [-1, 0, 0, 1], 2) == [0, 1, 2]
    assert select_nodes([0.0, -1.0, -1.0], [-1, 0, 1], 1) == [0, 1]  # a child tying its parent follows it


def test_select_nodes_rejects_increasing_scores():
    with pytest.raises(AssertionError, match="kept node 2 without its parent 1"):
        select_nodes([0.0, -2.0, -0.5], [-1, 0, 1], 1)


@pytest.mark.parametrize("field", ["depth", "top_k", "total_tokens"])
def test_dynamic_tree_rejects_zero(field):
    with pytest.raises(ValueError, match=f"DynamicTree.{field} must be >= 1, got 0"):
        DynamicTree(**{field: 0})
    with pytest.raises(ValueError, match=f"DynamicTree.{field} must be >= 1, got -2"):
        DynamicTree(**{field: -2})
    assert DynamicTree(**{field: 1}) is not None


def test_draft_tree_children_by_rank():
    tree = DraftTree(
        tokens=torch.tensor([5, 6, 7, 8, 9]),
        parents=torch.tensor([-1, 0, 0, 2, 2]),
        ranks=torch.tensor([0, 1, 0, 1, 0]),
    )
    assert tree.children == [[2, 1], [], [4, 3], [], []]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert len(tree) == 5
