"""Propose: grow the draft trees of a batch from its drafter (any `decode.drafter.Drafter`), static or EAGLE-2
dynamic; one engine for every drafter and every batch size (B = 1 is a batch of one).

Children of a node are its draft distribution's top-k (greedy) or, when sampling, a draw of k tokens
WITHOUT replacement in sampling order (Gumbel-top-k), which is what lossless recursive rejection sampling
in `decode/accept.py` requires. Which nodes exist is decided from ancestors' values and draft
distributions only (slot scores: parent score + k-th largest log q), never from a node's own sampled value;
a `DynamicTree.min_prob` bound is a floor on those same slot scores.

Every row's tree grows with the same spec in lock step: a static tree's levels, or EAGLE-2's dynamic levels
(each row keeps its own best nodes by its own scores). A proposal is grown on the drafter's device without
reading anything back to the host: every level has a number of nodes known in advance (a static tree's
shape; a dynamic tree's top_k per level), so node arrays are sized up front and filled with device ops, and
EAGLE-2's choices (which nodes to expand, which to keep) are device sorts over scores. A `min_prob` bound is
the exception: whether to draft the next level, and how many nodes pass the floor, are read back once per
level and once per proposal.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from decode.accept import tempered
from decode.drafter import Drafter
from decode.tree import BestFirstTree, DraftTree, DynamicTree, TreeBuffers, build_tree


@dataclass
class Candidates:
    draft_ids: Tensor  # (n, k) draft-vocabulary ids in draw order, one row per expanded node
    slot_logq: Tensor  # (n, k) k largest log q values per row, decreasing: the slot scores
    q: Tensor | None  # (n, Vd) draft distributions the ids were drawn from (sampling only)


def draw_children(
    logits: Tensor, k: int, temperature: float, generator: torch.Generator | None
) -> Candidates:
    """Per row of `logits` (n, Vd) (or one (Vd,) row): its top-k (greedy) or k draws without replacement from
    softmax(row / T). One batched call for all the nodes a draft level expands."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    k = min(k, logits.shape[-1])
    if temperature == 0:
        # log q = logit - logsumexp: the same order without a full log_softmax pass
        top = torch.topk(logits, k)
        return Candidates(top.indices, top.values - torch.logsumexp(logits, dim=-1, keepdim=True), None)
    logq = torch.log_softmax(tempered(logits, temperature), dim=-1)
    uniform = torch.rand(logq.shape, generator=generator, device=logq.device).clamp_(1e-20, 1.0)
    gumbel = -torch.log(-torch.log(uniform))
    ids = torch.topk(logq + gumbel, k).indices  # Gumbel-top-k = sequential sampling without replacement
    return Candidates(ids, torch.topk(logq, k).values, logq.exp())


class Growth:
    """B proposals grown together, one per row: node arrays (B, capacity) sized up front, filled one level at
    a time."""

    def __init__(
        self, drafter: Drafter, roots: Tensor, capacity: int, temperature: float, generator, vocab_size: int
    ):
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
        if logits.shape[1] == 1 and n > 1 and self.temperature == 0:  # one distribution for the whole level:
            cand = draw_children(logits[:, 0], k, 0.0, None)  # its top-k once, shared by the n nodes
            shared = (
                x[:, None].expand(batch, n, k).reshape(batch * n, k) for x in (cand.draft_ids, cand.slot_logq)
            )
            cand = Candidates(*shared, None)
        else:  # sampling draws each node's children on their own, even from one shared distribution
            logits = logits.expand(batch, n, -1)
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
            if keep is None:  # every node: views, ids unchanged
                kept, parents = slice(0, self.size), self.parents[b, : self.size]
                ancestors = self.ancestors[b, : self.size, : self.size]
            else:
                kept = keep[b]
                renumber = torch.full((self.size,), -1, dtype=torch.long, device=self.device)
                renumber[kept] = torch.arange(kept.numel(), device=self.device)
                parents = self.parents[b, kept]
                parents = torch.where(parents >= 0, renumber[parents.clamp(min=0)], -1)
                ancestors = self.ancestors[b][kept][:, kept]
            trees.append(
                DraftTree(
                    tokens=self.tokens[b, kept],
                    parents=parents,
                    ranks=self.ranks[b, kept],
                    q_rows=self.q_rows[b, kept] if q_table is not None else None,
                    q_table=q_table[b] if q_table is not None else None,
                    depths=self.depths[b, kept],
                    ancestors=ancestors,
                    max_depth=max_depth,
                    max_children=max_children,
                )
            )
        return trees


