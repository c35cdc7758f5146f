"""Tree sizing from a cost model (docs/design.md, When speculation pays): pick the tree that maximises
expected tokens per second,

    tokens/s = E[tokens per step] / (C_T(n + 1) + C_P(tree)),

where E comes from measured acceptance per (depth, sibling rank), C_T(n + 1) is the measured cost of one
target forward over the root plus n draft tokens, and C_P the measured cost of drafting the tree (about depth
x C_D for EAGLE, one pass of the heads for Medusa). On a CPU, C_T grows with n, so the best tree is small and
machine-bound.

Acceptance model: at depth d, the accepted node is the rank-r child of the accepted depth-(d-1) node with
probability a[d][r], independently across depths. A node reached by ranks (r1, ..., rd) is then accepted with
probability a[1][r1] ... a[d][rd], and E[tokens] = 1 (the bonus token) + the sum of that over the tree's
nodes. For a budget of n nodes, the best tree takes the n most probable nodes (best-first from the root;
children are never likelier than their parent, so the pick is always a tree). That is how Medusa chose its
sparse trees; EAGLE-2's dynamic trees pick by the draft's own confidence instead, so for them the estimate is
approximate.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode.policy import TreePolicy
from decode.tree import DynamicTree

if TYPE_CHECKING:
    from decode.generate import GenerateOutput, RowOutput


def rank_acceptance(outputs: Sequence[GenerateOutput | RowOutput]) -> list[list[float]]:
    """a[d-1][r]: P(the target takes the rank-r child at depth d | the parent at depth d - 1 was accepted and
    offered a rank-r child), pooled over all runs (a batched run counts each of its rows): `accepted_ranks` /
    `offered_ranks`. Ranks or depths that the measured trees never offered have no estimate and are absent (a
    wide, deep probe tree avoids that)."""
    accepted: list[list[int]] = []
    offered: list[list[int]] = []
    tables = []
    for out in outputs:  # a run's rows (`GenerateOutput`), or one row (`RowOutput`)
        rows = hasattr(out, "row")
        tables += (
            zip(out.accepted_ranks, out.offered_ranks) if rows else [(out.accepted_ranks, out.offered_ranks)]
        )
    for row_accepted, row_offered in tables:
        for table, counts in ((accepted, row_accepted), (offered, row_offered)):
            for depth, ranks in enumerate(counts):
                while len(table) <= depth:
                    table.append([])
                table[depth] += [0] * (len(ranks) - len(table[depth]))
                for rank, count in enumerate(ranks):
                    table[depth][rank] += count
    return [
        [
            (accepted[d][r] if d < len(accepted) and r < len(accepted[d]) else 0) / count if count else 0.0
            for r, count in enumerate(row)
        ]
        for d, row in enumerate(offered)
    ]


def _pop_order(
    acceptance: Sequence[Sequence[float]],
    budget: int,
    max_depth: int | None,
    top_k: int | None,
    expand_per_level: int | None,
) -> list[tuple[tuple[int, ...], float]]:
    """The nodes best-first search takes, in the order it takes them, with their probabilities: (rank path,
    P(node)). The order does not depend on the budget, so the best tree of n nodes is the first n of them."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    depth_limit = min(len(acceptance), max_depth if max_depth is not None else len(acceptance))
    heap: list[tuple[float, tuple[int, ...], float]] = []  # (-P(node), path, P(parent))

    def push(path: tuple[int, ...], parent_probability: float) -> None:
        rates, rank = acceptance[len(path) - 1], path[-1]
        if rank < len(rates) and (top_k is None or rank < top_k) and rates[rank] > 0:
            heapq.heappush(heap, (-parent_probability * rates[rank], path, parent_probability))

    if depth_limit > 0:
        push((0,), 1.0)
    expanded = [0] * depth_limit  # nodes per level that have been given children
    taken: list[tuple[tuple[int, ...], float]] = []
    while heap and len(taken) < budget:
        negative, path, parent_probability = heapq.heappop(heap)
        taken.append((path, -negative))
        push((*path[:-1], path[-1] + 1), parent_probability)
        level = len(path) - 1
        if len(path) < depth_limit and (expand_per_level is None or expanded[level] < expand_per_level):
            expanded[level] += 1
            push((*path, 0), -negative)
    return taken


