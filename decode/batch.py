"""Batched verification (issue 18, first step): B sequences share one target KV cache and one forward per
step, each with its own tree, its own committed length and its own accepted path.

The cache stays rectangular, (B, heads, L, head_dim) per layer. Column validity is per row (`valid`, (B, L)):
left padding and the columns a row did not keep are masked out, never attended to. Positions come from each
row's committed length (`lengths`), not from the column, so a row's holes cost nothing but memory. After a
step, `commit` moves each row's accepted tree entries right behind that row's last committed column and cuts
the columns no row uses any more: the cache grows by the longest accepted path, not by the tree size.

Used by `generate_plain_batch` (greedy plain decoding of B prompts, the baseline of batched speculation) and
tested against per-prompt verification and transformers' own batched `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from heads.eagle import additive_mask
from heads.features import FeatureCapture


@dataclass
class BatchState:
    """What a batched decode carries between steps."""

    cache: DynamicCache
    valid: Tensor  # (B, L) bool: cache column j holds a committed token of row b
    lengths: Tensor  # (B,) int64: committed tokens per row (the next token's position)
    ends: Tensor  # (B,) int64: one past each row's last valid column

    @property
    def columns(self) -> int:
        return self.valid.shape[1]

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` (int64 indices) in the batch and the cache (finished sequences leave)."""
        self.cache.batch_select_indices(rows)
        self.valid, self.lengths, self.ends = self.valid[rows], self.lengths[rows], self.ends[rows]
        self._trim()

    def _trim(self) -> None:
        end = int(self.ends.max()) if self.ends.numel() else 0
        if end < self.columns:
            self.valid = self.valid[:, :end]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]


@torch.no_grad()
def prefill(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, capture: FeatureCapture | None = None
) -> tuple[BatchState, Tensor, Tensor | None]:
    """Run the left-padded prompts (B, T) through the target.

    Returns:
        the batch state, the logits after each prompt's last token (B, V), and the captured features
        (B, T, F) or None.
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must have "
            "one (B, T) shape"
        )
    if bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("prompts must be left-padded: every row's last column must be a token (mask 1)")
    mask = attention_mask.to(device=model.device, dtype=torch.long)
    if bool((mask.sum(-1) == 0).any()):
        raise ValueError("a prompt row has no tokens")
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=input_ids.to(model.device),
        attention_mask=mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
    )
    features = capture.features() if capture is not None else None
    valid = mask.bool()
    state = BatchState(
        cache=cache,
        valid=valid,
        lengths=mask.sum(-1),
        ends=torch.full((valid.shape[0],), valid.shape[1], dtype=torch.long, device=valid.device),
    )
    return state, out.logits[:, -1], features


def batch_tree_mask(valid: Tensor, ancestors: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, 1, N, L + N) additive mask: each row's nodes see that row's valid columns, their ancestors and
    themselves. `valid` (B, L) bool, `ancestors` (B, N, N) bool (ancestor-or-self)."""
    b, n = ancestors.shape[:2]
    allowed = torch.cat([valid[:, None, :].expand(b, n, valid.shape[1]), ancestors], dim=-1)
    return additive_mask(allowed, dtype)[:, None]


@torch.no_grad()
def verify_batch(
    model: nn.Module,
    state: BatchState,
    tokens: Tensor,
    depths: Tensor,
    ancestors: Tensor,
    capture: FeatureCapture | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Score B trees of N nodes each in one target forward; their KV is appended to the cache.

    Args:
        model: the target.
        state: the batch (its cache holds `state.columns` columns).
        tokens: (B, N) node tokens, node 0 = the row's root (its last emitted token, not yet cached).
        depths: (B, N) node depths (root 0).
        ancestors: (B, N, N) bool ancestor-or-self matrices.
        capture: records the features a drafter needs, if any.
    Returns:
        logits (B, N, V) and features (B, N, F) or None.
    """
    device = model.device
    positions = state.lengths[:, None] + depths.to(device)
    mask = batch_tree_mask(state.valid, ancestors.to(device), model.dtype)
    out = model(
        input_ids=tokens.to(device),
        position_ids=positions,
        attention_mask=mask,
        cache=state.cache,
        use_cache=True,
    )
    features = capture.features() if capture is not None else None
    return out.logits, features


def commit(state: BatchState, keep: list[list[int]], tree_size: int) -> None:
    """Keep each row's accepted nodes (`keep[b]`: node indices, root first, in path order) of the last
    `verify_batch` (`tree_size` nodes per row): move their KV right behind the row's last valid column, mark
    them valid, advance the row's length, and cut the columns no row uses."""
    before = state.columns  # the columns before this step's tree (`valid` does not cover the tree yet)
    if len(keep) != state.valid.shape[0]:
        raise ValueError(f"keep has {len(keep)} rows, the batch {state.valid.shape[0]}")
    cached = state.cache.layers[0].keys.shape[-2]
    if cached != before + tree_size:
        raise ValueError(f"the cache holds {cached} columns, expected {before} + a tree of {tree_size}")
    grown = torch.zeros(state.valid.shape[0], tree_size, dtype=torch.bool, device=state.valid.device)
    valid = torch.cat([state.valid[:, :before], grown], dim=1)
    for row, nodes in enumerate(keep):
        if not nodes:
            continue
        start = int(state.ends[row])
        source = torch.tensor(nodes, device=state.valid.device) + before
        if nodes != list(range(start - before, start - before + len(nodes))):  # not in place already
            for layer in state.cache.layers:
                index = source.to(layer.keys.device)
                layer.keys[row, :, start : start + len(nodes)] = layer.keys[row].index_select(-2, index)
                layer.values[row, :, start : start + len(nodes)] = layer.values[row].index_select(-2, index)
        valid[row, start : start + len(nodes)] = True
        state.ends[row] = start + len(nodes)
        state.lengths[row] += len(nodes)
    state.valid = valid
    state._trim()


@torch.no_grad()
def generate_plain_batch(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> list[list[int]]:
    """Greedy plain decoding of B left-padded prompts through the batched verify path (trees of one node):
    each row's new tokens, EOS included when hit; a finished row leaves the batch and the cache."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, (list, tuple, set)) else [] if eos is None else [eos])
    state, last, _ = prefill(model, input_ids, attention_mask)
    rows = list(range(input_ids.shape[0]))
    outputs: list[list[int]] = [[] for _ in rows]
    root = last.argmax(-1)  # (B,)
    one = torch.ones(1, 1, 1, dtype=torch.bool, device=root.device)
    while True:
        alive = []
        for i, (row, token) in enumerate(zip(rows, root.tolist())):
            outputs[row].append(token)
            if token not in stop and len(outputs[row]) < max_new_tokens:
                alive.append(i)
        if not alive:
            return outputs
        if len(alive) < len(rows):
            keep = torch.tensor(alive, device=root.device)
            state.select(keep)
            rows, root = [rows[i] for i in alive], root[keep]
        b = len(rows)
        depths = torch.zeros(b, 1, dtype=torch.long, device=root.device)
        logits, _ = verify_batch(model, state, root[:, None], depths, one.expand(b, 1, 1))
        commit(state, [[0]] * b, 1)
        root = logits[:, 0].argmax(-1)
