"""Hybrid targets: some layers keep a recurrent state (gated delta-net linear attention, Mamba-2) instead of a
KV cache (Qwen3-Next, Qwen3.5, Granite 4.0 hybrids, Nemotron-H).

A KV cache lets the nodes of a token tree share one prefix, each node seeing its ancestors' entries only; a
recurrent state is one summary of everything fed so far, so a tree cannot share it: on a hybrid target
decoding verifies CHAINS (`check_chain`; the default is `chain(HYBRID_CHAIN)`), fed in order through the
recurrent layers. After acceptance the KV entries of the accepted prefix are right as they are (a chain is
causal: position i's entries depend on positions <= i only), but the recurrent state also took in the
rejected drafts. So the verify pass records the state after each of its tokens (`record`: transformers'
past recording, which the hybrids' layers honour by computing the chain's last states one token at a time),
and each row then takes the state after its last accepted token (`settle`): a gather, no forward. Where a
model's layers do not record intermediate states, the rows that accepted less than their whole chain are run
again from the state before the pass over their accepted tokens (`decode.batch.replay`): one more target
forward per distinct accepted length, whose only product kept is the recurrent state.

Every layer that keeps KV is a plain `DynamicLayer` that keeps every column (`hybrid_cache`), as for the
other targets (`decode.verify.target_cache`); transformers' `DummyLayer` (Nemotron-H's MLP and MoE layers)
holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from decode.tree import BestFirstTree, DynamicTree, TreeBuffers

HYBRID_CHAIN = 4  # drafts per step on a hybrid target when no tree is given (vLLM serves chains of 3 to 5)


def is_recurrent(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def kv_layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache layers that keep keys and values (not recurrent or empty ones)."""
    return [layer for layer in cache.layers if isinstance(layer, DynamicLayer)]


def kv_length(cache: DynamicCache) -> int:
    """The columns the cache's KV layers hold (its first KV layer's)."""
    layers = kv_layers(cache)
    return layers[0].keys.shape[-2] if layers and layers[0].keys is not None else 0


def recurrent_layers(cache: DynamicCache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if is_recurrent(layer)]


def hybrid_cache(model: nn.Module) -> DynamicCache:
    """An empty cache in the target's own layout (recurrent layers where it has them), each KV layer a plain
    `DynamicLayer` that keeps every column."""
    cache = DynamicCache(config=model.config)
    cache.layers = [
        DynamicLayer() if isinstance(layer, DynamicLayer) else layer for layer in cache.layers
    ]  # (a sliding-window layer would drop columns the masks index)
    return cache


@dataclass
class Snapshot:
    """Copies of every recurrent layer's states, rows in the batch's order: layer index -> (conv states,
    recurrent states), each a dict state index -> tensor (B, ...) or None."""

    layers: dict[int, tuple[dict[int, Tensor | None], dict[int, Tensor | None]]]


def _copies(states: dict[int, Tensor | None]) -> dict[int, Tensor | None]:
    return {i: None if s is None else s.clone() for i, s in states.items()}


def snapshot(cache: DynamicCache) -> Snapshot:
    """The recurrent states now (copies: the forwards update them in place)."""
    return Snapshot(
        {
            i: (_copies(layer.conv_states), _copies(layer.recurrent_states))
            for i, layer in enumerate(cache.layers)
            if is_recurrent(layer)
        }
    )


def restore(cache: DynamicCache, saved: Snapshot, rows: Tensor | None = None) -> None:
    """Write the saved states back (all rows, or `rows`: a (R,) index into the batch), in place."""
    for i, (conv, recurrent) in saved.layers.items():
        layer = cache.layers[i]
        for mine, theirs in ((layer.conv_states, conv), (layer.recurrent_states, recurrent)):
            for s, value in theirs.items():
                if value is None:
                    continue
                if rows is None:
                    mine[s].copy_(value)
                else:
                    mine[s].index_copy_(
                        0, rows.to(value.device), value.index_select(0, rows.to(value.device))
                    )


def record(cache: DynamicCache, tokens: int) -> None:
    """Have every recurrent layer keep its state after each of the next forward's `tokens` tokens (its conv
    inputs too), for `settle`."""
    for layer in cache.layers:
        if is_recurrent(layer):
            layer.record_past = True
            layer.recurrent_states_to_keep = tokens
            layer.recurrent_states_history = {s: [] for s in range(layer.number_of_states)}


