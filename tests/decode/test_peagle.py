"""P-EAGLE (heads/peagle.py, decode/drafters/peagle.py, train.block_losses.peagle_loss): training scores every
chain's placeholders as decoding does, batches equal rows alone, decoding is lossless, and a head trained on
the target's own continuation drafts whole chains from one forward."""

import pytest
import torch

from decode import generate
from decode.drafters.peagle import PEagleDrafter
from heads.peagle import PEagleConfig, PEagleHead
from tests.decode.test_dflash import _taps, assert_batch_equals_rows, assert_greedy_equals_plain
from train.block_losses import peagle_chains, peagle_hidden, peagle_loss


def _head(target, depths=4, vocab=None, seed=0):
    torch.manual_seed(seed)
    config = PEagleConfig.from_target(
        target.config,
        mask_token_id=target.config.vocab_size - 1,
        parallel_depths=depths,
        draft_vocab_size=vocab,
    )
    head = PEagleHead(config)
    head.init_from_target(target.get_input_embeddings().weight)
    if vocab:
        head.set_draft_vocab(torch.randperm(target.config.vocab_size)[:vocab])
    torch.nn.init.normal_(head.lm_head.weight, std=0.5)
    return head.eval()


@pytest.mark.parametrize("vocab", [None, 48], ids=["full-vocab", "own-vocab"])
def test_training_scores_each_chain_as_decoding_does(tiny_target, vocab):
    """One training forward over the depth-0 pass and several chains gives, for each chain, the logits the
    drafter computes after taking in the anchor's prefix in uneven chunks (depth 1 from the anchor's own
    output, depths 2 .. K from its placeholders)."""
    head = _head(tiny_target, depths=4, vocab=vocab)
    torch.manual_seed(1)
    ids = torch.randint(0, tiny_target.config.vocab_size, (2, 24))
    features, _ = _taps(tiny_target, head, ids)
    # row 0: whole chains at anchors 3 and 11; row 1: the chain at 6 and part of the one at 7, then padding
    anchors = torch.tensor([[3, 3, 3, 11, 11, 11], [6, 6, 6, 7, 7, 0]])
    depth = torch.tensor([[1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 2, 1]])
    valid = torch.tensor([[True] * 6, [True] * 5 + [False]])
    hidden = peagle_hidden(head, features, ids, anchors, depth, valid, tiny_target.get_input_embeddings())
    logits = head.logits(hidden, None)
    length = ids.shape[1] - 1
    for row in range(2):
        for a in sorted(set(anchors[row][valid[row]].tolist())):
            drafter = PEagleDrafter(head, tiny_target, 1)
            cut = (a + 1) // 2
            drafter.advance([features[row, :cut]], [ids[row, 1 : cut + 1]])
            drafter.advance([features[row, cut : a + 1]], [ids[row, cut + 1 : a + 2]])
            torch.testing.assert_close(drafter.root_logits()[0], logits[row, a], atol=2e-5, rtol=1e-4)
            for j in range(anchors.shape[1]):
                if valid[row, j] and anchors[row, j] == a:
                    d = int(depth[row, j])
                    torch.testing.assert_close(
                        drafter.expand(None, None, d)[0, 0], logits[row, length + j], atol=2e-5, rtol=1e-4
                    )


def test_a_batch_equals_each_row_alone_through_uneven_advances_and_leaving_rows(build_target):
    target = build_target("qwen2")
    assert_batch_equals_rows(PEagleDrafter, _head(target, depths=3), target)


@pytest.mark.parametrize("tree", ["static", "best-first", "chain", "prepared"])
def test_greedy_output_equals_plain_decoding(tiny_target, tree):
    """With the default static tree, a best-first tree, a chain, and after `decode.prepare`: the same tokens
    as plain decoding, alone and in a batch with left padding."""
    assert_greedy_equals_plain(tiny_target, _head(tiny_target, vocab=48), tree)


