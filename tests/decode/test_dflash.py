"""DFlash (heads/dflash.py, decode/drafters/dflash.py, train.block_losses.dflash_loss): training scores a
block as decoding does, batches equal rows alone, decoding is lossless, and a head trained on the target's own
continuation drafts it."""

import copy

import pytest
import torch

from decode import BestFirstTree, generate, prepare
from decode.drafters.dflash import DFlashDrafter
from heads.dflash import DFlashConfig, DFlashHead, dflash_layers
from heads.features import FeatureCapture
from train.block_losses import dflash_anchors, dflash_block_logits, dflash_loss, dflash_slots


def _head(target, block=5, vocab=None, layers=2, seed=0):
    torch.manual_seed(seed)
    config = DFlashConfig.from_target(
        target.config,
        target.config.vocab_size - 1,
        num_hidden_layers=layers,
        block_size=block,
        draft_vocab_size=vocab,
    )
    head = DFlashHead(config)
    if vocab:
        head.set_draft_vocab(torch.randperm(target.config.vocab_size)[:vocab])
        torch.nn.init.normal_(head.lm_head.weight, std=0.5)
    return head.eval()


def _taps(target, head, ids):
    with torch.no_grad(), FeatureCapture(target, head.feature_layers) as capture:
        logits = target(ids).logits
        return capture.features(), logits


@pytest.mark.parametrize("vocab", [None, 48], ids=["target-lm_head", "own-vocab"])
def test_training_scores_each_block_as_decoding_does(tiny_target, vocab):
    """One training forward over several anchors' blocks gives, for each, the logits the drafter computes
    after taking in that anchor's prefix in uneven chunks."""
    head = _head(tiny_target, vocab=vocab)
    torch.manual_seed(1)
    ids = torch.randint(0, tiny_target.config.vocab_size, (2, 24))
    features, _ = _taps(tiny_target, head, ids)
    anchors = torch.tensor([[3, 11, 20], [6, 7, 22]])
    blocks = dflash_block_logits(
        head, features, ids, anchors, tiny_target.get_input_embeddings(), tiny_target.lm_head
    )
    for row in range(2):
        for n, a in enumerate(anchors[row].tolist()):
            drafter = DFlashDrafter(head, tiny_target, 1)
            cut = a // 2
            drafter.advance([features[row, :cut]], [ids[row, 1 : cut + 1]])
            drafter.advance([features[row, cut:a]], [ids[row, cut + 1 : a + 1]])
            torch.testing.assert_close(drafter._logits[0], blocks[row, n], atol=2e-5, rtol=1e-4)
            assert drafter.root_logits().shape == (1, head.config.draft_vocab_size)
            torch.testing.assert_close(
                drafter.expand(None, None, 3)[:, 0], blocks[row, n, 3][None], atol=2e-5, rtol=1e-4
            )


def test_a_batch_equals_each_row_alone_through_uneven_advances_and_leaving_rows(build_target):
    target = build_target("qwen2")
    assert_batch_equals_rows(DFlashDrafter, _head(target, block=4), target)


def assert_batch_equals_rows(drafter_class, head, target) -> None:
    """A block drafter for 3 rows drafts what 3 one-row drafters do, through uneven advances and a row
    leaving the batch (its `_logits` hold every depth's distribution)."""
    torch.manual_seed(2)
    ids = torch.randint(0, target.config.vocab_size, (3, 40))
    features, _ = _taps(target, head, ids)
    batch = drafter_class(head, target, 3)
    alone = [drafter_class(head, target, 1) for _ in range(3)]
    done = [0, 0, 0]
    rows = [0, 1, 2]
    for step, sizes in enumerate([(5, 9, 2), (1, 3, 4), (2, 1, 1), (4, 2, 3), (3, 3, 3)]):
        feats, toks = [], []
        for r, n in zip(rows, sizes):
            feats.append(features[r, done[r] : done[r] + n])
            toks.append(ids[r, done[r] + 1 : done[r] + n + 1])
            alone[r].advance([feats[-1]], [toks[-1]])
            done[r] += n
        batch.advance(feats, toks)
        for i, r in enumerate(rows):
            torch.testing.assert_close(batch._logits[i], alone[r]._logits[0], atol=2e-5, rtol=1e-4)
        if hasattr(batch, "cache"):  # a drafter whose proposals add nothing to its cache: none left there
            assert batch.cache.keys.shape[2] == batch.valid.shape[1]
        if step == 2:  # row 1 finishes
            rows = [0, 2]
            batch.select([0, 2])


