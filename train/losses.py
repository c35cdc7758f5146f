"""Training losses as pure functions: EAGLE-1 (2401.15077 section 4.2), EAGLE-3 training-time test
(2503.01840 section 3.2), Medusa-1 and Medusa-2's head term (2401.10774 section 2.2), and the LK losses
(2602.23881: negative log acceptance and the KL/TV hybrid) as EAGLE-3 distillation options, DFlash's block
loss (2602.06036) and P-EAGLE's parallel-drafting loss (2602.01469).

Alignment used throughout: the target's hidden state / logits at position t predict token t + 1; a draft
output at position t (input: feature t and token t + 1) predicts feature t + 1 and token t + 2, so its
label is the target's distribution at t + 1 and it counts where token t + 2 is an assistant token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.dflash import DFlashHead
from heads.eagle import DraftCache, EagleHead, additive_mask
from heads.medusa import MedusaHeads
from heads.peagle import PEagleHead

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


NLA_FLOOR = 1e-5  # lk_nla: -log max(alpha, floor), so a position the draft misses entirely stays finite


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
    alpha = torch.minimum(target_probs, logq.exp()).sum(-1)  # `acceptance`
    if kind == "lk_nla":
        return -torch.log(alpha.clamp_min(NLA_FLOOR))
    kl = (torch.xlogy(target_probs, target_probs) - target_probs * logq).sum(-1)
    weight = torch.exp(-eta * alpha.detach())
    return weight * kl + (1 - weight) * (1 - alpha)


def _top1(logits: Tensor, target_probs: Tensor, mask: Tensor) -> Tensor:
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
        "top1": _top1(logits.detach(), target_probs, mask),
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
    token_mask = torch.zeros(b, length, dtype=torch.bool, device=features.device)
    token_mask[:, :-1] = loss_mask[:, 2:].bool()  # token t + 2
    cache = DraftCache()
    total = features.new_zeros((), dtype=torch.float32)
    metrics: dict[str, Tensor] = {}
    index = torch.arange(length, device=features.device)
    for step in range(ttt_steps):
        mask = ttt_attention_mask(length, step, features.dtype, features.device)
        hidden = head(features, embeds, positions, cache, attention_mask=mask)  # (B, T-1, H)
        logits = head.logits(hidden, None)  # (B, T-1, Vd)
        valid = token_mask & (index >= step)[None]  # a full chain exists
        if distill in LK_LOSSES:
            step_loss = lk_loss(logits, target_probs, valid, distill, lk_eta)
        else:
            step_loss = soft_cross_entropy(logits, target_probs, valid)
        total = total + decay**step * step_loss
        metrics[f"loss_step{step}"] = step_loss.detach()
        metrics[f"top1_step{step}"] = _top1(logits.detach(), target_probs, valid)
        if draft_mass is not None:
            own = target_probs if distill != "soft_ce" else target_probs * draft_mass.unsqueeze(-1)
            metrics[f"alpha_step{step}"] = masked_mean(acceptance(logits.detach(), own), valid)
        features = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)  # step j+1 input at t
    if draft_mass is not None:
        metrics["draft_mass"] = masked_mean(draft_mass, token_mask)
    return total, metrics


DFLASH_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}  # the paper's slot-weight decay per block size


def dflash_gamma(block_size: int) -> float:
    """DFlash's slot-weight decay for a block size (the paper's: 4 for 8, 5 for 10, 7 for 16; between them,
    the nearest smaller one's)."""
    return DFLASH_GAMMA[max((b for b in DFLASH_GAMMA if b <= block_size), default=8)]


