"""Verify: one target forward over every tree token with a 4-D tree mask (SpecInfer 2305.09781 section 4.2),
then keep only the accepted path's KV by indexing the cache (no recomputation).

Sliding-window layers keep every column too (`target_cache`): a tree's nodes, and a batch's rows after
uneven acceptance, sit at positions their cache column does not give, so the window is applied in the masks,
by position (`attention_masks`), never by dropping the oldest columns as transformers' own cache does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from decode.inputs import attention_windows
from decode.recurrent import hybrid_cache, kv_layers
from decode.tree import DraftTree
from heads.eagle import additive_mask
from heads.features import FeatureCapture

Masks = Tensor | dict[str, Tensor]  # one additive mask for every layer, or one per layer type


def target_cache(model: nn.Module | None = None) -> DynamicCache:
    """An empty cache in which every KV layer keeps every column, sliding-window layers too: without a config,
    transformers makes each layer a plain `DynamicLayer` on its first update. A `model` whose layers are not
    all KV layers (a hybrid's recurrent layers, Nemotron-H's empty MLP layers) gets its own layout, its KV
    layers plain (`decode.recurrent.hybrid_cache`). (Targets whose layers need another kind of cache are
    refused before one is made: `decode.inputs.attention_windows`.)"""
    if model is not None and not all(
        isinstance(layer, DynamicLayer) for layer in DynamicCache(config=model.config).layers
    ):
        return hybrid_cache(model)
    return DynamicCache()


def attention_masks(
    allowed: Tensor, distance: Tensor | None, windows: dict[str, int | None], dtype: torch.dtype
) -> Masks:
    """The additive (B, 1, N, K) mask(s) of a forward from `allowed` (B, N, K) bool, narrowed for each
    sliding-window layer type to the keys less than its window behind the query (transformers' rule).

    Args:
        allowed: which keys each query may see (validity, tree ancestry).
        distance: (B, N, K) query position minus key position; None when `windows` has no window.
        windows: layer type -> sliding window or None (`decode.inputs.attention_windows`).
        dtype: the mask's dtype (the target's).
    Returns:
        one mask when every layer attends alike, else a dict by layer type (what transformers' models with
        `layer_types` take).
    """
    if not any(windows.values()):
        return additive_mask(allowed, dtype)[:, None]
    by_window = {
        window: additive_mask(allowed & (distance < window) if window else allowed, dtype)[:, None]
        for window in set(windows.values())
    }
    if len(by_window) == 1:
        return next(iter(by_window.values()))
    return {kind: by_window[window] for kind, window in windows.items()}


def tree_attention_mask(
    ancestors: Tensor, past_length: int, dtype: torch.dtype, windows: dict[str, int | None] | None = None
) -> Masks:
    """(1, 1, N, past + N) additive mask on `ancestors`' device: every node sees the committed prefix, its
    ancestors and itself. `ancestors`: the (N, N) bool ancestor-or-self matrix (`DraftTree.ancestors`).
    With `windows` (`decode.inputs.attention_windows`), sliding-window layers see less (`attention_masks`)."""
    n = ancestors.shape[0]
    allowed = torch.ones(n, past_length + n, dtype=torch.bool, device=ancestors.device)
    allowed[:, past_length:] = ancestors
    if not windows or not any(windows.values()):
        return additive_mask(allowed, dtype)[None, None]
    queries = past_length + ancestors.sum(-1) - 1  # (N,) node positions: the prefix, then the node's depth
    keys = torch.cat([torch.arange(past_length, device=queries.device), queries])  # (past + N,)
    return attention_masks(allowed[None], (queries[:, None] - keys[None])[None], windows, dtype)


@torch.no_grad()
def verify(
    model: nn.Module,
    cache: DynamicCache,
    tree: DraftTree,
    past_length: int,
    capture: FeatureCapture | None = None,
    windows: dict[str, int | None] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Score all tree nodes in one target forward.

    Args:
        model: the target causal LM.
        cache: its KV cache (`target_cache`) holding exactly `past_length` committed positions; tree KV is
            appended.
        tree: the proposal (node 0 = root token, not yet cached).
        past_length: committed sequence length.
        capture: records the features the drafter needs, if any.
        windows: the target's `decode.inputs.attention_windows` (read here when None: callers that verify
            in a loop, or time it, pass them).
    Returns:
        logits (N, V) for the token after each node, and features (N, F) or None.
    """
    device = model.device  # a proposal is already there: the copies below are no-ops, not host round trips
    tokens = tree.tokens.to(device)[None]  # (1, N)
    positions = (past_length + tree.depths).to(device)[None]  # (1, N)
    mask = None  # one node: the target's own causal (and window) mask
    if len(tree) > 1:
        ancestors = tree.ancestors.to(device)
        windows = attention_windows(model) if windows is None else windows
        mask = tree_attention_mask(ancestors, past_length, model.dtype, windows)
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
    layers = kv_layers(cache)
    if keep == [0] and layers and layers[0].keys.shape[-2] == past_length + 1:
        return  # plain decoding: the single verified token is the one kept
    crop = keep == list(range(len(keep)))  # a chain prefix: a crop is enough
    index = None
    if not crop:
        device = layers[0].keys.device
        index = past_length + (keep_index if keep_index is not None else torch.tensor(keep, device=device))
    tree_length = None
    end = past_length + len(keep)
    for layer in layers:
        length = layer.keys.shape[-2]
        tree_length = length - past_length if tree_length is None else tree_length
        if length != past_length + tree_length:
            raise ValueError(
                f"cache layers differ in length ({length} and {past_length + tree_length} columns): a cache "
                "whose sliding-window layers drop columns cannot be compacted; make it with target_cache"
            )
        if not crop:  # move the kept tree entries up behind the prefix (the prefix itself is not copied)
            layer_index = index.to(layer.keys.device)  # a no-op unless the model is split over devices
            layer.keys[..., past_length:end, :] = layer.keys.index_select(-2, layer_index)
            layer.values[..., past_length:end, :] = layer.values.index_select(-2, layer_index)
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = end
