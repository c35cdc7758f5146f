"""Propose: grow a draft tree from a drafter (Medusa heads or an EAGLE head), static or EAGLE-2 dynamic.

Children of a node are its draft distribution's top-k (greedy) or, when sampling, a draw of k tokens
WITHOUT replacement in sampling order (Gumbel-top-k), which is what lossless recursive rejection sampling
in `decode/accept.py` requires. Which nodes exist is decided from ancestors' values and draft
distributions only (slot scores: parent score + k-th largest log q), never from a node's own sampled value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from decode.fused import fused_step
from decode.layout import draft_lm_head
from decode.tree import DraftTree, DynamicTree, TreeBuffers, select_nodes
from heads.eagle import DraftCache, EagleHead, additive_mask
from heads.medusa import MedusaHeads


@dataclass
class Candidates:
    draft_ids: Tensor   # (n, k) draft-vocabulary ids in draw order, one row per expanded node
    slot_logq: Tensor   # (n, k) k largest log q values per row, decreasing: the slot scores
    q: Tensor | None    # (n, Vd) draft distributions the ids were drawn from (sampling only)


def draw_children(logits: Tensor, k: int, temperature: float, generator: torch.Generator | None) -> Candidates:
    """Per row of `logits` (n, Vd) (or one (Vd,) row): its top-k (greedy) or k draws without replacement from
    softmax(row / T). One batched call for all the nodes a draft level expands."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    k = min(k, logits.shape[-1])
    if temperature == 0:
        top = torch.topk(logits, k)  # log q = logit - logsumexp: the same order without a full log_softmax pass
        return Candidates(top.indices, top.values - torch.logsumexp(logits, dim=-1, keepdim=True), None)
    logq = torch.log_softmax(logits / temperature, dim=-1)
    uniform = torch.rand(logq.shape, generator=generator, device=logq.device).clamp_(1e-20, 1.0)
    gumbel = -torch.log(-torch.log(uniform))
    ids = torch.topk(logq + gumbel, k).indices  # Gumbel-top-k = sequential sampling without replacement
    return Candidates(ids, torch.topk(logq, k).values, logq.exp())


