"""Draft trees as plain data (Medusa 2401.10774 section 2.1.2; EAGLE-2 2406.16858 section 4).

A static tree is a list of rank paths: `(0, 1)` is "the parent's best candidate, then that node's second
best". Node 0 is always the root: the token the target already chose, whose KV is not yet cached.
Everything here is pure; the drafters in `decode/propose.py` fill trees with tokens. The bottom of `decode/`:
it imports nothing else from the package.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TreeBuffers:
    """A static tree in index form; node i > 0 is `paths[i - 1]` after sorting by depth then ranks."""

    paths: tuple[tuple[int, ...], ...]  # sorted rank paths, one per non-root node
    parents: Tensor  # (N,) int64, parents[0] = -1
    ranks: Tensor  # (N,) int64 sibling rank (0 = best candidate), 0 for the root
    position_ids: Tensor  # (N,) int64 depth of each node, added to the committed length

    @property
    def depth(self) -> int:
        return max((len(path) for path in self.paths), default=0)  # from the host paths: no device read

    def __len__(self) -> int:
        return self.parents.numel()


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic tree: expand `depth` levels keeping the `top_k` best cumulative scores per level,
    then keep the `total_tokens` best draft nodes overall (the root comes on top).

    `min_prob` > 0 also bounds the tree by the draft's confidence, step by step: a node whose cumulative draft
    probability (its slot score, `decode.propose`) is below `min_prob` is neither expanded nor verified, and
    drafting stops at the first level with no node at or above it. Confident steps get the full tree,
    uncertain ones a few nodes or none (a plain step), so a deep tree costs little where it would not be
    accepted. Lossless like the rest: the bound reads slot scores only, never a node's own sampled value.
    With the shipped EAGLE-3 head, greedy, (8, 4, 24) at 0.05 beat (5, 4, 12) on chat, instruction and code;
    at temperature 1 in two runs of three (the draft's probabilities understate what the lossless rule
    accepts, so the bound prunes nodes that would pass) (measured: docs/cpu.md, A confidence bound on dynamic
    trees)."""

    depth: int = 5
    top_k: int = 4
    total_tokens: int = 12
    min_prob: float = 0.0  # a node's least cumulative draft probability; 0 = no bound (EAGLE-2)

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"DynamicTree.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.min_prob < 1.0:
            raise ValueError(f"DynamicTree.min_prob must be in [0, 1), got {self.min_prob}")

    def nodes(self, max_depth: int | None = None) -> int:
        """The most draft nodes this tree holds: `total_tokens`, or fewer where its levels cannot hold that
        many (`top_k` at the first level, `top_k`^2 at each deeper one, `decode.propose`), over `depth` levels
        or a drafter's `max_depth` where that is less."""
        depth = self.depth if max_depth is None else max(1, min(self.depth, max_depth))
        return min(self.total_tokens, self.top_k + (depth - 1) * self.top_k**2)


@dataclass(frozen=True)
class BestFirstTree:
    """DDTree (arXiv 2604.12989): the `budget` likeliest paths of a block drafter, best first. A block
    drafter scores each depth independently of the parent (one forward drafts every level), so a node's score
    is the sum of its path's per-depth log q; the tree is the `budget` highest-scoring rank paths up to
    `depth` levels (None: as deep as the drafter drafts). Built by a best-first search over rank paths (each
    node popped pushes its next sibling and its first child), on the host from one read of each depth's top
    `budget` log-probabilities per proposal. When sampling, the tree is chosen from the draft at the
    sampling temperature and its children are point masses: acceptance draws one token from the target per
    depth and descends while it is a child (`decode.accept.accept_chosen`), which is recursive rejection
    with those point masses."""

    budget: int = 16
    depth: int | None = None

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"BestFirstTree.budget must be >= 1, got {self.budget}")
        if self.depth is not None and self.depth < 1:
            raise ValueError(f"BestFirstTree.depth must be >= 1 or None, got {self.depth}")


