"""decode/prepare.py: `prepare` readies a target and its heads on this CPU (int8 draft, oneDNN reordered
weights; or, with onednn=False, MKL pretransposed and packed weights), keeps greedy output that of plain
decoding, takes its copies again at every call, and changes nothing for a model off the CPU or not fp32; a
prepared model that is trained (a fused AdamW step), loaded or edited decodes as the unprepared model with
the same weights, and trains with every gradient; `quantize_draft` (int8 drafts) and `pack_for_tree`
(packing per tree)."""

import copy
import importlib

import numpy as np
import pytest
import torch
from torch import nn

from decode import DEFAULT_EAGLE_TREE, generate, prepare
from decode.drafters.composite import Composite
from decode.drafters.lm_head import DRAFT_LM_HEAD, draft_lm_head
from decode.drafters.model import DraftModel
from decode.drafters.ngram import Ngram, NgramDrafter
from decode.fused import fused_step
from decode.layout import (
    can_int8,
    can_onednn,
    can_pack,
    is_onednn,
    is_pretransposed,
    onednn_weight,
    packed_rows,
    packed_weight,
    pretranspose_linears,
    transposed_weight,
)
from decode.prepare import is_int8_draft, pack_for_tree, quantize_draft
from decode.tree import DEFAULT_MEDUSA_TREE, DEFAULT_TREES, DynamicTree, verify_rows
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads
from heads.peagle import PEagleConfig, PEagleHead
from targets.layer_draft import layer_draft

prepare_module = importlib.import_module("decode.prepare")  # `decode.prepare` is the function
PROMPT = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
TREE = DynamicTree(depth=4, top_k=3, total_tokens=8)
needs_mkl = pytest.mark.skipif(not can_pack(), reason="this torch build has no MKL packed sgemm")
needs_fbgemm = pytest.mark.skipif(not can_int8(), reason="this torch build has no x86 quantized engine")
x86 = pytest.mark.skipif(not (can_pack() and can_int8()), reason="prepare's CPU steps need MKL and fbgemm")
onednn_x86 = pytest.mark.skipif(not (can_onednn() and can_int8()), reason="needs oneDNN and fbgemm")


def _eagle3(target, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=64)).eval()
    head.set_draft_vocab(torch.randperm(128)[:64])
    for param in head.parameters():  # a trained-looking head: weights well away from their init
        param.data.add_(0.05 * torch.randn_like(param))
    return head


def _linears(module: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}


@x86
def test_prepare_without_onednn_quantizes_the_draft_pretransposes_and_packs_for_the_tree(build_target):
    target = copy.deepcopy(build_target("llama"))
    head = _eagle3(target)
    keys = {"target": list(target.state_dict()), "head": list(head.state_dict())}
    assert prepare(target, head, TREE, onednn=False) is head  # what a CPU without oneDNN gets
    assert is_int8_draft(head) and is_pretransposed(target) and not is_onednn(target)
    assert all(transposed_weight(layer) is not None for layer in _linears(target).values())
    assert packed_rows(target) == verify_rows(TREE) == 9
    assert list(_linears(head)) == ["fc"]  # int8 but fc (test_int8_draft_logits_stay_close_to_fp32)
    assert packed_rows(head) == TREE.top_k  # fc, pretransposed and packed for a dynamic level's rows
    assert list(target.state_dict()) == keys["target"]  # the copies are not saved
    assert not any(name.startswith("_selfspec") for name in target.state_dict())


