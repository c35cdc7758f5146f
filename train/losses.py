"""Training losses as pure functions: EAGLE-1 (2401.15077 section 4.2), EAGLE-3 training-time test
(2503.01840 section 3.2), Medusa-1 and Medusa-2's head term (2401.10774 section 2.2), and the LK losses
(2602.23881: negative log acceptance and the KL/TV hybrid) as EAGLE-3 distillation options. The block
drafters' losses (DFlash, P-EAGLE) are in train/block_losses.py.

Alignment used throughout: the target's hidden state / logits at position t predict token t + 1; a draft
output at position t (input: feature t and token t + 1) predicts feature t + 1 and token t + 2, so its
label is the target's distribution at t + 1 and it counts where token t + 2 is an assistant token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.eagle import DraftCache, EagleHead, additive_mask
from heads.medusa import MedusaHeads

LK_LOSSES = ("lk_nla", "lk_hybrid")
DISTILL = ("soft_ce", "forward_kl", *LK_LOSSES)  # eagle3_ttt_loss's `distill` (config: eagle.distill_loss)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where `mask` is set (0 when nothing is)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def soft_cross_entropy(logits: Tensor, target_probs: Tensor, mask: Tensor) -> Tensor:
    """Masked mean of -sum_v p(v) log q(v); logits (..., V), target_probs (..., V), mask (...)."""
    return masked_mean(position_losses(logits, target_probs, "soft_ce"), mask)


def position_losses(logits: Tensor, target_probs: Tensor, distill: str, lk_eta: float = 3.0) -> Tensor:
    """The loss of every position (...) under `distill`, before any mean: soft cross-entropy for "soft_ce"
    and "forward_kl" (they differ in the probabilities given, `draft_target_probs`), else `lk_loss`'s."""
    if distill in LK_LOSSES:
        return _lk_positions(logits, target_probs, distill, lk_eta)
    return -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


def acceptance(logits: Tensor, target_probs: Tensor) -> Tensor:
    """alpha = sum_x min(p(x), q(x)) per position (..., V) -> (...): the probability that a token drawn from
    the draft q is accepted against the target p (1 - their total variation distance). `target_probs` must
    be the target's own probabilities (not renormalised over a reduced draft vocabulary: the draft proposes
    nothing outside it, so the mass there is never accepted)."""
    return torch.minimum(target_probs, torch.softmax(logits.float(), dim=-1)).sum(-1)


def lk_loss(logits: Tensor, target_probs: Tensor, mask: Tensor, kind: str, eta: float = 3.0) -> Tensor:
    """The LK losses (Samarin et al., arXiv 2602.23881), masked means over positions.

    "lk_nla": -log alpha, the negative log of the expected acceptance (`acceptance`); with a one-hot target it
    is the cross-entropy. "lk_hybrid": lambda * KL(p || q) + (1 - lambda) * TV(p, q) with TV = 1 - alpha and
    lambda = exp(-eta * alpha) per position, alpha not differentiated through: KL's gradients while the draft
    is far from the target (TV's vanish for a near-uniform draft over a large vocabulary), TV's once it
    accepts often. KL is over the draft vocabulary's tokens, sum p log(p / q), which differs from the full
    divergence by terms the draft cannot change.
    """
    return masked_mean(_lk_positions(logits, target_probs, kind, eta), mask)


def _lk_positions(logits: Tensor, target_probs: Tensor, kind: str, eta: float) -> Tensor:
    """`lk_loss` at every position (...), before the mean."""
    if kind not in LK_LOSSES:
        raise ValueError(f"kind must be 'lk_nla' or 'lk_hybrid', got {kind!r}")
    logq = torch.log_softmax(logits.float(), dim=-1)  # one pass: q for alpha, log q for KL
    if kind == "lk_nla":
        # -log alpha as a log-sum-exp of min(log p, log q): exact and finite however small alpha is, and its
        # gradient is whole there (a floor, -log max(alpha, 1e-5), left the draft's worst misses untrained);
        # a target probability that is exactly 0 counts as the smallest normal float
        logp = torch.log(target_probs.float().clamp_min(torch.finfo(torch.float32).tiny))
        return -torch.logsumexp(torch.minimum(logp, logq), dim=-1)
    alpha = torch.minimum(target_probs, logq.exp()).sum(-1)  # `acceptance`
    kl = (torch.xlogy(target_probs, target_probs) - target_probs * logq).sum(-1)
    weight = torch.exp(-eta * alpha.detach())
    return weight * kl + (1 - weight) * (1 - alpha)


