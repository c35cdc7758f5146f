"""The drafter contract: what any draft source implements to propose trees inside `decode.generate`.

A drafter drafts for a batch of B >= 1 rows (B = 1 is a batch of one). `generate` drives it so:

1. `start(prompts)`: once, with each row's prompt ids (1-D, no padding), before anything else.
2. `advance(features, tokens)`: each row takes in its newly committed positions: `tokens[b]` (n_b,) are the
   tokens that FOLLOW those positions (the prompt's tokens after the first, then each step's accepted tokens
   and the target's bonus token), `features[b]` (n_b, F) the target's features at those positions, tapped at
   `feature_layers` (`heads.features` conventions), or None for a drafter whose `feature_layers` is empty (it
   needs no taps). After an advance the current root of row b is `tokens[b][-1]`, the token whose children
   the next proposal drafts; its own KV is not in the target's cache yet.
3. A proposal: `root_logits()` (B, Vd) scores the roots' children; then, level by level, `expand(parent_rows,
   tokens, depth)` scores the children of n nodes per row at `depth` (>= 1): `tokens` (B, n) are the nodes'
   target ids and `parent_rows` (B, n) where each node's PARENT was expanded in this proposal (the first
   `expand` call's nodes are expansion rows 0..n-1, the next call's n.., and so on; -1 is the root). So a
   drafter finds a node's parent state, and the path to it, without node ids on the host. All of these are
   device tensors; a drafter that reads nothing back keeps a decoding step at one host round trip.
4. `end_proposal()`: drop whatever the proposal added (draft KV of unverified nodes).
5. `select(rows)`: keep only these rows (indices into the current batch); rows that finished leave.

Ids: logits are over the drafter's vocabulary (Vd); `to_target_ids` maps its ids to the target's (identity
unless the drafter has a reduced draft vocabulary). Limits: `limits()` says how deep it can draft (None: no
limit), whether its default tree is an EAGLE-2 dynamic tree, and whether it drafts a whole block at once (all
levels from one forward, so `expand` costs nothing: Medusa heads, block drafters) or one level per call.

The tree itself (static shapes, dynamic EAGLE-2 growth, `min_prob`, draws without replacement when sampling)
is grown by `decode.propose` for every drafter alike; a drafter only scores nodes. docs/drafters.md works an
example through (a bigram drafter, registered and decoded with).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class DraftLimits:
    """What a drafter can draft (read by `decode.tree.resolve_tree` and the cost model)."""

    max_depth: int | None = None  # the deepest level it can draft; None: no limit
    dynamic: bool = True  # its default tree is EAGLE-2's dynamic tree (else a static tree)
    block: bool = False  # every level comes from one forward per proposal (expand is free)


class Drafter:
    """Base class of every drafter; see the module docstring for the calling order. Subclasses implement
    `advance`, `root_logits`, `expand` and `select`; the rest has defaults."""

    feature_layers: tuple[int, ...] = ()  # target taps it takes in `advance`; () = none

    def limits(self) -> DraftLimits:
        return DraftLimits()

    def start(self, prompts: list[Tensor]) -> None:
        """Each row's prompt ids (1-D, no padding), before the first `advance`."""

    def advance(self, features: list[Tensor] | None, tokens: list[Tensor]) -> None:
        """Row b takes in `tokens[b]` (n_b >= 1) and, when it taps the target, `features[b]` (n_b, F)."""
        raise NotImplementedError

    def root_logits(self) -> Tensor:
        """(B, Vd) draft logits for the children of each row's root."""
        raise NotImplementedError

    def expand(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> Tensor:
        """(B, n, Vd) draft logits for the children of n nodes per row at `depth` (module docstring), or
        (B, 1, Vd) when every node of the level has the same children's distribution (a drafter that ignores
        the parent, as Medusa does): greedy growth then ranks it once for all n."""
        raise NotImplementedError

    def end_proposal(self) -> None:
        """Drop what this proposal added."""

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the current batch)."""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids


def tree_visibility(levels: list[Tensor], parent_rows: Tensor) -> Tensor:
    """(B, n, R) bool: which of a proposal's R earlier expanded entries each of n new nodes per row may attend
    to (its parent's ancestors and the parent itself; nothing for children of the root), for drafters that
    keep a KV entry per expanded node (tree attention in a draft cache). `levels`: what this returned for the
    proposal's earlier `expand` calls, in order; `parent_rows` (B, n) as `Drafter.expand` gets them."""
    batch, n = parent_rows.shape
    cached = sum(level.shape[1] for level in levels)
    if not levels:
        return torch.zeros(batch, n, 0, dtype=torch.bool, device=parent_rows.device)
    previous = torch.cat([nn.functional.pad(level, (0, cached - level.shape[-1])) for level in levels], 1)
    index = parent_rows.clamp(min=0)[:, :, None]
    from_parent = previous.gather(1, index.expand(-1, -1, cached))
    parent = index == torch.arange(cached, device=parent_rows.device)  # one_hot would read the range back
    return (from_parent | parent) & (parent_rows >= 0)[:, :, None]


def packed_columns(valid: Tensor, keep: int) -> Tensor | None:
    """For a draft cache with column validity `valid` (B, L) whose fullest row has `keep` valid columns (known
    on the host): the (B, keep) column order that packs each row's valid columns to the right in their order,
    once the unused columns (padding, finished rows' leftovers) are more than half the cache; else None."""
    columns = valid.shape[1]
    if columns <= 2 * max(keep, 16):
        return None
    # a stable order per row: invalid columns first, then the valid ones in their order
    return torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, columns - keep :]