@onednn_x86
def test_prepare_on_this_cpu_gives_target_plain_decoding_and_draft_fc_the_onednn_weights(build_target):
    target = copy.deepcopy(build_target("llama"))
    keys = list(target.state_dict())
    prepare(target, None)  # plain decoding runs on the same kernels as verification
    assert all(onednn_weight(layer) is not None for layer in _linears(target).values())
    assert not is_pretransposed(target) and packed_rows(target) is None  # superseded: no MKL copies
    head = prepare(target, _eagle3(target), TREE)
    assert is_int8_draft(head) and list(_linears(head)) == ["fc"] and onednn_weight(head.fc) is not None
    assert list(target.state_dict()) == keys  # the copies are not saved
    prepare(target, head, TREE, onednn=False)  # off: the copies go, the MKL layout comes back
    assert not is_onednn(target) and not is_onednn(head) and packed_rows(target) == verify_rows(TREE)
    prepare(target, head, TREE)  # on again: the MKL copies, which fp32 inputs would no longer read, go
    assert is_onednn(target) and not is_pretransposed(target) and packed_rows(target) is None
    assert not is_pretransposed(head) and onednn_weight(head.fc) is not None


@x86
@pytest.mark.parametrize("onednn", [False, None], ids=["mkl", "default"])
def test_prepare_readies_the_heads_inside_a_composite_as_it_readies_a_head(build_target, onednn):
    """A `Composite`'s head parts are heads to prepare: int8, the layout, packed for the tree's rows and
    their fused draft step taken again; its draft model gets the target's layout, its n-gram part nothing.
    Greedy output is plain decoding's."""
    target = copy.deepcopy(build_target("llama"))
    plain = generate(target, PROMPT, max_new_tokens=32).one.sequences
    head = _eagle3(target)
    draft = layer_draft(target, 1)  # a separate draft model's network: laid out as the target, not a head
    both = Composite([head, Ngram(min_ngram=2), DraftModel(draft)])
    assert prepare(target, both, TREE, onednn=onednn) is both
    assert is_int8_draft(head) and list(_linears(head)) == ["fc"]
    assert not is_int8_draft(draft) and len(_linears(draft)) > 1
    if onednn is False or not can_onednn():  # the default without oneDNN is MKL's layout
        assert packed_rows(head) == TREE.top_k and packed_rows(target) == verify_rows(TREE)
        assert is_pretransposed(draft)
    else:
        assert onednn_weight(head.fc) is not None and is_onednn(draft)
    out = generate(target, PROMPT, both, max_new_tokens=32, tree=TREE).one
    assert out.sequences.tolist() == plain.tolist()
    built = fused_step(head)  # what that decoding drafted with
    prepare(target, both, TREE, onednn=onednn)
    assert fused_step(head) is not built  # taken again from the current weights
    # a drafter instance as a part is its own business: prepare readies the heads beside it; a block head
    # (all depths from one forward) is packed for its own rows, not the dynamic tree's top_k per level
    block = PEagleHead(PEagleConfig.from_target(target.config, mask_token_id=7, parallel_depths=3)).eval()
    prepare(target, Composite([block, NgramDrafter(Ngram(), target, 1)]), TREE, onednn=onednn)
    assert is_int8_draft(block) and list(_linears(block)) == ["fc"]
    if onednn is False or not can_onednn():
        assert is_pretransposed(block) and packed_rows(block) is None


@x86
@pytest.mark.parametrize("onednn", [False, None], ids=["mkl", "default"])
@pytest.mark.parametrize("tree", [TREE, "tree8"], ids=str)
def test_greedy_output_after_prepare_equals_plain_decoding(tiny_target, tree, rank_oracle, onednn):
    plain = generate(tiny_target, PROMPT, max_new_tokens=48).one.sequences  # the oracle knows 8 tokens more
    target = copy.deepcopy(tiny_target)
    oracle = rank_oracle(plain[0].tolist(), 128, [1 / 3] * 3)  # long accepted paths: many multi-row verifies
    assert prepare(target, oracle, tree, onednn=onednn) is oracle  # a custom Drafter only sizes the tree
    if onednn is False:
        assert packed_rows(target) == verify_rows(tree)
    else:
        assert is_onednn(target) == can_onednn() and packed_rows(target) is None
    out = generate(target, PROMPT, oracle, max_new_tokens=40, tree=tree).one
    assert out.sequences.tolist() == plain[:, : PROMPT.shape[1] + 40].tolist() and out.tau > 1.5
    assert (
        generate(target, PROMPT, max_new_tokens=40).one.sequences.tolist() == out.sequences.tolist()
    )  # prepared
    head = prepare(target, _eagle3(target), tree, onednn=onednn)  # a real head, int8
    assert is_int8_draft(head)
    out = generate(target, PROMPT, head, max_new_tokens=40, tree=tree).one
    assert out.sequences.tolist() == plain[:, : PROMPT.shape[1] + 40].tolist()


