"""Training losses: alignment with decode-time drafting, masks, and that they can be minimised."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decode.drafters.eagle import EagleDrafter
from heads import EagleConfig, EagleHead, FeatureCapture, MedusaConfig, MedusaHeads
from train.losses import (
    acceptance,
    eagle1_loss,
    eagle3_ttt_loss,
    lk_loss,
    medusa_loss,
    ttt_attention_mask,
    ttt_chains,
)

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


def test_ttt_trains_only_chains_of_reply_tokens():
    """Two replies (1) around a user turn (0): step j at t scores token t + 2 after drafting t - j + 2 ..
    t + 1, so it trains only where all of them are reply tokens (the old mask checked token t + 2 alone and
    trained chains that drafted the user turn, which decoding never does)."""
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]])
    chains = ttt_chains(loss_mask, 3)
    assert chains.shape == (3, 1, 13)
    scored = [(row.nonzero().flatten() + 2).tolist() for row in chains[:, 0]]  # the tokens each step scores
    assert scored == [[2, 3, 4, 5, 9, 10, 11, 12, 13], [3, 4, 5, 10, 11, 12, 13], [4, 5, 11, 12, 13]]


@pytest.mark.parametrize("norms", [{}, {"norm_before_fc": True, "norm_output": True}], ids=["eagle3", "3.1"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_ttt_steps_equal_decode_time_chain_drafting(target, depth, norms):
    """TTT step j at position t must compute what the decoder computes for a depth-j chain node (also with
    the EAGLE-3.1 norms, whose weights are set off ones so a missed norm would show)."""
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=V, **norms)).eval()
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
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
    drafter = EagleDrafter(head, target, 1)
    drafter.advance([feats[0, :committed]], [ids[0, 1 : committed + 1]])
    node_logits = drafter.root_logits()[0]
    for d in range(1, depth + 1):  # a chain: each node's parent is the node expanded before it (row d - 2)
        token = ids[0, committed + d : committed + d + 1]
        node_logits = drafter.expand(torch.tensor([[d - 2]]), token[None], d)[0, 0]
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
    from train.eagle import draft_vocab_logits, target_pass

    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=40))
    head.set_draft_vocab(torch.randperm(V)[:40])
    batch = {"input_ids": torch.randint(0, V, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    with FeatureCapture(target, head.feature_layers) as capture:
        full_features, full = target_pass(target, capture, batch)
        features, reduced = target_pass(target, capture, batch, draft_vocab_logits(head, target))
        _, with_other = target_pass(target, capture, batch, draft_vocab_logits(head, target, other=True))
    torch.testing.assert_close(features, full_features)
    torch.testing.assert_close(reduced, full[..., head.t2d], atol=1e-5, rtol=1e-5)
    # the last column pools the outside tokens: softmax over Vd + 1 = the target's distribution, pooled
    pooled = torch.softmax(with_other, -1)
    probs = torch.softmax(full, -1)
    torch.testing.assert_close(pooled[..., :40], probs[..., head.t2d], atol=1e-6, rtol=1e-5)
    outside = torch.ones(V, dtype=torch.bool)
    outside[head.t2d] = False
    torch.testing.assert_close(pooled[..., 40], probs[..., outside].sum(-1), atol=1e-6, rtol=1e-5)
    assert draft_vocab_logits(EagleHead(EagleConfig.from_target(target.config, "eagle1")), target) is None


def test_draft_vocab_logits_soft_cap_and_chunk_like_the_full_head():
    from train.eagle import DraftVocabLogits

    torch.manual_seed(0)
    weight, hidden, t2d = torch.randn(50, 8), torch.randn(3, 150, 8) * 4, torch.randperm(50)[:20]
    module = DraftVocabLogits(weight, t2d, other=True, softcap=5.0)  # 450 positions: 4 chunks of 128
    full = torch.tanh(hidden @ weight.T / 5.0) * 5.0
    outside = torch.ones(50, dtype=torch.bool)
    outside[t2d] = False
    expected = torch.cat([full[..., t2d], full[..., outside].logsumexp(-1, keepdim=True)], -1)
    torch.testing.assert_close(module(hidden), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(DraftVocabLogits(weight, t2d, softcap=5.0)(hidden), full[..., t2d])


def test_forward_kl_weighs_the_target_mass_inside_the_draft_vocabulary(target):
    """soft_ce trains on the target distribution renormalised over the draft vocabulary, forward_kl on the
    target's own probabilities of those tokens: forward_kl weighs each position by the target's mass inside
    the draft vocabulary (exactly, shown with a uniform draft); the two agree when the draft vocabulary is
    the whole vocabulary, and forward_kl refuses logits without the
    outside mass."""
    from train.losses import draft_target_probs

    torch.manual_seed(3)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=16))
    head.set_draft_vocab(torch.randperm(V)[:16])
    logits = torch.randn(2, 5, V) * 3
    soft, mass = draft_target_probs(head, logits, "soft_ce")
    kl, mass_kl = draft_target_probs(head, logits, "forward_kl")
    probs = torch.softmax(logits, -1)[..., head.t2d]
    torch.testing.assert_close(kl, probs)
    torch.testing.assert_close(soft, probs / probs.sum(-1, keepdim=True))
    torch.testing.assert_close(mass, probs.sum(-1))
    assert torch.equal(mass, mass_kl) and (mass < 0.9).all()
    outside = torch.ones(V, dtype=torch.bool)
    outside[head.t2d] = False
    pooled = torch.cat([logits[..., head.t2d], logits[..., outside].logsumexp(-1, keepdim=True)], -1)
    torch.testing.assert_close(draft_target_probs(head, pooled, "forward_kl")[0], kl, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="forward_kl needs the target's mass outside"):
        draft_target_probs(head, logits[..., head.t2d], "forward_kl")
    with pytest.raises(ValueError, match="width 7"):
        draft_target_probs(head, logits[..., :7], "soft_ce")

    # through the TTT loss: one step, a fixed draft; forward_kl = sum over positions of mass x soft_ce term
    ids = torch.randint(0, V, (2, 6))
    features, full_logits = _target_pass(target, head, ids)
    mask = torch.ones(2, 6, dtype=torch.long)
    embed = target.get_input_embeddings()
    losses = {
        distill: eagle3_ttt_loss(head, features, ids, full_logits, mask, embed, ttt_steps=1, distill=distill)
        for distill in ("soft_ce", "forward_kl")
    }
    assert losses["forward_kl"][0] < losses["soft_ce"][0]  # every position scaled by its mass < 1
    torch.testing.assert_close(losses["forward_kl"][1]["draft_mass"], losses["soft_ce"][1]["draft_mass"])
    with torch.no_grad():  # a uniform draft: each position's -sum p log q is (its mass) x log Vd
        head.lm_head.weight.zero_()
    uniform = {
        distill: eagle3_ttt_loss(head, features, ids, full_logits, mask, embed, ttt_steps=1, distill=distill)
        for distill in ("soft_ce", "forward_kl")
    }
    log_vd = torch.log(torch.tensor(16.0))
    torch.testing.assert_close(uniform["soft_ce"][0], log_vd)
    torch.testing.assert_close(uniform["forward_kl"][0], uniform["forward_kl"][1]["draft_mass"] * log_vd)
    whole = EagleHead(EagleConfig.from_target(target.config, "eagle3"))  # draft vocabulary = vocabulary
    same = [
        eagle3_ttt_loss(whole, features, ids, full_logits, mask, embed, ttt_steps=2, distill=d)[0]
        for d in ("soft_ce", "forward_kl")
    ]
    torch.testing.assert_close(same[0], same[1])


def test_lk_nla_is_minus_log_acceptance_and_the_cross_entropy_of_a_one_hot_target():
    torch.manual_seed(0)
    logits, p = torch.randn(3, 4, 10) * 2, torch.softmax(torch.randn(3, 4, 10) * 2, -1)
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 0, 0, 1]])
    q = torch.softmax(logits, -1)
    alpha = torch.minimum(p, q).sum(-1)
    torch.testing.assert_close(acceptance(logits, p), alpha)
    torch.testing.assert_close(alpha, 1 - 0.5 * (p - q).abs().sum(-1))  # 1 - total variation
    torch.testing.assert_close(lk_loss(logits, p, mask, "lk_nla"), -alpha.log()[mask.bool()].mean())
    one_hot = torch.nn.functional.one_hot(p.argmax(-1), 10).float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), p.argmax(-1).reshape(-1), reduction="none")
    torch.testing.assert_close(lk_loss(logits, one_hot, mask, "lk_nla"), ce.reshape(3, 4)[mask.bool()].mean())
    far = torch.full((1, 10), -1e4)
    far[0, 0] = (
        1e4  # the draft puts everything where the target puts nothing: alpha underflows, loss stays finite
    )
    target = torch.zeros(1, 10)
    target[0, 1] = 1.0
    assert torch.isfinite(lk_loss(far, target, torch.ones(1), "lk_nla"))
    with pytest.raises(ValueError, match="'lk_nla' or 'lk_hybrid'"):
        lk_loss(logits, p, mask, "nla")


def test_lk_nla_trains_the_positions_the_draft_misses_by_far():
    """Where the draft puts 2e-6 on the token a one-hot target wants, -log alpha is -log q (13.0, not a
    floor's 11.5) and its gradient is the cross-entropy's, q - onehot: a floor cut it to zero there, so the
    draft's worst misses went untrained."""
    logits = torch.zeros(1, 2, 8192)
    logits[0, 0, 9], logits[0, 1, 9] = 13.0, 5.0
    logits.requires_grad_(True)
    target = torch.zeros(1, 2, 8192)
    target[..., 5] = 1.0
    q = torch.softmax(logits.detach(), -1)
    assert q[0, 0, 5] < 1e-5 < q[0, 1, 5]
    loss = lk_loss(logits, target, torch.ones(1, 2), "lk_nla")
    torch.testing.assert_close(loss, -q[0, :, 5].log().mean())
    loss.backward()
    torch.testing.assert_close(logits.grad, (q - target) / 2, atol=1e-7, rtol=1e-4)


def test_a_draft_vocabulary_one_token_short_of_the_target_is_refused(target):
    """Its logits with the outside-mass column would be as wide as the full vocabulary's: the losses, which
    tell the two apart by width, would read the outside column as a token."""
    from train.losses import draft_target_probs

    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=V - 1))
    with pytest.raises(ValueError, match=f"a draft vocabulary of {V - 1} tokens, one less than the target's"):
        draft_target_probs(head, torch.randn(2, V), "forward_kl")