@torch.no_grad()
def propose(
    drafter: Drafter | None,
    roots: Tensor,
    tree: TreeBuffers | DynamicTree | BestFirstTree | None,
    *,
    temperature: float,
    generator: torch.Generator | None,
    vocab_size: int,
) -> list[DraftTree]:
    """Grow one draft tree per row below `roots`, the same tree spec for all rows.

    Args:
        drafter: the batch's drafter (`decode.drafter.Drafter`); None gives each root alone (plain decoding).
        roots: (B,) int64, each row's last chosen token (its KV is not cached yet), on the target's device.
        tree: a static tree (`build_tree`) or a `DynamicTree` spec (None with `drafter=None`).
        temperature: 0 takes top-k children; > 0 draws them without replacement from the draft.
        generator: random source for the draws.
        vocab_size: the target vocabulary size (q rows are over target ids).
    Returns:
        One proposal per row, parents before children, its tensors on the drafter's device. Under a
        `DynamicTree.min_prob` bound every row's tree has the size of the row that keeps most nodes (and
        drafting goes on while any row has a node at the floor), so in a batch a row may verify more nodes
        than it would alone: the same tokens at T=0, perhaps fewer steps.
    """
    if drafter is None:
        return [_root_only(root.view(1)) for root in roots.view(-1, 1)]
    root_logits = drafter.root_logits()
    draws = {"temperature": temperature, "generator": generator, "vocab_size": vocab_size}
    try:
        if isinstance(tree, DynamicTree):
            return _grow_dynamic(drafter, roots, root_logits, tree, draws)
        if isinstance(tree, BestFirstTree):
            return _grow_best_first(drafter, roots, root_logits, tree, draws["temperature"])
        return _grow_static(drafter, roots, root_logits, tree, draws)
    finally:
        drafter.end_proposal()


def _grow_static(
    drafter: Drafter, roots: Tensor, root_logits: Tensor, tree: TreeBuffers, draws: dict
) -> list[DraftTree]:
    growth = Growth(drafter, roots, len(tree), **draws)
    levels = _static_levels(tree.paths, roots.device)
    batch = roots.shape[0]
    for depth, (nodes, select, k) in enumerate(levels):
        expanded = nodes[None].expand(batch, -1)
        logits = root_logits[:, None] if depth == 0 else growth.expand(expanded, depth)
        growth.add_children(expanded, logits, k, depth + 1, select)
    return growth.result(tree.depth, max((k for *_, k in levels), default=0))


def _grow_dynamic(
    drafter: Drafter, roots: Tensor, root_logits: Tensor, spec: DynamicTree, draws: dict
) -> list[DraftTree]:
    depth_limit = min(spec.depth, drafter.limits().max_depth or spec.depth)
    k = min(spec.top_k, root_logits.shape[-1])
    sizes = [k]
    for _ in range(1, depth_limit):
        sizes.append(min(spec.top_k, sizes[-1]) * k)
    growth = Growth(drafter, roots, 1 + sum(sizes), **draws)
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


def _grow_best_first(
    drafter: Drafter, roots: Tensor, root_logits: Tensor, spec: BestFirstTree, temperature: float
) -> list[DraftTree]:
    """DDTree: per row, the `spec.budget` likeliest rank paths of a block drafter's per-depth distributions
    (`best_first_paths`), from one read of each depth's top-`budget` log-probabilities. When sampling the
    same tree is chosen from the draft at that temperature, and acceptance draws from the target
    (`decode.accept.accept_chosen`)."""
    limits = drafter.limits()
    if not limits.block:
        raise ValueError(
            "a BestFirstTree needs a block drafter (one forward scores every depth, whatever the parent); "
            "this drafter drafts one level per call: use a DynamicTree"
        )
    caps = [d for d in (spec.depth, limits.max_depth) if d is not None]
    if not caps:
        raise ValueError("this drafter states no maximum depth: give the BestFirstTree a depth")
    depth = min(caps)
    batch, device = roots.shape[0], roots.device
    levels = [root_logits]
    no_parent, token = torch.full((batch, 1), -1, device=device), roots[:, None]
    for level in range(1, depth):  # a block drafter ignores the parent: one call per depth, any node
        levels.append(drafter.expand(no_parent, token, level)[:, 0])
    # ranked by the draft at the sampling temperature; the children are chosen (top ranks), not drawn, and
    # `decode.accept.accept_chosen` samples over them losslessly (no q_table: point masses)
    logq = torch.log_softmax(tempered(torch.stack(levels, dim=1), temperature or 1.0), dim=-1)  # (B, D, Vd)
    top = torch.topk(logq, min(spec.budget, logq.shape[-1]), dim=-1)
    ids = drafter.to_target_ids(top.indices)  # (B, D, k)
    values = top.values.tolist()  # the proposal's one read of the device
    shapes = []  # per row, root first: parents, depths, ranks, then the N rows of its ancestor mask
    max_depth, max_rank = 0, -1  # over every row's nodes, known on the host
    for row in values:
        paths = best_first_paths(row, spec.budget)
        index = {path: i + 1 for i, path in enumerate(paths)}
        parents = [-1] + [index.get(path[:-1], 0) for path in paths]
        depths, ranks = [0] + [len(path) for path in paths], [0] + [path[-1] for path in paths]
        shapes.append([parents, depths, ranks, *_host_ancestors(parents)])
        max_depth, max_rank = max(max_depth, *depths), max(max_rank, *ranks[1:], -1)
    arrays = torch.tensor(shapes, device=device)  # (B, 3 + N, N): the proposal's one upload
    parents, depths, ranks = arrays[:, :3].unbind(1)  # (B, N) each
    ancestors = arrays[:, 3:].bool()
    rows = torch.arange(batch, device=device)[:, None]
    tokens = torch.cat([roots[:, None], ids[rows, depths[:, 1:] - 1, ranks[:, 1:]]], dim=1)
    max_children = max_rank + 1
    return [
        DraftTree(
            tokens=tokens[b],
            parents=parents[b],
            ranks=ranks[b],
            depths=depths[b],
            ancestors=ancestors[b],
            max_depth=max_depth,
            max_children=max_children,
        )
        for b in range(batch)
    ]


