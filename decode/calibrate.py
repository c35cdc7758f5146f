"""Measuring what the cost model of `decode/sizing.py` needs, on this machine: the target's verify cost per
tree size, the drafter's cost per tree, and acceptance per (depth, rank) from decoding calibration prompts;
`calibrate` runs all three and ranks the candidate trees.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from decode.batch import commit, left_padded, prefill, verify_batch
from decode.drafters import make_drafter
from decode.generate import generate
from decode.inputs import attention_windows
from decode.layout import can_pack, is_pretransposed, pack_linears, packed_rows
from decode.prepare import head_rows
from decode.propose import propose
from decode.recurrent import rewind, snapshot
from decode.sizing import (
    AdaptivePolicy,
    BatchChoice,
    Candidate,
    batch_policy,
    best_tree,
    interpolate,
    monotone_costs,
    rank_acceptance,
    size_tree,
)
from decode.timing import synchronize
from decode.tree import BestFirstTree, DraftTree, DynamicTree, TreeBuffers, build_tree, tree_label
from decode.verify import target_cache, verify
from heads.features import FeatureCapture


def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of `fn` after a warm-up call, each call timed between `synchronize(device)` calls."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def measure_verify_cost(
    model: nn.Module, context: torch.Tensor, sizes: Sequence[int], repeats: int = 5
) -> dict[int, float]:
    """Seconds of one tree verify forward over n tokens (chain-shaped) above a cached `context` (1, T).

    The sizes are timed in `repeats` interleaved rounds (each round times every size once, after a warm-up
    pass), so a slow spell of a shared machine spreads over all sizes instead of spoiling one; each size gets
    the median of its rounds. The result is then made non-decreasing in n (`monotone_costs`): a tree of n
    tokens can always be padded to a larger measured size, so C_T(n) is at most C_T(m) for m > n.
    A pretransposed target (`decode.layout`) is measured packed for each n, as `decode.prepare` packs it to
    decode with an n-token tree, and is left packed as it was."""
    cache, windows = target_cache(model), attention_windows(model)
    model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
    saved = snapshot(cache)  # a hybrid's recurrent states after the context (none for other targets)
    past = context.shape[1]
    times: dict[int, list[float]] = {n: [] for n in sizes}
    pack, before = is_pretransposed(model) and can_pack(), packed_rows(model)
    for _ in range(max(repeats, 1)):
        for n in sizes:
            # a pretransposed target decodes packed for its tree (`pack_for_tree`): measure n that way
            if pack:
                pack_linears(model, n if n >= 2 else None)
            tokens = torch.randint(
                0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)
            )
            device = model.device  # the tree is made there, untimed: no upload inside the timer
            tree = DraftTree(
                tokens=tokens.to(device),
                parents=torch.arange(-1, n - 1, device=device),
                ranks=torch.zeros(n, dtype=torch.long, device=device),
            )

            def run(tree: DraftTree = tree, n: int = n) -> None:
                verify(model, cache, tree, past, windows=windows)
                rewind(cache, n, saved)  # the n positions just verified dropped, recurrent states put back

            times[n].append(_median_seconds(run, 1, model.device))
    if pack:
        pack_linears(model, before)
    return monotone_costs({n: statistics.median(t) for n, t in times.items()})


@torch.no_grad()
def measure_batch_verify_cost(
    model: nn.Module, context: torch.Tensor, batches: Sequence[int], sizes: Sequence[int], repeats: int = 3
) -> dict[int, dict[int, float]]:
    """Seconds of one batched verify forward (`decode.batch.verify_batch`) over B rows of n chain tokens each,
    above B copies of a cached `context` (1, T): {B: {n: seconds}}, what `decode.sizing.batch_policy` needs.

    Rounds interleave the sizes as `measure_verify_cost` does; each B is measured on its own batch (prefilled
    once, the verified tokens dropped after each timing), each size's costs made non-decreasing in n."""
    costs = {}
    for batch in batches:
        ids = context.expand(batch, -1).to(model.device)
        state, _, _ = prefill(model, ids, torch.ones_like(ids))
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(max(repeats, 1)):
            for n in sizes:
                tokens = torch.randint(0, model.config.vocab_size, (batch, n), device=model.device)
                depths = torch.arange(n, device=model.device).expand(batch, n)
                ancestors = torch.ones(n, n, dtype=torch.bool, device=model.device).tril().expand(batch, n, n)

                def run(
                    n=n, tokens=tokens, depths=depths, ancestors=ancestors, state=state, rows=batch
                ) -> None:
                    verify_batch(model, state, tokens, depths, ancestors)
                    commit(state, [[] for _ in range(rows)], n)  # keep nothing: the cache is as before

                times[n].append(_median_seconds(run, 1, model.device))
        costs[batch] = monotone_costs({n: statistics.median(t) for n, t in times.items()})
    return costs


