"""Propose: grow a draft tree from a drafter (Medusa heads or an EAGLE head), static or EAGLE-2 dynamic.

Children of a node are its draft distribution's top-k (greedy) or, when sampling, a draw of k tokens
WITHOUT replacement in sampling order (Gumbel-top-k), which is what lossless recursive rejection sampling
in `decode/accept.py` requires. Which nodes exist is decided from ancestors' values and draft
distributions only (slot scores: parent score + k-th largest log q), never from a node's own sampled value;
a `DynamicTree.min_prob` bound is a floor on those same slot scores.

A proposal is grown on the drafter's device without reading anything back to the host: every level has a
number of nodes known in advance (a static tree's shape; a dynamic tree's top_k per level), so node arrays are
sized up front and filled with device ops, and EAGLE-2's choices (which nodes to expand, which to keep) are
device sorts over scores. A `min_prob` bound is the exception: whether to draft the next level, and how many
nodes pass the floor, are read back once per level and once per proposal.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from decode.fused import fused_step
from decode.tree import DraftTree, DynamicTree, TreeBuffers, build_tree
from heads.eagle import DraftCache, EagleHead, additive_mask
from heads.medusa import MedusaHeads


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
    logq = torch.log_softmax(logits / temperature, dim=-1)
    uniform = torch.rand(logq.shape, generator=generator, device=logq.device).clamp_(1e-20, 1.0)
    gumbel = -torch.log(-torch.log(uniform))
    ids = torch.topk(logq + gumbel, k).indices  # Gumbel-top-k = sequential sampling without replacement
    return Candidates(ids, torch.topk(logq, k).values, logq.exp())


DRAFT_LM_HEAD = "_selfspec_draft_lm_head"  # a draft's own copy of the target's lm_head (`decode.prepare`)


def draft_lm_head(heads: nn.Module, target: nn.Module) -> nn.Module:
    """The lm_head a draft that shares the target's projects with: its own (int8) copy, if
    `decode.prepare.quantize_draft` gave it one, else the target's."""
    own = heads.__dict__.get(DRAFT_LM_HEAD)
    return own if own is not None else target.get_output_embeddings()


