"""Drafting for B rows at once (batched decoding): one head forward per draft level for the whole batch
instead of one per row, the trees grown as (B, ...) tensors.

`BatchEagleDrafter` keeps one rectangular draft KV cache for the batch, (B, kv_heads, L, head_dim), with a
column validity per row as `decode.batch.BatchState` does for the target: rows take in different numbers of
accepted positions per step (padded columns stay invalid, never attended to) and positions come from each
row's own count. A proposal appends the tree levels' entries for every row and crops them off afterwards.
`BatchMedusaDrafter` runs the Medusa heads on every row's last feature in one call.

`propose_batch` grows every row's tree with the same spec in lock step, as `decode.propose` grows one: a
static tree's levels, or EAGLE-2's dynamic levels (each row keeps its own best nodes by its own scores), the
children drawn per node by `draw_children` (top-k, or Gumbel-top-k when sampling: draws without replacement,
what the lossless rule needs). It returns one `DraftTree` per row, as `propose` would have.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from decode.fused import fused_step
from decode.propose import _static_levels, draft_lm_head, draw_children, float_dtype, min_score
from decode.tree import DraftTree, DynamicTree, TreeBuffers
from heads.eagle import DraftCache, EagleHead, additive_mask
from heads.medusa import MedusaHeads


class BatchEagleDrafter:
    """EAGLE-1/3 drafting for a batch: one draft cache and one head forward per call for all rows."""

    def __init__(self, head: EagleHead, target: nn.Module, batch: int) -> None:
        self.head, self.step = head, fused_step(head)
        self.embed, self.lm_head = target.get_input_embeddings(), draft_lm_head(head, target)
        self.feature_layers = head.feature_layers
        self.max_depth = None
        self.dtype = float_dtype(head)
        device = next(head.parameters()).device
        self.cache = DraftCache()
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # committed columns per row
        self.counts = torch.zeros(batch, dtype=torch.long, device=device)  # committed positions per row
        self.host_counts = [0] * batch  # the same on the host (valid columns per row)
        self.root_hidden: Tensor | None = None  # (B, H): output at each row's last committed position
        self._rows: list[Tensor] = []  # this proposal's expanded entries, (B, n, H) per level
        self._allowed: list[Tensor] = []  # (B, n, R) per level: which earlier expanded entries each may see

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
        counts = taken.sum(1).to(device)
        self.counts = self.counts + counts
        self.host_counts = [c + n for c, n in zip(self.host_counts, sizes)]
        self.root_hidden = hidden.gather(1, (counts - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        self._compact()
        self._start_proposal()

    def _compact(self) -> None:
        """Drop the columns no row uses once they are more than half the cache (padding and finished rows'
        leftovers): each row's valid entries keep their order, packed to the right."""
        columns = self.valid.shape[1]
        keep = max(self.host_counts, default=0)  # valid columns of the fullest row (kept on the host)
        if columns <= 2 * max(keep, 16):
            return
        # a stable order per row: invalid columns first, then the valid ones in their order
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, columns - keep :]
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
        cached = expanded.shape[1]
        # which earlier entries of this proposal each new one sees: its parent's ancestors and the parent
        if self._allowed:
            previous = torch.cat(
                [torch.nn.functional.pad(a, (0, cached - a.shape[-1])) for a in self._allowed], 1
            )
            from_parent = previous.gather(1, parent_rows.clamp(min=0)[:, :, None].expand(-1, -1, cached))
            # one_hot would read the indices' range back to the host
            parent = parent_rows.clamp(min=0)[:, :, None] == torch.arange(cached, device=device)
            tree = (from_parent | parent) & (parent_rows >= 0)[:, :, None]
        else:
            tree = torch.zeros(batch, n, 0, dtype=torch.bool, device=device)
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


class BatchMedusaDrafter:
    """Medusa for a batch: the heads on every row's last accepted feature in one call; head d scores depth
    d + 1 whatever the parent is."""

    def __init__(self, heads: MedusaHeads, target: nn.Module, batch: int) -> None:
        self.heads, self.lm_head = heads, draft_lm_head(heads, target)
        self.feature_layers = heads.feature_layers
        self.max_depth = heads.config.num_heads
        self.dtype = float_dtype(heads)
        self._logits: Tensor | None = None  # (B, K, V)

    @torch.no_grad()
    def advance(self, features: list[Tensor], next_tokens: list[Tensor]) -> None:
        last = torch.stack([f[-1] for f in features]).to(self.dtype)  # (B, F)
        self._logits = self.heads(last[:, None], lm_head=self.lm_head)[:, :, 0].transpose(0, 1)

    def select(self, rows: list[int]) -> None:
        if self._logits is not None:
            self._logits = self._logits[torch.tensor(rows, dtype=torch.long, device=self._logits.device)]

    def root_logits(self) -> Tensor:
        return self._logits[:, 0]

    def expand(self, parent_rows: Tensor, tokens: Tensor, depth: int) -> Tensor:
        return self._logits[:, depth, None].expand(-1, tokens.shape[1], -1)

    def end_proposal(self) -> None:
        pass

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids


def make_batch_drafter(heads: nn.Module, target: nn.Module, batch: int):
    """The batched drafter of a head module, or None for one it cannot batch (custom `Drafter`s)."""
    if isinstance(heads, EagleHead):
        return BatchEagleDrafter(heads, target, batch)
    if isinstance(heads, MedusaHeads):
        return BatchMedusaDrafter(heads, target, batch)
    return None


class _BatchGrowth:
    """B proposals grown together: `decode.propose._Growth` with a leading batch dimension."""

    def __init__(self, drafter, roots: Tensor, capacity: int, temperature: float, generator, vocab_size: int):
        self.drafter, self.temperature, self.generator, self.vocab_size = (
            drafter,
            temperature,
            generator,
            vocab_size,
        )
        batch, device = roots.shape[0], roots.device
        self.batch, self.device = batch, device
        self.size, self.rows, self.q_rows_used = 1, 0, 0
        self.tokens = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.tokens[:, 0] = roots
        self.parents = torch.full((batch, capacity), -1, dtype=torch.long, device=device)
        self.ranks = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.depths = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.scores = torch.zeros(batch, capacity, dtype=torch.float64, device=device)
        self.node_rows = torch.full((batch, capacity), -1, dtype=torch.long, device=device)
        self.q_rows = torch.full((batch, capacity), -1, dtype=torch.long, device=device)
        self.q_table: list[Tensor] = []  # (B, n, V) per drawn level
        self.ancestors = torch.zeros(batch, capacity, capacity, dtype=torch.bool, device=device)
        self.ancestors[:, 0, 0].fill_(True)  # fill_, not `= True` (a scalar tensor made and copied)

    def add_children(
        self, parents: Tensor, logits: Tensor, k: int, depth: int, select: Tensor | None = None
    ) -> tuple[int, int]:
        """Node parents[b, i] of row b gets the top k (or k drawn) children of logits[b, i]; `select` keeps
        only these flat `i * k + rank` entries, the same in every row (a static tree)."""
        batch, n = parents.shape
        cand = draw_children(logits.reshape(batch * n, -1), k, self.temperature, self.generator)
        if cand.draft_ids.shape[1] != k:
            raise ValueError(
                f"the tree wants {k} children per node, but the draft vocabulary has {logits.shape[-1]}"
            )
        targets = self.drafter.to_target_ids(cand.draft_ids).reshape(batch, n * k)
        start = self.size
        stop = start + (n * k if select is None else select.numel())
        if select is None:
            parent_ids = parents[:, :, None].expand(batch, n, k).reshape(batch, n * k)
            self.tokens[:, start:stop] = targets
            self.ranks[:, start:stop] = torch.arange(n * k, device=self.device) % k
            logq = cand.slot_logq.reshape(batch, n * k).double()
            self.scores[:, start:stop] = self.scores.gather(1, parent_ids) + logq
        else:
            parent_ids = parents[:, select // k]
            self.tokens[:, start:stop] = targets[:, select]
            self.ranks[:, start:stop] = select % k
        self.parents[:, start:stop] = parent_ids
        self.depths[:, start:stop].fill_(depth)
        capacity = self.ancestors.shape[-1]
        self.ancestors[:, start:stop] = self.ancestors.gather(
            1, parent_ids[:, :, None].expand(-1, -1, capacity)
        )
        self.ancestors[:, start:stop, start:stop].diagonal(dim1=1, dim2=2).fill_(True)
        if cand.q is not None:
            draft_vocab = self.drafter.to_target_ids(torch.arange(cand.q.shape[-1], device=cand.q.device))
            full = torch.zeros(batch * n, self.vocab_size, dtype=torch.float32, device=cand.q.device)
            full[:, draft_vocab] = cand.q
            rows = torch.arange(self.q_rows_used, self.q_rows_used + n, device=self.device)
            self.q_rows.scatter_(1, parents, rows.expand(batch, n))
            self.q_rows_used += n
            self.q_table.append(full.reshape(batch, n, -1))
        self.size = stop
        return start, stop

    def expand(self, nodes: Tensor, depth: int) -> Tensor:
        """Draft logits (B, n, Vd) for the children of nodes (B, n), all at `depth`."""
        parents = self.parents.gather(1, nodes)
        logits = self.drafter.expand(self.node_rows.gather(1, parents), self.tokens.gather(1, nodes), depth)
        n = nodes.shape[1]
        rows = torch.arange(self.rows, self.rows + n, device=self.device)
        self.node_rows.scatter_(1, nodes, rows.expand(self.batch, n))
        self.rows += n
        return logits

    def result(self, max_depth: int, max_children: int, keep: Tensor | None = None) -> list[DraftTree]:
        """Row b's proposal: all its nodes, or the nodes keep[b] (ids in creation order, prefix-closed)."""
        trees = []
        q_table = torch.cat(self.q_table, dim=1) if self.q_table else None
        for b in range(self.batch):
            kept = torch.arange(self.size, device=self.device) if keep is None else keep[b]
            renumber = torch.full((self.size,), -1, dtype=torch.long, device=self.device)
            renumber[kept] = torch.arange(kept.numel(), device=self.device)
            parents = self.parents[b, kept]
            trees.append(
                DraftTree(
                    tokens=self.tokens[b, kept],
                    parents=torch.where(parents >= 0, renumber[parents.clamp(min=0)], -1),
                    ranks=self.ranks[b, kept],
                    q_rows=self.q_rows[b, kept] if q_table is not None else None,
                    q_table=q_table[b] if q_table is not None else None,
                    depths=self.depths[b, kept],
                    ancestors=self.ancestors[b][kept][:, kept],
                    max_depth=max_depth,
                    max_children=max_children,
                )
            )
        return trees


@torch.no_grad()
def propose_batch(
    drafter,
    roots: Tensor,
    tree: TreeBuffers | DynamicTree,
    *,
    temperature: float,
    generator: torch.Generator | None,
    vocab_size: int,
) -> list[DraftTree]:
    """Grow one draft tree per row below `roots` (B,) with the batched drafter: `decode.propose.propose` for
    B rows at once, the same tree spec for all. Under a `DynamicTree.min_prob` bound every row's tree has the
    size of the row that keeps most nodes (and drafting goes on while any row has a node at the floor), so a
    row may verify more nodes than it would alone: the same tokens at T=0, perhaps fewer steps."""
    root_logits = drafter.root_logits()
    draws = {"temperature": temperature, "generator": generator, "vocab_size": vocab_size}
    try:
        if isinstance(tree, DynamicTree):
            return _grow_dynamic(drafter, roots, root_logits, tree, draws)
        return _grow_static(drafter, roots, root_logits, tree, draws)
    finally:
        drafter.end_proposal()


def _grow_static(
    drafter, roots: Tensor, root_logits: Tensor, tree: TreeBuffers, draws: dict
) -> list[DraftTree]:
    growth = _BatchGrowth(drafter, roots, len(tree), **draws)
    levels = _static_levels(tree.paths, roots.device)
    batch = roots.shape[0]
    for depth, (nodes, select, k) in enumerate(levels):
        expanded = nodes[None].expand(batch, -1)
        logits = root_logits[:, None] if depth == 0 else growth.expand(expanded, depth)
        growth.add_children(expanded, logits, k, depth + 1, select)
    return growth.result(tree.depth, max((k for *_, k in levels), default=0))


def _grow_dynamic(
    drafter, roots: Tensor, root_logits: Tensor, spec: DynamicTree, draws: dict
) -> list[DraftTree]:
    depth_limit = min(spec.depth, drafter.max_depth or spec.depth)
    k = min(spec.top_k, root_logits.shape[-1])
    sizes = [k]
    for _ in range(1, depth_limit):
        sizes.append(min(spec.top_k, sizes[-1]) * k)
    growth = _BatchGrowth(drafter, roots, 1 + sum(sizes), **draws)
    batch = roots.shape[0]
    start, stop = growth.add_children(roots.new_zeros(batch, 1), root_logits[:, None], k, 1)
    floor = min_score(spec)
    reached = 1
    for depth in range(1, depth_limit):
        if floor is not None and not bool(growth.scores[:, start:stop].max() >= floor):
            break  # no row keeps a node of this level
        order = torch.sort(-growth.scores[:, start:stop], dim=1, stable=True).indices[:, : spec.top_k]
        best = start + order.sort(dim=1).values
        start, stop = growth.add_children(best, growth.expand(best, depth), k, depth + 1)
        reached = depth + 1
    scores = growth.scores[:, : growth.size]
    budget = spec.total_tokens
    if floor is not None:  # one size for every row (the verify pass is one tensor): the row that keeps most
        budget = min(budget, int((scores[:, 1:] >= floor).sum(dim=1).max()))
    order = torch.sort(-scores[:, 1:], dim=1, stable=True).indices[:, :budget] + 1
    keep = torch.cat([order.new_zeros(batch, 1), order], dim=1).sort(dim=1).values
    return growth.result(reached, k, keep)