def test_lk_hybrid_weighs_kl_and_tv_by_the_acceptance_without_differentiating_the_weight():
    """lambda = exp(-eta alpha) is a constant for the gradient: the loss's gradient equals the gradient of
    lambda * KL + (1 - lambda) * TV with lambda computed beforehand and held fixed; a draft far from the
    target leans on KL (lambda near 1), a close one on TV."""
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(5, 12) * 3, -1)
    mask = torch.ones(5)
    logits = (torch.randn(5, 12) * 3).requires_grad_()
    loss = lk_loss(logits, p, mask, "lk_hybrid", eta=3.0)
    (grad,) = torch.autograd.grad(loss, logits)

    fixed = logits.detach().clone().requires_grad_()
    q = torch.softmax(fixed, -1)
    alpha = torch.minimum(p, q).sum(-1)
    weight = torch.exp(-3.0 * alpha).detach()
    kl = (p * (p.log() - q.log())).sum(-1)
    expected = (weight * kl + (1 - weight) * (1 - alpha)).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, torch.autograd.grad(expected, fixed)[0])
    close = p.log() + 0.01 * torch.randn(5, 12)  # a draft close to the target: alpha near 1, small weight
    assert (torch.exp(-3.0 * acceptance(close, p)) < 0.06).all() and (weight > 0.05).all()
    assert lk_loss(close, p, mask, "lk_hybrid") < loss