def _probe(model: nn.Module, layers, context: torch.Tensor, advance_tokens: int):
    """What a drafting-cost measurement starts from: the target's features (T, F) over `context` (1, T), the
    tokens after each position (T,), the greedy root (1,) on the device (as `generate` passes it) and how
    many of the last positions each timed step takes in again."""
    with FeatureCapture(model, layers) as capture:
        out = model(input_ids=context, use_cache=False, logits_to_keep=1)
        features = capture.features()[0]
    root = out.logits[0, -1].argmax().view(1)
    tokens = torch.cat([context[0, 1:], root])
    return features, tokens, root, min(advance_tokens, tokens.numel())


@torch.no_grad()
def measure_propose_cost(
    model: nn.Module,
    heads,
    context: torch.Tensor,
    trees: Sequence[TreeBuffers | DynamicTree],
    repeats: int = 5,
    advance_tokens: int = 2,
    batch: int = 1,
) -> list[float]:
    """Median seconds of the drafter's work in one decoding step, per tree, for `batch` rows drafting together
    over copies of `context` (1, T): every row taking in `advance_tokens` newly accepted positions (Medusa:
    its heads and their lm_head; EAGLE: a draft forward over them) and then drafting the tree (greedy), after
    the target prefilled `context`. A head packed for a tree (`decode.layout.pack_linears`) is packed as
    `decode.prepare.pack_for_tree` packs it for each tree while it is measured, and as it was afterwards."""
    if advance_tokens < 1 or repeats < 1:
        raise ValueError(f"advance_tokens and repeats must be >= 1, got {advance_tokens} and {repeats}")
    drafter = make_drafter(heads, model, batch)
    features, tokens, root, keep = _probe(model, drafter.feature_layers, context, advance_tokens)
    drafter.start([context[0]] * batch)
    taps = bool(drafter.feature_layers)
    drafter.advance([features[:-keep]] * batch if taps else None, [tokens[:-keep]] * batch)
    vocab = model.get_output_embeddings().weight.shape[0]
    roots = root.expand(batch)

    def step(tree) -> None:
        drafter.advance([features[-keep:]] * batch if taps else None, [tokens[-keep:]] * batch)  # caches grow
        propose(drafter, roots, tree, temperature=0.0, generator=None, vocab_size=vocab)

    pack = isinstance(heads, nn.Module) and is_pretransposed(heads) and can_pack()
    before = packed_rows(heads) if pack else None

    def measure(tree) -> float:
        if pack:
            pack_linears(heads, head_rows(drafter.limits(), tree))
        return _median_seconds(lambda: step(tree), repeats, model.device)

    costs = [measure(tree) for tree in trees]
    if pack:
        pack_linears(heads, before)
    return costs