@x86
def test_a_second_call_takes_every_copy_again_and_packs_for_the_new_tree(build_target, monkeypatch):
    target = copy.deepcopy(build_target("llama"))
    head = prepare(target, _eagle3(target), TREE, onednn=False)
    layers = {name: (m, transposed_weight(m), packed_weight(m)) for name, m in _linears(target).items()}
    head_layers = dict(head.named_modules())
    monkeypatch.setattr(prepare_module, "quantize_draft", lambda *a: pytest.fail("quantized twice"))
    prepare(target, head, "tree16", onednn=False)
    assert dict(head.named_modules()) == head_layers  # the same int8 layers
    for name, layer in _linears(target).items():  # new copies of the same weights
        assert layer is layers[name][0] and transposed_weight(layer) is not layers[name][1]
        assert torch.equal(transposed_weight(layer), layers[name][1])
        assert packed_weight(layer) is not layers[name][2]
    # static: unpacked
    assert packed_rows(target) == verify_rows("tree16") == 17 and packed_rows(head) is None


def test_without_refresh_a_second_call_keeps_the_copies_that_hold_their_weights(build_target):
    """`refresh=False` (the benchmark's loop): current copies stay, stale ones are taken again."""
    target = copy.deepcopy(build_target("llama"))
    head = prepare(target, _eagle3(target), TREE, onednn=False)
    layers = {name: transposed_weight(m) for name, m in _linears(target).items()}
    edited = next(iter(layers))
    with torch.no_grad():
        dict(target.named_modules())[edited].weight.mul_(2.0)
    prepare(target, head, TREE, onednn=False, refresh=False)
    for name, layer in _linears(target).items():
        assert (transposed_weight(layer) is layers[name]) == (name != edited)
        assert torch.equal(transposed_weight(layer), layer.weight)


@pytest.mark.parametrize("how", ["bf16", "meta"])
def test_prepare_changes_nothing_for_a_model_off_the_cpu_or_not_fp32(build_target, how):
    move = {"bf16": {"dtype": torch.bfloat16}, "meta": {"device": "meta"}}[how]
    target = copy.deepcopy(build_target("llama")).to(**move)
    head = _eagle3(build_target("llama")).to(**move)
    before = _tensors(target, head)
    assert prepare(target, head, None) is head
    assert not is_int8_draft(head) and not is_pretransposed(target) and not is_pretransposed(head)
    assert packed_rows(target) is None and packed_rows(head) is None
    assert not any("forward" in m.__dict__ for m in (*target.modules(), *head.modules()))  # nothing patched
    assert _tensors(target, head) == before  # no copies added, nothing moved or cast


def _tensors(*modules: nn.Module) -> list[tuple[str, torch.dtype, torch.device]]:
    return [(n, t.dtype, t.device) for m in modules for n, t in (*m.named_parameters(), *m.named_buffers())]


@x86
def test_a_prepared_model_cast_to_float64_decodes_as_a_float64_model(build_target, rank_oracle):
    target = copy.deepcopy(build_target("llama"))
    plain = generate(copy.deepcopy(target).to(torch.float64), PROMPT, max_new_tokens=24).one.sequences
    oracle = rank_oracle(plain[0].tolist(), 128, [1.0])
    prepare(target, oracle, "tree8", onednn=False)
    target.to(torch.float64)  # the fp32 copies are stale: never read, freed at the layers' next call
    out = generate(target, PROMPT, oracle, max_new_tokens=16, tree="tree8").one
    assert out.sequences.tolist() == plain[:, : PROMPT.shape[1] + 16].tolist() and out.tau > 2
    assert packed_rows(target) is None and not is_pretransposed(target)
    prepare(target, oracle, "tree8", onednn=False)  # float64: no copies
    assert packed_rows(target) is None and not is_pretransposed(target)


