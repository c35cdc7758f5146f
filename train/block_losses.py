"""Training losses of the block drafters, which draft every depth in one forward: DFlash's (arXiv 2602.06036,
blocks at random anchors) and P-EAGLE's (arXiv 2602.01469, placeholder chains beside the depth-0 pass). Both
train one forward over many drafts under a mask that gives each draft the context decoding gives it, against
the target's distribution with the distillation options of `train.losses` (soft_ce, forward_kl, the LK
losses). Alignment as in train/losses.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from heads.dflash import DFlashHead
from heads.eagle import additive_mask
from heads.peagle import PEagleHead
from train.losses import (
    LK_LOSSES,
    acceptance,
    draft_target_probs,
    lk_loss,
    masked_mean,
    position_losses,
    soft_cross_entropy,
    top1_rate,
)

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


def dflash_slots(loss_mask: Tensor, starts: Tensor, valid: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """(labels, slot_mask), each (B, N, block_size - 1): the position slot k of the block at anchor a scores
    (a + k, clamped to the sequence) and whether it is scored: a real block's slot inside the sequence on a
    token to learn, and every slot before it scored too. A block that runs past its reply's end (through a
    user turn into the next reply) would otherwise train slots to predict a reply from masks standing for
    text the draft never sees, which decoding never asks."""
    t = loss_mask.shape[1]
    labels = starts[:, :, None] + torch.arange(1, block_size, device=starts.device)
    inside = labels < t
    labels = labels.clamp(max=t - 1)
    learn = loss_mask.gather(1, labels.flatten(1)).view_as(labels).bool()
    return labels, (valid[:, :, None] & inside & learn).int().cumprod(-1).bool()


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
    k = head.block_size
    gamma = gamma or dflash_gamma(k)
    starts, valid = dflash_anchors(loss_mask, anchors, generator)
    logits = dflash_block_logits(head, target_features, input_ids, starts, embed, lm_head)  # (B, N, k-1, Vd)
    labels, slot_mask = dflash_slots(loss_mask, starts, valid, k)
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
        metrics[f"top1_slot{j + 1}"] = top1_rate(q.detach(), p, m)
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
    rows: list[tuple[Tensor, Tensor]] = []
    for r in range(b):
        scored = learn[r, 2:]  # depth-0 row t scores token t + 2
        n = int(scored.sum())
        scale = min(1.0, max_anchors / max(n * ratio, 1.0))
        kept = torch.arange(scored.numel())[scored]  # anchors whose own depth-0 token is one to learn
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