@dataclass
class Calibration:
    """What `calibrate` measured for one head on one machine, and the search over trees it allows."""

    acceptance: list[list[float]]  # a[d-1][r], from `rank_acceptance`
    verify_cost: dict[int, float]  # seconds of one target forward over n tree tokens
    candidates: list[Candidate]  # best first; empty when no draft was ever accepted
    measure_propose: Callable[[DynamicTree | list[tuple[int, ...]]], float]  # seconds to draft a given tree
    max_depth: int | None = None  # the drafter's depth limit (None: as deep as a tree asks)

    @property
    def plain_tokens_per_second(self) -> float:
        return 1.0 / self.verify_cost[1]

    def predict(self, tree: DynamicTree | Sequence[Sequence[int]]) -> dict[str, float]:
        """E[tokens], costs and tokens/s of a given tree (a DynamicTree's E is that of the best-first static
        tree of its size: an approximation of its confidence-driven shape); its drafting cost is measured.

        Raises:
            ValueError: a DynamicTree with a `min_prob` bound (its size changes step by step; the model
                prices a fixed size).
        """
        if isinstance(tree, DynamicTree) and tree.min_prob > 0:
            raise ValueError(
                f"the cost model prices trees of a fixed size; {tree_label(tree)} has a min_prob bound"
            )
        if isinstance(tree, DynamicTree):  # the nodes and levels the drafter can grow, not those asked for
            depth = tree.depth if self.max_depth is None else min(tree.depth, self.max_depth)
            nodes, top_k = tree.nodes(self.max_depth), tree.top_k
            expected, _ = best_tree(self.acceptance, nodes, depth, top_k, top_k)
        else:
            paths = [tuple(p) for p in tree]
            expected = 1.0
            for path in paths:
                probability = 1.0
                for d, r in enumerate(path):
                    probability *= (
                        self.acceptance[d][r]
                        if d < len(self.acceptance) and r < len(self.acceptance[d])
                        else 0.0
                    )
                expected += probability
            nodes, depth, top_k = len(paths), max(map(len, paths)), 1 + max(max(p) for p in paths)
        verify_seconds = interpolate(self.verify_cost, nodes + 1)
        propose_seconds = self.measure_propose(
            tree if isinstance(tree, DynamicTree) else [tuple(p) for p in tree]
        )
        return {
            "draft_nodes": nodes,
            "depth": depth,
            "top_k": top_k,
            "expected_tokens": expected,
            "verify_seconds": verify_seconds,
            "propose_seconds": propose_seconds,
            "tokens_per_second": expected / (verify_seconds + propose_seconds),
        }


def _check_search(verify_sizes: Sequence[int], max_depth: int, max_top_k: int, repeats: int) -> None:
    """Refuse a calibration that would measure nothing to search: C_T(1) and at least one larger size (the
    draft budgets run 1 .. max(verify_sizes) - 1), at least one level and one rank, at least one timing."""
    if 1 not in verify_sizes or max(verify_sizes) < 2:
        raise ValueError(
            f"verify_sizes must include 1 (plain decoding's cost) and a larger size (the tree's), "
            f"got {list(verify_sizes)}"
        )
    for name, value in (("max_depth", max_depth), ("max_top_k", max_top_k), ("repeats", repeats)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@torch.no_grad()
def calibrate(
    model: nn.Module,
    heads: nn.Module,
    prompts: Sequence[torch.Tensor],
    *,
    max_new_tokens: int = 64,
    verify_sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32, 48),
    max_depth: int = 6,
    max_top_k: int = 4,
    repeats: int = 3,
) -> Calibration:
    """Measure, on this machine, everything the cost model needs, and search the best tree for `heads`.

    1. Acceptance per (depth, rank): greedy decoding of `prompts` with a wide probe tree (EAGLE: dynamic,
    depth
       `max_depth`, top_k `max_top_k`, 48 nodes; Medusa: the top `max_top_k` candidates of every head below
       the top-1 chain). Use prompts the benchmark does not score: the choice is then not fitted to them.
    2. C_T(n): the target's verify forward over n tokens above the first prompt, for n in `verify_sizes` (1
       must be among them: C_T(1) is plain decoding's cost per token).
    3. Drafting cost per step (`measure_propose_cost`): EAGLE per (depth, top_k) shape (one draft forward per
       level); Medusa once (its heads run once per step whatever the tree).
    4. `size_tree` over draft budgets 1 .. max(verify_sizes) - 1, depths and top_k up to the measured ones.

    Args:
        model: the target.
        heads: MedusaHeads or EagleHead.
        prompts: (1, T) prompt ids.
    """
    _check_search(verify_sizes, max_depth, max_top_k, repeats)
    acceptance, propose_cost, measure_propose, grid = _draft_model(
        model, heads, prompts, max_new_tokens, max(verify_sizes), max_depth, max_top_k, repeats
    )
    verify_cost = measure_verify_cost(model, prompts[0], verify_sizes, repeats)
    candidates = size_tree(acceptance, verify_cost, propose_cost, **grid)
    max_depth = make_drafter(heads, model, 1).limits().max_depth
    return Calibration(acceptance, verify_cost, candidates, measure_propose, max_depth)


