"""Tests for decode/sizing.py: acceptance per (depth, rank) from generate's statistics, the best-first tree
and its expected tokens, and the cost-model search (the measurements feeding it: test_calibrate.py).

A rank oracle drafter (tests/conftest.py: it knows the plain greedy continuation and puts the true next token
at rank r with given probabilities) makes the acceptance model exact, so predicted E[tokens] can be checked
against measured tau.
"""

import itertools

import pytest
import torch

from decode import DynamicTree, generate
from decode.generate import GenerateOutput
from decode.sizing import best_tree, interpolate, monotone_costs, rank_acceptance, size_tree

PROMPT = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))


def _output(accepted, offered) -> GenerateOutput:
    return GenerateOutput(
        sequences=torch.zeros(1, 1),
        prompt_lengths=[1],
        new_tokens=[0],
        tau=[1.0],
        steps=[0],
        accepted_per_depth=[[]],
        accepted_ranks=[accepted],
        offered_ranks=[offered],
        draft_nodes=[0],
        stopped_at_eos=[False],
        target_forwards=1,
        seconds=0.0,
    )


def test_rank_acceptance_divides_accepted_by_offered_and_pools_runs():
    runs = [_output([[5, 1], [2, 1]], [[10, 10], [6, 4], [3]]), _output([[4]], [[10, 10], [4, 4]])]
    # depth 1: ranks 0/1 accepted 9/1 of 20 offers; depth 2: 2/1 of 10/8; depth 3: offered 3 times, never
    # taken
    assert rank_acceptance(runs) == [[0.45, 0.05], [0.2, 0.125], [0.0]]
    assert rank_acceptance([_output([], [])]) == []  # plain decoding measures nothing


def test_best_tree_takes_most_probable_nodes():
    expected, paths = best_tree([[0.6, 0.2], [0.5, 0.1]], budget=3)
    assert paths == [(0,), (1,), (0, 0)] and expected == pytest.approx(1 + 0.6 + 0.2 + 0.3)
    assert best_tree([[0.6, 0.2], [0.5, 0.1]], budget=3, top_k=1) == (
        pytest.approx(1 + 0.6 + 0.3),
        [(0,), (0, 0)],
    )
    assert best_tree([[0.6, 0.2], [0.5, 0.1]], budget=2, max_depth=1)[1] == [(0,), (1,)]
    assert best_tree([[0.6]], budget=0) == (1.0, [])
    with pytest.raises(ValueError, match="budget"):
        best_tree([[0.6]], budget=-1)


@pytest.mark.parametrize("alpha, k", [(0.5, 1), (0.7, 4), (0.9, 6)])
def test_chain_matches_closed_form(alpha, k):
    """docs/design.md, When speculation pays: a chain of k drafts with iid acceptance alpha yields
    (1 - alpha^(k+1)) / (1 - alpha)."""
    expected, paths = best_tree([[alpha]] * k, budget=k)
    assert paths == [(0,) * d for d in range(1, k + 1)]
    assert expected == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_best_tree_is_optimal_against_brute_force():
    acceptance = [[0.5, 0.3, 0.1], [0.6, 0.2], [0.4, 0.35]]
    all_nodes = [p for d in (1, 2, 3) for p in itertools.product(*(range(len(a)) for a in acceptance[:d]))]

    def value(nodes):
        return 1 + sum(torch.tensor([acceptance[i][r] for i, r in enumerate(p)]).prod().item() for p in nodes)

    for budget in (1, 3, 5):
        trees = [
            c for c in itertools.combinations(all_nodes, budget) if all(p[:-1] in c or len(p) == 1 for p in c)
        ]
        assert best_tree(acceptance, budget)[0] == pytest.approx(max(value(t) for t in trees))


def test_best_tree_keeps_sibling_ranks_consecutive_and_limits_expansion():
    # Rank 1 was never accepted but rank 2 was: a tree may not hold (2,) without (1,), so (2,) is unreachable.
    expected, paths = best_tree([[0.5, 0.0, 0.2], [0.5]], budget=3)
    assert paths == [(0,), (0, 0)] and expected == pytest.approx(1.75)
    # EAGLE-2 expands top_k nodes per level: with one expansion per level only (0,) gets children.
    acceptance = [[0.5, 0.4], [0.9, 0.05]]
    assert best_tree(acceptance, 4)[1] == [(0,), (1,), (0, 0), (1, 0)]
    assert best_tree(acceptance, 4, expand_per_level=1)[1] == [(0,), (1,), (0, 0), (0, 1)]


def test_interpolate():
    costs = {1: 10.0, 4: 16.0, 8: 20.0}
    assert interpolate(costs, 1) == 10.0 and interpolate(costs, 2) == 12.0 and interpolate(costs, 6) == 18.0
    assert interpolate(costs, 0) == 10.0 and interpolate(costs, 12) == 24.0  # flat below, last slope above
    assert interpolate({1: 0.05}, 2) == 0.05  # one measured size: flat (it raised IndexError)