@needs_mkl
def test_pack_for_tree_packs_target_and_eagle_head_for_the_tree(build_target):
    target = copy.deepcopy(build_target("llama"))
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=64)).eval()
    medusa = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=3)).eval()
    pack_for_tree(target, head, None)  # nothing pretransposed: nothing packed
    assert packed_rows(target) is None and packed_rows(head) is None
    pretranspose_linears(target)
    pretranspose_linears(head)
    pack_for_tree(target, head, None)  # the default EAGLE tree
    assert (
        packed_rows(target) == DEFAULT_EAGLE_TREE.total_tokens + 1
        and packed_rows(head) == DEFAULT_EAGLE_TREE.top_k
    )
    pack_for_tree(target, head, "tree8")  # static: the head's rows vary per level, it is not packed
    assert packed_rows(target) == verify_rows("tree8") and packed_rows(head) is None
    pack_for_tree(target, medusa, None)  # the default Medusa tree, cut to the 3 heads' depth
    assert packed_rows(target) == verify_rows([p for p in DEFAULT_TREES[DEFAULT_MEDUSA_TREE] if len(p) <= 3])
    pack_for_tree(target, None, None)
    assert packed_rows(target) is None


@needs_mkl
@pytest.mark.parametrize("tree", [DynamicTree(depth=4, top_k=3, total_tokens=9), "tree8"], ids=str)
def test_greedy_speculative_decoding_on_packed_models_equals_plain(any_target, tree, rank_oracle):
    plain = generate(
        any_target, PROMPT, max_new_tokens=48
    ).one.sequences  # the oracle knows 8 tokens more than decoded
    target = copy.deepcopy(any_target)
    with torch.no_grad():
        features = target(plain, output_hidden_states=True).hidden_states[-1][0]
    head = rank_oracle(plain[0].tolist(), 128, [1 / 3] * 3, features=features)
    pretranspose_linears(target, min_rows=2)
    pack_for_tree(target, head, tree)
    assert packed_rows(target) == verify_rows(tree)
    out = generate(target, PROMPT, head, max_new_tokens=40, tree=tree).one
    assert out.sequences.tolist() == plain[:, : PROMPT.shape[1] + 40].tolist()
    assert out.tau > 1.5


@needs_fbgemm
def test_int8_draft_logits_stay_close_to_fp32(build_target):
    target = build_target("llama")
    head = _eagle3(target)
    features = torch.randn(1, 24, 3 * 32)
    embeds = target.get_input_embeddings()(torch.randint(0, 128, (1, 24)))
    positions = torch.arange(24)[None]

    def logits(module):
        with torch.no_grad():
            return module.logits(module(module.project_features(features), embeds, positions), None)[0]

    before = logits(head)
    quantized = quantize_draft(copy.deepcopy(head))
    after = logits(quantized)
    assert is_int8_draft(quantized) and not is_int8_draft(head)
    # all int8 but fc, which reads the target's raw hidden states (their outliers need fp32)
    assert [name for name, m in quantized.named_modules() if isinstance(m, nn.Linear)] == ["fc"]
    assert (after - before).abs().max() < 0.05 * before.abs().max()  # int8 error: a few percent at most
    assert (after.argmax(-1) == before.argmax(-1)).float().mean() >= 0.9
    assert not torch.equal(after, before)  # the int8 path really ran