def best_tree(
    acceptance: Sequence[Sequence[float]],
    budget: int,
    max_depth: int | None = None,
    top_k: int | None = None,
    expand_per_level: int | None = None,
) -> tuple[float, list[tuple[int, ...]]]:
    """The `budget` most probable nodes under the acceptance model, as rank paths, and their E[tokens].

    Best-first from the root: a node's next sibling and first child become candidates when it is taken, so the
    result is a tree whose siblings have consecutive ranks (what `build_tree` accepts) even where measured
    rates do not fall with rank.

    Args:
        acceptance: a[d-1][r] from `rank_acceptance`.
        budget: draft nodes n (the root is extra).
        max_depth: deepest level allowed (default: all measured levels).
        top_k: most children per node (default: all measured ranks).
        expand_per_level: most nodes per level that get children (EAGLE-2 dynamic trees expand `top_k`).
    Returns:
        (E[tokens per step] including the bonus token, rank paths sorted by depth then ranks).
    """
    taken = _pop_order(acceptance, budget, max_depth, top_k, expand_per_level)
    expected = 1.0 + sum(probability for _, probability in taken)
    return expected, sorted((path for path, _ in taken), key=lambda p: (len(p), p))


def interpolate(costs: dict[int, float], n: int) -> float:
    """Linear interpolation of measured costs C(n): held flat below the smallest n, extended with the last
    segment's slope above the largest."""
    sizes = sorted(costs)
    if n <= sizes[0]:
        return costs[sizes[0]]
    if n >= sizes[-1]:  # extrapolate with the last segment's slope (one measured size: held flat)
        if len(sizes) == 1:
            return costs[sizes[0]]
        lo, hi = sizes[-2], sizes[-1]
        return costs[hi] + (n - hi) * (costs[hi] - costs[lo]) / (hi - lo)
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
    searched = set(budgets)
    wanted = sorted(searched)
    for depth in depths:
        for top_k in top_ks:
            # one best-first search per shape: the best tree of n nodes is its first n nodes
            taken = _pop_order(
                acceptance, wanted[-1] if wanted else 0, depth, top_k, top_k if dynamic else None
            )
            expected, used_depth, used_k = 1.0, 0, 0
            for count, (path, probability) in enumerate(taken, 1):
                expected += probability
                used_depth, used_k = max(used_depth, len(path)), max(used_k, path[-1] + 1)
                if count not in searched or (used_depth, used_k) != (depth, top_k):
                    continue  # not searched, or the same tree as a smaller candidate: keep one copy
                if dynamic:
                    tree = DynamicTree(depth, top_k, count)
                else:
                    tree = tuple(sorted((p for p, _ in taken[:count]), key=lambda p: (len(p), p)))
                candidates.append(
                    Candidate(
                        tree,
                        count,
                        depth,
                        top_k,
                        expected,
                        interpolate(verify_cost, count + 1),
                        propose_cost(count, depth, top_k),
                    )
                )
    return sorted(candidates, key=lambda c: -c.tokens_per_second)


def monotone_costs(costs: dict[int, float]) -> dict[int, float]:
    """{n: min over m >= n of costs[m]}: the cost of n tree tokens, padding to a larger size where that is
    cheaper."""
    bad = {n: c for n, c in costs.items() if not (math.isfinite(c) and c > 0)}
    if bad:
        raise ValueError(f"costs must be finite and > 0 seconds, got {bad}")
    out, best = {}, float("inf")
    for n in sorted(costs, reverse=True):
        best = min(best, costs[n])
        out[n] = best
    return {n: out[n] for n in costs}