def test_size_tree_trades_acceptance_against_cost():
    acceptance = [[0.8, 0.1], [0.8, 0.1], [0.8, 0.1], [0.8, 0.1]]
    grid = {"budgets": range(1, 9), "depths": range(1, 5), "top_ks": (1, 2)}
    # Flat verify cost, free drafting: the biggest, deepest tree wins.
    flat = size_tree(acceptance, {1: 1.0, 64: 1.0}, lambda n, d, k: 0.0, dynamic=True, **grid)
    assert flat[0].tree == DynamicTree(depth=4, top_k=2, total_tokens=8)
    # Every extra tree token costs as much as a target pass: no tree beats one draft token.
    steep = size_tree(acceptance, {1: 1.0, 65: 65.0}, lambda n, d, k: 0.0, dynamic=True, **grid)
    assert steep[0].draft_nodes == 1 and steep[0].expected_tokens == pytest.approx(1.8)
    # Each draft step costs half a target pass: depth stays shallow.
    slow_draft = size_tree(acceptance, {1: 1.0, 64: 1.0}, lambda n, d, k: 0.5 * d, dynamic=True, **grid)
    assert slow_draft[0].depth < 4
    for result in (flat, steep, slow_draft):
        speeds = [c.tokens_per_second for c in result]
        assert speeds == sorted(speeds, reverse=True)
        assert len({(c.draft_nodes, c.depth, c.top_k) for c in result}) == len(result)
    static = size_tree(acceptance, {1: 1.0, 64: 1.0}, lambda n, d, k: 0.0, dynamic=False, **grid)
    assert static[0].tree == tuple(best_tree(acceptance, 8, 4, 2)[1])


@pytest.mark.parametrize("tree", [[(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)], DynamicTree(3, 2, 6)])
def test_measured_acceptance_predicts_tau(build_target, rank_oracle, tree):
    """With a drafter whose rank probabilities are known, rank_acceptance recovers them and best_tree's
    E[tokens] for the tree used matches the measured tau."""
    model = build_target("llama")
    probs = [0.6, 0.25]
    sequence = generate(model, PROMPT, max_new_tokens=216).one.sequences[0].tolist()
    runs = [
        generate(model, PROMPT, rank_oracle(sequence, 128, probs, seed=s), max_new_tokens=200, tree=tree).one
        for s in range(3)
    ]
    acceptance = rank_acceptance(runs)
    assert len(acceptance) == 3
    for depth in range(2):  # depths 1-2 have both ranks in the tree; depth 3 rank 0 only
        assert acceptance[depth] == pytest.approx(probs, abs=0.08)
    tau = sum(r.new_tokens - 1 for r in runs) / sum(r.steps for r in runs)
    if isinstance(tree, list):
        predicted = 1 + sum(torch.tensor([probs[r] for r in p]).prod().item() for p in tree)
        assert best_tree([probs, probs, [probs[0]]], len(tree))[1] == sorted(tree, key=lambda p: (len(p), p))
        assert tau == pytest.approx(predicted, rel=0.08)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.01, 0.0])
def test_monotone_costs_refuse_a_cost_that_is_not_a_positive_time(bad):
    # a NaN at the largest size became inf, one elsewhere was replaced silently, a negative one was kept
    with pytest.raises(ValueError, match="finite and > 0"):
        monotone_costs({1: 0.05, 2: bad, 4: 0.06})


def test_a_dynamic_tree_is_priced_and_packed_for_the_nodes_its_levels_hold():
    """(depth 2, top_k 2) holds 2 + 4 = 6 draft nodes whatever its total_tokens asks: the cost model priced 8
    and `decode.prepare` packed the target for 9 rows where every verify passes 7."""
    from decode.calibrate import Calibration
    from decode.tree import verify_rows

    assert DynamicTree(2, 2, 8).nodes() == 6 and verify_rows(DynamicTree(2, 2, 8)) == 7
    assert DynamicTree(5, 4, 12).nodes() == 12 and verify_rows(DynamicTree(5, 4, 12)) == 13
    assert DynamicTree(4, 3, 30).nodes(max_depth=2) == 12 and verify_rows(DynamicTree(4, 3, 30), 2) == 13
    costs = {1: 0.01, 2: 0.011, 4: 0.012, 8: 0.016, 16: 0.024}
    calibration = Calibration([[0.5, 0.2], [0.5, 0.2], [0.5]], costs, [], lambda tree: 0.001)
    asked, holds = calibration.predict(DynamicTree(2, 2, 8)), calibration.predict(DynamicTree(2, 2, 6))
    assert asked == holds and asked["draft_nodes"] == 6
    assert asked["verify_seconds"] == pytest.approx(interpolate(costs, 7))
    shallow = Calibration([[0.5, 0.2], [0.5, 0.2], [0.5]], costs, [], lambda tree: 0.001, max_depth=1)
    one_level = shallow.predict(DynamicTree(3, 2, 8))  # a drafter of one level (e.g. one Medusa head)
    assert one_level["draft_nodes"] == 2 and one_level["depth"] == 1
    assert one_level["expected_tokens"] == pytest.approx(1 + 0.5 + 0.2)