def _host_ancestors(parents: list[int]) -> list[list[int]]:
    """The ancestor mask of a tree (`decode.tree.ancestor_mask`) as host lists: row i is 1 at i and at its
    ancestors (parents precede children)."""
    rows: list[list[int]] = []
    for node, parent in enumerate(parents):
        row = list(rows[parent]) if parent >= 0 else [0] * len(parents)
        row[node] = 1
        rows.append(row)
    return rows


def best_first_paths(logq: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """The `budget` rank paths (r_1, ..., r_d) of highest total sum_i logq[i][r_i], best first (ties: the
    earlier pushed), where logq[i] is depth i + 1's log-probabilities in decreasing order. Every path comes
    after its prefix (its score is lower), so parents precede children."""
    depths, width = len(logq), len(logq[0]) if logq else 0
    heap, out, pushed = [(-logq[0][0], 0, (0,))] if width else [], [], 1
    while heap and len(out) < budget:
        negative, _, path = heapq.heappop(heap)
        out.append(path)
        depth, rank = len(path) - 1, path[-1]
        if rank + 1 < width:  # the next sibling: the same prefix, the next rank at this depth
            sibling = -negative - logq[depth][rank] + logq[depth][rank + 1]
            heapq.heappush(heap, (-sibling, pushed, (*path[:-1], rank + 1)))
            pushed += 1
        if depth + 1 < depths:  # the first child: the best rank one depth further
            heapq.heappush(heap, (negative - logq[depth + 1][0], pushed, (*path, 0)))
            pushed += 1
    return out


def _root_only(root: Tensor) -> DraftTree:
    device = root.device
    return DraftTree(
        tokens=root,
        parents=torch.full((1,), -1, dtype=torch.long, device=device),
        ranks=torch.zeros(1, dtype=torch.long, device=device),
        depths=torch.zeros(1, dtype=torch.long, device=device),
        ancestors=torch.ones(1, 1, dtype=torch.bool, device=device),
        max_depth=0,
        max_children=0,
    )


@functools.lru_cache(maxsize=64)
def _static_levels(
    paths: tuple[tuple[int, ...], ...], device: torch.device
) -> tuple[tuple[Tensor, Tensor, int], ...]:
    """Per level of a static tree: the node ids that get children, `add_children`'s `select` and the widest
    row, on `device` (made once per tree and device: no uploads while decoding)."""
    tree = build_tree(paths)
    parents, ranks, depths = tree.parents.tolist(), tree.ranks.tolist(), tree.position_ids.tolist()
    widths = [0] * len(parents)
    for node in range(1, len(parents)):
        widths[parents[node]] = max(widths[parents[node]], ranks[node] + 1)
    levels, created = [], 1
    for depth in range(tree.depth):
        expanded = [i for i in range(len(parents)) if depths[i] == depth and widths[i] > 0]
        children = [i for i in range(len(parents)) if depths[i] == depth + 1]
        k = max(widths[i] for i in expanded)
        row = {node: r for r, node in enumerate(expanded)}
        select = [row[parents[c]] * k + ranks[c] for c in children]
        # growth creates children parent by parent, each by rank: it must reproduce the tree's own node order
        if children != list(range(created, created + len(children))) or select != sorted(select):
            raise AssertionError("static tree growth diverged from the tree's node order")
        created += len(children)
        levels.append((torch.tensor(expanded, device=device), torch.tensor(select, device=device), k))
    return tuple(levels)


def min_score(spec: DynamicTree) -> float | None:
    """The least slot score (cumulative log q) a node of `spec` may have; None when it has no `min_prob`."""
    return math.log(spec.min_prob) if spec.min_prob > 0 else None
