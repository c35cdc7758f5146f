"""decode/fused.py: the fused draft step computes what `EagleHead.forward` computes (fp32, pretransposed,
packed, oneDNN and int8 layers; causal and tree masks; the cache it leaves), is rebuilt when the head changes,
and the EAGLE drafter proposes and decodes the same with it as with the module path."""

import copy

import pytest
import torch

from decode import generate
from decode.drafters.eagle import EagleDrafter
from decode.fused import FusedEagleStep, fused_step
from decode.layout import (
    can_int8,
    can_onednn,
    can_pack,
    is_onednn,
    onednn_linears,
    pack_linears,
    pretranspose_linears,
)
from decode.prepare import prepare, quantize_draft
from decode.propose import propose
from decode.tree import DynamicTree
from heads.eagle import DraftCache, EagleConfig, EagleHead, additive_mask

PROMPT = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))


def _head(target, kind: str) -> EagleHead:
    torch.manual_seed(0)
    overrides = {"draft_vocab_size": 64} if kind == "eagle3" else {}
    head = EagleHead(EagleConfig.from_target(target.config, kind, **overrides)).eval()
    if kind == "eagle3":
        head.set_draft_vocab(torch.randperm(128)[:64])
    for param in head.parameters():  # a trained-looking head: weights well away from their init
        param.data.add_(0.05 * torch.randn_like(param))
    return head


def _layout(head: EagleHead, layout: str, target) -> EagleHead:
    head = copy.deepcopy(head)
    if layout == "int8":
        if not can_int8():
            pytest.skip("no fbgemm kernels in this torch build")
        quantize_draft(head, target)
    elif layout in ("pretransposed", "packed"):
        pretranspose_linears(head, min_rows=2)
        if layout == "packed":
            if not can_pack():
                pytest.skip("no MKL packing in this torch build")
            pack_linears(head, 3)
    elif layout == "onednn":
        if not can_onednn():
            pytest.skip("no oneDNN linear kernels in this torch build")
        onednn_linears(head)
    return head


def _inputs(head: EagleHead, rows: int, start: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = head.config.hidden_size
    return (
        torch.randn(1, rows, h, generator=g),
        torch.randn(1, rows, h, generator=g),
        torch.arange(start, start + rows)[None],
    )


@pytest.mark.parametrize("layout", ["fp32", "pretransposed", "packed", "onednn", "int8"])
@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_fused_step_equals_the_module_forward(any_target, kind, layout):
    head = _layout(_head(any_target, kind), layout, any_target)
    if layout == "onednn":  # the stacked layers take the head's layout
        assert all(is_onednn(layer) for layer in fused_step(head).layers.values())
    step = fused_step(head)
    caches = DraftCache(), DraftCache()
    with torch.no_grad():
        prefix = _inputs(head, 5, 0, seed=1)  # causal (mask=None), as in `advance`
        torch.testing.assert_close(step(*prefix, caches[1]), head(*prefix, caches[0]), atol=1e-5, rtol=1e-5)
        # a tree level: 3 rows at one position, each sees the prefix, row 1 also row 0's cached entry
        tree = _inputs(head, 3, 5, seed=2)
        positions = torch.full((1, 3), 5)
        allowed = torch.ones(3, 8, dtype=torch.bool)
        allowed[:, 5:] = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
        mask = additive_mask(allowed, torch.float32)[None, None]
        ours = step(tree[0], tree[1], positions, caches[1], attention_mask=mask)
        theirs = head(tree[0], tree[1], positions, caches[0], attention_mask=mask)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1].keys, caches[0].keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1].values, caches[0].values, atol=1e-5, rtol=1e-5)
    assert len(caches[1]) == 8
    if layout == "int8":  # one int8 matrix for q/k/v (and gate/up), rows kept with their own scales
        assert isinstance(step.layers["qkv"], torch.ao.nn.quantized.dynamic.Linear)


