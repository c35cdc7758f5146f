"""Tests for decode/accept.py with stub logits: greedy acceptance, the target distribution, rejection
sampling, typical acceptance."""

import math

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decode.accept import accept_greedy, accept_sampling, accept_typical, target_probs
from decode.tree import DraftTree

V = 16


def _tree(tokens, parents, ranks=None, q_rows=None, q_table=None) -> DraftTree:
    ranks = ranks if ranks is not None else [0] * len(tokens)
    return DraftTree(
        torch.tensor(tokens),
        torch.tensor(parents),
        torch.tensor(ranks),
        None if q_rows is None else torch.tensor(q_rows),
        q_table,
    )


def _lists(result: tuple[torch.Tensor, torch.Tensor]) -> tuple[list[int], int]:
    """(path padded with -1, bonus) tensors as `generate` reads them: the path's nodes and the bonus token."""
    path, bonus = result
    return [node for node in path.tolist() if node >= 0], int(bonus)


def _argmax_logits(best: list[int]) -> torch.Tensor:
    """(N, V) logits whose argmax after node i is best[i]."""
    logits = torch.randn(len(best), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(best)), torch.tensor(best)] = 10.0
    return logits


CHAIN = {"tokens": [1, 2, 3, 4], "parents": [-1, 0, 1, 2]}  # root token 1, drafts 2, 3, 4


@pytest.mark.parametrize(
    "best, path, bonus",
    [
        ([2, 3, 4, 9], [0, 1, 2, 3], 9),  # all accepted: the bonus comes after the last draft
        ([7, 3, 4, 9], [0], 7),  # none accepted: plain decoding's token
        ([2, 8, 4, 9], [0, 1], 8),  # first accepted only
        ([2, 3, 11, 9], [0, 1, 2], 11),  # first two
    ],
)
def test_greedy_chain(best, path, bonus):
    assert _lists(accept_greedy(_tree(**CHAIN), _argmax_logits(best))) == (path, bonus)


# root 0 -> node 1 (token 5, rank 0), node 2 (token 7, rank 1); node 1 -> node 4 (11); node 2 -> node 3 (9)
BRANCHING = {"tokens": [0, 5, 7, 9, 11], "parents": [-1, 0, 0, 2, 1], "ranks": [0, 0, 1, 0, 0]}


@pytest.mark.parametrize(
    "best, path, bonus",
    [
        ([7, 11, 9, 3, 4], [0, 2, 3], 3),  # the second sibling is accepted, then its child
        ([5, 11, 9, 3, 4], [0, 1, 4], 4),  # the first sibling and its child
        ([7, 11, 6, 3, 4], [0, 2], 6),  # second sibling only: the bonus is the argmax after node 2
        ([9, 11, 9, 3, 4], [0], 9),  # 9 is in the tree, but not a child of the root
    ],
)
def test_greedy_branching(best, path, bonus):
    assert _lists(accept_greedy(_tree(**BRANCHING), _argmax_logits(best))) == (path, bonus)


def test_target_probs_temperature():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.0])
    expected = torch.tensor([math.exp(0.5), math.e, math.exp(1.5), 1.0])
    torch.testing.assert_close(target_probs(logits, 2.0), expected / expected.sum())
    torch.testing.assert_close(target_probs(logits, 1.0), torch.softmax(logits, -1))
    assert target_probs(logits.to(torch.bfloat16), 1.0).dtype == torch.float32