def top1_rate(logits: Tensor, target_probs: Tensor, mask: Tensor) -> Tensor:
    return masked_mean((logits.argmax(-1) == target_probs.argmax(-1)).float(), mask)


def eagle1_loss(
    head: EagleHead,
    target_features: Tensor,
    input_ids: Tensor,
    target_logits: Tensor,
    loss_mask: Tensor,
    embed: nn.Module,
    lm_head: nn.Module,
    *,
    noise_width: float = 0.2,
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """EAGLE-1: SmoothL1 on predicted features + soft cross-entropy through the frozen lm_head.

    Args:
        head: an eagle1 head.
        target_features: (B, T, H) target final hidden states.
        input_ids: (B, T) tokens.
        target_logits: (B, T, V) target logits.
        loss_mask: (B, T) 1 on tokens to learn (assistant tokens).
        embed, lm_head: the target's frozen embedding and lm_head.
        noise_width: width of the uniform noise added to input features (EAGLE's robustness trick).
        feature_weight, ce_weight: loss weights (1.0 and 0.1 in EAGLE).
        generator: random source for the noise.
    Returns:
        (loss, metrics) with metrics `feature_loss`, `ce_loss`, `top1`.
    """
    b, t, _ = target_features.shape
    feats = target_features[:, :-1]  # (B, T-1, H)
    if noise_width > 0:
        noise = torch.rand(feats.shape, generator=generator, device=feats.device, dtype=feats.dtype)
        feats = feats + (noise - 0.5) * noise_width
    embeds = embed(input_ids[:, 1:]).to(feats.dtype)  # (B, T-1, H)
    positions = torch.arange(t - 1, device=feats.device).expand(b, -1)
    predicted = head(feats, embeds, positions)[:, :-1]  # (B, T-2, H)
    mask = loss_mask[:, 2:].bool()  # token t + 2
    feature_loss = masked_mean(
        F.smooth_l1_loss(predicted.float(), target_features[:, 1:-1].float(), reduction="none").mean(-1), mask
    )
    target_probs = torch.softmax(target_logits[:, 1:-1].float(), dim=-1)
    logits = lm_head(predicted)
    ce_loss = soft_cross_entropy(logits, target_probs, mask)
    loss = feature_weight * feature_loss + ce_weight * ce_loss
    return loss, {
        "feature_loss": feature_loss.detach(),
        "ce_loss": ce_loss.detach(),
        "top1": top1_rate(logits.detach(), target_probs, mask),
    }


def ttt_attention_mask(length: int, step: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(1, 1, L, (step + 1) * L) mask of unrolled step `step` over keys of steps 0..step, in step order.

    The query of step j at position t plays a depth-j tree node whose committed prefix ends at t - j: it
    sees step-0 keys at positions <= t - j, the key of step i at position t - j + i (its ancestors,
    0 < i < j) and itself, exactly as at decode time (decode/drafters/eagle.py `EagleDrafter.expand`).
    """
    pos = torch.arange(length, device=device)
    allowed = [pos[None, :] <= (pos[:, None] - step)]  # step 0: causal, shifted
    for i in range(1, step + 1):
        allowed.append(pos[None, :] == (pos[:, None] - step + i))  # one diagonal per step
    mask = torch.cat(allowed, dim=1)
    mask[:, step * length :] |= torch.eye(length, dtype=torch.bool, device=device)  # rows t < j: self only
    return additive_mask(mask, dtype)[None, None]


def eagle3_ttt_loss(
    head: EagleHead,
    target_features: Tensor,
    input_ids: Tensor,
    target_logits: Tensor,
    loss_mask: Tensor,
    embed: nn.Module,
    *,
    ttt_steps: int = 3,
    decay: float = 0.8,
    distill: str = "soft_ce",
    lk_eta: float = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """EAGLE-3 training-time test: unroll the draft on its own features for `ttt_steps` steps.

    Step 0 reads the fused target taps; step j reads step j-1's output at the previous position. Each
    step's logits over the draft vocabulary are trained against the target's distribution over the draft
    vocabulary, weighted decay**j: renormalised over it ("soft_ce"), or as the target's full-vocabulary
    probabilities of those tokens ("forward_kl": the KL divergence from the target up to terms the draft
    cannot change; a position whose target mass lies outside the draft vocabulary weighs less), or by an LK
    loss on those same probabilities ("lk_nla", "lk_hybrid": `lk_loss`).

    Args:
        head: an eagle3 head (its t2d selects the draft vocabulary).
        target_features: (B, T, taps * H) concatenated tapped target states.
        input_ids, target_logits, loss_mask: (B, T); the target logits over the full vocabulary (B, T, V),
            over the draft vocabulary (B, T, Vd), or over it plus one last column holding the log of the
            mass outside it (B, T, Vd + 1, `train.eagle.DraftVocabLogits(other=True)`); (B, T).
        embed: the target's frozen embedding.
        ttt_steps: unrolled steps (>= 1).
        decay: step weight base.
        distill: one of `DISTILL` ("forward_kl" and the LK losses need full logits or the outside column
            when Vd < V).
        lk_eta: lk_hybrid's eta.
    Returns:
        (loss, metrics) with `loss_step{j}` and `top1_step{j}` per step, and, when the target's mass inside
        the draft vocabulary is known, `draft_mass` (its mean) and `alpha_step{j}` (the mean acceptance
        probability of a token drawn from step j's draft, `acceptance`).
    """
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    b, t, _ = target_features.shape
    length = t - 1
    features = head.project_features(target_features[:, :-1])  # (B, T-1, H)
    embeds = embed(input_ids[:, 1:]).to(features.dtype)  # (B, T-1, H)
    positions = torch.arange(length, device=features.device).expand(b, -1)
    target_probs, draft_mass = draft_target_probs(head, target_logits[:, 1:], distill)  # (B, T-1, Vd)
    chains = ttt_chains(loss_mask, ttt_steps)  # chains[0]: token t + 2 is one to learn
    cache = DraftCache()
    total = features.new_zeros((), dtype=torch.float32)
    metrics: dict[str, Tensor] = {}
    for step in range(ttt_steps):
        mask = ttt_attention_mask(length, step, features.dtype, features.device)
        hidden = head(features, embeds, positions, cache, attention_mask=mask)  # (B, T-1, H)
        logits = head.logits(hidden, None)  # (B, T-1, Vd)
        valid = chains[step]
        if distill in LK_LOSSES:
            step_loss = lk_loss(logits, target_probs, valid, distill, lk_eta)
        else:
            step_loss = soft_cross_entropy(logits, target_probs, valid)
        total = total + decay**step * step_loss
        metrics[f"loss_step{step}"] = step_loss.detach()
        metrics[f"top1_step{step}"] = top1_rate(logits.detach(), target_probs, valid)
        if draft_mass is not None:
            own = target_probs if distill != "soft_ce" else target_probs * draft_mass.unsqueeze(-1)
            metrics[f"alpha_step{step}"] = masked_mean(acceptance(logits.detach(), own), valid)
        features = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)  # step j+1 input at t
    if draft_mass is not None:
        metrics["draft_mass"] = masked_mean(draft_mass, chains[0])
    return total, metrics


def ttt_chains(loss_mask: Tensor, ttt_steps: int) -> Tensor:
    """Which positions each unrolled step of `eagle3_ttt_loss` trains: (ttt_steps, B, T-1) booleans. Step j
    at position t scores token t + 2 after a chain that started on the target's features at t - j and drafted
    tokens t - j + 2 .. t + 1: all of them must be tokens to learn (reply tokens), as in decoding, which
    drafts only inside a reply; a chain through a user turn or a template header is never decoded. (P-EAGLE's
    `train.block_losses.peagle_chains` and DFlash's slots take the same rule.)"""
    b, t = loss_mask.shape
    token = torch.zeros(b, t - 1, dtype=torch.bool, device=loss_mask.device)
    token[:, :-1] = loss_mask[:, 2:].bool()  # token t + 2
    chains = [token]
    for _ in range(1, ttt_steps):
        chains.append(token & F.pad(chains[-1][:, :-1], (1, 0)))  # and the chain one position back
    return torch.stack(chains)


def draft_target_probs(head: EagleHead, target_logits: Tensor, distill: str) -> tuple[Tensor, Tensor | None]:
    """The target's probabilities an EAGLE-3 loss trains the draft vocabulary on, and the target's mass
    inside that vocabulary (None when the logits do not tell).

    Args:
        head: the eagle3 head (draft_vocab_size, vocab_size, t2d).
        target_logits: (..., V), (..., Vd) or (..., Vd + 1) with the log outside mass last.
        distill: "soft_ce" (renormalised over the draft vocabulary), or "forward_kl" and the LK losses
            (full-vocabulary probabilities of the draft tokens: `needs_outside_mass`).
    Returns:
        ((..., Vd) float32 probabilities, (...) mass inside the draft vocabulary or None).
    """
    if distill not in DISTILL:
        raise ValueError(f"distill must be one of {', '.join(DISTILL)}, got {distill!r}")
    draft, full = head.config.draft_vocab_size, head.config.vocab_size
    if draft == full - 1:  # the layouts are told apart by their width, and these two would be one
        raise ValueError(
            f"a draft vocabulary of {draft} tokens, one less than the target's {full}: its logits with the "
            f"outside-mass column are as wide as the full vocabulary's; draft {full} or at most {full - 2}"
        )
    width = target_logits.shape[-1]
    if width == full and draft != full:  # full-vocabulary logits
        probs = torch.softmax(target_logits.float(), dim=-1)[..., head.t2d]
    elif width == draft + 1 and draft != full:  # draft vocabulary + the outside mass
        probs = torch.softmax(target_logits.float(), dim=-1)[..., :draft]
    elif width == draft:  # the draft vocabulary alone: its mass is unknown (or 1 when it is the full one)
        if needs_outside_mass(distill) and draft != full:
            raise ValueError(
                f"{distill} needs the target's mass outside the {draft}-token draft vocabulary: pass logits "
                f"over all {full} tokens or with the outside column ({draft + 1})"
            )
        probs = torch.softmax(target_logits.float(), dim=-1)
        return probs, (torch.ones_like(probs[..., 0]) if draft == full else None)
    else:
        raise ValueError(f"target logits of width {width}: expected {full}, {draft} or {draft + 1}")
    mass = probs.sum(-1)
    return (probs if needs_outside_mass(distill) else probs / mass.unsqueeze(-1)), mass


def needs_outside_mass(distill: str) -> bool:
    """Whether an EAGLE-3 `distill` loss trains on the target's own probabilities of the draft tokens (so
    on reduced-vocabulary logits it needs the mass outside the draft vocabulary) rather than renormalised
    ones."""
    return distill != "soft_ce"


def medusa_loss(
    head_logits: Tensor, input_ids: Tensor, loss_mask: Tensor, *, decay: float = 0.8
) -> tuple[Tensor, dict[str, Tensor]]:
    """Medusa-1: cross-entropy of head k against token t + k + 2, weighted decay**k.

    Args:
        head_logits: (K, B, T, V) logits of the K heads.
        input_ids: (B, T) tokens.
        loss_mask: (B, T) 1 on tokens to learn.
        decay: head weight base (0.8 in Medusa).
    Returns:
        (loss, metrics) with `loss_head{k}` and `top1_head{k}`.
    """
    total = head_logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, Tensor] = {}
    t = input_ids.shape[1]
    for k in range(head_logits.shape[0]):
        shift = k + 2
        if shift >= t:
            break
        logits = head_logits[k, :, : t - shift].float()  # (B, T-k-2, V)
        labels, mask = input_ids[:, shift:], loss_mask[:, shift:].bool()
        ce = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        head_loss = masked_mean(ce, mask)
        total = total + decay**k * head_loss
        metrics[f"loss_head{k}"] = head_loss.detach()
        metrics[f"top1_head{k}"] = masked_mean((logits.detach().argmax(-1) == labels).float(), mask)
    return total, metrics


def medusa_loss_from_hidden(
    heads: MedusaHeads,
    hidden: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    *,
    decay: float = 0.8,
    lm_head: nn.Module | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`medusa_loss` computed head by head on the masked positions only, never materialising (K, B, T, V).

    Args:
        heads: the Medusa heads.
        hidden: (B, T, H) target final hidden states.
        input_ids, loss_mask: (B, T).
        decay: head weight base.
        lm_head: the target's lm_head when the heads share it.
    Returns:
        (loss, metrics) equal to `medusa_loss(heads(hidden), ...)`.
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, Tensor] = {}
    t = input_ids.shape[1]
    for k in range(heads.config.num_heads):
        shift = k + 2
        if shift >= t:
            break
        mask = loss_mask[:, shift:].bool()  # (B, T-k-2)
        labels = input_ids[:, shift:][mask]  # (M,)
        logits = heads.head_logits(k, hidden[:, : t - shift][mask], lm_head).float()  # (M, V)
        head_loss = F.cross_entropy(logits, labels) if labels.numel() else logits.sum() * 0.0
        total = total + decay**k * head_loss
        metrics[f"loss_head{k}"] = head_loss.detach()
        metrics[f"top1_head{k}"] = (
            (logits.detach().argmax(-1) == labels).float().mean() if labels.numel() else head_loss.detach()
        )
    return total, metrics