def test_fused_step_is_cached_and_rebuilt_when_the_head_changes(build_target):
    target = build_target("llama")
    head = _head(target, "eagle3")
    step = fused_step(head)
    assert fused_step(head) is step
    assert "_selfspec_fused_step" not in "".join(head.state_dict())  # not part of the checkpoint
    x, e, positions = _inputs(head, 4, 0, seed=3)
    before = step(x, e, positions, DraftCache())
    with torch.no_grad():
        head.midlayer.mlp.up_proj.weight.mul_(2.0)  # an optimizer step, say: changes the weights in place
    rebuilt = fused_step(head)
    assert rebuilt is not step
    after = rebuilt(x, e, positions, DraftCache())
    with torch.no_grad():
        torch.testing.assert_close(after, head(x, e, positions, DraftCache()), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after, before)
    pretranspose_linears(head)  # a layout change rebuilds it too
    assert fused_step(head) is not rebuilt


@pytest.mark.parametrize("write", ["fused adamw", "through .data, then prepare"])
def test_fused_step_follows_writes_that_bump_no_version(build_target, write):
    """A fused optimizer step and a write through `.data` leave every version counter as it was; the stacked
    weights are taken again all the same (the first at once, the second at `decode.prepare`)."""
    target = build_target("llama")
    head = _head(target, "eagle3")
    x, e, positions = _inputs(head, 4, 0, seed=3)
    step = fused_step(head)
    versions = [p._version for p in head.parameters()]
    if write == "fused adamw":
        optimizer = torch.optim.AdamW(head.parameters(), lr=0.5, fused=True)
        with torch.enable_grad():
            head(x, e, positions, DraftCache()).square().mean().backward()
        optimizer.step()
    else:
        for param in head.parameters():
            param.data.mul_(1.5)
        prepare(copy.deepcopy(target), head, int8_draft=False)  # a copy: the shared target stays as it is
    assert [p._version for p in head.parameters()] == versions  # the counters saw nothing
    rebuilt = fused_step(head)
    assert rebuilt is not step
    with torch.no_grad():
        expected = head(x, e, positions, DraftCache())
        torch.testing.assert_close(rebuilt(x, e, positions, DraftCache()), expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(step(x, e, positions, DraftCache()), expected, atol=1e-3)


def test_fused_step_refuses_what_it_cannot_stack(build_target):
    head = _head(build_target("llama"), "eagle3")
    head.midlayer.self_attn.k_proj = torch.nn.Identity()
    with pytest.raises(TypeError, match=r"cannot stack \['Linear', 'Identity', 'Linear'\]"):
        FusedEagleStep(head)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_fused_and_module_drafters_propose_the_same_trees(build_target, kind, temperature):
    target = build_target("qwen2")
    head = _head(target, kind)
    features = torch.randn(6, 3 * 32 if kind == "eagle3" else 32)
    tokens = torch.randint(0, 128, (6,))
    trees = []
    for fused in (True, False):
        drafter = EagleDrafter(head, target, 1, fused=fused)
        drafter.advance([features], [tokens])
        (tree,) = propose(
            drafter,
            torch.tensor([11]),
            DynamicTree(depth=4, top_k=3, total_tokens=9),
            temperature=temperature,
            generator=torch.Generator().manual_seed(5),
            vocab_size=128,
        )
        trees.append(tree)
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
    assert trees[0].parents.tolist() == trees[1].parents.tolist()
    assert len(trees[0]) == 10
    if temperature:
        torch.testing.assert_close(trees[0].q_table, trees[1].q_table, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_greedy_decoding_with_the_module_path_equals_the_fused_path_and_plain(
    build_target, kind, monkeypatch
):
    import decode.drafters.eagle as propose_module

    target = build_target("mistral")
    head = _head(target, kind)
    plain = generate(target, PROMPT, max_new_tokens=24).one.sequences.tolist()
    fused = generate(target, PROMPT, head, max_new_tokens=24).one
    monkeypatch.setattr(propose_module, "fused_step", lambda head: head)  # the drafter then calls the module
    module = generate(target, PROMPT, head, max_new_tokens=24).one
    assert fused.sequences.tolist() == module.sequences.tolist() == plain
    assert fused.accepted_per_depth == module.accepted_per_depth and fused.steps == module.steps
