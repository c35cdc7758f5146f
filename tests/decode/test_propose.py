"""decode/propose.py and the built-in drafters: the EAGLE drafter's tree masks, batched child draws, what a
drafter tells the tree resolver (`limits`: depth it reaches, dynamic or static, block or level by level), the
lm_head a sharing draft projects with, and the trees a `DynamicTree.min_prob` bound grows."""

import pytest
import torch

from decode.drafter import Drafter, DraftLimits
from decode.drafters import make_drafter
from decode.drafters.eagle import EagleDrafter
from decode.drafters.lm_head import draft_lm_head
from decode.drafters.medusa import MedusaDrafter
from decode.propose import draw_children, propose
from decode.tree import DynamicTree
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads


def _head(target) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=64)).eval()
    head.set_draft_vocab(torch.randperm(128)[:64])
    return head


def test_drafter_tree_mask_lets_each_node_see_its_ancestors_only(build_target):
    target = build_target("llama")
    drafter = EagleDrafter(_head(target), target, 1)
    drafter.advance([torch.randn(4, 3 * 32)], [torch.randint(0, 128, (4,))])
    seen = []
    real = drafter.step

    def spy(*args, attention_mask):
        seen.append((attention_mask[0, 0] == 0)[:, drafter.valid.shape[1] :].int().tolist())
        return real(*args, attention_mask=attention_mask)

    drafter.step = spy
    # root -> 1, 2; 1 -> 3; 2 -> 4, 5; 4 -> 6. Rows follow expansion order: 1, 2 | 3, 4 | 6 (5 is a leaf);
    # each call names where its nodes' parents were expanded (-1: the root)
    drafter.expand(torch.tensor([[-1, -1]]), torch.tensor([[5, 6]]), depth=1)
    drafter.expand(torch.tensor([[0, 1]]), torch.tensor([[7, 8]]), depth=2)
    drafter.expand(torch.tensor([[3]]), torch.tensor([[9]]), depth=3)
    assert seen == [[[1, 0], [0, 1]],
                    [[1, 0, 1, 0], [0, 1, 0, 1]],
                    [[0, 1, 0, 1, 1]]]  # fmt: skip
    assert len(drafter.cache) == 4 + 5
    drafter.end_proposal()  # the next proposal starts from the committed prefix and an empty tree
    assert len(drafter.cache) == 4
    seen.clear()
    drafter.expand(torch.tensor([[-1]]), torch.tensor([[5]]), depth=1)
    assert seen == [[[1]]]


def test_batched_draws_match_one_row_at_a_time():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    batched = draw_children(logits, 4, 0.0, None)
    for row in range(5):
        logq = torch.log_softmax(logits[row], -1)
        top = torch.topk(logq, 4)
        assert batched.draft_ids[row].tolist() == top.indices.tolist()
        torch.testing.assert_close(batched.slot_logq[row], top.values)
    # sampling: k distinct ids per row, slot scores are the row's k largest log q, q is the row's softmax
    sampled = draw_children(logits, 4, 0.7, torch.Generator().manual_seed(1))
    for row in range(5):
        assert len(set(sampled.draft_ids[row].tolist())) == 4
        torch.testing.assert_close(sampled.q[row], torch.softmax(logits[row] / 0.7, -1))
        torch.testing.assert_close(
            sampled.slot_logq[row], torch.topk(torch.log_softmax(logits[row] / 0.7, -1), 4).values
        )
    # the first draw of a row follows q: 4000 draws of a 3-token row
    row = torch.tensor([[0.0, 1.0, 2.0]]).expand(4000, 3)
    first = draw_children(row, 2, 1.0, torch.Generator().manual_seed(2)).draft_ids[:, 0]
    freq = torch.bincount(first, minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(torch.tensor([0.0, 1.0, 2.0]), -1), atol=0.03, rtol=0)


def test_drafter_limits_give_the_depth_reached_the_kind_of_tree_and_the_drafting_mode(build_target):
    target = build_target("llama")
    medusa = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=3))
    assert MedusaDrafter(medusa, target, 1).limits() == DraftLimits(max_depth=3, dynamic=False, block=True)
    assert make_drafter(_head(target), target, 2).limits() == DraftLimits(max_depth=None, dynamic=True)
    assert Drafter().limits() == DraftLimits(max_depth=None, dynamic=True, block=False)
    with pytest.raises(
        TypeError, match="no drafter is registered for Linear; registered: eagle3 .EagleHead."
    ):
        make_drafter(torch.nn.Linear(2, 2), target, 1)