def test_lk_losses_train_eagle3_on_the_targets_own_probabilities_and_report_the_acceptance(target):
    """The TTT loss with an LK distillation: it needs the target's mass outside the draft vocabulary (as
    forward_kl does), reports alpha per step for every distillation (the mean acceptance of a draft token),
    and an optimizer step on lk_nla raises that acceptance."""
    from train.losses import draft_target_probs

    torch.manual_seed(4)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=16))
    head.set_draft_vocab(torch.randperm(V)[:16])
    ids = torch.randint(0, V, (2, 8))
    features, full_logits = _target_pass(target, head, ids)
    full_logits = full_logits * 4  # a peaked target (the tiny random one is near uniform: alpha = its mass)
    mask, embed = torch.ones(2, 8, dtype=torch.long), target.get_input_embeddings()
    with pytest.raises(ValueError, match="lk_nla needs the target's mass outside"):
        draft_target_probs(head, full_logits[..., head.t2d], "lk_nla")
    for distill in ("soft_ce", "lk_hybrid"):
        _, metrics = eagle3_ttt_loss(
            head, features, ids, full_logits, mask, embed, ttt_steps=2, distill=distill
        )
        assert 0 < metrics["alpha_step0"] <= metrics["draft_mass"] <= 1  # nothing outside Vd is accepted
    # alpha_step0 by hand: the first step's draft over the draft vocabulary against the target's own p
    with torch.no_grad():
        hidden = head(
            head.project_features(features[:, :-1]), embed(ids[:, 1:]), torch.arange(7).expand(2, -1)
        )
        own = torch.softmax(full_logits[:, 1:], -1)[..., head.t2d]
        by_hand = acceptance(head.logits(hidden, None), own)[:, :-1].mean()
    torch.testing.assert_close(metrics["alpha_step0"], by_hand)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5)
    before = None
    for _ in range(5):
        loss, metrics = eagle3_ttt_loss(
            head, features, ids, full_logits, mask, embed, ttt_steps=1, distill="lk_nla"
        )
        before = metrics["alpha_step0"] if before is None else before
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert (
        eagle3_ttt_loss(head, features, ids, full_logits, mask, embed, ttt_steps=1)[1]["alpha_step0"] > before
    )
