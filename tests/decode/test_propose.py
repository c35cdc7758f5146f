"""decode/propose.py: the EAGLE drafter's tree masks, batched child draws, what a drafter tells the tree
resolver (depth it reaches, dynamic or static), and the lm_head a sharing draft projects with."""

import pytest
import torch

from decode.propose import Drafter, EagleDrafter, draft_lm_head, drafter_limits, draw_children
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads


def _head(target) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=64)).eval()
    head.set_draft_vocab(torch.randperm(128)[:64])
    return head


def test_drafter_tree_mask_lets_each_node_see_its_ancestors_only(build_target):
    target = build_target("llama")
    drafter = EagleDrafter(_head(target), target)
    drafter.advance(torch.randn(4, 3 * 32), torch.randint(0, 128, (4,)))
    seen = []
    real = drafter.step

    def spy(*args, attention_mask):
        seen.append((attention_mask[0, 0] == 0)[:, drafter.committed :].int().tolist())
        return real(*args, attention_mask=attention_mask)

    drafter.step = spy
    # root -> 1, 2; 1 -> 3; 2 -> 4, 5; 4 -> 6. Slots follow expansion order: 1, 2 | 3, 4 | 6 (5 is a leaf)
    drafter.expand([1, 2], torch.tensor([5, 6]), [0, 0], depth=1)
    drafter.expand([3, 4], torch.tensor([7, 8]), [1, 2], depth=2)
    drafter.expand([6], torch.tensor([9]), [4], depth=3)
    assert seen == [[[1, 0], [0, 1]],
                    [[1, 0, 1, 0], [0, 1, 0, 1]],
                    [[0, 1, 0, 1, 1]]]  # fmt: skip
    assert len(drafter.cache) == 4 + 5
    drafter.end_proposal()  # the next proposal starts from the committed prefix and an empty tree
    assert len(drafter.cache) == 4
    seen.clear()
    drafter.expand([1], torch.tensor([5]), [0], depth=1)
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


def test_drafter_limits_give_the_depth_reached_and_the_kind_of_tree(build_target):
    assert drafter_limits(MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=3))) == (
        3,
        False,
    )
    assert drafter_limits(_head(build_target("llama"))) == (None, True)
    custom = Drafter()
    assert drafter_limits(custom) == (None, True)
    custom.max_depth = 2
    assert drafter_limits(custom) == (2, True)
    with pytest.raises(TypeError, match="heads must be MedusaHeads or EagleHead, got Linear"):
        drafter_limits(torch.nn.Linear(2, 2))


def test_draft_lm_head_is_the_targets_unless_the_draft_has_its_own(build_target):
    target = build_target("llama")
    head = EagleHead(EagleConfig.from_target(target.config, "eagle1"))
    assert draft_lm_head(head, target) is target.get_output_embeddings()
    own = torch.nn.Linear(32, 128, bias=False)
    object.__setattr__(head, "_selfspec_draft_lm_head", own)  # what decode.prepare.quantize_draft sets
    assert draft_lm_head(head, target) is own and "_selfspec_draft_lm_head" not in dict(head.named_modules())