def test_draft_lm_head_is_the_targets_unless_the_draft_has_its_own(build_target):
    target = build_target("llama")
    head = EagleHead(EagleConfig.from_target(target.config, "eagle1"))
    assert draft_lm_head(head, target) is target.get_output_embeddings()
    own = torch.nn.Linear(32, 128, bias=False)
    object.__setattr__(head, "_selfspec_draft_lm_head", own)  # what decode.prepare.quantize_draft sets
    assert draft_lm_head(head, target) is own and "_selfspec_draft_lm_head" not in dict(head.named_modules())


# ---- a min_prob bound ------------------------------------------------------------------------------------


class _SameEveryParent(Drafter):
    """Every node's children drawn from one distribution, PROBS then a flat tail (as Medusa's heads, whatever
    the parent), so a node's cumulative draft probability is the product of PROBS over its rank path; records
    the depths it expands."""

    feature_layers = ()

    def __init__(self, probs: list[float], vocab_size: int = 16) -> None:
        p = torch.full((vocab_size,), (1.0 - sum(probs)) / (vocab_size - len(probs)))
        p[: len(probs)] = torch.tensor(probs)
        self.logits, self.levels = p.log(), []

    def root_logits(self):
        return self.logits[None]

    def expand(self, parent_rows, tokens, depth):
        self.levels.append(depth)
        return self.logits.expand(1, tokens.shape[1], -1)


def _rank_paths(tree) -> list[tuple[int, ...]]:
    parents, ranks = tree.parents.tolist(), tree.ranks.tolist()
    paths = [()]
    for node in range(1, len(parents)):
        paths.append(paths[parents[node]] + (ranks[node],))
    return paths[1:]


PROBS = [0.6, 0.3, 0.05]
ROOT = torch.tensor([3])  # a batch of one row


def _cumulative(path: tuple[int, ...]) -> float:
    return float(torch.tensor([PROBS[r] for r in path], dtype=torch.float64).prod())


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampling"])
def test_a_min_prob_bound_keeps_the_nodes_at_or_above_it_and_stops_drafting_below_it(temperature):
    """The bounded tree is the unbounded one's nodes whose cumulative draft probability reaches min_prob (a
    prefix of each node's children in draw order, so recursive rejection sampling stays exact), and levels
    past the last one with such a node are not drafted. When sampling, which nodes exist depends on slot
    scores only: the same rank paths as greedy, whatever was drawn."""
    draws = {"temperature": temperature, "vocab_size": 16}
    full, bounded = _SameEveryParent(PROBS), _SameEveryParent(PROBS)
    generator = torch.Generator().manual_seed(0)
    unbounded_tree = propose(full, ROOT, DynamicTree(6, 3, 20), generator=generator, **draws)[0]
    tree = propose(bounded, ROOT, DynamicTree(6, 3, 20, min_prob=0.1), generator=generator, **draws)[0]
    expected = [p for p in _rank_paths(unbounded_tree) if _cumulative(p) >= 0.1 - 1e-9]
    # 0.6, 0.3 | 0.36, 0.18, 0.18 | 0.216 and three of 0.108 | 0.1296; depth 5 (0.078) is drafted, not kept
    assert sorted(_rank_paths(tree)) == sorted(expected) and len(expected) == 10
    assert full.levels == [1, 2, 3, 4, 5] and bounded.levels == [1, 2, 3, 4]
    for node, children in enumerate(tree.children):  # kept children: the first ones drawn
        assert sorted(tree.ranks[children].tolist()) == list(range(len(children))), node
    ancestors = tree.ancestors.tolist()
    assert all(ancestors[i][tree.parents[i]] for i in range(1, len(tree)))
    if temperature == 0:
        assert tree.tokens[1:3].tolist() == [0, 1]  # the depth-1 nodes: the top two
    # a bound above the best first draft: the root alone, nothing drafted past it
    alone = _SameEveryParent(PROBS)
    root = propose(alone, ROOT, DynamicTree(6, 3, 20, min_prob=0.7), generator=generator, **draws)[0]
    assert len(root) == 1 and root.tokens.tolist() == [3] and alone.levels == []
    # a budget below the bound's count: the best nodes, as without a bound
    small = propose(
        _SameEveryParent(PROBS), ROOT, DynamicTree(6, 3, 4, min_prob=0.1), generator=generator, **draws
    )[0]
    assert sorted(_rank_paths(small)) == [(0,), (0, 0), (0, 0, 0), (1,)]