@needs_fbgemm
@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "medusa_shared", "medusa_own"])
def test_greedy_decoding_with_int8_drafts_equals_plain_and_leaves_the_target_alone(any_target, kind):
    plain = generate(any_target, PROMPT, max_new_tokens=32).one.sequences
    target = copy.deepcopy(any_target)
    lm_weight = target.get_output_embeddings().weight.clone()
    torch.manual_seed(0)
    if kind == "eagle3":
        heads = _eagle3(target)
    elif kind == "eagle1":
        heads = EagleHead(EagleConfig.from_target(target.config, "eagle1")).eval()
    else:
        heads = MedusaHeads(
            MedusaConfig(hidden_size=32, vocab_size=128, num_heads=4, share_lm_head=kind == "medusa_shared")
        ).eval()
        heads.init_from_lm_head(lm_weight)
    shares = kind in ("eagle1", "medusa_shared")
    if shares:
        with pytest.raises(ValueError, match="project with the target's lm_head: pass target="):
            quantize_draft(copy.deepcopy(heads))
    assert quantize_draft(heads, target) is heads
    assert (draft_lm_head(heads, target) is target.get_output_embeddings()) != shares
    assert not any(name.startswith(DRAFT_LM_HEAD) for name, _ in heads.named_modules())  # no submodule
    for tree in (None, "tree8"):
        out = generate(target, PROMPT, heads, max_new_tokens=32, tree=tree).one
        assert out.sequences.tolist() == plain.tolist()
    assert isinstance(target.get_output_embeddings(), nn.Linear)
    assert torch.equal(target.get_output_embeddings().weight, lm_weight)


@needs_fbgemm
def test_int8_heads_are_not_saved(build_target, tmp_path):
    from heads.io import save_heads

    head = quantize_draft(_eagle3(build_target("llama")))
    with pytest.raises(
        ValueError,
        match=r"holds 8 quantized layers \(midlayer.self_attn.q_proj, midlayer.self_attn."
        r"k_proj, midlayer.self_attn.v_proj, \.\.\.\): int8 drafts are for decoding",
    ):
        save_heads(head, tmp_path / "head", base_model="tiny")
    assert not (tmp_path / "head").exists()


@needs_fbgemm
def test_quantize_draft_refuses_heads_it_cannot_serve(build_target):
    head = _eagle3(build_target("llama")).to(torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"fp32 heads on the CPU; these heads hold \['torch.bfloat16 on cpu'\]"
    ):
        quantize_draft(head)


# A prepared model that is trained, loaded or edited: both weight layouts, plain and speculative decoding.
LAYOUTS = {"onednn": {"onednn": True}, "mkl": {"onednn": False, "pretranspose": True}}
layouts = pytest.mark.parametrize("layout", list(LAYOUTS))


def _trainable(build_target, layout: str) -> nn.Module:
    """A fresh trainable copy of the tiny 2-layer llama; skips a layout this torch build lacks kernels for."""
    if not (can_onednn() if layout == "onednn" else can_pack()):
        pytest.skip(f"this torch build has no {layout} kernels")
    return copy.deepcopy(build_target("llama", num_hidden_layers=2)).requires_grad_(True)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step on a fixed batch of 2 x 16 random tokens."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _assert_decodes_as(model: nn.Module, reference: nn.Module, rank_oracle, layout: str) -> None:
    """`model` (prepared) gives `reference`'s (unprepared, same weights) logits and greedy tokens, plain and
    speculative."""
    expected = generate(reference, PROMPT, max_new_tokens=24).one.sequences
    assert generate(model, PROMPT, max_new_tokens=16).one.sequences.tolist() == expected[:, :23].tolist()
    with torch.no_grad():
        torch.testing.assert_close(model(expected).logits, reference(expected).logits, rtol=1e-5, atol=1e-5)
    oracle = rank_oracle(expected[0].tolist(), 128, [1 / 3] * 3)  # many multi-row verifies
    prepare(model, oracle, "tree8", **LAYOUTS[layout])  # the packed copies for its 9 rows (MKL)
    out = generate(model, PROMPT, oracle, max_new_tokens=16, tree="tree8").one
    assert out.sequences.tolist() == expected[:, :23].tolist() and out.tau > 1.5