def _draft_model(
    model,
    heads,
    prompts,
    max_new_tokens,
    max_size,
    max_depth,
    max_top_k,
    repeats,
    measure=True,
    probe_batch_size=1,
):
    """Steps 1 and 3 of `calibrate`: acceptance per (depth, rank) from probe decoding (`probe_batch_size`
    prompts at a time: at T=0 every row decodes as it would alone, so the counts are the same), the drafting
    cost per tree shape (one row; not measured when `measure` is False), and the search grid (budgets below
    `max_size`)."""
    limits = make_drafter(heads, model, 1).limits()
    if limits.dynamic:
        depth = min(max_depth, limits.max_depth or max_depth)
        probe: TreeBuffers | DynamicTree = DynamicTree(depth=depth, top_k=max_top_k, total_tokens=48)
    else:
        probe = build_tree([(0,) * d + (r,) for d in range(limits.max_depth) for r in range(max_top_k)])
    runs: list = []
    for start in range(0, len(prompts), max(probe_batch_size, 1)):
        chunk = [ids.reshape(-1) for ids in prompts[start : start + max(probe_batch_size, 1)]]
        ids, mask = left_padded(chunk, 0)
        mask = mask if len(chunk) > 1 else None
        runs.append(
            generate(model, ids, heads, max_new_tokens=max_new_tokens, tree=probe, attention_mask=mask)
        )
    acceptance = rank_acceptance(runs)
    context = prompts[0]

    def measure_propose(tree) -> float:
        spec = tree if isinstance(tree, DynamicTree) else build_tree(tree)
        return measure_propose_cost(model, heads, context, [spec], repeats)[0]

    depths = range(1, min(max_depth, len(acceptance)) + 1)
    top_ks = range(1, max_top_k + 1)
    budgets = range(1, max_size)
    if not measure:
        propose_cost = None
    elif not limits.block:  # level by level: one measurement per (depth, top_k) shape, at the largest budget
        by_shape = {(d, k): measure_propose(DynamicTree(d, k, budgets[-1])) for d in depths for k in top_ks}

        def propose_cost(n: int, d: int, k: int) -> float:
            return by_shape[(d, k)]
    else:  # a block drafter: one forward drafts every level, whatever the tree
        block_seconds = measure_propose([(0,)])

        def propose_cost(n: int, d: int, k: int) -> float:
            return block_seconds

    grid = {"dynamic": limits.dynamic, "budgets": budgets, "depths": depths, "top_ks": top_ks}
    return acceptance, propose_cost, measure_propose, grid


@dataclass
class BatchCalibration:
    """What `calibrate_batches` measured: acceptance, C_T(B, n), drafting costs per (B, tree shape), and the
    policies they give."""

    acceptance: list[list[float]]  # a[d-1][r], from `rank_acceptance`
    verify_cost: dict[
        int, dict[int, float]
    ]  # {B: {n: seconds of one verify forward over B rows of n tokens}}
    drafting: dict[int, dict[tuple[int, int], float]]  # {B: {(depth, top_k): seconds}}; Medusa: key (0, 0)
    grid: dict  # the search grid: dynamic, budgets, depths, top_ks

    def propose_cost(self, batch: int, n: int, d: int, k: int) -> float:
        return self.drafting[batch][(d, k) if self.grid["dynamic"] else (0, 0)]

    @functools.cached_property
    def choices(self) -> dict[int, BatchChoice]:
        """Per measured batch size, the best tree or plain decoding (`decode.sizing.batch_policy`);
        `functools.partial(decode.sizing.policy_tree, choices)` is the fixed per-step policy."""
        return batch_policy(self.acceptance, self.verify_cost, self.propose_cost, **self.grid)

    def adaptive(self, **kwargs) -> AdaptivePolicy:
        """A fresh `decode.sizing.AdaptivePolicy` from these measurements (one per decode: it learns its
        batch); `kwargs`: its prior_weight, decay, refit_every, probe_every, time_prior."""
        return AdaptivePolicy(self.acceptance, self.verify_cost, self.propose_cost, **self.grid, **kwargs)


