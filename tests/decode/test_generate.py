"""Tests for decode/generate.py: greedy speculative decoding equals plain decoding token for token, stops
where plain decoding stops, and reports consistent statistics (argument checks: test_generate_inputs.py).

Random heads are almost never accepted, so an ORACLE drafter (it knows the plain greedy continuation and ranks
the true next token 1st, 2nd or 3rd at random) drives long, branching accepted paths through the same loop.
"""

import copy
import functools
import importlib

import pytest
import torch
from torch import nn

from decode import DEFAULT_EAGLE_TREE, DEFAULT_TREES, DynamicTree, generate
from decode.drafter import Drafter
from decode.drafters.model import DraftModel
from decode.tree import SAMPLING_CHAIN, chain
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads

PROMPT = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
T, N, V = PROMPT.shape[1], 64, 128
TREES = {
    "chain3": [(0,), (0, 0), (0, 0, 0)],
    "branch5": [(0,), (1,), (0, 0), (1, 0), (0, 1)],
    "tree8": "tree8",
    "dynamic338": DynamicTree(depth=3, top_k=3, total_tokens=8),
    "dynamic426": DynamicTree(depth=4, top_k=2, total_tokens=6),
    # the oracle's top three draft probabilities are about 0.67, 0.24 and 0.09: a bound of 0.2 keeps its first
    # two children, the first child's first child (0.44) and so on down the first choices, to depth 3 (0.30)
    "bounded": DynamicTree(depth=6, top_k=3, total_tokens=20, min_prob=0.2),
}
BRANCHING_TREES = ["branch5", "tree8", "dynamic338", "dynamic426", "bounded"]
# `decode.generate` is the function (re-exported by decode/__init__.py), so fetch the module itself
generate_module = importlib.import_module("decode.generate")
# tree8 is 4 deep; the Medusa heads draft 3
GRID = [
    (kind, tree)
    for kind in ("medusa", "eagle1", "eagle3")
    for tree in TREES
    if (kind, tree) != ("medusa", "tree8")
]


def _random_heads(kind: str, model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    if kind == "medusa":
        return MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=V, num_heads=3)).eval()
    head = EagleHead(
        EagleConfig.from_target(model.config, kind, **({"draft_vocab_size": 64} if kind == "eagle3" else {}))
    )
    if kind == "eagle3":
        head.set_draft_vocab(torch.randperm(V)[:64])
    return head.eval()


@functools.cache
def _reference(model: nn.Module) -> tuple[list[int], torch.Tensor]:
    """Plain greedy prompt + continuation (with slack past N for overshooting steps) and its final hidden
    states."""
    sequence = generate(model, PROMPT, max_new_tokens=N + 8).one.sequences
    with torch.no_grad():
        hidden = model(sequence, output_hidden_states=True).hidden_states[-1][0]  # (T + N + 8, H)
    return sequence[0].tolist(), hidden


@pytest.fixture
def oracle(rank_oracle):
    """`oracle(model, seed)`: ranks the true next token 1st, 2nd or 3rd uniformly; checks the features it is
    fed."""

    def build(model: nn.Module, seed: int = 0) -> Drafter:
        sequence, features = _reference(model)
        return rank_oracle(sequence, V, [1 / 3, 1 / 3, 1 / 3], seed=seed, features=features)

    return build


def _plain_ids(model: nn.Module, n: int = N) -> list[int]:
    return _reference(model)[0][: T + n]


# ---- lossless greedy: random heads
# --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, tree", GRID, ids=[f"{k}-{t}" for k, t in GRID])
def test_greedy_random_heads_equal_plain(tiny_target, kind, tree):
    out = generate(
        tiny_target, PROMPT, _random_heads(kind, tiny_target), max_new_tokens=N, tree=TREES[tree]
    ).one
    assert out.sequences[0].tolist() == _plain_ids(tiny_target)
    assert out.new_tokens == N and out.tau >= 1.0 and out.steps == out.target_forwards - 1


def test_plain_equals_transformers_generate(any_target):
    plain = generate(any_target, PROMPT, max_new_tokens=N).one
    assert plain.sequences[0].tolist() == _plain_ids(any_target)
    hf = any_target.generate(
        PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=N, do_sample=False, pad_token_id=0
    )
    assert hf[0].tolist() == _plain_ids(any_target)


def _spy_on_compaction(monkeypatch) -> list[list[int]]:
    """Record the accepted node path of every verify step (what `compact_cache` keeps)."""
    kept_paths = []
    compact = importlib.import_module("decode.verify").compact_cache
    monkeypatch.setattr(
        importlib.import_module("decode.batch"),
        "compact_cache",
        lambda cache, past, keep, *index: (kept_paths.append(list(keep)), compact(cache, past, keep, *index)),
    )
    return kept_paths


# ---- oracle drafter: long, branching accepted paths --------------------------------------------------