def tree_label(tree: DynamicTree | BestFirstTree | str | Sequence[Sequence[int]]) -> str:
    """A one-line description of a tree argument of `decode.generate` (reports, benchmark tables)."""
    if isinstance(tree, BestFirstTree):
        return f"best-first(budget={tree.budget}" + (f", depth={tree.depth})" if tree.depth else ")")
    if isinstance(tree, DynamicTree):
        bound = f", min_prob={tree.min_prob:g}" if tree.min_prob > 0 else ""
        return f"dynamic(depth={tree.depth}, top_k={tree.top_k}, total={tree.total_tokens}{bound})"
    if isinstance(tree, str):
        return f"static {tree} ({len(DEFAULT_TREES[tree])} nodes)"
    paths = tree.paths if isinstance(tree, TreeBuffers) else tree  # (a TreeBuffers counts its root too)
    return f"static, {len(paths)} nodes, depth {max((len(p) for p in paths), default=0)}"


def verify_rows(
    tree: DynamicTree | TreeBuffers | str | Sequence[Sequence[int]], max_depth: int | None = None
) -> int:
    """Tokens one verify forward passes for this tree, root included (a dynamic tree's when the drafter
    reaches its full size, which a `min_prob` bound makes a maximum; `max_depth`: the drafter's depth limit,
    `DynamicTree.nodes`): what `decode.prepare` packs the target's weights for."""
    if isinstance(tree, DynamicTree):
        return tree.nodes(max_depth) + 1
    if isinstance(tree, BestFirstTree):
        return tree.budget + 1
    if isinstance(tree, TreeBuffers):
        return len(tree)
    return len(DEFAULT_TREES[tree] if isinstance(tree, str) else tree) + 1


def ancestor_mask(parents: Tensor) -> Tensor:
    """(N, N) bool: [i, j] is True when j == i or j is an ancestor of i. Parents must precede children."""
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            if parent >= i:
                raise ValueError(f"node {i} has parent {parent}: parents must come before their children")
            mask[i] |= mask[parent]
    return mask


def node_depths(parents: Tensor) -> Tensor:
    """(N,) int64 depth of each node (root = 0)."""
    depths = [0] * parents.numel()
    for i, parent in enumerate(parents.tolist()):
        depths[i] = 0 if parent < 0 else depths[parent] + 1
    return torch.tensor(depths, dtype=torch.long)


def build_tree(paths: Sequence[Sequence[int]]) -> TreeBuffers:
    """Index form of a static tree given as rank paths (a Medusa "choices" list).

    Args:
        paths: non-empty rank tuples; every prefix of a path must itself be a path (prefix-closed).
    Returns:
        TreeBuffers with the root as node 0.
    """
    normalized = [tuple(int(r) for r in p) for p in paths]
    if any(len(p) == 0 for p in normalized):
        raise ValueError("tree paths must be non-empty rank tuples; the root is implicit")
    if any(r < 0 for p in normalized for r in p):
        raise ValueError(f"tree ranks must be >= 0, got {next(p for p in normalized if min(p) < 0)}")
    if len(set(normalized)) != len(normalized):
        dup = next(p for p in normalized if normalized.count(p) > 1)
        raise ValueError(f"tree path {dup} appears twice")
    present = set(normalized)
    for p in normalized:
        if len(p) > 1 and p[:-1] not in present:
            raise ValueError(f"tree is not prefix-closed: path {p} needs its prefix {p[:-1]}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in present:
            raise ValueError(f"tree path {p} skips sibling rank {p[-1] - 1}: siblings must be ranks 0..k-1")
    ordered = sorted(normalized, key=lambda p: (len(p), p))
    index = {(): 0} | {p: i + 1 for i, p in enumerate(ordered)}
    parents = torch.tensor([-1] + [index[p[:-1]] for p in ordered], dtype=torch.long)
    ranks = torch.tensor([0] + [p[-1] for p in ordered], dtype=torch.long)
    return TreeBuffers(
        paths=tuple(ordered),
        parents=parents,
        ranks=ranks,
        position_ids=node_depths(parents),
    )


def chain(depth: int) -> list[tuple[int, ...]]:
    """A single path of `depth` top-1 drafts."""
    return [(0,) * d for d in range(1, depth + 1)]


# Static trees sized for a CPU, where verify cost grows with the tree (docs/design.md, When speculation pays).
DEFAULT_TREES: dict[str, list[tuple[int, ...]]] = {
    "chain4": chain(4),
    "tree8": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 1)],
    "tree16": [
        (0,),
        (1,),
        (2,),
        (0, 0),
        (0, 1),
        (1, 0),
        (2, 0),
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 0),
        (0, 0, 0, 0),
        (0, 0, 1, 0),
        (0, 0, 0, 1),
        (0, 0, 0, 0, 0),
        (0, 0, 0, 0, 0, 0),
    ],
}
DEFAULT_MEDUSA_TREE = "tree8"
# Default trees by the target's device. On a CPU the verify cost grows with the tree, so the defaults there
# are small, chosen by measurement (docs/cpu.md, Default trees on a CPU); on a GPU a verify pass costs about
# the same for a few dozen tokens, and the defaults are the sizes the papers decode with.
DEFAULT_EAGLE_TREE = DynamicTree(depth=5, top_k=4, total_tokens=12)  # sized for a 2-core CPU
GPU_EAGLE_TREE = DynamicTree(depth=6, top_k=10, total_tokens=60)  # EAGLE-2's GPU setting
GPU_MEDUSA_TREE = "tree16"  # the largest tree in DEFAULT_TREES (the Medusa paper's GPU trees have ~64 nodes)
# Sampling on a CPU: a chain of this many drafts for every drafter. At temperature 1 a draft survives the
# target's own draw far less often than greedy matching (shipped EAGLE-3 head: tau 1.9 with (5, 4, 12)
# against 3.0 greedy), so the nodes of a tree cost more verify work than they return. For EAGLE-3 and P-EAGLE
# a chain of 2-3 was the fastest tree measured at T=1 and the only one faster than plain decoding on every
# prompt kind; Medusa-1 and DFlash gained nothing from larger trees either (docs/cpu.md, Default trees when
# sampling).
SAMPLING_CHAIN = 3


