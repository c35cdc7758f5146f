"""Tests for decode/calibrate.py: what the timing harness runs (which sizes and trees, in which order, packed
how), never how long it took: wall-clock comparisons flake on a shared machine."""

import copy
import importlib

import pytest
import torch

from decode.calibrate import measure_propose_cost, measure_verify_cost
from decode.layout import can_pack, pack_linears, packed_rows, pretranspose_linears
from decode.tree import build_tree
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads

calibrate_module = importlib.import_module("decode.calibrate")  # `decode.calibrate` is the function
PROMPT = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))


def _spy_forward(model, seen: list, packed: bool = False) -> None:
    """Record the row count (and the packing then) of every forward of `model`."""
    original = model.forward

    def spy(*args, **kwargs):
        rows = kwargs["input_ids"].shape[1]
        seen.append((rows, packed_rows(model)) if packed else rows)
        return original(*args, **kwargs)

    model.forward = spy


def test_verify_costs_are_timed_in_interleaved_rounds_and_made_monotone(build_target):
    model = copy.deepcopy(build_target("llama"))
    context = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    _spy_forward(model, seen)
    costs = measure_verify_cost(model, context, [1, 2, 6], repeats=3)
    # prefill, then per round every size once (a warm-up pass and a timed pass): a slow spell hits all sizes
    assert seen == [16] + [1, 1, 2, 2, 6, 6] * 3
    assert set(costs) == {1, 2, 6} and all(c > 0 for c in costs.values())
    assert costs[1] <= costs[2] <= costs[6]  # `monotone_costs`: padding to a larger size is always allowed


@pytest.mark.skipif(not can_pack(), reason="this torch build has no MKL packed sgemm")
def test_verify_cost_is_measured_packed_and_leaves_the_packing_as_it_was(build_target):
    target = copy.deepcopy(build_target("llama"))
    pretranspose_linears(target)
    pack_linears(target, 7)
    seen = []
    _spy_forward(target, seen, packed=True)
    measure_verify_cost(target, PROMPT, [1, 3, 5], repeats=1)
    assert {rows: packed for rows, packed in seen[1:]} == {1: None, 3: 3, 5: 5}
    assert packed_rows(target) == 7


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_propose_cost_times_one_drafting_step_per_tree(build_target, kind, monkeypatch):
    model = build_target("llama")
    context = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    if kind == "medusa":
        heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=3)).eval()
    else:
        heads = EagleHead(EagleConfig.from_target(model.config, "eagle3", draft_vocab_size=64)).eval()
        heads.set_draft_vocab(torch.randperm(128)[:64])
    calls = []  # ("advance", rows) and ("expand", depth), in order
    real = calibrate_module.make_drafter

    def spy_drafter(heads, model, batch):
        assert batch == 1
        drafter = real(heads, model, batch)
        advance, expand = drafter.advance, drafter.expand

        def spy_advance(features, tokens):
            (row,) = tokens
            calls.append(("advance", row.numel()))
            return advance(features, tokens)

        def spy_expand(*args):
            calls.append(("expand", args[-1]))
            return expand(*args)

        drafter.advance, drafter.expand = spy_advance, spy_expand
        return drafter

    monkeypatch.setattr(calibrate_module, "make_drafter", spy_drafter)
    shallow, deep = build_tree([(0,)]), build_tree([(0,), (0, 0), (0, 0, 0)])
    times = measure_propose_cost(model, heads, context, [shallow, deep], repeats=3, advance_tokens=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    # the context minus the 2 newest positions, then per timed call (a warm-up + 3 repeats, per tree): 2 newly
    # accepted positions, then one draft expansion per level below the first
    step = {"shallow": [("advance", 2)], "deep": [("advance", 2), ("expand", 1), ("expand", 2)]}
    assert calls == [("advance", 30)] + step["shallow"] * 4 + step["deep"] * 4


def test_acceptance_pools_the_rows_of_a_batched_run_as_separate_runs(build_target, rank_oracle):
    """`rank_acceptance` over one batched run equals it over each prompt decoded alone (T=0, drafters that
    accept at known rates): what lets the calibration probes decode in batches."""
    from decode import generate
    from decode.batch import left_padded
    from decode.sizing import rank_acceptance
    from decode.tree import DynamicTree

    model = build_target("llama")
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (6, 3, 9)]
    plains = [
        generate(model, p, None, max_new_tokens=30, eos_token_id=[]).one.sequences[0].tolist()
        for p in prompts
    ]

    def oracles():
        return [rank_oracle(seq, 128, [0.6, 0.2], seed=row) for row, seq in enumerate(plains)]

    tree = DynamicTree(depth=3, top_k=2, total_tokens=6)
    ids, mask = left_padded(prompts, 0)
    batched = generate(
        model, ids, oracles(), attention_mask=mask, max_new_tokens=20, eos_token_id=[], tree=tree
    )
    alone = [
        generate(model, p, drafter, max_new_tokens=20, eos_token_id=[], tree=tree)
        for p, drafter in zip(prompts, oracles())
    ]
    rates = rank_acceptance([batched])
    assert rates == rank_acceptance(alone) and 0.3 < rates[0][0] < 0.9


