"""The target's side of a decode: B sequences share one target KV cache and one forward per step, each with
its own tree, its own committed length and its own accepted path (B = 1 is a batch of one).

The cache stays rectangular, (B, heads, L, head_dim) per layer. Column validity is per row (`valid`, (B, L)):
left padding and the columns a row did not keep are masked out, never attended to. Positions come from each
row's committed length (`lengths`), not from the column, so a row's holes cost nothing but memory. After a
step, `commit` moves each row's accepted tree entries right behind that row's last committed column and cuts
the columns no row uses any more: the cache grows by the longest accepted path, not by the tree size.

Sliding-window layers keep every column as the others do: the window is applied in the masks, by each row's
positions (`decode.verify.attention_masks`), since holes and trees make a column's index no position.

A batch whose every column is valid (`BatchState.full`: one row without padding) takes the shorter paths a
single sequence allows: no mask over the prompt's prefill or a plain step, and a tree's accepted path kept by
a crop or one index per layer (`decode.verify.compact_cache`) instead of a per-row gather and scatter.
`decode.generate` runs the loop over these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from decode.inputs import attention_windows, check_attention_mask
from decode.recurrent import (
    Snapshot,
    adopt,
    is_recurrent,
    kv_layers,
    merge_rows,
    recurrent_layers,
    select_rows,
)
from decode.verify import attention_masks, compact_cache, target_cache, tree_attention_mask
from heads.eagle import additive_mask
from heads.features import FeatureCapture


@dataclass
class BatchState:
    """What a batched decode carries between steps."""

    cache: DynamicCache
    valid: Tensor  # (B, L) bool: cache column j holds a committed token of row b
    lengths: Tensor  # (B,) int64: committed tokens per row (the next token's position)
    ends: Tensor  # (B,) int64: one past each row's last valid column
    host_ends: list[int] = field(
        default_factory=list
    )  # `ends` on the host: laying out the cache reads nothing
    full: bool = False  # every column of the (single) row is valid: the shorter paths (module docstring)
    windows: dict[str, int | None] = field(default_factory=dict)  # layer type -> sliding window or None
    hybrid: bool = False  # some layers keep recurrent state: chains only, rolled back (`decode.recurrent`)

    def __post_init__(self) -> None:
        if not self.host_ends:
            self.host_ends = self.ends.tolist()

    @property
    def columns(self) -> int:
        return self.valid.shape[1]

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the batch) in the batch and the cache (finished sequences leave)."""
        if rows == list(range(self.valid.shape[0])):
            return
        self.full = False  # a row left alone may hold padding or holes
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        select_rows(self.cache, index)
        self.valid, self.lengths, self.ends = self.valid[index], self.lengths[index], self.ends[index]
        self.host_ends = [self.host_ends[r] for r in rows]
        self._trim()

    def _trim(self) -> None:
        end = max(self.host_ends, default=0)
        if end < self.columns:
            self.valid = self.valid[:, :end]
            for layer in kv_layers(self.cache):
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]


def left_padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask of 1-D prompts of any lengths, padded on the left with `pad`."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - row.numel() :], mask[b, width - row.numel() :] = row, 1
    return ids, mask


