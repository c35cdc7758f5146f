"""Training losses: alignment with decode-time drafting, masks, and that they can be minimised."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decode.propose import EagleDrafter
from heads import EagleConfig, EagleHead, FeatureCapture, MedusaConfig, MedusaHeads
from train.losses import eagle1_loss, eagle3_ttt_loss, medusa_loss, ttt_attention_mask

V, H = 64, 32


@pytest.fixture(scope="module")
def target():
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval().requires_grad_(False)


def _target_pass(model, head, ids):
    with torch.no_grad(), FeatureCapture(model, head.feature_layers) as capture:
        logits = model(ids).logits
        return capture.features(), logits


def test_ttt_mask_by_hand():
    allowed = ttt_attention_mask(4, 1, torch.float32, torch.device("cpu"))[0, 0] == 0
    expected = torch.tensor(
        [
            # step-0 keys (t - 1 and before) | step-1 keys (self)
            [0, 0, 0, 0, 1, 0, 0, 0],
            [1, 0, 0, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)
    allowed2 = ttt_attention_mask(4, 2, torch.float32, torch.device("cpu"))[0, 0] == 0
    assert allowed2[3].nonzero().flatten().tolist() == [
        0,
        1,
        4 + 2,
        8 + 3,
    ]  # prefix <= 1, ancestor at 2, self


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_ttt_steps_equal_decode_time_chain_drafting(target, depth):
    """TTT step j at position t must compute what the decoder computes for a depth-j chain node."""
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=V)).eval()
    ids = torch.randint(0, V, (1, 12))
    feats, logits = _target_pass(target, head, ids)
    captured = {}
    original = head.logits

    def record(hidden, lm_head):  # keep the draft logits of each step
        captured.setdefault("steps", []).append(original(hidden, lm_head))
        return captured["steps"][-1]

    head.logits = record
    eagle3_ttt_loss(
        head, feats, ids, logits, torch.ones_like(ids), target.get_input_embeddings(), ttt_steps=depth + 1
    )
    head.logits = original
    t = 8  # the query position checked
    committed = t - depth + 1  # draft positions holding verified features
    drafter = EagleDrafter(head, target)
    drafter.advance(feats[0, :committed], ids[0, 1 : committed + 1])
    node_logits, parent = drafter.root_logits(), 0
    for d in range(1, depth + 1):
        token = ids[0, committed + d : committed + d + 1]
        node_logits = drafter.expand([d], token, [parent], d)[0]
        parent = d
    torch.testing.assert_close(node_logits, captured["steps"][depth][0, t], atol=1e-5, rtol=1e-5)


def test_medusa_loss_alignment_and_mask():
    ids = torch.randint(0, V, (2, 10))
    logits = torch.full((3, 2, 10, V), -20.0)
    for k in range(3):  # head k at t scores token t + k + 2 perfectly
        logits[k, :, : 10 - k - 2].scatter_(-1, ids[:, k + 2 :, None], 20.0)
    loss, metrics = medusa_loss(logits, ids, torch.ones_like(ids))
    assert loss.item() < 1e-6 and all(metrics[f"top1_head{k}"].item() == 1.0 for k in range(3))
    shifted, _ = medusa_loss(logits.roll(1, dims=2), ids, torch.ones_like(ids))
    assert shifted.item() > 1.0
    mask = torch.zeros_like(ids)
    mask[:, 5] = 1  # only token 5 counts; break every other prediction
    broken = logits.clone()
    broken[0, :, :3] = 0.0
    assert medusa_loss(broken, ids, mask)[0].item() < 1e-6


def test_eagle1_loss_trains_the_head_and_respects_the_mask(target):
    torch.manual_seed(2)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle1"))
    ids = torch.randint(0, V, (2, 9))
    feats, logits = _target_pass(target, head, ids)
    mask = torch.ones_like(ids)
    loss, metrics = eagle1_loss(
        head,
        feats,
        ids,
        logits,
        mask,
        target.get_input_embeddings(),
        target.get_output_embeddings(),
        noise_width=0.0,
    )
    loss.backward()
    assert all(p.grad is not None for p in head.parameters())
    assert metrics["feature_loss"] > 0 and 0 <= metrics["top1"] <= 1
    mask[:, 2:] = 0  # nothing left to learn
    empty, _ = eagle1_loss(
        head,
        feats,
        ids,
        logits,
        mask,
        target.get_input_embeddings(),
        target.get_output_embeddings(),
        noise_width=0.0,
    )
    assert empty.item() == 0.0


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "medusa"])
def test_losses_can_be_minimised(target, kind):
    torch.manual_seed(3)
    if kind == "medusa":
        head = MedusaHeads(MedusaConfig(H, V, num_heads=2))
        head.init_from_lm_head(target.get_output_embeddings().weight)
    else:
        head = EagleHead(
            EagleConfig.from_target(
                target.config, kind, **({"draft_vocab_size": 48} if kind == "eagle3" else {})
            )
        )
    ids = torch.randint(0, V, (2, 16))
    feats, logits = _target_pass(target, head, ids)
    logits = logits * 8  # a random tiny target is nearly uniform; sharpen it so its argmax is learnable
    mask = torch.ones_like(ids)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)

    def step():
        if kind == "medusa":
            return medusa_loss(head(feats), ids, mask)
        if kind == "eagle1":
            return eagle1_loss(
                head,
                feats,
                ids,
                logits,
                mask,
                target.get_input_embeddings(),
                target.get_output_embeddings(),
                noise_width=0.0,
            )
        return eagle3_ttt_loss(head, feats, ids, logits, mask, target.get_input_embeddings(), ttt_steps=2)

    first = step()[0].item()
    for _ in range(100):
        optimizer.zero_grad()
        loss, metrics = step()
        loss.backward()
        optimizer.step()
    # soft-CE has the (high) entropy of a random tiny target as its floor: judge by top-1 agreement too
    assert loss.item() < first, f"{kind}: loss {first:.3f} -> {loss.item():.3f}"
    top1 = {k: v.item() for k, v in metrics.items() if k.startswith("top1")}
    assert min(top1.values()) >= 0.8, f"{kind}: top-1 after training {top1}"


def test_medusa_loss_from_hidden_equals_full_logits_version():
    from train.losses import medusa_loss_from_hidden

    torch.manual_seed(4)
    heads = MedusaHeads(MedusaConfig(H, V, num_heads=3))
    for block in heads.blocks:  # non-identity blocks
        torch.nn.init.normal_(block[0].linear.weight, std=0.3)
    hidden, ids = torch.randn(2, 11, H), torch.randint(0, V, (2, 11))
    mask = (torch.rand(2, 11) > 0.3).long()
    full, full_metrics = medusa_loss(heads(hidden), ids, mask)
    light, light_metrics = medusa_loss_from_hidden(heads, hidden, ids, mask)
    torch.testing.assert_close(light, full, atol=1e-5, rtol=1e-5)
    for key, value in full_metrics.items():
        torch.testing.assert_close(light_metrics[key], value, atol=1e-5, rtol=1e-5)


def test_target_pass_over_draft_rows_equals_full_logits_restricted(target):
    from train.eagle import draft_vocab_rows, target_pass

    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=40))
    head.set_draft_vocab(torch.randperm(V)[:40])
    batch = {"input_ids": torch.randint(0, V, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    with FeatureCapture(target, head.feature_layers) as capture:
        full_features, full = target_pass(target, capture, batch)
        features, reduced = target_pass(target, capture, batch, draft_vocab_rows(head, target))
    torch.testing.assert_close(features, full_features)
    torch.testing.assert_close(reduced, full[..., head.t2d], atol=1e-5, rtol=1e-5)
    assert draft_vocab_rows(EagleHead(EagleConfig.from_target(target.config, "eagle1")), target) is None
