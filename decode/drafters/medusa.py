"""Medusa heads as a drafter: head d scores depth d + 1 from each row's last accepted feature, whatever the
parent node is, so one call of the heads per step drafts every level (a block drafter)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from decode.drafter import Drafter, DraftLimits
from decode.drafters.lm_head import draft_lm_head, float_dtype
from heads.medusa import MedusaHeads


class MedusaDrafter(Drafter):
    """Medusa for a batch: the heads on every row's last accepted feature in one call."""

    def __init__(self, heads: MedusaHeads, target: nn.Module, batch: int) -> None:
        self.heads, self.lm_head = heads, draft_lm_head(heads, target)
        self.feature_layers = heads.feature_layers
        self.dtype = float_dtype(heads)
        self._logits: Tensor | None = None  # (B, K, V)

    def limits(self) -> DraftLimits:
        return DraftLimits(max_depth=self.heads.config.num_heads, dynamic=False, block=True)

    @torch.no_grad()
    def advance(self, features: list[Tensor], next_tokens: list[Tensor]) -> None:
        last = torch.stack([f[-1] for f in features]).to(self.dtype)  # (B, F)
        self._logits = self.heads(last[:, None], lm_head=self.lm_head)[:, :, 0].transpose(0, 1)

    def select(self, rows: list[int]) -> None:
        if self._logits is not None:
            self._logits = self._logits[torch.tensor(rows, dtype=torch.long, device=self._logits.device)]

    def root_logits(self) -> Tensor:
        return self._logits[:, 0]

    def expand(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> Tensor:
        return self._logits[:, depth, None]  # (B, 1, V): the same for every node of the level