def float_dtype(module: nn.Module) -> torch.dtype:
    """dtype of the first floating-point parameter (float32 when there is none, e.g. all-int8 heads)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


class Drafter:
    """Interface of a draft model inside `generate`: advance on accepted tokens, then expand tree nodes.

    The proposer calls `expand_batch` (device tensors, no host round trip in the built-in drafters). A custom
    drafter may implement the list form `expand` instead: the default `expand_batch` then reads the node ids
    back to the host once per draft level."""

    feature_layers: tuple[int, ...]
    max_depth: int | None = None

    def advance(self, features: Tensor, next_tokens: Tensor) -> None:
        """Consume target features (T, F) of accepted positions and the tokens that follow each (T,)."""
        raise NotImplementedError

    def root_logits(self) -> Tensor:
        """(Vd,) draft logits for the children of the current root."""
        raise NotImplementedError

    def expand(self, nodes: list[int], tokens: Tensor, parents: list[int], depth: int) -> Tensor:
        """(n, Vd) draft logits for the children of `nodes` (all at `depth`, tokens are target ids)."""
        raise NotImplementedError

    def expand_batch(
        self, nodes: Tensor, tokens: Tensor, parents: Tensor, parent_rows: Tensor, depth: int
    ) -> Tensor:
        """`expand` on device tensors: node ids, their tokens and their parents' ids, (n,) each, and each
        parent's row in this proposal's expansion order (-1 for the root): a proposal's first `expand_batch`
        expands rows 0..n-1, the next one rows n.., so a node's children find its draft state without node ids
        on the host. The default reads the ids back to the host and calls `expand`."""
        return self.expand(nodes.tolist(), tokens.cpu(), parents.tolist(), depth)

    def end_proposal(self) -> None:
        """Drop any state the tree expansion added (draft KV of unverified nodes)."""

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids


class MedusaDrafter(Drafter):
    """Medusa: head d scores depth d + 1 from the last accepted feature, whatever the parent is."""

    def __init__(self, heads: MedusaHeads, target: nn.Module) -> None:
        self.heads, self.lm_head = heads, draft_lm_head(heads, target)
        self.feature_layers = heads.feature_layers
        self.max_depth = heads.config.num_heads
        self.dtype = float_dtype(heads)
        self._logits: Tensor | None = None

    @torch.no_grad()
    def advance(self, features: Tensor, next_tokens: Tensor) -> None:
        last = features[-1:].to(self.dtype)
        self._logits = self.heads(last[None], lm_head=self.lm_head)[:, 0, 0]  # (K, V)

    def root_logits(self) -> Tensor:
        return self._logits[0]

    def expand(self, nodes, tokens, parents, depth):
        return self._logits[depth].expand(len(nodes), -1)

    def expand_batch(self, nodes, tokens, parents, parent_rows, depth):
        return self._logits[depth].expand(nodes.numel(), -1)


class EagleDrafter(Drafter):
    """EAGLE-1/3: the head autoregresses on features with its own KV cache; tree nodes use tree attention.

    `fused=True` (default) runs the head through `decode.fused.FusedEagleStep` (the same function, fewer and
    larger kernel calls); False runs `EagleHead.forward` itself."""

    def __init__(self, head: EagleHead, target: nn.Module, *, fused: bool = True) -> None:
        self.head = head
        self.step = fused_step(head) if fused else head
        self.embed, self.lm_head = target.get_input_embeddings(), draft_lm_head(head, target)
        self.feature_layers = head.feature_layers
        self.dtype = float_dtype(head)
        self.cache = DraftCache()
        self.committed = 0  # draft positions holding verified (feature, next token) pairs
        self._root_hidden: Tensor | None = None  # (1, 1, H) output at the last committed position
        self._rows_hidden: Tensor | None = None  # (R, H) outputs of this proposal's expanded nodes, by row
        self._row_of_node: dict[int, int] = {0: -1}  # node -> row, for the list form `expand` only
        # row r: which of this proposal's cached tree entries (= expansion rows) row r may attend to
        self._tree_allowed = torch.zeros(0, 0, dtype=torch.bool)

    @torch.no_grad()
    def advance(self, features: Tensor, next_tokens: Tensor) -> None:
        n = next_tokens.numel()
        feats = self.head.project_features(features.to(self.dtype)[None])  # (1, n, H)
        embeds = self.embed(next_tokens[None]).to(self.dtype)  # (1, n, H)
        positions = torch.arange(self.committed, self.committed + n, device=feats.device)[None]
        hidden = self.step(feats, embeds, positions, self.cache)
        self.committed += n
        self._root_hidden = hidden[:, -1:]
        self._start_proposal()

    def _start_proposal(self) -> None:
        self._rows_hidden, self._row_of_node = self._root_hidden[0, :0], {0: -1}

    @property
    def _hidden(self) -> dict[int, Tensor]:
        """node -> draft output (H,) of the root and of the nodes expanded through the list form `expand`."""
        return {
            node: self._root_hidden[0, 0] if row < 0 else self._rows_hidden[row]
            for node, row in self._row_of_node.items()
        }

    def root_logits(self) -> Tensor:
        return self.head.logits(self._root_hidden, self.lm_head)[0, 0]

    def _tree_mask(self, parent_rows: Tensor, n: int, device: torch.device) -> Tensor:
        """(1, 1, n, committed + cached + n) additive mask of n new rows: the committed prefix, the cached
        entries of their ancestors, and themselves."""
        cached = self._rows_hidden.shape[0]
        if cached + n > self._tree_allowed.shape[0]:
            grown = torch.zeros(2 * (cached + n), 2 * (cached + n), dtype=torch.bool, device=device)
            grown[:cached, :cached] = self._tree_allowed[:cached, :cached]
            self._tree_allowed = grown
        # the parent's ancestors and the parent itself (nothing for children of the root, row -1)
        rows = self._tree_allowed[parent_rows.clamp(min=0)] & (parent_rows >= 0)[:, None]
        rows[:, cached : cached + n].diagonal().fill_(True)
        self._tree_allowed[cached : cached + n] = rows
        allowed = torch.ones(n, self.committed + cached + n, dtype=torch.bool, device=device)
        allowed[:, self.committed :] = rows[:, : cached + n]
        return additive_mask(allowed, self.dtype)[None, None]

    @torch.no_grad()
    def expand_batch(self, nodes, tokens, parents, parent_rows, depth):
        n = tokens.numel()
        outputs = torch.cat([self._root_hidden[0], self._rows_hidden])  # (1 + R, H): root, then rows
        feats = outputs.index_select(0, parent_rows + 1)[None]  # (1, n, H)
        embeds = self.embed(tokens.to(feats.device)[None]).to(self.dtype)  # (1, n, H)
        positions = torch.full((1, n), self.committed + depth - 1, dtype=torch.long, device=feats.device)
        mask = self._tree_mask(parent_rows, n, feats.device)
        hidden = self.step(feats, embeds, positions, self.cache, attention_mask=mask)[0]  # (n, H)
        self._rows_hidden = torch.cat([self._rows_hidden, hidden])
        return self.head.logits(hidden, self.lm_head)

    def expand(self, nodes, tokens, parents, depth):
        device, first = self._root_hidden.device, self._rows_hidden.shape[0]
        parent_rows = torch.tensor([self._row_of_node[p] for p in parents], device=device)
        logits = self.expand_batch(
            torch.tensor(nodes, device=device),
            tokens,
            torch.tensor(parents, device=device),
            parent_rows,
            depth,
        )
        self._row_of_node.update({node: first + row for row, node in enumerate(nodes)})
        return logits

    def end_proposal(self) -> None:
        self.cache.crop(self.committed)
        self._start_proposal()

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return self.head.to_target_ids(draft_ids)


def make_drafter(heads: nn.Module, target: nn.Module) -> Drafter:
    """The drafter for a head module (a Drafter instance is used as it is: custom drafters, test oracles)."""
    if isinstance(heads, Drafter):
        return heads
    if isinstance(heads, MedusaHeads):
        return MedusaDrafter(heads, target)
    if isinstance(heads, EagleHead):
        return EagleDrafter(heads, target)
    raise TypeError(f"heads must be MedusaHeads or EagleHead, got {type(heads).__name__}")


def drafter_limits(heads: nn.Module) -> tuple[int | None, bool]:
    """What `decode.tree.resolve_tree` needs to know of a drafter: the deepest level it can draft (None: no
    limit) and whether it grows EAGLE-2 dynamic trees by default (EAGLE heads and `Drafter`s do)."""
    if isinstance(heads, MedusaHeads):
        return heads.config.num_heads, False
    if isinstance(heads, EagleHead):
        return None, True
    if isinstance(heads, Drafter):
        return heads.max_depth, True
    raise TypeError(f"heads must be MedusaHeads or EagleHead, got {type(heads).__name__}")


class _Growth:
    """A proposal being grown on the device: node arrays sized up front, filled one level at a time."""

    def __init__(
        self, drafter: Drafter, root: Tensor, capacity: int, temperature: float, generator, vocab_size: int
    ) -> None:
        self.drafter, self.temperature, self.generator, self.vocab_size = (
            drafter,
            temperature,
            generator,
            vocab_size,
        )
        device = self.device = root.device
        self.size, self.rows, self.q_rows_used = 1, 0, 0  # nodes, expanded nodes (not the root), q_table rows
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.tokens[:1] = root
        self.parents = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.ranks = torch.zeros(capacity, dtype=torch.long, device=device)
        self.depths = torch.zeros(capacity, dtype=torch.long, device=device)
        self.scores = torch.zeros(capacity, dtype=torch.float64, device=device)  # cumulative log q, float64
        self.node_rows = torch.full((capacity,), -1, dtype=torch.long, device=device)  # expansion row or -1
        self.q_rows = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.q_table: list[Tensor] = []
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)
        self.ancestors[:1, :1].fill_(True)  # fill_, not `= True`: no scalar tensor is made and copied

    def add_children(
        self, parents: Tensor, logits: Tensor, k: int, depth: int, select: Tensor | None = None
    ) -> tuple[int, int]:
        """Give node parents[i] (all at `depth` - 1) the top k (or k drawn) children of logits[i] (one batched
        draw over (n, Vd)); `select` keeps only these flat `row * k + rank` entries (a static tree's rows
        differ in width; its nodes need no scores). Returns the new nodes' id range."""
        cand = draw_children(logits, k, self.temperature, self.generator)
        if cand.draft_ids.shape[1] != k:
            raise ValueError(
                f"the tree wants {k} children per node, but the draft vocabulary has {logits.shape[-1]}"
            )
        n = parents.numel()
        targets = self.drafter.to_target_ids(cand.draft_ids).reshape(-1)  # (n * k,)
        start = self.size
        stop = start + (n * k if select is None else select.numel())
        if select is None:
            parent_ids = parents[:, None].expand(n, k).reshape(-1)
            self.tokens[start:stop] = targets
            self.ranks[start:stop] = torch.arange(n * k, device=self.device) % k  # (repeat is slower here)
            self.scores[start:stop] = self.scores[parent_ids] + cand.slot_logq.reshape(-1).double()
        else:
            parent_ids = parents[select // k]
            self.tokens[start:stop] = targets[select]
            self.ranks[start:stop] = select % k
        self.parents[start:stop] = parent_ids
        self.depths[start:stop].fill_(depth)
        self.ancestors[start:stop] = self.ancestors[parent_ids]
        self.ancestors[start:stop, start:stop].diagonal().fill_(True)
        if cand.q is not None:
            draft_vocab = self.drafter.to_target_ids(torch.arange(cand.q.shape[-1], device=cand.q.device))
            full = torch.zeros(n, self.vocab_size, dtype=torch.float32, device=cand.q.device)
            full[:, draft_vocab] = cand.q
            self.q_rows[parents] = torch.arange(self.q_rows_used, self.q_rows_used + n, device=self.device)
            self.q_rows_used += n
            self.q_table.append(full)
        self.size = stop
        return start, stop

    def expand(self, nodes: Tensor, depth: int) -> Tensor:
        """Draft logits (n, Vd) for the children of `nodes` (n,), all at `depth`; gives them their rows."""
        parents = self.parents[nodes]
        logits = self.drafter.expand_batch(nodes, self.tokens[nodes], parents, self.node_rows[parents], depth)
        self.node_rows[nodes] = torch.arange(self.rows, self.rows + nodes.numel(), device=self.device)
        self.rows += nodes.numel()
        return logits

    def result(self, max_depth: int, max_children: int, keep: Tensor | None = None) -> DraftTree:
        """The proposal: all nodes, or the nodes `keep` (ids in creation order, prefix-closed) renumbered."""
        if keep is None:
            keep = torch.arange(self.size, device=self.device)
        renumber = torch.full((self.size,), -1, dtype=torch.long, device=self.device)
        renumber[keep] = torch.arange(keep.numel(), device=self.device)
        parents = self.parents[keep]
        sampling = bool(self.q_table)
        return DraftTree(
            tokens=self.tokens[keep],
            parents=torch.where(parents >= 0, renumber[parents.clamp(min=0)], -1),
            ranks=self.ranks[keep],
            q_rows=self.q_rows[keep] if sampling else None,
            q_table=torch.cat(self.q_table) if sampling else None,
            depths=self.depths[keep],
            ancestors=self.ancestors[keep][:, keep],
            max_depth=max_depth,
            max_children=max_children,
        )


@torch.no_grad()
def propose(
    drafter: Drafter | None,
    root_token: int | Tensor,
    tree: TreeBuffers | DynamicTree,
    *,
    temperature: float,
    generator: torch.Generator | None,
    vocab_size: int,
) -> DraftTree:
    """Grow one draft tree below `root_token`.

    Args:
        drafter: the draft model; None gives the root alone (plain decoding).
        root_token: the target's last chosen token (its KV is not cached yet); a (1,) or 0-d int64 tensor on
            the target's device keeps the proposal free of host round trips.
        tree: a static tree (`build_tree`) or a `DynamicTree` spec.
        temperature: 0 takes top-k children; > 0 draws them without replacement from the draft.
        generator: random source for the draws.
        vocab_size: the target vocabulary size (q rows are over target ids).
    Returns:
        The proposal, parents before children, its tensors on the drafter's device.
    """
    if drafter is None:
        return _root_only(torch.as_tensor(root_token).view(1))
    root_logits = drafter.root_logits()
    root = torch.as_tensor(root_token, device=root_logits.device).view(1)
    draws = {"temperature": temperature, "generator": generator, "vocab_size": vocab_size}
    try:
        if isinstance(tree, DynamicTree):
            return _grow_dynamic(drafter, root, root_logits, tree, draws)
        return _grow_static(drafter, root, root_logits, tree, draws)
    finally:
        drafter.end_proposal()


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


def _grow_static(
    drafter: Drafter, root: Tensor, root_logits: Tensor, tree: TreeBuffers, draws: dict
) -> DraftTree:
    growth = _Growth(drafter, root, len(tree), **draws)
    levels = _static_levels(tree.paths, root.device)
    for depth, (nodes, select, k) in enumerate(levels):
        logits = root_logits[None] if depth == 0 else growth.expand(nodes, depth)
        growth.add_children(nodes, logits, k, depth + 1, select)
    return growth.result(tree.depth, max((k for *_, k in levels), default=0))


def _grow_dynamic(
    drafter: Drafter, root: Tensor, root_logits: Tensor, spec: DynamicTree, draws: dict
) -> DraftTree:
    depth_limit = min(spec.depth, drafter.max_depth or spec.depth)
    k = min(spec.top_k, root_logits.shape[-1])
    sizes = [k]  # nodes per level: known before any draw
    for _ in range(1, depth_limit):
        sizes.append(min(spec.top_k, sizes[-1]) * k)
    growth = _Growth(drafter, root, 1 + sum(sizes), **draws)
    start, stop = growth.add_children(root.new_zeros(1), root_logits[None], k, 1)
    floor = min_score(spec)
    reached = 1
    for depth in range(1, depth_limit):
        if floor is not None and not bool(growth.scores[start:stop].max() >= floor):  # a host read per level
            break  # no node of this level is kept, so none below it would be
        # expand the level's top_k by score, ties to the earlier node (a stable sort), in creation order
        best = start + torch.sort(-growth.scores[start:stop], stable=True).indices[: spec.top_k].sort().values
        start, stop = growth.add_children(best, growth.expand(best, depth), k, depth + 1)
        reached = depth + 1
    return growth.result(reached, k, rerank(growth.scores[: growth.size], spec.total_tokens, floor))


def min_score(spec: DynamicTree) -> float | None:
    """The least slot score (cumulative log q) a node of `spec` may have; None when it has no `min_prob`."""
    return math.log(spec.min_prob) if spec.min_prob > 0 else None


def rerank(scores: Tensor, budget: int, floor: float | None = None) -> Tensor:
    """`decode.tree.select_nodes` on the device: the root and the `budget` best-scoring other nodes (ties to
    the earlier node), ids in creation order; with a `floor`, only those scoring at least that. Scores never
    increase from parent to child and ties go to the earlier node, which a parent is, so the kept set is
    prefix-closed (`select_nodes` checks that on the host)."""
    order = torch.sort(-scores[1:], stable=True).indices[:budget] + 1
    if floor is not None:
        order = order[scores[order] >= floor]  # a data-dependent size: a host read on a GPU
    return torch.cat([order.new_zeros(1), order]).sort().values