def test_taps_spread_as_dflash_spreads_them():
    assert dflash_layers(30, 5) == (1, 8, 14, 20, 27)  # DFlash's build_target_layer_ids for 30 layers
    assert dflash_layers(36, 1) == (18,)
    assert dflash_layers(4, 2) == (0, 3)  # a tiny target: spread over all its layers


@pytest.mark.parametrize("tree", ["static", "best-first", "chain", "prepared"])
def test_greedy_output_equals_plain_decoding(tiny_target, tree):
    """With the default static tree, a best-first tree, a chain, and after `decode.prepare` (the CPU layout
    and, where fbgemm runs, int8 layers but fc): the same tokens as plain decoding, alone and in a batch."""
    assert_greedy_equals_plain(tiny_target, _head(tiny_target, vocab=48), tree)


def assert_greedy_equals_plain(target, head, tree: str) -> None:
    """A block head's greedy output equals plain decoding's on 3 left-padded rows, with the `tree` named
    ("static": the default, "best-first", "chain", or "prepared": best-first after `decode.prepare`), and its
    drafts were offered."""
    trees = {"static": None, "best-first": BestFirstTree(6), "chain": [(0,) * d for d in range(1, 5)]}
    if tree == "prepared":
        target = copy.deepcopy(target)
        head = prepare(target, head, BestFirstTree(6))
        trees["prepared"] = BestFirstTree(6)
    ids = torch.randint(1, target.config.vocab_size, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = mask[2, :2] = 0
    plain = generate(target, ids, None, max_new_tokens=16, attention_mask=mask)
    drafted = generate(target, ids, head, max_new_tokens=16, attention_mask=mask, tree=trees[tree])
    assert drafted.sequences.tolist() == plain.sequences.tolist()
    assert min(drafted.draft_nodes) > 0  # the drafts were offered


def test_a_head_trained_on_the_targets_continuation_drafts_it(build_target):
    """A few hundred steps of `dflash_loss` on one greedy continuation: decoding that prompt again takes whole
    blocks (the trained slots are the ones decoding reads), and the output is still the target's."""
    target = build_target("llama")
    prompt = torch.tensor([[5, 17, 3, 99, 42, 7]])
    reply = generate(target, prompt, None, max_new_tokens=40).sequences
    head = _head(target, block=5, layers=1).train()
    features, logits = _taps(target, head, reply)
    loss_mask = torch.zeros_like(reply)
    loss_mask[:, prompt.shape[1] :] = 1
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    embed = target.get_input_embeddings()
    first = None
    for _ in range(150):
        loss, metrics = dflash_loss(
            head, features, reply, logits, loss_mask, embed, target.lm_head, anchors=16
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = first if first is not None else metrics["alpha_slot1"].item()
    assert metrics["alpha_slot1"] > max(0.9, first)
    head.eval()
    out = generate(target, prompt, head, max_new_tokens=40, tree=[(0,) * d for d in range(1, 5)]).one
    assert out.sequences.tolist() == reply.tolist()
    assert out.tau > 2.5, out.tau  # 1.0 untrained; at most 5 with this chain


def test_anchors_are_distinct_learnable_positions_with_a_learnable_successor():
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 4:] = 1
    mask[1, 9:11] = 1  # one candidate: 9 (10's successor is not learnable)
    anchors, valid = dflash_anchors(mask, 5, torch.Generator().manual_seed(0))
    first = anchors[0][valid[0]]
    assert len(first) == 5 and len(set(first.tolist())) == 5
    assert all(4 <= a <= 10 for a in first.tolist())
    assert anchors[1][valid[1]].tolist() == [9] and valid[1].sum() == 1


def test_a_block_scores_its_slots_up_to_the_first_that_is_not_a_reply_token():
    """Two replies with a 4-token user turn between them: a block of 8 from the end of the first reaches into
    the second. Its slots past the first reply's end are not scored, those in the next reply neither: they
    would learn a reply from masks standing for a user turn the draft never sees."""
    mask = torch.zeros(1, 24, dtype=torch.long)
    mask[0, 8:14] = 1
    mask[0, 18:24] = 1
    starts = torch.arange(7, 23).unsqueeze(0)
    labels, slots = dflash_slots(mask, starts, torch.ones_like(starts, dtype=torch.bool), 8)
    assert slots[0, 11 - 7].tolist() == [1, 1, 0, 0, 0, 0, 0]  # tokens 12, 13 (end of turn), then the gap
    assert slots[0, 17 - 7].tolist() == [1, 1, 1, 1, 1, 1, 0]  # 18 .. 23, then past the end
    for row, mask_row in zip(slots[0], mask[0, labels[0]], strict=True):
        scored = row.int().tolist()
        assert scored == sorted(scored, reverse=True)  # a prefix of the block
        assert all(mask_row[: sum(scored)])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"block_size": 1}, "block_size must be at least 2"),
        ({"mask_token_id": 128}, r"mask_token_id 128 is outside the vocabulary \[0, 128\)"),
        ({"draft_vocab_size": 500}, r"draft_vocab_size 500 must be in \[1, 128\]"),
        ({"aux_layer_ids": ()}, "needs aux_layer_ids"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(build_target, change, message):
    config = DFlashConfig.from_target(build_target("llama").config, 3).to_dict()
    with pytest.raises(ValueError, match=message):
        DFlashConfig(**{**config, **change})


def test_a_head_starts_from_the_targets_last_layers_and_final_norm(build_target):
    target = build_target("llama")
    head = _head(target, layers=2)
    head.init_from_target(target, layers=True)
    torch.testing.assert_close(head.norm.weight, target.model.norm.weight, rtol=0, atol=0)
    for ours, theirs in zip(head.layers, target.model.layers[-2:], strict=True):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "input_layernorm"):
            assert torch.equal(ours.get_submodule(name).weight, theirs.get_submodule(name).weight), name
        assert torch.equal(ours.self_attn.q_norm.weight, torch.ones_like(ours.self_attn.q_norm.weight))