def float_dtype(module: nn.Module) -> torch.dtype:
    """dtype of the first floating-point parameter (float32 when there is none, e.g. all-int8 heads)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


class Drafter:
    """Interface of a draft model inside `generate`: advance on accepted tokens, then expand tree nodes."""

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
        self.committed = 0                 # draft positions holding verified (feature, next token) pairs
        self._root_hidden: Tensor | None = None   # (1, 1, H) output at the last committed position
        self._hidden: dict[int, Tensor] = {}      # node -> draft output hidden (H,) during a proposal
        self._slot: dict[int, int] = {}           # node -> index among this proposal's cached tree entries
        # row s: which of this proposal's cached tree entries the entry in slot s may attend to (its ancestors, itself)
        self._tree_allowed = torch.zeros(0, 0, dtype=torch.bool)

    @torch.no_grad()
    def advance(self, features: Tensor, next_tokens: Tensor) -> None:
        n = next_tokens.numel()
        feats = self.head.project_features(features.to(self.dtype)[None])       # (1, n, H)
        embeds = self.embed(next_tokens[None]).to(self.dtype)                   # (1, n, H)
        positions = torch.arange(self.committed, self.committed + n, device=feats.device)[None]
        hidden = self.step(feats, embeds, positions, self.cache)
        self.committed += n
        self._root_hidden = hidden[:, -1:]
        self._hidden, self._slot = {0: hidden[0, -1]}, {}

    def root_logits(self) -> Tensor:
        return self.head.logits(self._root_hidden, self.lm_head)[0, 0]

    def _tree_mask(self, parents: list[int], n: int, device: torch.device) -> Tensor:
        """(1, 1, n, committed + cached + n) additive mask of n new nodes: the committed prefix, the cached
        entries of their ancestors, and themselves."""
        cached = len(self._slot)
        if cached + n > self._tree_allowed.shape[0]:
            grown = torch.zeros(2 * (cached + n), 2 * (cached + n), dtype=torch.bool, device=device)
            grown[:cached, :cached] = self._tree_allowed[:cached, :cached]
            self._tree_allowed = grown
        slots = torch.tensor([self._slot.get(p, -1) for p in parents], device=device)
        rows = torch.zeros(n, self._tree_allowed.shape[1], dtype=torch.bool, device=device)
        below = (slots >= 0).nonzero().flatten()  # nodes whose parent is a tree entry (not the root)
        rows[below] = self._tree_allowed[slots[below]]  # the parent's ancestors and the parent itself
        new = torch.arange(n, device=device)
        rows[new, cached + new] = True
        self._tree_allowed[cached : cached + n] = rows
        allowed = torch.ones(n, self.committed + cached + n, dtype=torch.bool, device=device)
        allowed[:, self.committed :] = rows[:, : cached + n]
        return additive_mask(allowed, self.dtype)[None, None]

    @torch.no_grad()
    def expand(self, nodes, tokens, parents, depth):
        n = len(nodes)
        feats = torch.stack([self._hidden[p] for p in parents])[None]           # (1, n, H)
        embeds = self.embed(tokens.to(feats.device)[None]).to(self.dtype)       # (1, n, H)
        positions = torch.full((1, n), self.committed + depth - 1, dtype=torch.long, device=feats.device)
        mask = self._tree_mask(parents, n, feats.device)
        cached = len(self._slot)
        for row, node in enumerate(nodes):
            self._slot[node] = cached + row
        hidden = self.step(feats, embeds, positions, self.cache, attention_mask=mask)[0]  # (n, H)
        for row, node in enumerate(nodes):
            self._hidden[node] = hidden[row]
        return self.head.logits(hidden, self.lm_head)

    def end_proposal(self) -> None:
        self.cache.crop(self.committed)
        self._hidden, self._slot = {0: self._root_hidden[0, 0]}, {}

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


class _Growth:
    """Bookkeeping shared by static and dynamic growth: node arrays and the q table for sampling."""

    def __init__(self, drafter: Drafter, root_token: int, temperature: float, generator, vocab_size: int):
        self.drafter, self.temperature, self.generator, self.vocab_size = drafter, temperature, generator, vocab_size
        self.tokens, self.parents, self.ranks, self.scores = [root_token], [-1], [0], [0.0]
        self.q_rows: list[int] = [-1]
        self.q_table: list[Tensor] = []

    def add_children(self, nodes: list[int], logits: Tensor, ks: list[int]) -> list[int]:
        """Give node nodes[i] ks[i] children drawn from logits[i] (one batched draw); returns the new nodes."""
        cand = draw_children(logits, max(ks), self.temperature, self.generator)
        if cand.q is not None:
            draft_vocab = self.drafter.to_target_ids(torch.arange(cand.q.shape[-1], device=cand.q.device))
            full = torch.zeros(len(nodes), self.vocab_size, dtype=torch.float32, device=cand.q.device)
            full[:, draft_vocab] = cand.q
            for row, node in enumerate(nodes):
                self.q_rows[node] = len(self.q_table)
                self.q_table.append(full[row])
        targets = self.drafter.to_target_ids(cand.draft_ids).tolist()
        slots = cand.slot_logq.tolist()
        created = []
        for node, k, row_targets, row_slots in zip(nodes, ks, targets, slots):
            for rank, (token, slot) in enumerate(zip(row_targets[:k], row_slots[:k])):
                created.append(len(self.tokens))
                self.tokens.append(token)
                self.parents.append(node)
                self.ranks.append(rank)
                self.scores.append(self.scores[node] + slot)
                self.q_rows.append(-1)
        return created

    def expand(self, nodes: list[int], depth: int) -> Tensor:
        tokens = torch.tensor([self.tokens[i] for i in nodes], dtype=torch.long)
        return self.drafter.expand(nodes, tokens, [self.parents[i] for i in nodes], depth)

    def result(self, keep: list[int] | None = None) -> DraftTree:
        keep = keep if keep is not None else list(range(len(self.tokens)))
        new_index = {old: new for new, old in enumerate(keep)}
        sampling = bool(self.q_table)
        return DraftTree(
            tokens=torch.tensor([self.tokens[i] for i in keep], dtype=torch.long),
            parents=torch.tensor([new_index[self.parents[i]] if i else -1 for i in keep], dtype=torch.long),
            ranks=torch.tensor([self.ranks[i] for i in keep], dtype=torch.long),
            q_rows=torch.tensor([self.q_rows[i] for i in keep], dtype=torch.long) if sampling else None,
            q_table=torch.stack(self.q_table) if sampling else None,
        )


@torch.no_grad()
def propose(drafter: Drafter | None, root_token: int, tree: TreeBuffers | DynamicTree, *, temperature: float,
            generator: torch.Generator | None, vocab_size: int) -> DraftTree:
    """Grow one draft tree below `root_token`.

    Args:
        drafter: the draft model; None gives the root alone (plain decoding).
        root_token: the target's last chosen token (its KV is not cached yet).
        tree: a static tree (`build_tree`) or a `DynamicTree` spec.
        temperature: 0 takes top-k children; > 0 draws them without replacement from the draft.
        generator: random source for the draws.
        vocab_size: the target vocabulary size (q rows are over target ids).
    Returns:
        The proposal, parents before children.
    """
    if drafter is None:
        return DraftTree(tokens=torch.tensor([root_token]), parents=torch.tensor([-1]), ranks=torch.tensor([0]))
    growth = _Growth(drafter, root_token, temperature, generator, vocab_size)
    try:
        if isinstance(tree, DynamicTree):
            return _grow_dynamic(growth, tree)
        return _grow_static(growth, tree)
    finally:
        drafter.end_proposal()


def _grow_static(growth: _Growth, tree: TreeBuffers) -> DraftTree:
    # Growth creates nodes breadth-first, parents in order and children by rank: exactly the static tree's
    # (depth, ranks) order, so growth's node ids are the static tree's ids.
    parents, ranks, depths = tree.parents.tolist(), tree.ranks.tolist(), tree.position_ids.tolist()
    num_children = [0] * len(parents)
    for node in range(1, len(parents)):
        num_children[parents[node]] = max(num_children[parents[node]], ranks[node] + 1)
    growth.add_children([0], growth.drafter.root_logits(), [num_children[0]])
    for depth in range(1, tree.depth):
        expandable = [i for i in range(len(parents)) if depths[i] == depth and num_children[i] > 0]
        if expandable:
            logits = growth.expand(expandable, depth)
            growth.add_children(expandable, logits, [num_children[node] for node in expandable])
    if growth.parents != parents or growth.ranks != ranks:
        raise AssertionError("static tree growth diverged from the tree's node order")
    return growth.result()


def _grow_dynamic(growth: _Growth, spec: DynamicTree) -> DraftTree:
    depth_limit = min(spec.depth, growth.drafter.max_depth or spec.depth)
    frontier_nodes = growth.add_children([0], growth.drafter.root_logits(), [spec.top_k])
    for depth in range(1, depth_limit):
        best = sorted(frontier_nodes, key=lambda i: (-growth.scores[i], i))[: spec.top_k]
        best.sort()
        logits = growth.expand(best, depth)
        frontier_nodes = growth.add_children(best, logits, [spec.top_k] * len(best))
    return growth.result(select_nodes(growth.scores, growth.parents, spec.total_tokens))