def test_monotone_costs_pad_to_a_cheaper_larger_size():
    # a measured outlier at n=8 (a noisy spell) is capped by the cheaper larger size: pad 8 tokens to 12
    assert monotone_costs({1: 0.05, 4: 0.06, 8: 0.32, 12: 0.09, 16: 0.08}) == {
        1: 0.05,
        4: 0.06,
        8: 0.08,
        12: 0.08,
        16: 0.08,
    }


def test_batch_policy_speculates_while_verifying_is_cheap_and_stops_where_it_loses():
    """Verify cost flat in n at B = 1 (memory-bound) and linear in B x n at B = 16 (compute-bound): a tree at
    B = 1, plain decoding at B = 16; the policy maps every batch size to the nearest measured one below."""
    from decode.sizing import batch_policy, policy_tree

    acceptance = [[0.8, 0.1], [0.7, 0.1], [0.6]]
    flat = {n: 0.010 for n in (1, 2, 4, 8, 16)}
    linear = {n: 0.010 * 16 * n / 16 for n in (1, 2, 4, 8, 16)}  # B x n tokens at B = 16: cost grows with n
    choices = batch_policy(
        acceptance,
        {1: flat, 16: linear},
        lambda b, n, d, k: 0.0005 * d * (1 + b / 16),  # rows draft together: far below B single drafts
        dynamic=True,
        budgets=[2, 4, 8],
        depths=[1, 2, 3],
        top_ks=[1, 2],
    )
    assert choices[1].tree is not None and choices[1].speedup > 1.5
    assert choices[16].tree is None and choices[16].speedup == 1.0
    assert choices[16].plain_tokens_per_second == pytest.approx(16 / 0.010)
    assert policy_tree(choices, 4) == choices[1].tree and policy_tree(choices, 40) is None
    assert policy_tree(choices, 16) is None
    with pytest.raises(ValueError, match="no plain-decoding cost"):
        batch_policy(
            acceptance,
            {2: {4: 0.01}},
            lambda b, n, d, k: 0.0,
            dynamic=True,
            budgets=[2],
            depths=[1],
            top_ks=[1],
        )


def _adaptive(verify_cost=None, **kwargs):
    """A policy whose calibrated rates make a tree pay at B = 1 and 4 with the default costs (verifying 8
    tokens costs as 1)."""
    from decode.sizing import AdaptivePolicy

    flat = {n: 0.010 for n in (1, 2, 4, 8)}
    return AdaptivePolicy(
        [[0.8, 0.3], [0.8, 0.3], [0.8]],
        verify_cost or {1: flat, 4: flat},
        lambda b, n, d, k: 0.0005 * d,
        dynamic=True,
        budgets=range(1, 8),
        depths=[1, 2, 3],
        top_ks=[1, 2],
        **kwargs,
    )


def test_adaptive_policy_stops_speculating_when_its_batch_accepts_nothing_and_probes_back():
    policy = _adaptive(prior_weight=2.0, decay=1.0, refit_every=1, probe_every=3)
    first = policy.tree(4)
    assert first is not None and first == policy.choice(4).tree and policy.choice(4).speedup > 1.5
    rejected = [[0, 0]], [[4, 4]]  # 4 rows: each offered two depth-1 children, none taken
    policy.observe(*rejected)
    assert policy.rates()[0] == pytest.approx([2 * 0.8 / 6, 2 * 0.3 / 6])
    assert policy.rates()[1:] == [[0.8, 0.3], [0.8]]  # never offered: the calibrated rates
    for _ in range(20):
        policy.observe(*rejected)
    assert (
        policy.tree(4) is None and policy.tree(4) is None
    )  # speculation now loses for this batch: plain steps
    assert policy.tree(4) is not None  # every third plain step is a probe with the best tree it knows
    for _ in range(30):
        policy.observe([[4, 0], [4, 0], [4]], [[4, 4], [4, 4], [4]])  # the batch turned predictable
    assert policy.tree(3) is not None and policy.choice(3).speedup > 1.5  # 3 rows: batch size 1's costs
    assert policy.chosen[None] == 2 and sum(policy.chosen.values()) == 5


