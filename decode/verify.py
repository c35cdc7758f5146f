"""Verify: one target forward over every tree token with a 4-D tree mask (SpecInfer 2305.09781 section 4.2),
then keep only the accepted path's KV by indexing the cache (no recomputation)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from decode.tree import DraftTree, ancestor_mask
from heads.eagle import additive_mask
from heads.features import FeatureCapture


def tree_attention_mask(parents: Tensor, past_length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(1, 1, N, past + N) additive mask: every node sees the committed prefix, its ancestors and itself."""
    n = parents.numel()
    allowed = torch.ones(n, past_length + n, dtype=torch.bool, device=device)
    allowed[:, past_length:] = ancestor_mask(parents).to(device)
    return additive_mask(allowed, dtype)[None, None]


@torch.no_grad()
def verify(model: nn.Module, cache: DynamicCache, tree: DraftTree, past_length: int,
           capture: FeatureCapture | None = None) -> tuple[Tensor, Tensor | None]:
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
    device = model.device
    tokens = tree.tokens.to(device)[None]                                   # (1, N)
    positions = (past_length + tree.depths).to(device)[None]                # (1, N)
    mask = None if len(tree) == 1 else tree_attention_mask(tree.parents, past_length, model.dtype, device)
    out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True)
    features = capture.features()[0] if capture is not None else None
    return out.logits[0], features


def compact_cache(cache: DynamicCache, past_length: int, keep: list[int]) -> None:
    """Keep the committed prefix plus the tree nodes `keep` (root-to-node path) in every cache layer."""
    if keep == [0] and cache.layers and cache.layers[0].keys.shape[-2] == past_length + 1:
        return  # plain decoding: the single verified token is the one kept
    tree_length = None
    for layer in cache.layers:
        length = layer.keys.shape[-2]
        tree_length = length - past_length if tree_length is None else tree_length
        if length != past_length + tree_length:
            raise NotImplementedError("cache layers differ in length (a sliding window is full); sequences "
                                      "longer than the sliding window are not supported yet")
        if keep == list(range(len(keep))):  # a chain prefix: a crop is enough
            layer.keys = layer.keys[..., : past_length + len(keep), :]
            layer.values = layer.values[..., : past_length + len(keep), :]
        else:  # move the kept tree entries up behind the prefix (the prefix itself is not copied), then crop
            index = torch.tensor([past_length + i for i in keep], device=layer.keys.device)
            end = past_length + len(keep)
            layer.keys[..., past_length:end, :] = layer.keys.index_select(-2, index)
            layer.values[..., past_length:end, :] = layer.values.index_select(-2, index)
            layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = past_length + len(keep)
