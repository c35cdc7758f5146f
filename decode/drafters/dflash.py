"""DFlash heads as a drafter: one head forward per step drafts every depth of the tree (a block drafter).

Each row keeps, per draft layer, the keys and values of its committed positions (`DFlashHead.context`,
computed once from the target's taps when the positions are accepted; nothing a proposal adds needs
cropping). After an advance the head runs the block [root, MASK, ...] at the root's position and the B - 1
after it, and its slots 1 .. B - 1 are the distributions of depths 1 .. B - 1 whatever the parent: the tree
(static, or `BestFirstTree`) is grown from them as from Medusa's heads. The cache is rectangular with a
column validity per row, as the EAGLE drafter's: rows take in different numbers of positions per step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from decode.drafter import Drafter, DraftLimits, packed_columns
from decode.drafters.lm_head import draft_lm_head, float_dtype
from heads.dflash import DFlashHead
from heads.eagle import additive_mask


class DFlashDrafter(Drafter):
    """DFlash for a batch: one context pass per advance (the new positions) and one block pass per step."""

    def __init__(self, head: DFlashHead, target: nn.Module, batch: int) -> None:
        self.head, self.embed, self.lm_head = head, target.get_input_embeddings(), draft_lm_head(head, target)
        self.feature_layers, self.dtype = head.feature_layers, float_dtype(head)
        device = next(head.parameters()).device
        self.block = head.block_size  # the root and draft_depths drafts
        self.keys: list[Tensor] = []  # per layer (B, kv_heads, L, D)
        self.values: list[Tensor] = []
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # committed columns per row
        self.counts = torch.zeros(batch, dtype=torch.long, device=device)  # committed positions per row
        self.host_counts = [0] * batch
        self.masks = torch.full(
            (1, self.block - 1), head.config.mask_token_id, dtype=torch.long, device=device
        )
        self._logits: Tensor | None = None  # (B, block - 1, Vd): depth d's distribution at [:, d - 1]

    def limits(self) -> DraftLimits:
        return DraftLimits(max_depth=self.block - 1, dynamic=False, block=True)

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @torch.no_grad()
    def advance(self, features: list[Tensor], next_tokens: list[Tensor]) -> None:
        device = self.valid.device
        sizes = [t.numel() for t in next_tokens]
        width = max(sizes)
        if len(sizes) == 1:
            feats, roots = features[0].to(self.dtype)[None], next_tokens[0][-1:]
            taken = torch.ones(1, width, dtype=torch.bool, device=device)
        else:
            feats = pad_sequence([f.to(self.dtype) for f in features], batch_first=True)
            roots = torch.stack([t[-1] for t in next_tokens])
            taken = pad_sequence([t.new_ones(n, dtype=torch.bool) for t, n in zip(next_tokens, sizes)], True)
        positions = self.counts[:, None] + torch.arange(width, device=device)
        new = self.head.context(feats, positions)
        if self.keys:
            self.keys = [torch.cat([old, k], 2) for old, (k, _) in zip(self.keys, new, strict=True)]
            self.values = [torch.cat([old, v], 2) for old, (_, v) in zip(self.values, new, strict=True)]
        else:
            self.keys, self.values = [k for k, _ in new], [v for _, v in new]
        self.valid = torch.cat([self.valid, taken.to(device)], dim=1)
        self.counts = self.counts + (width if len(sizes) == 1 else taken.sum(1).to(device))
        self.host_counts = [c + n for c, n in zip(self.host_counts, sizes)]
        self._compact()
        self._draft_block(roots)

    def _draft_block(self, roots: Tensor) -> None:
        """Run the block [root, MASK x (B - 1)] of every row; keep its slots 1 .. B - 1's logits."""
        batch, device = roots.shape[0], roots.device
        ids = torch.cat([roots[:, None], self.masks.expand(batch, -1)], dim=1)
        positions = self.counts[:, None] + torch.arange(self.block, device=device)
        allowed = torch.cat(
            [
                self.valid[:, None, :].expand(-1, self.block, -1),
                torch.ones(batch, self.block, self.block, dtype=torch.bool, device=device),
            ],
            dim=-1,
        )
        hidden = self.head(
            self.embed(ids).to(self.dtype),
            positions,
            list(zip(self.keys, self.values, strict=True)),
            additive_mask(allowed, self.dtype)[:, None],
        )
        self._logits = self.head.logits(hidden[:, 1:], self.lm_head)

    def _compact(self) -> None:
        order = packed_columns(self.valid, max(self.host_counts, default=0))
        if order is None:
            return
        index = order[:, None, :, None].expand(-1, self.keys[0].shape[1], -1, self.keys[0].shape[-1])
        self.keys = [k.gather(2, index) for k in self.keys]
        self.values = [v.gather(2, index) for v in self.values]
        self.valid = self.valid.gather(1, order)

    def select(self, rows: list[int]) -> None:
        self.host_counts = [self.host_counts[r] for r in rows]
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        self.valid, self.counts = self.valid[index], self.counts[index]
        self.keys, self.values = [k[index] for k in self.keys], [v[index] for v in self.values]
        if self._logits is not None:
            self._logits = self._logits[index]

    def root_logits(self) -> Tensor:
        return self._logits[:, 0]

    def expand(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> Tensor:
        return self._logits[:, depth, None]  # (B, 1, Vd): every node of the level has the same children

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return self.head.to_target_ids(draft_ids)