def test_adaptive_policy_refits_only_every_few_steps_and_refuses_bad_settings():
    policy = _adaptive(prior_weight=1.0, decay=0.5, refit_every=3)
    tree = policy.tree(1)
    for _ in range(2):
        policy.observe([[0, 0]], [[50, 50]])
    assert policy.tree(1) == tree  # two observed steps: not re-picked yet
    policy.observe([[0, 0]], [[50, 50]])
    assert policy.tree(1) is None
    for bad, message in (
        ({"prior_weight": 0.0}, "prior_weight must be > 0"),
        ({"decay": 1.5}, "decay must be in"),
        ({"refit_every": 0}, "refit_every must be >= 1"),
        ({"prior_weight": float("nan")}, "prior_weight must be > 0"),  # NaN passed `<= 0` checks
        ({"time_prior": float("nan")}, "time_prior must be > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            _adaptive(**bad)


def test_adaptive_policy_follows_what_its_steps_cost():
    """Calibration says plain decoding wins at B = 4 (verifying 2-8 tokens costs 4x one token); a probe's
    speculative step takes half its calibrated time, so the policy speculates from then on, until its
    speculative steps take 3x their calibrated time and it decodes plainly again. Without timing it never
    leaves plain decoding but for its probes."""
    costs = {1: 0.010, **{n: 0.040 for n in (2, 4, 8)}}
    settings = {"prior_weight": 1.0, "decay": 1.0, "refit_every": 1, "probe_every": 2}

    def policy(**kwargs):
        return _adaptive({4: costs}, **settings, **kwargs)

    timed = policy(time_prior=1.0)
    assert timed.tree(4) is None and timed.choice(4).speedup == pytest.approx(1.0)
    timed.record_time(0.010)  # a plain step as calibrated
    assert timed.time_scale("plain") == pytest.approx(1.0) and timed.time_scale("spec") == 1.0
    probe = timed.tree(4)  # every second plain step is a probe
    assert probe is not None
    _, best = timed._picked(4)
    predicted = best.verify_seconds + best.propose_seconds
    timed.observe([], [])  # the probe's counts (none here: the rates stay the calibrated ones)
    timed.record_time(0.5 * predicted)
    assert timed.time_scale("spec") == pytest.approx(0.75)
    assert timed.tree(4) == probe and timed.choice(4).speedup > 1.0  # speculation now pays
    timed.observe([], [])
    timed.record_time(3 * predicted)  # the speculative step turns slow
    timed.record_time(3 * predicted)  # no step handed out since: not counted
    assert timed.time_scale("spec") == pytest.approx((1 + 0.5 + 3) / 3)
    assert timed.tree(4) is None  # plain again
    assert timed.chosen[None] == 2 and timed.chosen[probe] == 2

    untimed = policy(time_prior=None)
    for step in range(6):
        tree = untimed.tree(4)
        assert (tree is None) == (step % 2 == 0)  # plain, then a probe, again and again
        untimed.observe([], [])
        untimed.record_time(0.1 if tree is not None else 0.010)
    assert untimed.time_scale("spec") == 1.0 and untimed.choice(4).tree is None
    with pytest.raises(ValueError, match="time_prior must be > 0"):
        policy(time_prior=0.0)


def test_adaptive_policy_decays_each_time_factor_by_its_own_steps():
    """A speculative step measured at 3x its calibrated time, then plain steps: the speculative factor keeps
    its evidence (plain runs must not bring back a speculation measured to lose), the plain one decays."""
    policy = _adaptive(prior_weight=1.0, decay=0.5, refit_every=1, probe_every=0, time_prior=1.0)
    assert policy.tree(4) is not None
    policy.record_time(3 * policy.handed[1])
    assert policy.time_scale("spec") == pytest.approx((1 + 3) / 2)
    for _ in range(3):
        policy.handed = ("plain", 0.010)
        policy.record_time(0.020)
    assert policy.time_scale("spec") == pytest.approx(2.0)
    weight = 1 + 0.5 + 0.25  # three plain steps at ratio 2, decaying by half per step
    assert policy.time_scale("plain") == pytest.approx((1 + 2 * weight) / (1 + weight))


def test_tally_ranks_counts_what_the_accepted_path_offered_and_took():
    from decode.accept import tally_ranks

    # root 0 -> children 1 (rank 0), 2 (rank 1); node 1 -> 3 (rank 0), 4 (rank 1); node 2 -> 5 (rank 0)
    parents, ranks = [-1, 0, 0, 1, 1, 2], [0, 0, 1, 0, 1, 0]
    accepted, offered = [], []
    tally_ranks(parents, ranks, [0, 1, 4], accepted, offered)
    assert offered == [[1, 1], [1, 1]] and accepted == [[1], [0, 1]]
    tally_ranks(parents, ranks, [0, 2], accepted, offered)  # rank 1 taken at depth 1, its child rejected
    assert offered == [[2, 2], [2, 1]] and accepted == [[1, 1], [0, 1]]
