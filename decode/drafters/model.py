"""A separate draft model: any Hugging Face causal LM that shares the target's tokenizer drafts for it with
its own KV cache (the classic speculative decoding of Leviathan et al. and Chen et al., here with trees).

The draft model reads token ids only (no target features). Its cache is rectangular over the batch, (B, heads,
L, head_dim) per layer, with a column validity per row (`valid`), as the target's is in `decode.batch`: rows
take in different numbers of accepted tokens per step, padded columns stay invalid. A proposal appends each
level's nodes behind the committed columns, every node seeing its row's committed tokens, its ancestors and
itself (tree attention), and crops them off afterwards. Chains are trees of width one: `tree=chain(k)`.

`targets.layer_draft` makes a draft from the target itself (its first N layers, final norm and lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from decode.drafter import Drafter, DraftLimits, tree_visibility
from decode.inputs import attention_windows, recurrent_layer_indices
from decode.verify import attention_masks, target_cache


@dataclass(frozen=True, eq=False)
class DraftModel:
    """A draft source: `generate(target, ids, DraftModel(small_model), tree=...)`.

    Args:
        model: a causal LM over the target's vocabulary (same tokenizer), on the target's device.
        max_depth: the deepest level drafted (None: as deep as the tree asks).
    """

    model: nn.Module
    max_depth: int | None = None


def draft_models(source: DraftModel) -> list[nn.Module]:
    """The model `decode.prepare` lays out for fast CPU decoding, as it lays out the target."""
    return [source.model]


def check_draft_model(draft: nn.Module, target: nn.Module) -> dict[str, int | None]:
    """The draft must score the target's vocabulary (ids mean the same tokens) on the target's device, and
    its layers attend (fully or in sliding windows). Returns its windows (`decode.inputs.attention_windows`:
    layer type -> sliding window or None)."""
    draft_vocab = draft.get_output_embeddings().weight.shape[0]
    target_vocab = target.get_output_embeddings().weight.shape[0]
    if draft_vocab != target_vocab:
        raise ValueError(
            f"the draft model scores {draft_vocab} tokens, the target {target_vocab}: a draft model must "
            "share the target's tokenizer and vocabulary"
        )
    if draft.device != target.device:
        raise ValueError(f"the draft model is on {draft.device}, the target on {target.device}")
    recurrent = recurrent_layer_indices(draft)
    if recurrent:
        raise ValueError(
            f"the draft model's layers {recurrent} keep recurrent state (a hybrid): a draft model drafts "
            "trees over a KV cache; use a draft model whose every layer attends"
        )
    try:
        return attention_windows(draft)
    except ValueError as err:
        raise ValueError(f"the draft model: {err}") from None


class ModelDrafter(Drafter):
    """`DraftModel`'s drafter for a batch (see the module docstring)."""

    feature_layers = ()

    def __init__(self, source: DraftModel, target: nn.Module, batch: int) -> None:
        self.windows = check_draft_model(source.model, target)
        self.model, self.max_depth = source.model, source.max_depth
        self.device, self.dtype = source.model.device, source.model.dtype
        # every column kept (transformers' own cache would drop the oldest of a sliding-window draft, under
        # the columns the masks below index); its windows are applied in the masks instead, as the target's
        self.cache = target_cache()
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=self.device)
        self.key_positions = torch.zeros(batch, 0, dtype=torch.long, device=self.device)  # per column
        self.counts = torch.zeros(batch, dtype=torch.long, device=self.device)  # tokens taken in per row
        self.first: list[Tensor] = []  # each row's first prompt token, fed with its first `advance`
        self.root: Tensor | None = None  # (B, V) logits after each row's last token
        self._allowed: list[Tensor] = []  # (B, n, R) per level: which earlier tree entries each node sees
        self._positions: list[Tensor] = []  # (B, n) per level: its nodes' positions

    def limits(self) -> DraftLimits:
        return DraftLimits(max_depth=self.max_depth, dynamic=True, block=False)

    def start(self, prompts: list[Tensor]) -> None:
        self.first = [p[:1].to(self.device) for p in prompts]

    def _forward(self, tokens: Tensor, positions: Tensor, allowed: Tensor, keys: Tensor) -> Tensor:
        """Logits of `tokens` at `positions` (B, n), seeing what `allowed` (B, n, K) says of the keys at
        positions `keys` (B, K): the cache's columns, then the new tokens (a window counts positions)."""
        distance = positions[:, :, None] - keys[:, None, :] if any(self.windows.values()) else None
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=attention_masks(allowed, distance, self.windows, self.dtype),
            cache=self.cache,
            use_cache=True,
        )
        return out.logits

    @torch.no_grad()
    def advance(self, features, tokens: list[Tensor]) -> None:
        if self.first:  # the prompt's first token precedes what the first advance brings
            tokens = [torch.cat([f, t.to(self.device)]) for f, t in zip(self.first, tokens, strict=True)]
            self.first = []
        sizes = [t.numel() for t in tokens]
        width = max(sizes)
        ids = pad_sequence([t.to(self.device) for t in tokens], batch_first=True)
        taken = pad_sequence(
            [torch.ones(n, dtype=torch.bool, device=self.device) for n in sizes], batch_first=True
        )
        new = torch.arange(width, device=self.device)
        allowed = torch.cat(
            [
                self.valid[:, None, :].expand(-1, width, -1),
                # causal over the real tokens; a padding position sees itself only (never an empty row)
                ((new[None, :, None] >= new[None, None, :]) & taken[:, None, :])
                | torch.eye(width, dtype=torch.bool, device=self.device),
            ],
            dim=-1,
        )
        positions = self.counts[:, None] + new[None, :]
        logits = self._forward(ids, positions, allowed, torch.cat([self.key_positions, positions], dim=1))
        counts = torch.tensor(sizes, device=self.device)
        self.root = logits.gather(1, (counts - 1)[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        self.valid = torch.cat([self.valid, taken], dim=1)
        self.key_positions = torch.cat([self.key_positions, positions], dim=1)
        self.counts = self.counts + counts
        self._allowed, self._positions = [], []

    def root_logits(self) -> Tensor:
        return self.root

    @torch.no_grad()
    def expand(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> Tensor:
        batch, n = tokens.shape
        tree = tree_visibility(
            self._allowed, parent_rows.to(self.device)
        )  # the parent's ancestors and itself
        allowed = torch.cat(
            [
                self.valid[:, None, :].expand(-1, n, -1),
                tree,
                torch.eye(n, dtype=torch.bool, device=self.device).expand(batch, -1, -1),
            ],
            dim=-1,
        )
        positions = (self.counts + depth - 1)[:, None].expand(-1, n)
        keys = torch.cat([self.key_positions, *self._positions, positions], dim=1)
        logits = self._forward(tokens.to(self.device), positions, allowed, keys)
        self._allowed.append(tree)
        self._positions.append(positions)
        return logits

    def end_proposal(self) -> None:
        end = self.valid.shape[1]
        for layer in self.cache.layers:
            if layer.keys is not None and layer.keys.shape[-2] > end:
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        self._allowed, self._positions = [], []

    def select(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.valid, self.counts = self.valid[index], self.counts[index]
        self.key_positions = self.key_positions[index]
        if self.root is not None:
            self.root = self.root[index]
        if self.cache.get_seq_length() > 0:
            self.cache.batch_select_indices(index)
        self.first = [self.first[r] for r in rows] if self.first else []