@dataclass(frozen=True)
class BatchChoice:
    """What to do at one batch size: the best candidate tree, or plain decoding when no tree beats it."""

    batch: int
    candidate: Candidate | None  # None: plain decoding (speculation loses at this batch size)
    tokens_per_second: float  # predicted for the whole batch
    plain_tokens_per_second: float  # predicted for plain decoding of the batch

    @property
    def tree(self) -> DynamicTree | tuple[tuple[int, ...], ...] | None:
        return None if self.candidate is None else self.candidate.tree

    @property
    def speedup(self) -> float:
        return self.tokens_per_second / self.plain_tokens_per_second


def batch_policy(
    acceptance: Sequence[Sequence[float]],
    verify_cost: dict[int, dict[int, float]],
    propose_cost: Callable[[int, int, int], float],
    *,
    dynamic: bool,
    budgets: Sequence[int],
    depths: Sequence[int],
    top_ks: Sequence[int],
) -> dict[int, BatchChoice]:
    """Per measured batch size B, the tree that maximises the batch's expected tokens per second, or plain
    decoding where none beats it.

    With B rows drafting their trees (together) and one target forward over all B trees:
    tokens/s = B x E[tokens per step] / (C_T(B, n + 1) + C_P(B, tree)), against B / C_T(B, 1) for plain
    decoding. As B grows the target pass turns from memory-bound to compute-bound, C_T(B, n + 1) grows with
    B x n and the best tree shrinks, down to none.

    Args:
        acceptance: a[d-1][r] from `rank_acceptance`.
        verify_cost: {B: {n: seconds of one target forward over B rows of n tree tokens each}}, measured
            (`decode.calibrate.measure_batch_verify_cost`); every B needs n = 1 (plain decoding).
        propose_cost: (batch, draft_nodes, depth, top_k) -> seconds for B rows to draft that tree each
            (`decode.calibrate.measure_batch_propose_cost`).
        dynamic, budgets, depths, top_ks: as `size_tree`.
    """
    _check_plain_costs(verify_cost)
    grid = {"dynamic": dynamic, "budgets": budgets, "depths": depths, "top_ks": top_ks}
    return {
        batch: _choose(acceptance, batch, costs, propose_cost, grid)[0]
        for batch, costs in sorted(verify_cost.items())
    }


def _check_plain_costs(verify_cost: dict[int, dict[int, float]]) -> None:
    for batch, costs in verify_cost.items():
        if 1 not in costs:
            raise ValueError(
                f"batch {batch}: no plain-decoding cost (n = 1) among the measured sizes {costs}"
            )


def _choose(
    acceptance: Sequence[Sequence[float]],
    batch: int,
    costs: dict[int, float],
    propose_cost: Callable[[int, int, int, int], float],
    grid: dict,
    plain_scale: float = 1.0,
    spec_scale: float = 1.0,
) -> tuple[BatchChoice, Candidate | None]:
    """`batch_policy`'s pick at one batch size, and the best candidate tree even where plain decoding wins.
    `plain_scale` and `spec_scale` multiply the calibrated seconds of a plain and of a speculative step (what
    `AdaptivePolicy` measured against what calibration predicted)."""
    candidates = size_tree(acceptance, costs, lambda n, d, k: propose_cost(batch, n, d, k), **grid)
    plain = batch / (costs[1] * plain_scale)
    best = candidates[0] if candidates else None
    speed = batch * best.tokens_per_second / spec_scale if best is not None else 0.0
    if best is None or speed <= plain:
        return BatchChoice(batch, None, plain, plain), best
    return BatchChoice(batch, best, speed, plain), best


def measured_batch(sizes: Sequence[int], batch: int) -> int:
    """The measured batch size that stands for `batch` rows: the nearest at or below it (the smallest
    measured one below all of them)."""
    if not sizes:
        raise ValueError("no batch sizes were measured")
    below = [b for b in sorted(sizes) if b <= batch]
    return below[-1] if below else min(sizes)


def policy_tree(choices: dict[int, BatchChoice], batch: int):
    """The tree `batch_policy` chose for `batch` rows (None: plain), at `measured_batch`'s size."""
    return choices[measured_batch(list(choices), batch)].tree


