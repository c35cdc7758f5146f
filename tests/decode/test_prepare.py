"""decode/prepare.py: `prepare` readies a target and its heads on this CPU (int8 draft, oneDNN reordered
weights; or, with onednn=False, MKL pretransposed and packed weights), keeps greedy output that of plain
decoding, re-packs only on a new tree, and changes nothing for a model off the CPU or not fp32;
`quantize_draft` (int8 drafts) and `pack_for_tree` (packing per tree)."""

import copy
import importlib

import pytest
import torch
from torch import nn

from decode import DEFAULT_EAGLE_TREE, generate, prepare
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
from decode.propose import DRAFT_LM_HEAD, draft_lm_head
from decode.tree import DEFAULT_MEDUSA_TREE, DEFAULT_TREES, DynamicTree, verify_rows
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads

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
@pytest.mark.parametrize("tree", [TREE, "tree8"], ids=str)
def test_greedy_output_after_prepare_equals_plain_decoding(tiny_target, tree, rank_oracle, onednn):
    plain = generate(tiny_target, PROMPT, max_new_tokens=48).sequences  # the oracle knows 8 tokens more
    target = copy.deepcopy(tiny_target)
    oracle = rank_oracle(plain[0].tolist(), 128, [1 / 3] * 3)  # long accepted paths: many multi-row verifies
    assert prepare(target, oracle, tree, onednn=onednn) is oracle  # a custom Drafter only sizes the tree
    if onednn is False:
        assert packed_rows(target) == verify_rows(tree)
    else:
        assert is_onednn(target) == can_onednn() and packed_rows(target) is None
    out = generate(target, PROMPT, oracle, max_new_tokens=40, tree=tree)
    assert out.sequences.tolist() == plain[:, : PROMPT.shape[1] + 40].tolist() and out.tau > 1.5
    assert (
        generate(target, PROMPT, max_new_tokens=40).sequences.tolist() == out.sequences.tolist()
    )  # prepared
    head = prepare(target, _eagle3(target), tree, onednn=onednn)  # a real head, int8
    assert is_int8_draft(head)
    out = generate(target, PROMPT, head, max_new_tokens=40, tree=tree)
    assert out.sequences.tolist() == plain[:, : PROMPT.shape[1] + 40].tolist()


@x86
def test_a_second_call_with_another_tree_only_repacks(build_target, monkeypatch):
    target = copy.deepcopy(build_target("llama"))
    head = prepare(target, _eagle3(target), TREE, onednn=False)
    layers = {name: (m, transposed_weight(m)) for name, m in _linears(target).items()}
    head_layers = dict(head.named_modules())
    packed = packed_weight(layers["lm_head"][0])
    added = []
    real = prepare_module.pretranspose_linears
    monkeypatch.setattr(prepare_module, "pretranspose_linears", lambda m: added.append(real(m)))
    monkeypatch.setattr(prepare_module, "quantize_draft", lambda *a: pytest.fail("quantized twice"))
    prepare(target, head, "tree16", onednn=False)
    assert added == [0, 0]  # target and head: no new copies
    assert {name: (m, transposed_weight(m)) for name, m in _linears(target).items()} == layers
    assert dict(head.named_modules()) == head_layers  # the same int8 layers
    # static: unpacked
    assert packed_rows(target) == verify_rows("tree16") == 17 and packed_rows(head) is None
    assert packed_weight(layers["lm_head"][0]) is not packed


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
def test_a_prepared_model_cast_to_float64_refuses_its_packed_rows_until_prepared_again(
    build_target, rank_oracle
):
    target = copy.deepcopy(build_target("llama"))
    plain = generate(copy.deepcopy(target).to(torch.float64), PROMPT, max_new_tokens=24).sequences
    oracle = rank_oracle(plain[0].tolist(), 128, [1.0])
    prepare(target, oracle, "tree8", onednn=False)
    target.to(torch.float64)  # the transposed copies follow; the packed weights cannot
    assert transposed_weight(target.lm_head).dtype == torch.float64
    refused = r"Linear layer 'model.layers.0.self_attn.q_proj' holds an MKL-packed weight for 9-row inputs"
    with pytest.raises(RuntimeError, match=refused + r".*now on cpu / float64; .* call decode.prepare"):
        generate(target, PROMPT, oracle, max_new_tokens=16, tree="tree8")
    prepare(target, oracle, "tree8", onednn=False)  # float64: nothing new, and the packed weights are dropped
    assert packed_rows(target) is None and is_pretransposed(target)
    oracle = rank_oracle(plain[0].tolist(), 128, [1.0])
    out = generate(target, PROMPT, oracle, max_new_tokens=16, tree="tree8")
    assert out.sequences.tolist() == plain[:, : PROMPT.shape[1] + 16].tolist() and out.tau > 2


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
    ).sequences  # the oracle knows 8 tokens more than decoded
    target = copy.deepcopy(any_target)
    with torch.no_grad():
        features = target(plain, output_hidden_states=True).hidden_states[-1][0]
    head = rank_oracle(plain[0].tolist(), 128, [1 / 3] * 3, features=features)
    pretranspose_linears(target, min_rows=2)
    pack_for_tree(target, head, tree)
    assert packed_rows(target) == verify_rows(tree)
    out = generate(target, PROMPT, head, max_new_tokens=40, tree=tree)
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
    plain = generate(any_target, PROMPT, max_new_tokens=32).sequences
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
        out = generate(target, PROMPT, heads, max_new_tokens=32, tree=tree)
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