def default_tree(
    max_depth: int | None, dynamic: bool, device: torch.device | str = "cpu", temperature: float = 0.0
) -> DynamicTree | list[tuple[int, ...]]:
    """The tree `generate` uses when none is given: GPU-sized when the target is on CUDA (`GPU_EAGLE_TREE`,
    `GPU_MEDUSA_TREE`), CPU-sized elsewhere (`DEFAULT_EAGLE_TREE`, `DEFAULT_MEDUSA_TREE`); on a CPU when
    sampling, a chain of `SAMPLING_CHAIN` drafts (cut to `max_depth`) for every drafter.

    Args:
        max_depth: the deepest level the drafter can draft (Medusa: its number of heads); None = no limit.
            A static default tree is cut to it.
        dynamic: the drafter grows EAGLE-2 dynamic trees (EAGLE heads, custom drafters); else a static tree.
        device: the target's device.
        temperature: the sampling temperature (0: greedy).
    """
    cuda = torch.device(device).type == "cuda"
    if temperature > 0 and not cuda:
        return chain(min(SAMPLING_CHAIN, max_depth or SAMPLING_CHAIN))
    if dynamic:
        return GPU_EAGLE_TREE if cuda else DEFAULT_EAGLE_TREE
    paths = DEFAULT_TREES[GPU_MEDUSA_TREE if cuda else DEFAULT_MEDUSA_TREE]
    return [p for p in paths if max_depth is None or len(p) <= max_depth]


def resolve_tree(
    tree: DynamicTree | TreeBuffers | str | Sequence[Sequence[int]] | None,
    *,
    max_depth: int | None,
    dynamic: bool,
    device: torch.device | str = "cpu",
    temperature: float = 0.0,
) -> TreeBuffers | DynamicTree:
    """The tree to decode with, from a `tree` argument of `generate` and what the drafter can do.

    Args:
        tree: rank paths, a name in DEFAULT_TREES, TreeBuffers, a DynamicTree, or None for `default_tree`.
        max_depth: the deepest level the drafter can draft; None = no limit. A deeper static tree is an error
            (a dynamic tree is cut to it while drafting).
        dynamic: the drafter's default is a dynamic tree (see `default_tree`).
        device: the target's device (picks the default tree).
        temperature: the sampling temperature (picks the default tree; 0: greedy).
    Raises:
        ValueError: an unknown tree name, an invalid tree, or a static tree deeper than `max_depth`.
        TypeError: `tree` is none of the above.
    """
    if tree is None:
        tree = default_tree(max_depth, dynamic, device, temperature)
    if isinstance(tree, str):
        if tree not in DEFAULT_TREES:
            raise ValueError(f"unknown tree name {tree!r}; known: {sorted(DEFAULT_TREES)}")
        tree = DEFAULT_TREES[tree]
    if isinstance(tree, (list, tuple)):
        tree = build_tree(tree)
    if not isinstance(tree, (TreeBuffers, DynamicTree, BestFirstTree)):
        raise TypeError(
            "tree must be rank paths, a tree name, TreeBuffers, DynamicTree or BestFirstTree, got "
            f"{type(tree).__name__}"
        )
    if max_depth is not None and isinstance(tree, TreeBuffers) and tree.depth > max_depth:
        raise ValueError(f"tree depth {tree.depth} exceeds the {max_depth} levels these heads can draft")
    return tree