@torch.no_grad()
def prefill(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    capture: FeatureCapture | None = None,
    windows: dict[str, int | None] | None = None,
) -> tuple[BatchState, Tensor, Tensor | None]:
    """Run the left-padded prompts (B, T) through the target (`attention_mask` None: no padding). `windows`:
    the target's `decode.inputs.attention_windows`, when the caller has them (read here otherwise).

    Returns:
        the batch state, the logits after each prompt's last token (B, V), and the captured features
        (B, T, F) or None.
    """
    hybrid = bool(recurrent_layers(target_cache(model)))
    # a hybrid's rows always get the explicit masks (its cache's own lengths count chains it rolled back)
    full = attention_mask is None and input_ids.shape[0] == 1 and not hybrid
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = check_attention_mask(attention_mask, tuple(input_ids.shape)).to(model.device)
    lengths = mask.sum(-1)
    if full:
        cache = target_cache(model)
        out = model(input_ids=input_ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
        last, features = out.logits[:, -1], capture.features() if capture is not None else None
    elif hybrid or input_ids.numel() > PER_ROW_PREFILL * int(lengths.sum()):
        # (a hybrid's rows one by one: padding fed through its recurrent layers would be fed into the state)
        cache, last, features = _prefill_rows(model, input_ids.to(model.device), lengths, capture)
    else:  # the target masks padding and windows from the 2-D mask: a column is a position plus the padding
        cache = target_cache(model)
        out = model(
            input_ids=input_ids.to(model.device),
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,  # the next token's logits only: not B x T x V floats
        )
        last, features = out.logits[:, -1], capture.features() if capture is not None else None
    valid = mask.bool()
    state = BatchState(
        cache=cache,
        valid=valid,
        lengths=lengths,
        ends=torch.full((valid.shape[0],), valid.shape[1], dtype=torch.long, device=valid.device),
        host_ends=[valid.shape[1]] * valid.shape[0],
        full=full,
        windows=attention_windows(model) if windows is None else windows,
        hybrid=hybrid,
    )
    return state, last, features


PER_ROW_PREFILL = 1.5  # prefill row by row when padding would make the batched prompt pass this much larger


def _prefill_rows(
    model: nn.Module, input_ids: Tensor, lengths: Tensor, capture: FeatureCapture | None
) -> tuple[DynamicCache, Tensor, Tensor | None]:
    """`prefill` one row at a time (each over its own tokens only, no padding), the results laid out as the
    batched pass lays them out: the cache and the features left-padded to the batch's width. For prompts of
    very different lengths (one long prompt in a batch of short ones): sum of the lengths instead of B x the
    longest, and no attention over padding."""
    batch, width = input_ids.shape
    rows, lasts, feats = [], [], []
    for r in range(batch):
        n = int(lengths[r])
        cache = target_cache(model)
        out = model(
            input_ids=input_ids[r : r + 1, width - n :], cache=cache, use_cache=True, logits_to_keep=1
        )
        rows.append(cache)
        lasts.append(out.logits[0, -1])
        if capture is not None:
            feats.append(capture.features()[0])
    cache = target_cache(model)
    for index in range(len(rows[0].layers)):
        if not isinstance(rows[0].layers[index], DynamicLayer):
            continue  # recurrent states are merged below; empty layers hold nothing
        parts = [(row.layers[index].keys, row.layers[index].values) for row in rows]
        shape = (batch, *parts[0][0].shape[1:-2], width, parts[0][0].shape[-1])
        keys = parts[0][0].new_zeros(shape)
        values = parts[0][1].new_zeros(shape[:-1] + (parts[0][1].shape[-1],))
        for r, (k, v) in enumerate(parts):
            keys[r, ..., width - k.shape[-2] :, :], values[r, ..., width - v.shape[-2] :, :] = k[0], v[0]
        cache.update(keys, values, index)
    merge_rows(cache, rows)
    features = None
    if capture is not None:
        features = feats[0].new_zeros(batch, width, feats[0].shape[-1])
        for r, f in enumerate(feats):
            features[r, width - f.shape[0] :] = f
    return cache, torch.stack(lasts), features


def batch_tree_mask(
    valid: Tensor,
    ancestors: Tensor,
    dtype: torch.dtype,
    lengths: Tensor | None = None,
    windows: dict[str, int | None] | None = None,
) -> Tensor | dict[str, Tensor]:
    """(B, 1, N, L + N) additive mask: each row's nodes see that row's valid columns, their ancestors and
    themselves. `valid` (B, L) bool, `ancestors` (B, N, N) bool (ancestor-or-self). With `windows`
    (`decode.inputs.attention_windows`) and the rows' committed `lengths` (B,), sliding-window layers see less
    (`decode.verify.attention_masks`)."""
    b, n = ancestors.shape[:2]
    allowed = torch.cat([valid[:, None, :].expand(b, n, valid.shape[1]), ancestors], dim=-1)
    if not windows or not any(windows.values()):
        return additive_mask(allowed, dtype)[:, None]
    depths = ancestors.sum(-1) - 1  # (B, N)
    queries = lengths[:, None] + depths  # (B, N) node positions
    keys = torch.cat([valid.cumsum(-1) - 1, queries], dim=-1)  # (B, L + N): a valid column's position
    return attention_masks(allowed, queries[:, :, None] - keys[:, None, :], windows, dtype)


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
    if state.full:  # one row, nothing masked before the tree
        n = tokens.shape[1]
        mask = (
            None
            if n == 1
            else tree_attention_mask(ancestors[0].to(device), state.columns, model.dtype, state.windows)
        )
    else:
        mask = batch_tree_mask(state.valid, ancestors.to(device), model.dtype, state.lengths, state.windows)
    out = model(
        input_ids=tokens.to(device),
        position_ids=positions,
        attention_mask=mask,
        cache=state.cache,
        use_cache=True,
    )
    features = capture.features() if capture is not None else None
    return out.logits, features


def commit(state: BatchState, keep: list[list[int]], tree_size: int, path: Tensor | None = None) -> None:
    """Keep each row's accepted nodes (`keep[b]`: node indices, root first, in path order) of the last
    `verify_batch` (`tree_size` nodes per row): move their KV right behind the row's last valid column, mark
    them valid, advance the row's length, and cut the columns no row uses.

    The move is a few batched ops per layer whatever B is (a gather of every row's path, a scatter behind its
    end). `path`: the same nodes as a (B, P) device tensor padded with -1 (what `accept_greedy` returns, one
    row per sequence), so nothing is uploaded; without it `keep` is uploaded once."""
    before = state.columns  # the columns before this step's tree (`valid` does not cover the tree yet)
    batch = state.valid.shape[0]
    if len(keep) != batch:
        raise ValueError(f"keep has {len(keep)} rows, the batch {batch}")
    if state.full:  # one row: keep its path by a crop or one index per layer
        kept = len(keep[0])
        compact_cache(state.cache, before, keep[0], path[0, :kept] if path is not None else None)
        state.valid = state.valid[:, :1].expand(1, before + kept)  # all valid, as a view: nothing written
        state.ends, state.lengths = state.ends + kept, state.lengths + kept
        state.host_ends = [state.host_ends[0] + kept]
        return
    lengths = {layer.keys.shape[-2] for layer in kv_layers(state.cache)}
    if lengths != {before + tree_size}:
        held = lengths.pop() if len(lengths) == 1 else sorted(lengths)  # layers of unequal lengths: all
        raise ValueError(f"the cache holds {held} columns, expected {before} + a tree of {tree_size}")
    device = state.valid.device
    width = min(max((len(nodes) for nodes in keep), default=0), tree_size)  # a path is at most the tree
    valid = torch.cat([state.valid, state.valid.new_zeros(batch, tree_size)], dim=1)
    if width:
        if path is None:
            path = torch.tensor([nodes + [-1] * (width - len(nodes)) for nodes in keep], device=device)
        path = path[:, :width].to(device)
        taken = path >= 0
        # row b's i-th kept node goes to column ends[b] + i; the padding (-1) copies the root into columns
        # past the row's new end, which stay invalid (ends[b] + width - 1 <= before + tree_size - 1)
        target = state.ends[:, None] + torch.arange(width, device=device)
        source = before + path.clamp(min=0)
        for layer in kv_layers(state.cache):
            for name in ("keys", "values"):
                cached = getattr(layer, name)
                shape = (-1, cached.shape[1], -1, cached.shape[-1])
                src = source.to(cached.device)[:, None, :, None].expand(shape)
                dst = target.to(cached.device)[:, None, :, None].expand(shape)
                cached.scatter_(2, dst, cached.gather(2, src))
        valid.scatter_(1, target, taken)
        counts = taken.sum(1)
        state.ends = state.ends + counts
        state.lengths = state.lengths + counts
        state.host_ends = [end + len(nodes) for end, nodes in zip(state.host_ends, keep)]
    state.valid = valid
    state._trim()


@torch.no_grad()
def replay(
    model: nn.Module, state: BatchState, saved: Snapshot, tokens: Tensor, keeps: list[list[int]], size: int
) -> None:
    """Roll each row's recurrent state back to its accepted prefix, after a chain's verify pass and before
    `decode.batch.commit` (`decode.recurrent`).

    Args:
        model: the target.
        state: the `decode.batch.BatchState` the chains were verified on (its cache holds the chains'
            columns behind `state.columns`).
        saved: the `snapshot` taken just before the verify pass.
        tokens: (B, N) the chains' tokens (node i at depth i).
        keeps: each row's accepted nodes, a prefix of its chain.
        size: N.
    """
    groups: dict[int, list[int]] = {}
    for row, keep in enumerate(keeps):
        if keep != list(range(len(keep))):
            raise ValueError(f"row {row} accepted nodes {keep}: a hybrid target verifies chains only")
        if len(keep) < size:
            groups.setdefault(len(keep), []).append(row)
    before = state.columns
    device = state.valid.device
    for n, rows in groups.items():
        index = torch.tensor(rows, device=device)
        cache = DynamicCache(config=model.config)
        for i, (layer, theirs) in enumerate(zip(cache.layers, state.cache.layers, strict=True)):
            if isinstance(theirs, DynamicLayer):
                layer = cache.layers[i] = DynamicLayer()
                keys = theirs.keys.index_select(0, index.to(theirs.keys.device))[..., :before, :]
                values = theirs.values.index_select(0, index.to(theirs.values.device))[..., :before, :]
                layer.update(keys, values)
            elif is_recurrent(theirs):
                adopt(layer, theirs)
                conv, recurrent = saved.layers[i]
                for mine, states in ((layer.conv_states, conv), (layer.recurrent_states, recurrent)):
                    for s, value in states.items():
                        mine[s] = None if value is None else value.index_select(0, index.to(value.device))
        valid, lengths = state.valid.index_select(0, index), state.lengths.index_select(0, index)
        chain = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        mask = batch_tree_mask(valid, chain.expand(len(rows), n, n), model.dtype, lengths, state.windows)
        model(
            input_ids=tokens.index_select(0, index.to(tokens.device))[:, :n].to(model.device),
            position_ids=lengths[:, None] + torch.arange(n, device=device),
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        for i in saved.layers:
            ours, replayed = state.cache.layers[i], cache.layers[i]
            for mine, theirs in (
                (ours.conv_states, replayed.conv_states),
                (ours.recurrent_states, replayed.recurrent_states),
            ):
                for s, value in theirs.items():
                    if value is not None:
                        mine[s].index_copy_(0, index.to(value.device), value)


def truncate_at_stop(tokens: list[int], eos: frozenset[int], max_new_tokens: int) -> list[int]:
    """Cut at the first stop token (kept) and at max_new_tokens."""
    for i, token in enumerate(tokens):
        if token in eos:
            tokens = tokens[: i + 1]
            break
    return tokens[:max_new_tokens]