@layouts
def test_a_prepared_model_follows_a_fused_adamw_step(build_target, rank_oracle, layout):
    model = _trainable(build_target, layout)
    reference = copy.deepcopy(model)
    before = generate(model, PROMPT, max_new_tokens=16).one.sequences
    prepare(model, None, **LAYOUTS[layout])
    for module in (model, reference):  # fused: the weights change, their version counters do not
        _train_step(module, torch.optim.AdamW(module.parameters(), lr=0.05, fused=True))
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(param, ref), name  # the same step: every gradient reached the prepared model
    assert (
        generate(reference, PROMPT, max_new_tokens=16).one.sequences.tolist() != before.tolist()
    )  # it shows
    _assert_decodes_as(model, reference, rank_oracle, layout)


@layouts
def test_a_prepared_model_follows_load_state_dict(build_target, rank_oracle, layout):
    model = _trainable(build_target, layout).requires_grad_(False)
    generator = torch.Generator().manual_seed(3)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model)
    reference.load_state_dict(state)
    prepare(model, None, **LAYOUTS[layout])
    model.load_state_dict(state)
    _assert_decodes_as(model, reference, rank_oracle, layout)


@layouts
def test_prepare_again_takes_new_copies_after_writes_through_data(build_target, rank_oracle, layout):
    model = _trainable(build_target, layout).requires_grad_(False)
    reference = copy.deepcopy(model)
    prepare(model, None, **LAYOUTS[layout])
    for module in (model, reference):
        generator = torch.Generator().manual_seed(3)
        for param in module.parameters():
            param.data.add_(0.05 * torch.randn(param.shape, generator=generator))  # no version bump: unseen
    prepare(model, None, **LAYOUTS[layout])
    _assert_decodes_as(model, reference, rank_oracle, layout)


def test_a_model_prepared_for_mkl_trains_with_every_gradient(build_target, rank_oracle):
    model = _trainable(build_target, "mkl")
    reference = copy.deepcopy(model)
    prepare(model, rank_oracle([0] * 8, 128, [1.0]), "tree8", onednn=False, pretranspose=True)
    assert is_pretransposed(model) and packed_rows(model) == 9
    for module in (model, reference):  # 9 rows (the packed copies' count) and 32 (the transposed copies')
        for shape in ((1, 9), (2, 16)):
            ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(2))
            module(ids, labels=ids).loss.backward()
    grads = {name: param.grad for name, param in reference.named_parameters()}
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.equal(param.grad, grads[name]), name


@layouts
def test_a_frozen_targets_copies_stay_valid_while_an_optimizer_trains_a_head(build_target, layout):
    target = _trainable(build_target, layout).requires_grad_(False)
    head = _eagle3(target).train()
    prepare(target, None, **LAYOUTS[layout])
    copies = {name: (onednn_weight(m), transposed_weight(m)) for name, m in _linears(target).items()}
    assert all(any(c is not None for c in pair) for pair in copies.values())
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # the online recipe: no-grad target features, a trained head
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
        hidden = torch.cat([out.hidden_states[i] for i in (1, 1, 2)], dim=-1)
        positions = torch.arange(16)[None]
        embeds = target.get_input_embeddings()(ids)
        logits = head.logits(head(head.project_features(hidden), embeds, positions), None)
        logits.square().mean().backward()
        optimizer.step()
    for name, layer in _linears(target).items():  # the very same copies
        assert onednn_weight(layer) is copies[name][0] and transposed_weight(layer) is copies[name][1], name


