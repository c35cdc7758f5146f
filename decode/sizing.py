"""Tree sizing from a cost model (REFERENCE section 1): pick the tree that maximises expected tokens per second,

    tokens/s = E[tokens per step] / (C_T(n + 1) + C_P(tree)),

where E comes from measured acceptance per (depth, sibling rank), C_T(n + 1) is the measured cost of one target
forward over the root plus n draft tokens, and C_P the measured cost of drafting the tree (about depth x C_D for
EAGLE, one pass of the heads for Medusa). On a CPU, C_T grows with n, so the best tree is small and machine-bound.

Acceptance model: at depth d, the accepted node is the rank-r child of the accepted depth-(d-1) node with
probability a[d][r], independently across depths. A node reached by ranks (r1, ..., rd) is then accepted with
probability a[1][r1] ... a[d][rd], and E[tokens] = 1 (the bonus token) + the sum of that over the tree's nodes.
For a budget of n nodes, the best tree takes the n most probable nodes (best-first from the root; children are
never likelier than their parent, so the pick is always a tree). That is how Medusa chose its sparse trees;
EAGLE-2's dynamic trees pick by the draft's own confidence instead, so for them the estimate is approximate.
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from decode.generate import GenerateOutput, generate
from decode.propose import make_drafter, propose
from decode.tree import DraftTree, DynamicTree, TreeBuffers, build_tree
from decode.verify import verify
from heads.eagle import EagleHead
from heads.features import FeatureCapture


def rank_acceptance(outputs: Sequence[GenerateOutput]) -> list[list[float]]:
    """a[d-1][r]: P(the node accepted at depth d is its parent's rank-r child | depth d - 1 was accepted).

    Pooled over all runs. Ranks or depths that the measured trees never drafted have no estimate and are
    absent; a probe tree wider and deeper than any candidate keeps the estimate from being cut short.
    """
    reached: list[
        int
    ] = []  # [d-1]: steps that accepted depth d - 1 (depth 0: every step) and drafted depth d
    accepted: list[list[int]] = []
    for out in outputs:
        counts = [out.steps, *out.accepted_per_depth]
        for depth in range(out.draft_depth):
            if len(reached) <= depth:
                reached.append(0)
                accepted.append([])
            reached[depth] += counts[depth] if depth < len(counts) else 0
            ranks = out.accepted_ranks[depth] if depth < len(out.accepted_ranks) else []
            accepted[depth] += [0] * (len(ranks) - len(accepted[depth]))
            for rank, count in enumerate(ranks):
                accepted[depth][rank] += count
    return [[count / total if total else 0.0 for count in row] for row, total in zip(accepted, reached)]


def best_tree(
    acceptance: Sequence[Sequence[float]], budget: int, max_depth: int | None = None, top_k: int | None = None
) -> tuple[float, list[tuple[int, ...]]]:
    """The `budget` most probable nodes under the acceptance model, as rank paths, and their E[tokens].

    Args:
        acceptance: a[d-1][r] from `rank_acceptance`.
        budget: draft nodes n (the root is extra).
        max_depth: deepest level allowed (default: all measured levels).
        top_k: most children per node (default: all measured ranks).
    Returns:
        (E[tokens per step] including the bonus token, rank paths sorted by depth then ranks).
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    depth_limit = min(len(acceptance), max_depth if max_depth is not None else len(acceptance))
    heap: list[tuple[float, tuple[int, ...]]] = []

    def push_children(path: tuple[int, ...], probability: float) -> None:
        depth = len(path)
        if depth >= depth_limit:
            return
        ranks = acceptance[depth][: top_k if top_k is not None else None]
        for rank, rate in enumerate(ranks):
            if rate > 0:
                heapq.heappush(heap, (-probability * rate, (*path, rank)))

    push_children((), 1.0)
    chosen, expected = [], 1.0
    while heap and len(chosen) < budget:
        negative, path = heapq.heappop(heap)
        chosen.append(path)
        expected -= negative
        push_children(path, -negative)
    return expected, sorted(chosen, key=lambda p: (len(p), p))


def interpolate(costs: dict[int, float], n: int) -> float:
    """Linear interpolation of measured costs C(n) (held flat beyond the measured range's ends)."""
    sizes = sorted(costs)
    if n <= sizes[0]:
        return costs[sizes[0]]
    if n >= sizes[-1]:  # extrapolate with the last segment's slope
        lo, hi = sizes[-2], sizes[-1]
        return costs[hi] + (n - hi) * (costs[hi] - costs[lo]) / (hi - lo) if len(sizes) > 1 else costs[hi]
    hi = next(s for s in sizes if s >= n)
    lo = max(s for s in sizes if s <= n)
    return costs[lo] if hi == lo else costs[lo] + (n - lo) * (costs[hi] - costs[lo]) / (hi - lo)


@dataclass(frozen=True)
class Candidate:
    tree: DynamicTree | tuple[tuple[int, ...], ...]  # EAGLE: dynamic spec; Medusa: static rank paths
    draft_nodes: int
    depth: int
    top_k: int
    expected_tokens: float
    verify_seconds: float
    propose_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.expected_tokens / (self.verify_seconds + self.propose_seconds)


def size_tree(
    acceptance: Sequence[Sequence[float]],
    verify_cost: dict[int, float],
    propose_cost: Callable[[int, int, int], float],
    *,
    dynamic: bool,
    budgets: Sequence[int],
    depths: Sequence[int],
    top_ks: Sequence[int],
) -> list[Candidate]:
    """Every (budget, depth, top_k) candidate with its predicted tokens/s, best first.

    Args:
        acceptance: a[d-1][r] from `rank_acceptance`.
        verify_cost: seconds of one target forward over n tree tokens (root included), measured.
        propose_cost: (draft_nodes, depth, top_k) -> seconds to draft that tree, measured.
        dynamic: True gives `DynamicTree` specs (EAGLE), False static rank paths (Medusa).
        budgets, depths, top_ks: the grid searched.
    """
    candidates = []
    for depth in depths:
        for top_k in top_ks:
            for budget in budgets:
                expected, paths = best_tree(acceptance, budget, depth, top_k)
                if not paths:
                    continue
                used_depth = max(len(p) for p in paths)
                used_k = 1 + max(max(p) for p in paths)
                if (used_depth, used_k, len(paths)) != (depth, top_k, budget):
                    continue  # the same tree as a smaller candidate: keep one copy
                tree = DynamicTree(depth, top_k, budget) if dynamic else tuple(paths)
                candidates.append(
                    Candidate(
                        tree,
                        budget,
                        depth,
                        top_k,
                        expected,
                        interpolate(verify_cost, budget + 1),
                        propose_cost(budget, depth, top_k),
                    )
                )
    return sorted(candidates, key=lambda c: -c.tokens_per_second)


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def measure_verify_cost(
    model: nn.Module, context: torch.Tensor, sizes: Sequence[int], repeats: int = 5
) -> dict[int, float]:
    """Median seconds of one tree verify forward over n tokens (chain-shaped) above a cached `context` (1, T)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
    past = context.shape[1]
    costs = {}
    for n in sizes:
        tokens = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        tree = DraftTree(
            tokens=tokens, parents=torch.arange(-1, n - 1), ranks=torch.zeros(n, dtype=torch.long)
        )

        def run(tree: DraftTree = tree, n: int = n) -> None:
            verify(model, cache, tree, past)
            cache.crop(-n)  # transformers 5.x: drop the n positions just verified

        costs[n] = _median_seconds(run, repeats)
    return costs


@torch.no_grad()
def measure_propose_cost(
    model: nn.Module,
    heads: nn.Module,
    context: torch.Tensor,
    trees: Sequence[TreeBuffers | DynamicTree],
    repeats: int = 5,
) -> list[float]:
    """Median seconds to draft each tree (greedy) after the target prefilled `context` (1, T)."""
    drafter = make_drafter(heads, model)
    capture = FeatureCapture(model, drafter.feature_layers)
    with capture:
        out = model(input_ids=context, use_cache=False, logits_to_keep=1)
        root = int(out.logits[0, -1].argmax())
        drafter.advance(capture.features()[0], torch.cat([context[0, 1:], torch.tensor([root])]))
    vocab = model.get_output_embeddings().weight.shape[0]
    return [
        _median_seconds(
            lambda t=tree: propose(drafter, root, t, temperature=0.0, generator=None, vocab_size=vocab),
            repeats,
        )
        for tree in trees
    ]


@dataclass
class Calibration:
    """What `calibrate` measured for one head on one machine, and the search over trees it allows."""

    acceptance: list[list[float]]     # a[d-1][r], from `rank_acceptance`
    verify_cost: dict[int, float]     # seconds of one target forward over n tree tokens
    candidates: list[Candidate]       # best first; empty when no draft was ever accepted
    measure_propose: Callable[[DynamicTree | list[tuple[int, ...]]], float]  # seconds to draft a given tree

    @property
    def plain_tokens_per_second(self) -> float:
        return 1.0 / self.verify_cost[1]

    def predict(self, tree: DynamicTree | Sequence[Sequence[int]]) -> dict[str, float]:
        """E[tokens], costs and tokens/s of a given tree (a DynamicTree's E is that of the best-first static
        tree of its size: an approximation of its confidence-driven shape); its drafting cost is measured."""
        if isinstance(tree, DynamicTree):
            expected, _ = best_tree(self.acceptance, tree.total_tokens, tree.depth, tree.top_k)
            nodes, depth, top_k = tree.total_tokens, tree.depth, tree.top_k
        else:
            paths = [tuple(p) for p in tree]
            expected = 1.0
            for path in paths:
                probability = 1.0
                for d, r in enumerate(path):
                    probability *= self.acceptance[d][r] if d < len(self.acceptance) and r < len(self.acceptance[d]) \
                        else 0.0  # fmt: skip
                expected += probability
            nodes, depth, top_k = len(paths), max(map(len, paths)), 1 + max(max(p) for p in paths)
        verify_seconds = interpolate(self.verify_cost, nodes + 1)
        propose_seconds = self.measure_propose(tree if isinstance(tree, DynamicTree) else [tuple(p) for p in tree])
        return {"draft_nodes": nodes, "depth": depth, "top_k": top_k, "expected_tokens": expected,
                "verify_seconds": verify_seconds, "propose_seconds": propose_seconds,
                "tokens_per_second": expected / (verify_seconds + propose_seconds)}  # fmt: skip


@torch.no_grad()
def calibrate(model: nn.Module, heads: nn.Module, prompts: Sequence[torch.Tensor], *, max_new_tokens: int = 64,
              verify_sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32, 48), max_depth: int = 6, max_top_k: int = 4,
              repeats: int = 3) -> Calibration:
    """Measure, on this machine, everything the cost model needs, and search the best tree for `heads`.

    1. Acceptance per (depth, rank): greedy decoding of `prompts` with a wide probe tree (EAGLE: dynamic, depth
       `max_depth`, top_k `max_top_k`, 48 nodes; Medusa: the top `max_top_k` candidates of every head below
       the top-1 chain). Use prompts the benchmark does not score: the choice is then not fitted to them.
    2. C_T(n): the target's verify forward over n tokens above the first prompt, for n in `verify_sizes`.
    3. Drafting cost: EAGLE per (depth, top_k) shape (one draft forward per level); Medusa once (its heads run
       once per step whatever the tree).
    4. `size_tree` over draft budgets 1 .. max(verify_sizes) - 1, depths and top_k up to the measured ones.

    Args:
        model: the target.
        heads: MedusaHeads or EagleHead.
        prompts: (1, T) prompt ids.
    """
    eagle = isinstance(heads, EagleHead)
    if eagle:
        probe: TreeBuffers | DynamicTree = DynamicTree(depth=max_depth, top_k=max_top_k, total_tokens=48)
    else:
        probe = build_tree([(0,) * d + (r,) for d in range(heads.config.num_heads) for r in range(max_top_k)])
    runs = [generate(model, ids, heads, max_new_tokens=max_new_tokens, tree=probe) for ids in prompts]
    acceptance = rank_acceptance(runs)
    context = prompts[0]
    verify_cost = measure_verify_cost(model, context, verify_sizes, repeats)

    def measure_propose(tree) -> float:
        spec = tree if isinstance(tree, DynamicTree) else build_tree(tree)
        return measure_propose_cost(model, heads, context, [spec], repeats)[0]

    depths = range(1, min(max_depth, len(acceptance)) + 1)
    top_ks = range(1, max_top_k + 1)
    budgets = range(1, max(verify_sizes))
    if eagle:  # one measurement per (depth, top_k) shape, at the largest budget
        by_shape = {(d, k): measure_propose(DynamicTree(d, k, budgets[-1])) for d in depths for k in top_ks}

        def propose_cost(n: int, d: int, k: int) -> float:
            return by_shape[(d, k)]
    else:
        medusa_seconds = measure_propose([(0,)])

        def propose_cost(n: int, d: int, k: int) -> float:
            return medusa_seconds

    candidates = size_tree(acceptance, verify_cost, propose_cost, dynamic=eagle, budgets=budgets, depths=depths,
                           top_ks=top_ks)  # fmt: skip
    return Calibration(acceptance, verify_cost, candidates, measure_propose)