def test_the_best_first_budget_is_priced_from_measured_tau_and_costs(build_target):
    """`size_best_first`: tau measured per budget, costs measured, the best predicted speedup first; refused
    for a drafter that drafts level by level."""
    from decode import size_best_first

    target = build_target("llama")
    head = _head(target, vocab=48)
    prompts = [torch.tensor([[5, 17, 3, 99, 42]]), torch.tensor([[8, 1, 64]])]
    choices = size_best_first(target, head, prompts, budgets=(1, 4), max_new_tokens=8, repeats=1)
    assert [c.budget for c in sorted(choices, key=lambda c: c.budget)] == [1, 4]
    assert choices[0].predicted_speedup >= choices[1].predicted_speedup
    for c in choices:
        # tau pools tokens per verify pass, the prefill's first token left out (it was counted: +1/N a prompt)
        runs = [
            generate(target, p, head, max_new_tokens=8, tree=BestFirstTree(c.budget)).one for p in prompts
        ]
        assert c.tau == pytest.approx(sum(r.new_tokens - 1 for r in runs) / sum(r.steps for r in runs))
        assert c.verify_seconds > 0 and c.propose_seconds > 0
        expected = c.tau * c.plain_seconds / (c.verify_seconds + c.propose_seconds)
        assert c.predicted_speedup == pytest.approx(expected)
    with pytest.raises(ValueError, match="block drafters"):
        from heads import EagleConfig, EagleHead

        size_best_first(target, EagleHead(EagleConfig.from_target(target.config, "eagle1")), prompts)