class AdaptivePolicy(TreePolicy):
    """A batch policy (`generate(..., tree=policy)`) that follows the acceptance of its own batch.

    `batch_policy` fixes one tree per batch size from the acceptance measured on calibration prompts; a batch
    whose prompts the draft predicts worse (or better) gets the wrong tree, and where speculation loses for
    that batch it still speculates. This policy starts from the calibrated rates and re-estimates them from
    what its own batch accepts: after each speculative step `decode.generate` calls `observe` with the step's
    counts per (depth, rank) summed over its rows, and the policy re-picks the tree for the rows still
    decoding (or none) every `refit_every` observed steps, with the same cost tables.

    Estimate per (depth, rank): (prior_weight x a0 + accepted) / (prior_weight + offered), where a0 is the
    calibrated rate and the observed counts decay by `decay` per step (the estimate follows the batch as rows
    finish and others remain). Cells the trees in use never offered keep a0 (they still count through their
    ancestors' observed rates). While the policy decodes plainly it observes nothing, so every
    `probe_every`-th plain step it speculates with the best tree it knows (a probe: it may cost a little, and
    it is how a batch that turned predictable gets speculation back).

    It also follows what its steps cost. Calibration measured the costs on a few prompts at a few batch
    sizes, at one moment of a shared machine; the rows of a batch fall between the measured sizes, and the
    machine's speed drifts. `decode.generate` tells the policy each step's wall time (`record_time`: from
    after
    the policy's pick to the end of the step's bookkeeping, its one host read included; a drafter catching
    up on the prompt or on plain steps is a one-off cost, waited for and left out). The policy keeps two
    factors, measured over predicted seconds, one for plain and one for speculative steps: each
    `(time_prior + sum of ratios) / (time_prior + steps)`, where the sum and the steps decay by `decay` per
    step of their own kind (the prior does not decay). It compares speculation with plain decoding through
    those factors: the trees' ranking among themselves is the calibrated one, but whether to speculate at
    all follows the measured times of the two kinds of step. With timing, plain steps count towards
    `refit_every` through their time; speculative ones count through `observe`.

    Args:
        acceptance: a0[d-1][r], the calibrated rates (`rank_acceptance`).
        verify_cost, propose_cost, dynamic, budgets, depths, top_ks: as `batch_policy`.
        prior_weight: offers the calibrated rate counts as, per cell.
        decay: weight of the past per observed step, and per timed step of each kind (1: never forget).
        refit_every: observed steps between re-picks of the tree.
        probe_every: plain steps between probes (0: never probe).
        time_prior: steps the calibrated costs count as in the two time factors (None: ignore `record_time`,
            decide on the calibrated costs alone).
    """

    def __init__(
        self,
        acceptance: Sequence[Sequence[float]],
        verify_cost: dict[int, dict[int, float]],
        propose_cost: Callable[[int, int, int, int], float],
        *,
        dynamic: bool,
        budgets: Sequence[int],
        depths: Sequence[int],
        top_ks: Sequence[int],
        prior_weight: float = 16.0,
        decay: float = 0.9,
        refit_every: int = 2,
        probe_every: int = 16,
        time_prior: float | None = 4.0,
    ) -> None:
        if not prior_weight > 0:  # (NaN fails every comparison: `<= 0` let it through)
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        if time_prior is not None and not time_prior > 0:
            raise ValueError(f"time_prior must be > 0 (or None), got {time_prior}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if refit_every < 1 or probe_every < 0:
            raise ValueError(
                f"refit_every must be >= 1 and probe_every >= 0, got {refit_every}, {probe_every}"
            )
        _check_plain_costs(verify_cost)
        self.prior = [list(map(float, row)) for row in acceptance]
        self.verify_cost, self.propose_cost = verify_cost, propose_cost
        self.grid = {"dynamic": dynamic, "budgets": budgets, "depths": depths, "top_ks": top_ks}
        self.prior_weight, self.decay = prior_weight, decay
        self.refit_every, self.probe_every = refit_every, probe_every
        self.accepted = [[0.0] * len(row) for row in self.prior]
        self.offered = [[0.0] * len(row) for row in self.prior]
        # per measured batch size, under the current estimate: the pick and the best tree (a probe's)
        self.choices: dict[int, tuple[BatchChoice, Candidate | None]] = {}
        self.since_refit = 0
        self.plain_steps = 0
        self.chosen: Counter = Counter()  # steps per tree handed out (None: plain), probes included
        self.time_prior = time_prior
        # per kind of step: [sum of measured / predicted seconds, steps], both decayed
        self.timed = {"plain": [0.0, 0.0], "spec": [0.0, 0.0]}
        self.handed: tuple[str, float] | None = None  # the last step handed out: its kind, predicted seconds

    def rates(self) -> list[list[float]]:
        """The current estimate a[d-1][r]."""
        w = self.prior_weight
        return [
            [(w * a0 + acc) / (w + off) for a0, acc, off in zip(prior, accepted, offered)]
            for prior, accepted, offered in zip(self.prior, self.accepted, self.offered)
        ]

    def observe(self, accepted: Sequence[Sequence[int]], offered: Sequence[Sequence[int]]) -> None:
        """One speculative step's counts per (depth, rank), summed over the batch's rows (`tally_ranks`)."""
        for table in (self.accepted, self.offered):
            for row in table:
                row[:] = [value * self.decay for value in row]
        for table, counts in ((self.accepted, accepted), (self.offered, offered)):
            for d, row in enumerate(counts[: len(table)]):
                for r, count in enumerate(row[: len(table[d])]):
                    table[d][r] += count
        self._count_step()

    def _count_step(self) -> None:
        """One more step seen since the last pick: every `refit_every` the trees are re-picked when next
        asked."""
        self.since_refit += 1
        if self.since_refit >= self.refit_every:
            self.choices.clear()

    def time_scale(self, kind: str) -> float:
        """Measured over calibrated seconds of a `kind` ("plain" or "spec") step, as estimated so far (1.0
        without timing)."""
        if self.time_prior is None:
            return 1.0
        ratios, steps = self.timed[kind]
        return (self.time_prior + ratios) / (self.time_prior + steps)

    def record_time(self, seconds: float) -> None:
        """The wall time of the step just taken with what the policy last handed out (`decode.generate` calls
        it after every step)."""
        handed, self.handed = self.handed, None
        if self.time_prior is None or handed is None or not (seconds > 0 and handed[1] > 0):
            return
        kind, predicted = handed
        counts = self.timed[kind]  # decayed by its own kind's steps only: plain runs keep the probes' times
        counts[:] = [counts[0] * self.decay + seconds / predicted, counts[1] * self.decay + 1]
        if kind == "plain":  # a speculative step counted already, through `observe`
            self._count_step()

    def choice(self, rows: int) -> BatchChoice:
        """What the current estimate picks for `rows` rows (the nearest measured batch size at or below)."""
        return self._picked(rows)[0]

    def _picked(self, rows: int) -> tuple[BatchChoice, Candidate | None]:
        batch = measured_batch(list(self.verify_cost), rows)
        if batch not in self.choices:
            self.since_refit = 0
            self.choices[batch] = _choose(
                self.rates(),
                batch,
                self.verify_cost[batch],
                self.propose_cost,
                self.grid,
                self.time_scale("plain"),
                self.time_scale("spec"),
            )
        return self.choices[batch]

    def tree(self, rows: int):
        picked, best = self._picked(rows)
        tree = picked.tree
        if tree is None:
            self.plain_steps += 1
            if self.probe_every and self.plain_steps % self.probe_every == 0 and best is not None:
                tree = best.tree  # a probe: the best tree it knows, though plain decoding is predicted faster
        self.chosen[tree] += 1
        if tree is None:
            self.handed = ("plain", self.verify_cost[picked.batch][1])
        else:
            spec = picked.candidate if picked.candidate is not None else best
            self.handed = ("spec", spec.verify_seconds + spec.propose_seconds)
        return tree
