"""P-EAGLE heads as a drafter: the advance's head forward drafts every depth (a block drafter).

Each advance runs EAGLE-3's forward over the newly committed positions with K - 1 placeholder positions
appended per row (`PEagleHead.placeholders`, after the row's last committed position, causal among
themselves), so the output at the root's position scores depth 1 and placeholder j depth j + 1. The
placeholders' draft KV is cropped off at once: the next advance re-runs those positions with their real
features, as vLLM's parallel drafting does. The tree (static, or `BestFirstTree`) is grown from the K
per-depth distributions as from Medusa's heads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from decode.drafter import DraftLimits
from decode.drafters.eagle import EagleDrafter
from heads.eagle import additive_mask
from heads.peagle import PEagleHead


class PEagleDrafter(EagleDrafter):
    """P-EAGLE for a batch: one head forward per step, over the new positions and K - 1 placeholders."""

    def __init__(self, head: PEagleHead, target: nn.Module, batch: int, *, fused: bool = True) -> None:
        super().__init__(head, target, batch, fused=fused)
        self.depths = head.draft_depths
        self._logits: Tensor | None = None  # (B, K, Vd): depth d's distribution at [:, d - 1]

    def limits(self) -> DraftLimits:
        return DraftLimits(max_depth=self.depths, dynamic=False, block=True)

    @torch.no_grad()
    def advance(self, features: list[Tensor], next_tokens: list[Tensor]) -> None:
        device = self.valid.device
        sizes = [t.numel() for t in next_tokens]
        width, extra = max(sizes), self.depths - 1
        if len(sizes) == 1:
            feats, tokens = features[0].to(self.dtype)[None], next_tokens[0][None]
            taken = torch.ones(1, width, dtype=torch.bool, device=device)
        else:
            feats = pad_sequence([f.to(self.dtype) for f in features], batch_first=True)
            tokens = pad_sequence(list(next_tokens), batch_first=True)
            taken = pad_sequence([t.new_ones(n, dtype=torch.bool) for t, n in zip(next_tokens, sizes)], True)
        taken = taken.to(device)
        batch = taken.shape[0]
        mask_feature, mask_embed = self.head.placeholders(batch, extra, self.dtype)
        hidden_in = torch.cat([self.head.project_features(feats), mask_feature], dim=1)
        embeds = torch.cat([self.embed(tokens).to(self.dtype), mask_embed], dim=1)
        new = torch.arange(width, device=device)
        slots = torch.arange(extra, device=device)
        counts = taken.sum(1)
        # the new positions see the committed columns and, causally, each other; placeholder j sees the
        # committed and new (taken) columns and the placeholders up to itself
        sees_new = torch.cat(
            [
                (new[:, None] >= new[None, :]).expand(batch, -1, -1),
                torch.zeros(batch, width, extra, dtype=torch.bool, device=device),
            ],
            dim=-1,
        )
        sees_slots = torch.cat(
            [
                taken[:, None, :].expand(-1, extra, -1),
                (slots[:, None] >= slots[None, :]).expand(batch, -1, -1),
            ],
            dim=-1,
        )
        allowed = torch.cat(
            [
                self.valid[:, None, :].expand(-1, width + extra, -1),
                torch.cat([sees_new, sees_slots], dim=1),
            ],
            dim=-1,
        )
        positions = torch.cat(
            [
                self.counts[:, None] + new[None, :],
                (self.counts + counts)[:, None] + slots[None, :],  # after each row's last new position
            ],
            dim=1,
        )
        hidden = self.step(
            hidden_in,
            embeds,
            positions,
            self.cache,
            attention_mask=additive_mask(allowed, self.dtype)[:, None],
        )
        self.valid = torch.cat([self.valid, taken], dim=1)
        self.cache.crop(self.valid.shape[1])  # the placeholders' entries
        self.host_counts = [c + n for c, n in zip(self.host_counts, sizes)]
        self.counts = self.counts + counts
        last = (counts - 1)[:, None, None].expand(-1, 1, hidden.shape[-1])
        self.root_hidden = hidden.gather(1, last)[:, 0]
        outputs = torch.cat([self.root_hidden[:, None], hidden[:, width:]], dim=1)  # (B, K, H)
        self._logits = self.head.logits(outputs, self.lm_head)
        self._compact()
        self._start_proposal()

    def select(self, rows: list[int]) -> None:
        super().select(rows)
        if self._logits is not None:
            self._logits = self._logits[torch.tensor(rows, dtype=torch.long, device=self._logits.device)]

    def root_logits(self) -> Tensor:
        return self._logits[:, 0]

    def expand(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> Tensor:
        return self._logits[:, depth, None]  # (B, 1, Vd): every node of the level has the same children

    def end_proposal(self) -> None:
        self._start_proposal()  # nothing of the proposal is in the cache