def settle(cache: DynamicCache, kept: Tensor, tokens: int) -> Snapshot | None:
    """End a `record`ed verify pass of `tokens` chain tokens: give each row the recurrent state after its
    `kept` (B,) accepted tokens (>= 1, on the cache's device) and the conv inputs that end there, and stop
    recording.

    Returns:
        None; or, where a layer's model did not record the state after every token, the states before the
        pass (each row is then left at the end of its chain): the caller runs the rows that accepted less
        again from those (`decode.batch.replay`).
    """
    before: dict[int, tuple[dict[int, Tensor | None], dict[int, Tensor | None]]] = {}
    incomplete = False
    for i, layer in enumerate(cache.layers):
        if not is_recurrent(layer):
            continue
        conv_before, states_before = {}, {}
        for s in range(layer.number_of_states):
            full = layer.conv_states[s]
            if full is not None:
                width = layer.conv_kernel_size[s]
                if full.shape[-1] != width + tokens:
                    raise RuntimeError(
                        f"layer {i}: {full.shape[-1]} recorded conv columns, expected {width} + {tokens}"
                    )
                conv_before[s] = full[..., :width]
                # after token j the conv inputs are columns j + 1 .. j + width: j + 1 = kept
                columns = kept.to(full.device)[:, None] + torch.arange(width, device=full.device)
                index = columns[:, None, :].expand(full.shape[0], full.shape[1], width)
                layer.conv_states[s] = full.gather(-1, index)
            current = layer.recurrent_states[s]
            if current is not None:
                history = layer.recurrent_states_history[s]
                states_before[s] = history[0].clone() if history else None
                if len(history) == tokens:  # the state before the pass, then after each token but the last
                    steps = torch.stack([*history[1:], current])  # (tokens, B, ...): after token j
                    rows = torch.arange(current.shape[0], device=current.device)
                    current.copy_(steps[(kept - 1).to(current.device), rows])
                else:
                    incomplete = True
            layer.recurrent_states_history[s] = []
        layer.record_past = False
        layer.recurrent_states_to_keep = 0
        before[i] = (conv_before, states_before)
    return Snapshot(before) if incomplete else None


def rewind(cache: DynamicCache, n: int, saved: Snapshot | None = None) -> None:
    """Drop the last `n` columns of every KV layer, and put back the recurrent states `saved` before those
    columns were fed (timing loops that verify the same context again and again)."""
    for layer in kv_layers(cache):
        layer.keys, layer.values = layer.keys[..., :-n, :], layer.values[..., :-n, :]
    if saved is not None:
        restore(cache, saved)


def select_rows(cache: DynamicCache, index: Tensor) -> None:
    """Keep only the batch rows `index` in every layer (KV and recurrent)."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer):
            layer.batch_select_indices(index)
        elif is_recurrent(layer):
            for states in (layer.conv_states, layer.recurrent_states):
                for s, value in states.items():
                    if value is not None:
                        states[s] = value.index_select(0, index.to(value.device))


def merge_rows(cache: DynamicCache, parts: list[DynamicCache]) -> None:
    """Give `cache`'s recurrent layers the states of one-row caches `parts`, stacked in order (a batch
    prefilled row by row: `decode.batch.prefill`)."""
    for i, layer in enumerate(cache.layers):
        if not is_recurrent(layer):
            continue
        first = parts[0].layers[i]
        adopt(layer, first)
        for mine, name in ((layer.conv_states, "conv_states"), (layer.recurrent_states, "recurrent_states")):
            for s in mine:
                values = [getattr(part.layers[i], name)[s] for part in parts]
                mine[s] = None if values[0] is None else torch.cat(values)


def adopt(layer, other) -> None:
    """Copy a recurrent layer's bookkeeping (initialised flags, kernel sizes, device) from `other`."""
    for name in (
        "is_conv_states_initialized",
        "is_recurrent_states_initialized",
        "has_previous_state",
        "conv_kernel_size",
    ):
        setattr(layer, name, dict(getattr(other, name)))
    layer.device, layer.dtype = other.device, other.dtype
    layer.cumulative_length_linear = other.cumulative_length_linear.clone()


def check_chain(tree, target: str) -> None:
    """A hybrid target verifies chains only (module docstring): refuse a resolved tree with branches.

    Raises:
        ValueError: a static tree with more than one node at a depth, a dynamic tree with top_k > 1, or a
            best-first tree; named with the target.
    """
    if isinstance(tree, TreeBuffers):
        branched = len(tree.paths) != tree.depth or any(rank for path in tree.paths for rank in path)
    elif isinstance(tree, DynamicTree):
        branched = tree.top_k > 1
    else:
        branched = isinstance(tree, BestFirstTree)
    if branched:
        raise ValueError(
            f"{target} is a hybrid target (layers with recurrent state): it verifies chains only, one draft "
            f"per depth, and got a tree with branches ({tree!r}); pass tree=decode.tree.chain(depth), a "
            "DynamicTree with top_k=1, or no tree (a chain of "
            f"{HYBRID_CHAIN})"
        )