@pytest.mark.parametrize("tree", BRANCHING_TREES)
def test_oracle_drafts_are_accepted_and_output_is_plain(any_target, tree, monkeypatch, oracle):
    plain = _plain_ids(any_target)  # before the spy: the reference's own decoding would be counted
    kept_paths = _spy_on_compaction(monkeypatch)
    out = generate(any_target, PROMPT, oracle(any_target), max_new_tokens=N, tree=TREES[tree]).one
    assert out.sequences[0].tolist() == plain
    assert out.tau > 1.5, out
    assert len(out.accepted_per_depth) >= 2 and min(out.accepted_per_depth[:2]) > 0, out.accepted_per_depth
    assert any(keep != list(range(len(keep))) for keep in kept_paths)  # some accepted path left the chain
    assert len(kept_paths) == out.steps
    assert out.tau == pytest.approx((N - 1) / out.steps)


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 0.01}], ids=str)
def test_typical_acceptance_samples_from_the_filtered_target(build_target, oracle, filters):
    """top-k 1 (or a tiny top-p) leaves one token per step: typical acceptance must then decode greedily,
    accepting the oracle's true drafts; dropping the filter would sample at temperature 1 instead."""
    model = build_target("llama")
    out = generate(
        model,
        PROMPT,
        oracle(model),
        max_new_tokens=N,
        temperature=1.0,
        acceptance="typical",
        seed=0,
        tree=DEFAULT_EAGLE_TREE,  # the oracle ranks the truth 1st to 3rd: a tree, not the sampling chain
        **filters,
    ).one
    assert out.sequences[0].tolist() == _plain_ids(model) and out.tau > 1.5


# ---- EOS and max_new_tokens -------------------------------------------------------------------------


def _eos_step(model: nn.Module) -> int:
    """The latest step < 40 at which plain decoding emits a token for the first time."""
    new = _reference(model)[0][T:]
    return max(j for j in range(40) if new[j] not in new[:j])


@pytest.mark.parametrize("heads", ["plain", "eagle1", "oracle"])
def test_eos_stops_where_plain_decoding_stops(any_target, heads, oracle):
    j = _eos_step(any_target)
    eos = _plain_ids(any_target)[T + j]
    drafter = {
        "plain": None,
        "eagle1": _random_heads("eagle1", any_target),
        "oracle": oracle(any_target),
    }[heads]
    out = generate(any_target, PROMPT, drafter, max_new_tokens=N, eos_token_id=eos, tree=TREES["branch5"]).one
    assert out.sequences[0].tolist() == _plain_ids(any_target, j + 1)
    assert out.new_tokens == j + 1 and out.stopped_at_eos


def test_eos_list_and_generation_config(build_target, oracle):
    model = build_target("qwen2")
    j = _eos_step(model)
    eos = _plain_ids(model)[T + j]
    out = generate(model, PROMPT, oracle(model), max_new_tokens=N, eos_token_id=[999, eos], tree="tree8").one
    assert out.sequences[0].tolist() == _plain_ids(model, j + 1) and out.stopped_at_eos
    # the fixture cleared generation_config's EOS, so no stop without eos_token_id
    assert generate(model, PROMPT, max_new_tokens=N).one.new_tokens == N


def test_eos_inside_an_accepted_path_stops_decoding(build_target, monkeypatch, oracle):
    model = build_target("llama")
    j = _eos_step(model)
    eos = _plain_ids(model)[T + j]
    for seed in range(4):  # seed 0 accepts the EOS as a draft token with more drafts after it
        kept_paths = _spy_on_compaction(monkeypatch)
        out = generate(
            model,
            PROMPT,
            oracle(model, seed),
            max_new_tokens=N,
            eos_token_id=eos,
            tree=TREES["branch5"],
        ).one
        assert out.new_tokens == j + 1
        # the last verify step must be the one that emitted the EOS (each step emits accepted + bonus)
        emitted_before_last_step = 1 + sum(len(keep) for keep in kept_paths[:-1])
        assert emitted_before_last_step < j + 1, f"seed {seed}: {len(kept_paths)} steps, EOS came earlier"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13])
def test_max_new_tokens_is_exact(build_target, max_new_tokens, oracle):
    model = build_target("qwen2")
    out = generate(model, PROMPT, oracle(model), max_new_tokens=max_new_tokens, tree=TREES["tree8"]).one
    assert out.new_tokens == max_new_tokens
    assert out.sequences[0].tolist() == _plain_ids(model, max_new_tokens)
    assert not out.stopped_at_eos


# ---- statistics -------------------------------------------------------------------------------------


def test_plain_statistics(build_target):
    out = generate(build_target("llama"), PROMPT, max_new_tokens=20).one
    assert out.tau == 1.0 and out.steps == out.new_tokens - 1 == 19 and out.target_forwards == 20
    assert out.accepted_per_depth == [] and out.acceptance_rates() == []
    assert out.accepted_ranks == [] and out.draft_nodes == 0
    assert out.seconds > 0 and out.tokens_per_second == pytest.approx(20 / out.seconds)