@torch.no_grad()
def calibrate_batches(
    model: nn.Module,
    heads: nn.Module,
    prompts: Sequence[torch.Tensor],
    batch_sizes: Sequence[int],
    *,
    max_new_tokens: int = 64,
    verify_sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24),
    max_depth: int = 6,
    max_top_k: int = 4,
    repeats: int = 3,
    probe_batch_size: int = 8,
) -> BatchCalibration:
    """`calibrate` with the batch dimension: acceptance as there (the probe prompts decoded
    `probe_batch_size` at a time), C_T(B, n) measured per batch size (`measure_batch_verify_cost`), and the
    drafting cost of B rows drafting together per tree shape (`measure_propose_cost`, `batch=B`). Its
    `choices` are
    `decode.sizing.batch_policy`'s pick per batch size; `adaptive()` makes a policy that also follows the
    acceptance of the batch it decodes."""
    _check_search(verify_sizes, max_depth, max_top_k, repeats)
    acceptance, _, _, grid = _draft_model(
        model,
        heads,
        prompts,
        max_new_tokens,
        max(verify_sizes),
        max_depth,
        max_top_k,
        repeats,
        measure=False,
        probe_batch_size=probe_batch_size,
    )
    costs = measure_batch_verify_cost(model, prompts[0], batch_sizes, verify_sizes, repeats)
    # drafting cost per batch size and tree shape, the rows drafting together as `generate` drafts them
    budget = grid["budgets"][-1]
    if grid["dynamic"]:
        shapes = [(d, k) for d in grid["depths"] for k in grid["top_ks"]]
        trees = [DynamicTree(d, k, budget) for d, k in shapes]
    else:
        shapes, trees = [(0, 0)], [build_tree([(0,)])]
    drafting = {
        b: dict(zip(shapes, measure_propose_cost(model, heads, prompts[0], trees, repeats, batch=b)))
        for b in batch_sizes
    }
    return BatchCalibration(acceptance, costs, drafting, grid)


@dataclass(frozen=True)
class BudgetChoice:
    """One `BestFirstTree` budget priced on this machine: measured tau, measured costs, predicted speed."""

    budget: int
    tau: float  # tokens per verify pass on the calibration prompts (greedy, pooled), bonus token included
    verify_seconds: float  # C_T(budget + 1)
    propose_seconds: float  # the block drafter's work per step with this tree
    plain_seconds: float  # C_T(1): plain decoding's cost per token

    @property
    def predicted_speedup(self) -> float:
        return self.tau * self.plain_seconds / (self.verify_seconds + self.propose_seconds)


@torch.no_grad()
def size_best_first(
    model: nn.Module,
    heads,
    prompts: Sequence[torch.Tensor],
    *,
    budgets: Sequence[int] = (2, 4, 6, 8, 12, 16, 24, 32),
    max_new_tokens: int = 64,
    repeats: int = 3,
) -> list[BudgetChoice]:
    """The budget of a block drafter's DDTree (`BestFirstTree`) on this machine, best first.

    A best-first tree follows the draft's confidence step by step, so its acceptance is measured, not
    modelled: the calibration `prompts` are decoded greedily with every budget (tau per budget). The costs are
    measured as `calibrate` measures them: C_T(n) the target's verify forward over n tokens, and the drafter's
    step (its advance and one proposal of that tree). Predicted speedup = tau * C_T(1) / (C_T(budget + 1) +
    C_P(budget)), what `scripts/bench.py --size-tree` decodes with at its best.
    """
    if not make_drafter(heads, model, 1).limits().block:
        raise ValueError("size_best_first sizes block drafters' trees; this drafter drafts level by level")
    taus = {}
    for budget in budgets:
        tokens = steps = 0
        for ids in prompts:
            out = generate(
                model, ids.reshape(1, -1), heads, max_new_tokens=max_new_tokens, tree=BestFirstTree(budget)
            )
            # the first token comes from the prefill, not a verify pass (tau as `generate` and bench.md say)
            tokens, steps = tokens + max(out.one.new_tokens - 1, 0), steps + out.one.steps
        taus[budget] = tokens / steps if steps else 1.0
    verify = measure_verify_cost(model, prompts[0], sorted({1, *(b + 1 for b in budgets)}), repeats)
    propose = measure_propose_cost(model, heads, prompts[0], [BestFirstTree(b) for b in budgets], repeats)
    choices = [
        BudgetChoice(b, taus[b], verify[b + 1], cost, verify[1])
        for b, cost in zip(budgets, propose, strict=True)
    ]
    return sorted(choices, key=lambda c: -c.predicted_speedup)
