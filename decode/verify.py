"""Verify: one target forward over every tree token with a 4-D tree mask (SpecInfer 2305.09781 section 4.2),
then keep only the accepted path's KV by indexing the cache (no recomputation)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from decode.tree import DraftTree
from heads.eagle import additive_mask
from heads.features import FeatureCapture


def tree_attention_mask(ancestors: Tensor, past_length: int, dtype: torch.dtype) -> Tensor:
    """(1, 1, N, past + N) additive mask on `ancestors`' device: every node sees the committed prefix, its
    ancestors and itself. `ancestors`: the (N, N) bool ancestor-or-self matrix (`DraftTree.ancestors`)."""
    n = ancestors.shape[0]
    allowed = torch.ones(n, past_length + n, dtype=torch.bool, device=ancestors.device)
    allowed[:, past_length:] = ancestors
    return additive_mask(allowed, dtype)[None, None]


@torch.no_grad()
def verify(
    model: nn.Module,
    cache: DynamicCache,
    tree: DraftTree,
    past_length: int,
    capture: FeatureCapture | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Score all tree nodes in one target forward.

    Args:
        model: the target causal LM.
        cache: its KV cache holding exactly `past_length` committed positions; tree KV is appended.
        tree: the proposal (node 0 = root token, not yet cached).
        past_length: committed sequence length.
        capture: records the features the drafter needs, if any.
    Returns:
        logits (N, V) for the token after each node, and features (N, F) or None.
    """
    device = model.device  # a proposal is already there: the copies below are no-ops, not host round trips
    tokens = tree.tokens.to(device)[None]  # (1, N)
    positions = (past_length + tree.depths).to(device)[None]  # (1, N)
    mask = (
        None if len(tree) == 1 else tree_attention_mask(tree.ancestors.to(device), past_length, model.dtype)
    )
    out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True)
    features = capture.features()[0] if capture is not None else None
    return out.logits[0], features


def compact_cache(
    cache: DynamicCache, past_length: int, keep: list[int], keep_index: Tensor | None = None
) -> None:
    """Keep the committed prefix plus the tree nodes `keep` (root-to-node path) in every cache layer.

    `keep_index` is `keep` as an int64 tensor on the cache's device, when the caller has one (`generate` does:
    no upload); otherwise it is made once here. Either way one index serves every layer.
    """
    if keep == [0] and cache.layers and cache.layers[0].keys.shape[-2] == past_length + 1:
        return  # plain decoding: the single verified token is the one kept
    crop = keep == list(range(len(keep)))  # a chain prefix: a crop is enough
    index = None
    if not crop:
        device = cache.layers[0].keys.device
        index = past_length + (keep_index if keep_index is not None else torch.tensor(keep, device=device))
    tree_length = None
    end = past_length + len(keep)
    for layer in cache.layers:
        length = layer.keys.shape[-2]
        tree_length = length - past_length if tree_length is None else tree_length
        if length != past_length + tree_length:
            raise NotImplementedError(
                "cache layers differ in length (a sliding window is full); sequences "
                "longer than the sliding window are not supported yet"
            )
        if not crop:  # move the kept tree entries up behind the prefix (the prefix itself is not copied)
            layer_index = index.to(layer.keys.device)  # a no-op unless the model is split over devices
            layer.keys[..., past_length:end, :] = layer.keys.index_select(-2, layer_index)
            layer.values[..., past_length:end, :] = layer.values.index_select(-2, layer_index)
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = end
