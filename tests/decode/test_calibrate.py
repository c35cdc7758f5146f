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

    def spy_drafter(heads, model):
        drafter = real(heads, model)
        advance, expand = drafter.advance, drafter.expand_batch

        def spy_advance(features, tokens):
            calls.append(("advance", tokens.numel()))
            return advance(features, tokens)

        def spy_expand(*args):
            calls.append(("expand", args[-1]))
            return expand(*args)

        drafter.advance, drafter.expand_batch = spy_advance, spy_expand
        return drafter

    monkeypatch.setattr(calibrate_module, "make_drafter", spy_drafter)
    shallow, deep = build_tree([(0,)]), build_tree([(0,), (0, 0), (0, 0, 0)])
    times = measure_propose_cost(model, heads, context, [shallow, deep], repeats=3, advance_tokens=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    # the context minus the 2 newest positions, then per timed call (a warm-up + 3 repeats, per tree): 2 newly
    # accepted positions, then one draft expansion per level below the first
    step = {"shallow": [("advance", 2)], "deep": [("advance", 2), ("expand", 1), ("expand", 2)]}
    assert calls == [("advance", 30)] + step["shallow"] * 4 + step["deep"] * 4