def select_nodes(scores: Sequence[float], parents: Sequence[int], budget: int) -> list[int]:
    """Keep the root and the `budget` best-scoring other nodes, ties to the earlier node (EAGLE-2 rerank).

    Scores must not increase from parent to child (cumulative log-probabilities), so the kept set is
    prefix-closed. Returns kept node ids in creation order (parents before children).
    """
    order = sorted(range(1, len(scores)), key=lambda i: (-scores[i], i))[:budget]
    kept = set(order) | {0}
    for i in kept:
        if i and parents[i] not in kept:
            raise AssertionError(f"rerank kept node {i} without its parent {parents[i]}: scores increase")
    return sorted(kept)


@dataclass
class DraftTree:
    """One proposal: tokens of a tree rooted at the target's last token, plus what verification and acceptance
    need. `decode.propose` fills every field with tensors on the target's device and host-known sizes, so a
    decoding step reads nothing back from the device until acceptance; a tree built by hand (tests, cost
    measurements) gives `tokens`, `parents` and `ranks` only and gets the rest derived here, on the host."""

    tokens: Tensor  # (N,) int64 target-vocabulary ids; tokens[0] is the root
    parents: Tensor  # (N,) int64, parents[0] = -1; parents precede children
    ranks: Tensor  # (N,) int64 order in which siblings were drawn (0 first)
    q_rows: Tensor | None = None  # (N,) int64 row of `q_table` holding the draft distribution a node's
    q_table: Tensor | None = None  # children were drawn from (-1 if it has none); (M, V) fp32, sampling only
    depths: Tensor | None = None  # (N,) int64 depth of each node (root 0)
    ancestors: Tensor | None = None  # (N, N) bool, [i, j]: j is i or an ancestor of i (the verify mask)
    max_depth: int | None = None  # no node is deeper (a bound known on the host: sizes acceptance's loops)
    max_children: int | None = None  # ranks are below it (a bound known on the host)

    def __post_init__(self) -> None:
        if any(x is None for x in (self.depths, self.ancestors, self.max_depth, self.max_children)):
            depths = node_depths(self.parents)
            self.depths = depths.to(self.parents.device) if self.depths is None else self.depths
            if self.ancestors is None:
                self.ancestors = ancestor_mask(self.parents).to(self.parents.device)
            self.max_depth = int(depths.max()) if self.max_depth is None else self.max_depth
            if self.max_children is None:
                self.max_children = int(self.ranks[1:].max()) + 1 if len(self) > 1 else 0

    @functools.cached_property
    def children(self) -> list[list[int]]:
        """children[i]: node i's children by rank (host lists: one read of `parents` and `ranks`)."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for node, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                kids[parent].append(node)
        ranks = self.ranks.tolist()
        return [sorted(k, key=lambda c: ranks[c]) for k in kids]

    def child_table(self) -> Tensor:
        """(N, max_children) int64 on the tree's device: [i, r] is node i's rank-r child, -1 where none."""
        n = len(self)
        table = torch.full((n, max(self.max_children, 1)), -1, dtype=torch.long, device=self.parents.device)
        if n > 1:
            table[self.parents[1:], self.ranks[1:]] = torch.arange(1, n, device=self.parents.device)
        return table[:, : self.max_children]

    def __len__(self) -> int:
        return self.tokens.numel()