class RowDrafters(Drafter):
    """B one-row drafters (each a `Drafter` for a batch of one) driven as one batch drafter: per-prompt
    drafters (custom draft sources, test oracles) in a batch. Each row's logits come from its own drafter, so
    this costs B draft calls per level."""

    def __init__(self, drafters: list[Drafter]) -> None:
        if not drafters:
            raise ValueError("RowDrafters needs at least one drafter")
        layers = {tuple(d.feature_layers) for d in drafters}
        if len(layers) != 1:
            raise ValueError(f"the row drafters tap different layers: {sorted(layers)}")
        limits = {d.limits() for d in drafters}
        if len(limits) != 1:
            raise ValueError(f"the row drafters state different limits: {sorted(map(repr, limits))}")
        self.drafters, self.feature_layers, self._limits = list(drafters), layers.pop(), limits.pop()
        self._vocab_checked = False

    def limits(self) -> DraftLimits:
        return self._limits

    def start(self, prompts):
        for drafter, prompt in zip(self.drafters, prompts, strict=True):
            drafter.start([prompt])

    def advance(self, features, tokens):
        for b, drafter in enumerate(self.drafters):
            drafter.advance(None if features is None else [features[b]], [tokens[b]])

    def root_logits(self):
        logits = torch.cat([d.root_logits() for d in self.drafters])
        if not self._vocab_checked:  # once: the rows' draft ids go to target ids through one map
            ids = torch.arange(logits.shape[-1], device=logits.device)
            maps = [d.to_target_ids(ids) for d in self.drafters]
            other = next((b for b, m in enumerate(maps) if not torch.equal(m, maps[0])), None)
            if other is not None:
                raise ValueError(
                    f"row drafters 0 and {other} map their draft vocabularies to other target ids (heads "
                    "with different d2t maps, say): a batch drafts through one map; decode them apart"
                )
            self._vocab_checked = True
        return logits

    def expand(self, parent_rows, tokens, depth):
        return torch.cat(
            [d.expand(parent_rows[b : b + 1], tokens[b : b + 1], depth) for b, d in enumerate(self.drafters)]
        )

    def end_proposal(self):
        for drafter in self.drafters:
            drafter.end_proposal()

    def select(self, rows):
        self.drafters = [self.drafters[r] for r in rows]

    def to_target_ids(self, draft_ids):
        return self.drafters[0].to_target_ids(draft_ids)