def dflash_anchors(
    loss_mask: Tensor, count: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Up to `count` block anchors per row, drawn uniformly without replacement among the positions a >= 1
    whose token and the next are both tokens to learn (the root of a block is always a token the target
    produced, and its first draft must be one too), in increasing order.

    Returns:
        (anchors, valid), both (B, N) with N = min(count, T): positions, and which are real (a row with
        fewer candidates pads with position 0, not valid).
    """
    b, t = loss_mask.shape
    ok = torch.zeros(b, t, dtype=torch.bool, device=loss_mask.device)
    ok[:, 1 : t - 1] = loss_mask[:, 1 : t - 1].bool() & loss_mask[:, 2:].bool()
    scores = torch.rand(
        b, t, generator=generator, device=loss_mask.device if generator is None else generator.device
    )
    scores = scores.to(loss_mask.device).masked_fill(~ok, -1.0)
    values, index = scores.topk(min(count, t), dim=1)
    anchors = index.masked_fill(values < 0, t).sort(dim=1).values
    valid = anchors < t
    return anchors.masked_fill(~valid, 0), valid


def dflash_block_logits(
    head: DFlashHead,
    target_features: Tensor,
    input_ids: Tensor,
    anchors: Tensor,
    embed: nn.Module,
    lm_head: nn.Module | None = None,
) -> Tensor:
    """The draft logits of every anchor's block in one head forward, as decoding computes them one block at
    a time (`decode.drafters.dflash`): block n is [input_ids[a_n], MASK, ...] at positions a_n .. a_n + B - 1,
    seeing the context keys of positions < a_n and its own block only.

    Args:
        head: the DFlash head.
        target_features: (B, T, taps * Ht) the target's concatenated taps.
        input_ids: (B, T) tokens.
        anchors: (B, N) block positions (`dflash_anchors`).
        embed: the target's frozen embedding; lm_head: the target's, for a head that shares it.
    Returns:
        (B, N, B_block - 1, Vd): slot k's logits score the token at a_n + k.
    """
    b, t = input_ids.shape
    k, n = head.block_size, anchors.shape[1]
    device = input_ids.device
    context = head.context(target_features, torch.arange(t, device=device).expand(b, -1))
    ids = torch.full((b, n, k), head.config.mask_token_id, dtype=torch.long, device=device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    positions = (anchors[:, :, None] + torch.arange(k, device=device)).flatten(1)  # (B, N * k)
    starts = anchors.repeat_interleave(k, dim=1)  # each query's anchor
    sees_context = torch.arange(t, device=device)[None, None, :] < starts[:, :, None]  # (B, N * k, T)
    block = torch.arange(n, device=device).repeat_interleave(k)
    sees_block = (block[:, None] == block[None, :]).expand(b, -1, -1)
    dtype = context[0][0].dtype
    mask = additive_mask(torch.cat([sees_context, sees_block], dim=-1), dtype)[:, None]
    hidden = head(embed(ids.flatten(1)).to(dtype), positions, context, mask)
    return head.logits(hidden.view(b, n, k, -1)[:, :, 1:], lm_head)


def dflash_loss(
    head: DFlashHead,
    target_features: Tensor,
    input_ids: Tensor,
    target_logits: Tensor,
    loss_mask: Tensor,
    embed: nn.Module,
    lm_head: nn.Module | None = None,
    *,
    anchors: int = 64,
    gamma: float | None = None,
    distill: str = "soft_ce",
    lk_eta: float = 3.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DFlash's training loss (arXiv 2602.06036, section 3.3): blocks at random anchors (`dflash_anchors`),
    all in one forward (`dflash_block_logits`); slot k (1 .. B - 1) is trained against the target's
    distribution of the token at a + k given the true prefix, weighted exp(-(k - 1) / gamma), where that
    token is one to learn. The target's distribution instead of the data token: the committed chats are the
    target's own replies, so this is the paper's self-distillation without its sampling noise; `distill`
    picks the divergence as for EAGLE-3 (`draft_target_probs`: soft_ce, forward_kl, lk_nla, lk_hybrid).

    Args:
        head, target_features, input_ids, loss_mask, embed, lm_head: as `dflash_block_logits`; target_logits
            (B, T, V | Vd | Vd + 1) as `eagle3_ttt_loss` takes them (position t scores token t + 1).
        anchors: blocks per row at most.
        gamma: slot-weight decay; None = `dflash_gamma(block_size)`.
        distill, lk_eta: the divergence and lk_hybrid's eta.
        generator: random source of the anchors.
    Returns:
        (loss, metrics) with `loss_slot{k}` and `top1_slot{k}` per slot, and `alpha_slot{k}` (the mean
        acceptance probability of slot k's draft given the true prefix) when the target's mass inside the
        draft vocabulary is known.
    """
    t = input_ids.shape[1]
    k = head.block_size
    gamma = gamma or dflash_gamma(k)
    starts, valid = dflash_anchors(loss_mask, anchors, generator)
    logits = dflash_block_logits(head, target_features, input_ids, starts, embed, lm_head)  # (B, N, k-1, Vd)
    labels = starts[:, :, None] + torch.arange(1, k, device=input_ids.device)  # the positions scored
    inside = labels < t
    labels = labels.clamp(max=t - 1)
    learn = loss_mask.gather(1, labels.flatten(1)).view_as(labels).bool()
    slot_mask = valid[:, :, None] & inside & learn
    width = target_logits.shape[-1]
    scores = target_logits.gather(1, (labels - 1).flatten(1)[:, :, None].expand(-1, -1, width))
    target_probs, draft_mass = draft_target_probs(head, scores.view(*labels.shape, width), distill)
    total = logits.new_zeros((), dtype=torch.float32)
    metrics: dict[str, Tensor] = {}
    for j in range(k - 1):
        q, p, m = logits[:, :, j], target_probs[:, :, j], slot_mask[:, :, j]
        slot_loss = lk_loss(q, p, m, distill, lk_eta) if distill in LK_LOSSES else soft_cross_entropy(q, p, m)
        total = total + math.exp(-j / gamma) * slot_loss
        metrics[f"loss_slot{j + 1}"] = slot_loss.detach()
        metrics[f"top1_slot{j + 1}"] = _top1(q.detach(), p, m)
        if draft_mass is not None:
            own = p if distill != "soft_ce" else p * draft_mass[:, :, j].unsqueeze(-1)
            metrics[f"alpha_slot{j + 1}"] = masked_mean(acceptance(q.detach(), own), m)
    return total, metrics


def peagle_chains(
    loss_mask: Tensor,
    depths: int,
    *,
    ratio: float = 0.7,
    min_ratio: float = 0.2,
    max_anchors: int = 256,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """P-EAGLE's chains (conditional-on-depth sampling, as speculators' `generate_cod_sample_indices`): the
    draft rows trained at depths 2 .. K, as (anchor, depth) pairs in the loss's shifted frame (row t of the
    depth-0 pass reads the target's feature at t and token t + 1 and scores token t + 2).

    Depth d >= 1 (tree depth d + 1) keeps a fraction max(ratio**d, min_ratio) of a row's n scored depth-0
    positions, drawn uniformly among the anchors kept at depth d - 1 whose depth-d token is one to learn, so
    every kept row's chain is whole (its placeholders at depths 1 .. d - 1 are kept too). `max_anchors`
    caps depth 1 and scales the others down with it.

    Returns:
        (anchors, depth, valid), each (B, N): the anchor a (the last committed position), the depth d (the
        placeholder at position a + d, scoring token a + d + 2), and which entries are real (padding: a = 0,
        d = 1, not valid). Sorted by anchor, then depth.
    """
    if depths < 2:
        empty = torch.zeros(loss_mask.shape[0], 0, dtype=torch.long, device=loss_mask.device)
        return empty, empty.clone(), empty.bool()
    b, t = loss_mask.shape
    learn = loss_mask.bool().cpu()
    length = t - 1  # depth-0 rows
    rows: list[tuple[Tensor, Tensor]] = []
    for r in range(b):
        scored = learn[r, 2:]  # depth-0 row t scores token t + 2
        n = int(scored.sum())
        scale = min(1.0, max_anchors / max(n * ratio, 1.0))
        kept = torch.arange(length)
        anchors, levels = [], []
        for d in range(1, depths):
            label = kept + d + 2  # the token the placeholder at a + d scores
            candidates = kept[(label < t) & learn[r, label.clamp(max=t - 1)]]
            size = min(candidates.numel(), math.ceil(n * max(ratio**d, min_ratio) * scale))
            if size == 0:
                break
            pick = torch.randperm(candidates.numel(), generator=generator)[:size]
            kept = candidates[pick].sort().values
            anchors.append(kept)
            levels.append(torch.full_like(kept, d))
        if anchors:
            a, d = torch.cat(anchors), torch.cat(levels)
            order = torch.argsort(a * depths + d)
            rows.append((a[order], d[order]))
        else:
            rows.append((torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
    width = max(a.numel() for a, _ in rows)
    anchor = torch.zeros(b, width, dtype=torch.long)
    depth = torch.ones(b, width, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for r, (a, d) in enumerate(rows):
        anchor[r, : a.numel()], depth[r, : a.numel()], valid[r, : a.numel()] = a, d, True
    device = loss_mask.device
    return anchor.to(device), depth.to(device), valid.to(device)


def peagle_hidden(
    head: PEagleHead,
    target_features: Tensor,
    input_ids: Tensor,
    anchors: Tensor,
    depth: Tensor,
    valid: Tensor,
    embed: nn.Module,
) -> Tensor:
    """The head's outputs of the depth-0 pass and of every chain's placeholders in one forward, as decoding
    computes them (`decode.drafters.peagle`): depth-0 row t (target feature t, token t + 1, position t) sees
    rows <= t; the placeholder (a, d) at position a + d sees depth-0 rows <= a and its chain's placeholders
    of depths <= d.

    Args:
        head: the P-EAGLE head.
        target_features: (B, T, taps * Ht); input_ids: (B, T).
        anchors, depth, valid: (B, N) from `peagle_chains`.
        embed: the target's frozen embedding.
    Returns:
        (B, T - 1 + N, H): the T - 1 depth-0 outputs, then the N placeholders'.
    """
    b, t = input_ids.shape
    length, n = t - 1, anchors.shape[1]
    device = input_ids.device
    features = head.project_features(target_features[:, :-1])
    dtype = features.dtype
    mask_feature, mask_embed = head.placeholders(b, n, dtype)
    hidden = torch.cat([features, mask_feature], dim=1)
    embeds = torch.cat([embed(input_ids[:, 1:]).to(dtype), mask_embed], dim=1)
    rows = torch.arange(length, device=device)
    positions = torch.cat([rows.expand(b, -1), anchors + depth], dim=1)
    top = torch.cat(
        [
            (rows[:, None] >= rows[None, :]).expand(b, -1, -1),
            torch.zeros(b, length, n, dtype=torch.bool, device=device),
        ],
        dim=-1,
    )
    sees_rows = (rows[None, None, :] <= anchors[:, :, None]) & valid[:, :, None]
    same_chain = (anchors[:, :, None] == anchors[:, None, :]) & (depth[:, None, :] <= depth[:, :, None])
    sees_chain = same_chain & valid[:, :, None] & valid[:, None, :]
    sees_chain |= torch.eye(n, dtype=torch.bool, device=device)  # padding sees itself only
    allowed = torch.cat([top, torch.cat([sees_rows, sees_chain], dim=-1)], dim=1)
    return head(hidden, embeds, positions, attention_mask=additive_mask(allowed, dtype)[:, None])


def peagle_loss(
    head: PEagleHead,
    target_features: Tensor,
    input_ids: Tensor,
    target_logits: Tensor,
    loss_mask: Tensor,
    embed: nn.Module,
    *,
    ratio: float = 0.7,
    min_ratio: float = 0.2,
    max_anchors: int = 256,
    distill: str = "soft_ce",
    lk_eta: float = 3.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """P-EAGLE's training loss (arXiv 2602.01469; speculators' and SpecForge's recipe): the depth-0 pass over
    every position plus the placeholders of chains sampled by `peagle_chains`, all in one forward
    (`peagle_hidden`); every scored row, whatever its depth, counts once in one mean (no depth weights),
    against the target's distribution of its token given the true prefix. `distill` picks the divergence as
    for EAGLE-3 (`draft_target_probs`).

    Args:
        head, target_features, input_ids, loss_mask, embed: as `peagle_hidden`; target_logits (B, T, V | Vd
            | Vd + 1) as `eagle3_ttt_loss` takes them.
        ratio, min_ratio, max_anchors, generator: `peagle_chains`.
        distill, lk_eta: the divergence and lk_hybrid's eta.
    Returns:
        (loss, metrics) with `loss_slot{k}`, `top1_slot{k}` and, when the target's mass inside the draft
        vocabulary is known, `alpha_slot{k}` per tree depth k = 1 .. K (slot 1 is the depth-0 pass).
    """
    b, t = input_ids.shape
    length, k = t - 1, head.parallel_depths
    anchors, depth, valid = peagle_chains(
        loss_mask, k, ratio=ratio, min_ratio=min_ratio, max_anchors=max_anchors, generator=generator
    )
    hidden = peagle_hidden(head, target_features, input_ids, anchors, depth, valid, embed)
    logits = head.logits(hidden, None)  # (B, L + N, Vd)
    scored = torch.cat([torch.arange(length, device=input_ids.device).expand(b, -1), anchors + depth], 1)
    scored = scored.clamp(max=length - 1)  # row scores token scored + 2, the target's logits at scored + 1
    width = target_logits.shape[-1]
    scores = target_logits[:, 1:].gather(1, scored[:, :, None].expand(-1, -1, width))
    target_probs, draft_mass = draft_target_probs(head, scores, distill)
    label = torch.cat([torch.arange(length, device=input_ids.device).expand(b, -1), anchors + depth], 1) + 2
    learn = loss_mask.bool().gather(1, label.clamp(max=t - 1)) & (label < t)
    levels = torch.cat([torch.zeros_like(scored[:, :length]), depth], dim=1)
    mask = learn & torch.cat([torch.ones_like(learn[:, :length]), valid], dim=1)
    losses = position_losses(logits, target_probs, distill, lk_eta)
    total = masked_mean(losses, mask)
    metrics: dict[str, Tensor] = {}
    detached = logits.detach()
    own = None
    if draft_mass is not None:
        own = target_probs if distill != "soft_ce" else target_probs * draft_mass.unsqueeze(-1)
        alphas = acceptance(detached, own)
    hits = (detached.argmax(-1) == target_probs.argmax(-1)).float()
    for d in range(k):
        at = mask & (levels == d)
        metrics[f"loss_slot{d + 1}"] = masked_mean(losses.detach(), at)
        metrics[f"top1_slot{d + 1}"] = masked_mean(hits, at)
        if own is not None:
            metrics[f"alpha_slot{d + 1}"] = masked_mean(alphas, at)
    return total, metrics


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