def test_a_head_trained_on_the_targets_continuation_drafts_it(build_target):
    """A few hundred steps of `peagle_loss` on one greedy continuation: decoding that prompt again accepts
    whole chains drafted in one forward (the placeholders are what was trained), and the output is still the
    target's."""
    target = build_target("llama")
    prompt = torch.tensor([[5, 17, 3, 99, 42, 7]])
    reply = generate(target, prompt, None, max_new_tokens=40).sequences
    head = _head(target, depths=4)
    head.init_lm_head_from_target(target.lm_head.weight)  # as the recipe starts it
    head.train()
    features, logits = _taps(target, head, reply)
    loss_mask = torch.zeros_like(reply)
    loss_mask[:, prompt.shape[1] :] = 1
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    embed = target.get_input_embeddings()
    generator = torch.Generator().manual_seed(0)
    first = None
    for _ in range(150):
        loss, metrics = peagle_loss(
            head, features, reply, logits, loss_mask, embed, ratio=0.9, min_ratio=0.5, generator=generator
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = first if first is not None else metrics["top1_slot3"].item()
    assert metrics["top1_slot3"] > max(0.7, first)
    head.eval()
    out = generate(target, prompt, head, max_new_tokens=40, tree=[(0,) * d for d in range(1, 5)]).one
    assert out.sequences.tolist() == reply.tolist()
    assert out.tau > 2.5, out.tau  # 1.0 untrained; at most 5 with this chain


def test_chains_are_whole_nested_and_shrink_with_depth():
    """Depth d keeps about max(ratio**d, min_ratio) of the scored positions, every kept chain has all its
    shallower placeholders, and every placeholder scores a token to learn, as does its anchor's depth-0 row
    (an anchor at the end of the assistant header, whose depth-0 token is the header's newline, is not one
    decoding drafts from)."""
    mask = torch.zeros(2, 40, dtype=torch.long)
    mask[0, 5:] = 1
    mask[1, 10:20] = 1
    anchors, depth, valid = peagle_chains(mask, 5, ratio=0.6, min_ratio=0.2, generator=torch.Generator())
    for r in range(2):
        pairs = set(zip(anchors[r][valid[r]].tolist(), depth[r][valid[r]].tolist(), strict=True))
        for a, d in pairs:
            assert d == 1 or (a, d - 1) in pairs
            assert a + d + 2 < 40 and mask[r, a + d + 2] == 1
            assert mask[r, a + 2] == 1, (r, a, d)  # its depth-0 token too: a prefix decoding drafts from
    scored = int(mask[0, 2:].sum())
    per_depth = [int(((depth[0] == d) & valid[0]).sum()) for d in range(1, 5)]
    assert scored == 35 and per_depth == [21, 13, 8, 7]  # ceil(35 * max(0.6 ** d, 0.2))
    capped, _, ok = peagle_chains(mask, 3, max_anchors=4, generator=torch.Generator())
    assert int(((capped[0] >= 0) & ok[0]).sum()) <= 4 + 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"parallel_depths": 0}, "parallel_depths must be at least 1"),
        ({"mask_token_id": 128}, r"mask_token_id must be a token id in \[0, 128\), got 128"),
        ({"mask_token_id": None}, "mask_token_id must be a token id"),
        ({"head_type": "eagle3"}, r"head_type must be one of \('peagle',\)"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(build_target, change, message):
    config = PEagleConfig.from_target(build_target("llama").config, mask_token_id=3).to_dict()
    with pytest.raises(ValueError, match=message):
        PEagleConfig(**{**config, **change})


def test_a_head_started_from_an_eagle3_head_drafts_its_first_depth_as_that_head(build_target):
    """`PEagleHead.from_eagle3`: the EAGLE-3 head's weights and draft vocabulary, its EAGLE-3.1 norm_output
    dropped, and depth 1 (the root's own output) equal to that head's root logits; the placeholders are
    new."""
    from decode.drafters.eagle import EagleDrafter
    from heads.eagle import EagleConfig, EagleHead

    target = build_target("llama")
    torch.manual_seed(3)
    config = EagleConfig.from_target(
        target.config, "eagle3", draft_vocab_size=48, norm_before_fc=True, norm_output=True
    )
    eagle3 = EagleHead(config)
    eagle3.set_draft_vocab(torch.randperm(target.config.vocab_size)[:48])
    torch.nn.init.normal_(eagle3.lm_head.weight, std=0.5)
    torch.nn.init.normal_(eagle3.input_norm.weight)
    eagle3.eval()
    embedding = target.get_input_embeddings().weight
    head = PEagleHead.from_eagle3(eagle3, 3, 11, embedding).eval()
    assert (head.config.norm_before_fc, head.config.norm_output, head.config.mask_token_id) == (
        True,
        False,
        11,
    )
    assert torch.equal(head.d2t, eagle3.d2t) and torch.equal(head.mask_embedding, embedding[11])
    ids = torch.randint(0, target.config.vocab_size, (1, 14))
    features, _ = _taps(target, head, ids)
    ours, theirs = PEagleDrafter(head, target, 1), EagleDrafter(eagle3, target, 1)
    for drafter in (ours, theirs):
        drafter.advance([features[0, :13]], [ids[0, 1:]])
    torch.testing.assert_close(ours.root_logits(), theirs.root_logits(), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="starts from an eagle3 head, got eagle1"):
        PEagleHead.from_eagle3(EagleHead(EagleConfig.from_target(target.config, "eagle1")), 3, 11, embedding)