def test_acceptance_rates_count_only_steps_that_offered_a_draft(build_target):
    """The target drafting for itself (a `DraftModel` copy) on a chain of 2 accepts every draft; a policy that
    decodes every other step plainly offers none then, which must not lower the rates (it read 0.53)."""
    model = build_target("llama")
    draft = DraftModel(copy.deepcopy(model))
    chain = [(0,), (0, 0)]
    fixed = generate(model, PROMPT, draft, max_new_tokens=40, tree=chain).one
    calls = []

    def every_other(rows):
        calls.append(rows)
        return chain if len(calls) % 2 else None

    mixed = generate(model, PROMPT, draft, max_new_tokens=40, tree=every_other).one
    assert mixed.steps > mixed.offered_ranks[0][0] > 0  # plain steps were taken
    assert fixed.acceptance_rates() == mixed.acceptance_rates() == [1.0, 1.0]
    assert mixed.accepted_per_depth == [mixed.offered_ranks[0][0]] * 2


def test_a_min_prob_bound_sizes_each_step_by_the_drafts_confidence(build_target, monkeypatch, oracle):
    """Steps where the oracle drafts off the true path (its children are then flat: nothing reaches 0.2)
    verify fewer nodes than confident ones; never more than the four the bound allows, never nodes past depth
    3; the output is plain decoding's."""
    model = build_target("qwen2")
    sizes = []
    propose = generate_module.propose
    monkeypatch.setattr(
        generate_module,
        "propose",
        lambda *a, **k: (sizes.append(len((trees := propose(*a, **k))[0])), trees)[1],
    )
    out = generate(model, PROMPT, oracle(model, seed=2), max_new_tokens=N, tree=TREES["bounded"]).one
    assert out.sequences[0].tolist() == _plain_ids(model)
    assert len(sizes) == out.steps and out.draft_nodes == sum(sizes) - out.steps
    assert max(sizes) == 5 and min(sizes) < 5  # root + 0.67, 0.24, 0.44, 0.30 when confident
    assert len(out.accepted_per_depth) <= 3 and out.tau > 1.3


def test_sampling_drafts_a_chain_by_default_and_greedy_the_cpu_tree(build_target):
    """No tree given: a chain of SAMPLING_CHAIN drafts every step when sampling (the same draws as passing
    that chain), DEFAULT_EAGLE_TREE's nodes when greedy."""
    model = build_target("llama")
    head = _random_heads("eagle3", model)
    sampled = generate(model, PROMPT, head, max_new_tokens=N, temperature=1.0, seed=3).one
    assert sampled.draft_nodes == sampled.steps * SAMPLING_CHAIN
    assert [len(ranks) for ranks in sampled.offered_ranks] == [1] * len(sampled.offered_ranks)
    assert 1 <= len(sampled.offered_ranks) <= SAMPLING_CHAIN
    chained = generate(
        model, PROMPT, head, max_new_tokens=N, temperature=1.0, seed=3, tree=chain(SAMPLING_CHAIN)
    ).one
    assert chained.sequences.tolist() == sampled.sequences.tolist() and chained.steps == sampled.steps
    greedy = generate(model, PROMPT, head, max_new_tokens=N).one
    assert greedy.draft_nodes == greedy.steps * DEFAULT_EAGLE_TREE.total_tokens


@pytest.mark.parametrize("tree", ["tree8", "dynamic338"])
def test_acceptance_rates(build_target, tree, oracle):
    model = build_target("gemma2")
    out = generate(model, PROMPT, oracle(model, seed=1), max_new_tokens=N, tree=TREES[tree]).one
    rates = out.acceptance_rates()
    assert len(rates) == len(out.accepted_per_depth) >= 2
    assert all(0.0 <= r <= 1.0 for r in rates)
    assert out.offered_ranks[0][0] == out.steps  # every step drafted: depth 1's rate is per step
    assert rates[0] == out.accepted_per_depth[0] / out.steps
    assert rates[1] == out.accepted_per_depth[1] / out.offered_ranks[1][0]
    assert out.offered_ranks[1][0] <= out.accepted_per_depth[0]  # an accepted leaf offers nothing below
    assert out.accepted_per_depth == sorted(out.accepted_per_depth, reverse=True)
    assert 0.3 < rates[0] <= 1.0
    # Accepted nodes split by sibling rank add up to the per-depth counts; each was offered first.
    assert [sum(ranks) for ranks in out.accepted_ranks] == out.accepted_per_depth
    for accepted, offered in zip(out.accepted_ranks, out.offered_ranks):
        assert all(a <= o for a, o in zip(accepted, offered)) and len(accepted) <= len(offered)
    if tree == "tree8":  # the root offers its children every step; deeper nodes only when their parent won
        root_children = sum(1 for p in DEFAULT_TREES["tree8"] if len(p) == 1)
        assert out.offered_ranks[0] == [out.steps] * root_children
    assert all(count >= 0 for ranks in out.accepted_ranks for count in ranks)
    if tree == "tree8":
        assert out.draft_nodes == out.steps * len(DEFAULT_TREES["tree8"])
    else:
        assert out.draft_nodes == out.steps * TREES[tree].total_tokens