@layouts
def test_generate_sees_whole_weight_writes_that_bump_no_version_counter(build_target, layout):
    """A loader filling weights through a NumPy alias (or `.data`, or the storage) bumps no version counter,
    so a layer kept reading its copy of the old weights: plain decoding gave the old model's tokens.
    `generate` now compares sampled rows of each copied weight first; for the draft head too (its copies and
    EAGLE's fused step), whose stale drafts would cost only acceptance: the steps must be those of fresh
    copies."""
    model = _trainable(build_target, layout).requires_grad_(False)
    head = _eagle3(model)
    before = generate(model, PROMPT, max_new_tokens=16).one.sequences.tolist()
    reference, fresh = copy.deepcopy(model), copy.deepcopy(head)
    prepare(model, head, DEFAULT_EAGLE_TREE, int8_draft=False, **LAYOUTS[layout])
    generate(model, PROMPT, head, max_new_tokens=8)  # the fused draft step is built
    generator = torch.Generator().manual_seed(3)
    for module, twin in ((model, reference), (head, fresh)):
        for param, ref in zip(module.parameters(), twin.parameters()):
            new = param.detach() + 0.5 * param.detach().std() * torch.randn(param.shape, generator=generator)
            np.copyto(param.detach().numpy(), new.numpy())  # the same memory, no version bump
            with torch.no_grad():
                ref.copy_(new)
    expected = generate(reference, PROMPT, max_new_tokens=16).one.sequences.tolist()
    assert expected != before  # it shows
    assert generate(model, PROMPT, max_new_tokens=16).one.sequences.tolist() == expected
    prepare(reference, fresh, DEFAULT_EAGLE_TREE, int8_draft=False, **LAYOUTS[layout])
    ours = generate(model, PROMPT, head, max_new_tokens=16).one
    theirs = generate(reference, PROMPT, fresh, max_new_tokens=16).one
    assert ours.sequences.tolist() == expected and ours.accepted_per_depth == theirs.accepted_per_depth


def test_prepare_refuses_inference_tensors_by_name(build_target):
    with torch.inference_mode():
        model = copy.deepcopy(build_target("llama", num_hidden_layers=2))
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert next(model.parameters()).is_inference()
    with pytest.raises(ValueError, match=r"weights \(model.embed_tokens.weight, .*\) are inference tensors"):
        prepare(model, None)


@needs_fbgemm
def test_prepare_again_takes_the_int8_copy_of_a_changed_target_lm_head(build_target):
    """EAGLE-1 drafts through an int8 copy of the target's lm_head; it was taken once and never again."""
    model = copy.deepcopy(build_target("llama", num_hidden_layers=2))
    head = EagleHead(EagleConfig.from_target(model.config, "eagle1")).eval()
    prepare(model, head)
    with torch.no_grad():
        model.lm_head.weight.copy_(
            torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(5))
        )
    prepare(model, head)
    error = (draft_lm_head(head, model).weight().dequantize() - model.lm_head.weight).abs().max()
    assert error < 0.05, float(error)


@x86
@pytest.mark.parametrize("onednn", [False, None], ids=["mkl", "default"])
def test_prepare_takes_one_draft_source_per_row_as_generate_does(build_target, onednn):
    """`generate` takes a list of draft sources (one per row); `prepare` readies each distinct head once
    and packs the target for the rows every source's tree verifies (none where they differ). Greedy
    output stays each row's plain decoding."""
    target = copy.deepcopy(build_target("llama"))
    first, second = _eagle3(target, seed=0), _eagle3(target, seed=1)
    second.set_draft_vocab(first.to_target_ids(torch.arange(64)))  # a batch drafts through one vocabulary
    prompts = torch.randint(1, 128, (3, 6), generator=torch.Generator().manual_seed(5))
    plain = generate(target, prompts, max_new_tokens=16).sequences
    sources = [first, second, first]
    assert prepare(target, sources, TREE, onednn=onednn) is sources
    assert is_int8_draft(first) and is_int8_draft(second)
    if onednn is False or not can_onednn():
        assert packed_rows(target) == verify_rows(TREE) and packed_rows(second) == TREE.top_k
    assert (
        generate(target, prompts, sources, max_new_tokens=16, tree=TREE).sequences.tolist() == plain.tolist()
    )
    medusa = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=128, num_heads=3)).eval()
    prepare(target, [first, medusa], onednn=False)  # default trees: EAGLE's verifies 13 rows, Medusa's 9
    assert packed_rows(target) is None and packed_rows(first) == DEFAULT_EAGLE_TREE.top_k
    assert is_int8_draft(medusa)
