"""EAGLE-1/3 heads as drafters: the head autoregresses on the target's features with its own KV cache, the
tree's nodes under tree attention, every row of the batch in one head forward per draft level.

The draft KV cache is rectangular, (B, kv_heads, L, head_dim), with a column validity per row as
`decode.batch.BatchState` has for the target: rows take in different numbers of accepted positions per step
(padded columns stay invalid, never attended to) and positions come from each row's own count. A proposal
appends the tree levels' entries for every row and crops them off afterwards.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from decode.drafter import Drafter, DraftLimits, packed_columns, tree_visibility
from decode.drafters.lm_head import draft_lm_head, float_dtype
from decode.fused import fused_step
from heads.eagle import DraftCache, EagleHead, additive_mask


class EagleDrafter(Drafter):
    """EAGLE-1/3 drafting for a batch: one draft cache and one head forward per call for all rows.

    `fused=True` (default) runs the head through `decode.fused.FusedEagleStep` (the same function, fewer and
    larger kernel calls); False runs `EagleHead.forward` itself."""

    def __init__(self, head: EagleHead, target: nn.Module, batch: int, *, fused: bool = True) -> None:
        self.head, self.step = head, fused_step(head) if fused else head
        self.embed, self.lm_head = target.get_input_embeddings(), draft_lm_head(head, target)
        self.feature_layers = head.feature_layers
        self.dtype = float_dtype(head)
        device = next(head.parameters()).device
        self.cache = DraftCache()
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # committed columns per row
        self.counts = torch.zeros(batch, dtype=torch.long, device=device)  # committed positions per row
        self.host_counts = [0] * batch  # the same on the host (valid columns per row)
        self.root_hidden: Tensor | None = None  # (B, H): output at each row's last committed position
        self._rows: list[Tensor] = []  # this proposal's expanded entries, (B, n, H) per level
        self._allowed: list[Tensor] = []  # (B, n, R) per level: which earlier expanded entries each may see

    def limits(self) -> DraftLimits:
        return DraftLimits(max_depth=None, dynamic=True, block=False)

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    @torch.no_grad()
    def advance(self, features: list[Tensor], next_tokens: list[Tensor]) -> None:
        """Row b takes in `features[b]` (n_b, F) of its newly accepted positions and the tokens after them
        (n_b,); rows may differ in n_b (n_b >= 1)."""
        device = self.valid.device
        sizes = [t.numel() for t in next_tokens]  # host-known: nothing is read back or uploaded for them
        width = max(sizes)
        if len(sizes) == 1:  # a batch of one: nothing to pad
            feats, tokens = features[0].to(self.dtype)[None], next_tokens[0][None]
            taken = torch.ones(1, width, dtype=torch.bool, device=device)
        else:
            feats = pad_sequence([f.to(self.dtype) for f in features], batch_first=True)  # (B, width, F)
            tokens = pad_sequence(list(next_tokens), batch_first=True)
            taken = pad_sequence(
                [t.new_ones(n, dtype=torch.bool) for t, n in zip(next_tokens, sizes)], batch_first=True
            )
        new = torch.arange(width, device=device)
        allowed = torch.cat(
            [
                self.valid[:, None, :].expand(-1, width, -1),
                (new[None, :, None] >= new[None, None, :]).expand(self.batch, -1, -1),  # causal in the new
            ],
            dim=-1,
        )
        hidden = self.step(
            self.head.project_features(feats),
            self.embed(tokens).to(self.dtype),
            self.counts[:, None] + new[None, :],
            self.cache,
            attention_mask=additive_mask(allowed, self.dtype)[:, None],
        )
        self.valid = torch.cat([self.valid, taken.to(device)], dim=1)
        self.host_counts = [c + n for c, n in zip(self.host_counts, sizes)]
        if len(sizes) == 1:
            self.counts = self.counts + width
            self.root_hidden = hidden[:, -1]
        else:
            counts = taken.sum(1).to(device)
            self.counts = self.counts + counts
            last = (counts - 1)[:, None, None].expand(-1, 1, hidden.shape[-1])
            self.root_hidden = hidden.gather(1, last)[:, 0]
        self._compact()
        self._start_proposal()

    def _compact(self) -> None:
        """Drop the columns no row uses once they are more than half the cache (padding and finished rows'
        leftovers): each row's valid entries keep their order, packed to the right."""
        order = packed_columns(self.valid, max(self.host_counts, default=0))
        if order is None:
            return
        index = order[:, None, :, None].expand(-1, self.cache.keys.shape[1], -1, self.cache.keys.shape[-1])
        self.cache.keys = self.cache.keys.gather(2, index)
        self.cache.values = self.cache.values.gather(2, index)
        self.valid = self.valid.gather(1, order)

    def _start_proposal(self) -> None:
        self._rows, self._allowed = [], []

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the batch; finished sequences leave it)."""
        self.host_counts = [self.host_counts[r] for r in rows]
        rows = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        self.valid, self.counts = self.valid[rows], self.counts[rows]
        if self.root_hidden is not None:
            self.root_hidden = self.root_hidden[rows]
        if self.cache.keys is not None:
            self.cache.keys, self.cache.values = self.cache.keys[rows], self.cache.values[rows]

    def root_logits(self) -> Tensor:
        """(B, Vd) draft logits for the children of every row's root."""
        return self.head.logits(self.root_hidden[:, None], self.lm_head)[:, 0]

    @torch.no_grad()
    def expand(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> Tensor:
        """Draft logits (B, n, Vd) for the children of n nodes per row at `depth`, whose tokens are `tokens`
        (B, n) and whose parents sit at `parent_rows` (B, n) in this proposal's expansion order (-1: the
        root)."""
        batch, n = tokens.shape
        device = tokens.device
        expanded = torch.cat(self._rows, dim=1) if self._rows else self.root_hidden[:, None][:, :0]
        outputs = torch.cat([self.root_hidden[:, None], expanded], dim=1)  # (B, 1 + R, H)
        index = (parent_rows + 1)[:, :, None].expand(-1, -1, outputs.shape[-1])
        feats = outputs.gather(1, index)
        tree = tree_visibility(self._allowed, parent_rows)  # the parent's ancestors and the parent
        allowed = torch.cat(
            [
                self.valid[:, None, :].expand(-1, n, -1),
                tree,
                torch.eye(n, dtype=torch.bool, device=device).expand(batch, -1, -1),
            ],
            dim=-1,
        )
        positions = (self.counts + depth - 1)[:, None].expand(-1, n)
        hidden = self.step(
            feats,
            self.embed(tokens).to(self.dtype),
            positions,
            self.cache,
            attention_mask=additive_mask(allowed, self.dtype)[:, None],
        )
        self._rows.append(hidden)
        self._allowed.append(tree)
        return self.head.logits(hidden, self.lm_head)

    def end_proposal(self) -> None:
        self.cache.crop(self.valid.shape[1])
        self._start_proposal()

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return self.head.to_target_ids(draft_ids)