def test_batch_calibration_probes_in_batches_and_makes_both_policies(build_target, monkeypatch):
    """The probes decode `probe_batch_size` prompts per `generate` call (that the pooled acceptance is then
    the same is `test_acceptance_pools_the_rows_of_a_batched_run_as_separate_runs`, with drafts accepted:
    this random head's are not), and both policies come out of one calibration."""
    from decode.calibrate import calibrate_batches
    from decode.sizing import AdaptivePolicy

    model = build_target("qwen2")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(model.config, "eagle3")).eval()
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 128, (1, n), generator=generator) for n in (5, 7, 4)]
    kwargs = {"max_new_tokens": 6, "verify_sizes": (1, 2, 4), "max_depth": 2, "max_top_k": 2, "repeats": 1}
    rows, real = [], calibrate_module.generate

    def spy(model, ids, *args, **kw):
        rows.append((ids.shape[0], kw.get("attention_mask") is not None))
        return real(model, ids, *args, **kw)

    monkeypatch.setattr(calibrate_module, "generate", spy)
    one = calibrate_batches(model, head, prompts, [1, 2], probe_batch_size=1, **kwargs)
    assert rows == [(1, False)] * 3
    rows.clear()
    three = calibrate_batches(model, head, prompts, [1, 2], probe_batch_size=3, **kwargs)
    assert rows == [(3, True)]  # one left-padded batch of the three prompts
    assert one.acceptance == three.acceptance
    assert sorted(three.verify_cost) == [1, 2] and sorted(three.drafting) == [1, 2]
    assert sorted(three.choices) == [1, 2]
    policy = three.adaptive(probe_every=0)
    assert isinstance(policy, AdaptivePolicy) and policy.probe_every == 0 and policy is not three.adaptive()
    assert policy.tree(2) == three.choices[2].tree  # it starts where the fixed policy is


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"verify_sizes": (1,)}, "and a larger size"),  # nothing to search: it raised IndexError
        ({"verify_sizes": (2, 4)}, "must include 1"),
        ({"max_depth": 0}, "max_depth must be >= 1"),
        ({"max_top_k": 0}, "max_top_k must be >= 1"),
        ({"repeats": 0}, "repeats must be >= 1"),
    ],
)
def test_a_calibration_that_would_search_nothing_is_refused(build_target, bad, message):
    from decode.calibrate import calibrate, calibrate_batches

    model = build_target("llama")
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=2)).eval()
    with pytest.raises(ValueError, match=message):
        calibrate(model, heads, [PROMPT], **bad)
    with pytest.raises(ValueError, match=message):
        calibrate_batches(model, heads, [PROMPT], [1], **bad)


@pytest.mark.parametrize("advance", [0, -3])
def test_a_drafting_cost_over_no_new_positions_is_refused(build_target, advance):
    # -3 timed an advance of 29 positions per step (the slices [-keep:] / [:-keep]), 0 raised IndexError
    model = build_target("llama")
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=2)).eval()
    with pytest.raises(ValueError, match="advance_tokens and repeats must be >= 1"):
        measure_propose_cost(model, heads, PROMPT, [build_tree([(0,)])], advance_tokens=advance)
