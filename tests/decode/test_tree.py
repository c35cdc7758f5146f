"""Tests for decode/tree.py: static trees in index form, validation, EAGLE-2 rerank, DynamicTree specs, verify
row counts, and the default and resolved trees of a drafter."""

import pytest
import torch

from decode.tree import (
    DEFAULT_EAGLE_TREE,
    DEFAULT_MEDUSA_TREE,
    DEFAULT_TREES,
    GPU_EAGLE_TREE,
    GPU_MEDUSA_TREE,
    SAMPLING_CHAIN,
    DraftTree,
    DynamicTree,
    ancestor_mask,
    build_tree,
    chain,
    default_tree,
    resolve_tree,
    select_nodes,
    tree_label,
    verify_rows,
)


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
    assert torch.equal(ancestor_mask(tree.parents), expected_mask)  # the verify mask of its nodes
    assert len(tree) == 4 and tree.depth == 2


def test_chain_tree():
    tree = build_tree(chain(3))
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(ancestor_mask(tree.parents), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
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
    assert len(tree) == n and tree.depth == max(len(p) for p in paths)
    # every node's mask row is exactly its root path: the rank path's prefixes
    mask = ancestor_mask(tree.parents)
    index = {(): 0} | {p: i + 1 for i, p in enumerate(tree.paths)}
    for p, i in index.items():
        ancestors = {index[p[:k]] for k in range(len(p) + 1)}
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == ancestors, (name, p)


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
    assert getattr(DynamicTree(**{field: 1}), field) == 1  # the least value is taken as given


@pytest.mark.parametrize("min_prob", [-0.1, 1.0, 2.0])
def test_dynamic_tree_min_prob_is_a_probability_below_one(min_prob):
    with pytest.raises(ValueError, match=rf"DynamicTree.min_prob must be in \[0, 1\), got {min_prob}"):
        DynamicTree(min_prob=min_prob)


def test_a_bounded_dynamic_tree_says_so_and_verifies_at_most_its_total():
    bounded = DynamicTree(8, 4, 24, min_prob=0.05)
    assert tree_label(bounded) == "dynamic(depth=8, top_k=4, total=24, min_prob=0.05)"
    assert tree_label(DynamicTree(8, 4, 24)) == "dynamic(depth=8, top_k=4, total=24)"
    assert verify_rows(bounded) == 25


def test_draft_tree_children_by_rank():
    tree = DraftTree(
        tokens=torch.tensor([5, 6, 7, 8, 9]),
        parents=torch.tensor([-1, 0, 0, 2, 2]),
        ranks=torch.tensor([0, 1, 0, 1, 0]),
    )
    assert tree.children == [[2, 1], [], [4, 3], [], []]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert len(tree) == 5


def test_verify_rows_counts_the_root():
    assert verify_rows(DynamicTree(depth=5, top_k=4, total_tokens=12)) == 13
    assert verify_rows("tree8") == len(DEFAULT_TREES["tree8"]) + 1
    assert verify_rows([(0,), (1,), (0, 0)]) == 4
    assert verify_rows(build_tree([(0,), (1,), (0, 0)])) == 4


def test_default_trees_follow_the_target_device():
    """GPU-sized trees when the target is on CUDA (no GPU needed: only the device type is read)."""
    assert default_tree(None, True, torch.device("cuda", 0)) == GPU_EAGLE_TREE == DynamicTree(6, 10, 60)
    assert default_tree(None, True, "cpu") == DEFAULT_EAGLE_TREE == DynamicTree(5, 4, 12)
    assert resolve_tree(None, max_depth=None, dynamic=True, device="cuda:1") == GPU_EAGLE_TREE
    assert default_tree(6, False, "cuda") == DEFAULT_TREES[GPU_MEDUSA_TREE]  # the largest: 16 nodes, 6 deep
    assert len(DEFAULT_TREES[GPU_MEDUSA_TREE]) == max(len(t) for t in DEFAULT_TREES.values())
    assert default_tree(6, False, "cpu") == DEFAULT_TREES[DEFAULT_MEDUSA_TREE]
    assert default_tree(3, False, "cuda") == [
        p for p in DEFAULT_TREES["tree16"] if len(p) <= 3
    ]  # cut to depth
    resolved = resolve_tree(None, max_depth=6, dynamic=False, device="cpu")
    assert resolved.paths == build_tree(DEFAULT_TREES[DEFAULT_MEDUSA_TREE]).paths


def test_sampling_on_a_cpu_defaults_to_a_chain_for_every_drafter():
    """Temperature > 0 on a CPU: a chain of SAMPLING_CHAIN drafts, cut to what the drafter drafts; greedy and
    CUDA defaults are unchanged."""
    assert SAMPLING_CHAIN == 3
    assert default_tree(None, True, "cpu", temperature=1.0) == chain(3)
    # Medusa, P-EAGLE: static drafters alike
    assert default_tree(6, False, "cpu", temperature=0.7) == chain(3)
    assert default_tree(2, False, "cpu", temperature=1.0) == chain(2)  # two heads: two drafts
    assert default_tree(None, True, "cpu", temperature=0.0) == DEFAULT_EAGLE_TREE
    assert default_tree(None, True, "cuda", temperature=1.0) == GPU_EAGLE_TREE
    resolved = resolve_tree(None, max_depth=None, dynamic=True, device="cpu", temperature=1.0)
    assert resolved.paths == ((0,), (0, 0), (0, 0, 0))


def test_resolve_tree_takes_every_form_and_checks_the_drafter_depth():
    spec = DynamicTree(depth=9, top_k=2, total_tokens=5)
    assert resolve_tree(spec, max_depth=2, dynamic=False) is spec  # a dynamic tree is cut while drafting
    built = build_tree([(0,), (0, 0)])
    assert resolve_tree(built, max_depth=2, dynamic=True) is built
    assert resolve_tree("chain4", max_depth=None, dynamic=False).paths == build_tree(chain(4)).paths
    assert resolve_tree([(0,), (1,)], max_depth=1, dynamic=False).paths == ((0,), (1,))
    with pytest.raises(ValueError, match="tree depth 4 exceeds the 2 levels these heads can draft"):
        resolve_tree("chain4", max_depth=2, dynamic=False)
    with pytest.raises(ValueError, match=r"unknown tree name 'tree99'.*chain4"):
        resolve_tree("tree99", max_depth=None, dynamic=True)
    with pytest.raises(TypeError, match="got int"):
        resolve_tree(7, max_depth=None, dynamic=True)


def test_tree_label_reads_built_trees_and_empty_ones():
    paths = [(0,), (1,), (0, 0)]
    assert tree_label(build_tree(paths)) == tree_label(paths) == "static, 3 nodes, depth 2"
    assert tree_label([]) == "static, 0 nodes, depth 0"  # no draft: was max() of an empty sequence