def test_target_probs_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    torch.testing.assert_close(target_probs(logits, 1.0, top_k=2), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(target_probs(logits, 1.0, top_k=1), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(target_probs(logits, 1.0, top_p=0.7), torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(
        target_probs(logits, 1.0, top_p=0.85), torch.tensor([0.0, 0.5, 0.15, 0.3]) / 0.95
    )
    torch.testing.assert_close(target_probs(logits, 1.0, top_p=0.3), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # top-k first, then top-p on the renormalised rest: 0.5/0.95, 0.3/0.95 = 0.842 >= 0.8 keeps two
    torch.testing.assert_close(
        target_probs(logits, 1.0, top_k=3, top_p=0.8), torch.tensor([0.0, 0.625, 0.0, 0.375])
    )


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.9), (0.8, 7, 0.6)]
)
def test_target_probs_match_transformers_warpers(temperature, top_k, top_p):
    """Plain sampling here and HF `generate(do_sample=True)` must draw from the same distribution."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    scores = TopPLogitsWarper(top_p)(None, scores) if top_p < 1 else scores
    torch.testing.assert_close(target_probs(logits, temperature, top_p, top_k), torch.softmax(scores, -1))


def _sampling_tree(child_tokens: list[int], q: torch.Tensor) -> DraftTree:
    """Root with children `child_tokens` (in draw order) drawn from q (V,)."""
    n = len(child_tokens)
    return _tree(
        [0] + child_tokens, [-1] + [0] * n, [0] + list(range(n)), q_rows=[0] + [-1] * n, q_table=q[None]
    )


def test_sampling_accepts_always_when_draft_equals_target():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen)  # after root, node 1, node 2 (a chain)
    p = target_probs(logits, 0.9)
    for seed in range(50):
        gen.manual_seed(seed)
        tokens = [
            int(torch.multinomial(p[0], 1, generator=gen)),
            int(torch.multinomial(p[1], 1, generator=gen)),
        ]
        tree = _tree([0] + tokens, [-1, 0, 1], q_rows=[0, 1, -1], q_table=p[:2].clone())
        path, bonus = _lists(accept_sampling(tree, logits, 0.9, 1.0, 0, gen))
        assert path == [0, 1, 2]
        assert 0 <= bonus < V


def test_sampling_rejects_zero_mass_tokens_and_samples_the_residual():
    logits = torch.full((2, V), -math.inf)
    logits[0, [1, 2]] = 0.0  # p = 0.5 on tokens 1 and 2, nothing on the draft token 0
    q = torch.zeros(V)
    q[[0, 1]] = 0.5  # residual max(0, p - q) = 0.5 on token 2 only
    for seed in range(40):
        path, bonus = _lists(
            accept_sampling(_sampling_tree([0], q), logits, 1.0, 1.0, 0, torch.Generator().manual_seed(seed))
        )
        assert (path, bonus) == ([0], 2)


def test_sampling_second_sibling_is_tested_against_the_residual():
    logits = torch.full((3, V), -math.inf)
    logits[0, [1, 2]] = 0.0  # p: tokens 1, 2 at 0.5
    q = torch.zeros(V)
    q[[0, 3]] = 0.5  # both siblings (0 then 3) have zero target mass
    bonuses = set()
    for seed in range(60):
        generator = torch.Generator().manual_seed(seed)
        path, bonus = _lists(accept_sampling(_sampling_tree([0, 3], q), logits, 1.0, 1.0, 0, generator))
        assert path == [0]
        bonuses.add(bonus)
    assert bonuses == {1, 2}  # sampled from normalize(max(0, p - q)) = p here, never 0 or 3


def test_a_sibling_slot_after_the_drafts_mass_is_spent_leaves_the_residual_alone():
    """Two siblings, the draft's whole mass on the first (token 0): the second was drawn from nothing and is
    never tested. After the first is rejected the bonus comes from max(0, p - q), which is 0 at token 0. The
    untested slot's scale was (p_mass / 0) * False = NaN, and the fallback for an empty residual then drew
    the bonus from the target's p again: token 0, just rejected, came back."""
    logits = torch.full((3, V), -math.inf)
    logits[0, [0, 1, 2]] = 0.0  # p: 1/3 on tokens 0, 1, 2
    q = torch.zeros(V)
    q[0] = 1.0
    bonuses = set()
    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        path, bonus = _lists(accept_sampling(_sampling_tree([0, 3], q), logits, 1.0, 1.0, 0, generator))
        if path == [0]:
            bonuses.add(bonus)
    assert bonuses == {1, 2}


def test_low_temperature_drafts_through_propose_sample_the_target_distribution():
    """The same end to end: `propose` draws two root children from a draft whose softmax at T = 0.05 is
    exactly one-hot in fp32, `accept_sampling` decides; the first emitted token must follow the target's
    distribution at that temperature (chi-square, 5 degrees of freedom, 99.9%: 20.5; it was 728)."""
    from decode.drafter import Drafter, DraftLimits
    from decode.propose import propose
    from decode.tree import build_tree

    vocab, temperature = 6, 0.05
    draft = torch.tensor([10.0, 0.0, 0.0, 0.0, 0.0, 0.0])

    class OneHot(Drafter):
        def limits(self):
            return DraftLimits()

        def root_logits(self):
            return draft[None]

        def expand(self, parents, tokens, depth):
            return draft[None, None].expand(1, tokens.shape[1], vocab)

    target = torch.tensor([0.0, 0.05, 0.0, 0.02, 0.0, 0.0])
    p = target_probs(target, temperature)
    spec, generator, n = build_tree([(0,), (1,)]), torch.Generator().manual_seed(0), 4000
    counts = torch.zeros(vocab)
    for _ in range(n):
        tree = propose(
            OneHot(), torch.tensor([0]), spec, temperature=temperature, generator=generator, vocab_size=vocab
        )[0]
        path, bonus = accept_sampling(
            tree, target[None].expand(len(tree), vocab), temperature, 1.0, 0, generator
        )
        nodes = [node for node in path.tolist()[1:] if node >= 0]
        counts[int(tree.tokens[nodes[0]]) if nodes else int(bonus)] += 1
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5, (counts / n).tolist()


def test_sampling_accept_rate_matches_min_one_p_over_q():
    logits = torch.log(torch.tensor([[0.2, 0.8] + [1e-30] * (V - 2)] * 2))
    q = torch.zeros(V)
    q[[0, 1]] = torch.tensor([0.8, 0.2])  # draft token 0 accepted with p/q = 0.25
    gen = torch.Generator().manual_seed(0)
    tree = _sampling_tree([0], q)
    outcomes = [_lists(accept_sampling(tree, logits, 1.0, 1.0, 0, gen)) for _ in range(2000)]
    accepted = sum(path == [0, 1] for path, _ in outcomes)
    assert 400 < accepted < 600  # 0.25 * 2000 = 500, 5 sigma ~ 97
    assert all(bonus == 1 for path, bonus in outcomes if path == [0])  # residual (0, 0.6) -> token 1 only


@pytest.mark.parametrize(
    "top_p, top_k, path, bonus",
    [
        (1.0, 0, [0, 1], 9),  # no filter: the child's p (0.24) is above the threshold (<= 0.09): typical
        (1.0, 1, [0], 3),  # top-k 1 keeps token 3 only: the child is not typical, and 3 is the bonus
        (0.2, 0, [0], 3),  # top-p 0.2: token 3 alone (p 0.30) reaches it
        (1.0, 2, [0, 1], 9),  # top-k 2 keeps tokens 3 and 5: the child stays typical
    ],
)
def test_typical_acceptance_applies_top_p_and_top_k(top_p, top_k, path, bonus):
    logits = torch.zeros(2, V)
    logits[0, 3], logits[0, 5] = 2.2, 2.0  # after the root: token 3 first, the drafted token 5 second
    logits[1, 9] = 100.0  # after the child: token 9, certainly
    tree = _tree([1, 5], [-1, 0])
    for seed in range(10):
        result = accept_typical(tree, logits, 1.0, top_p, top_k, torch.Generator().manual_seed(seed))
        assert _lists(result) == (path, bonus)
