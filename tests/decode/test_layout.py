"""decode/layout.py: the transposed weight copy and the MKL-packed weights compute the same products, are
used only for the row counts they are meant for, and speculative decoding on pretransposed and packed models
still equals plain decoding token for token."""

import copy

import pytest
import torch
from torch import nn

from decode import generate
from decode.calibrate import measure_verify_cost
from decode.generate import DEFAULT_EAGLE_TREE
from decode.layout import (
    DRAFT_LM_HEAD,
    can_int8,
    can_pack,
    draft_lm_head,
    is_int8_draft,
    is_pretransposed,
    pack_for_tree,
    pack_linears,
    packed_rows,
    pretranspose_linears,
    quantize_draft,
)
from decode.tree import DEFAULT_MEDUSA_TREE, DEFAULT_TREES, DynamicTree, build_tree, verify_rows
from heads.eagle import EagleConfig, EagleHead
from heads.medusa import MedusaConfig, MedusaHeads

PROMPT = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (3,), (5,), (2, 9)], ids=str)  # rows: 1, 1, 3, 5, 18
def test_patched_linear_computes_the_same_product(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    inputs = torch.randn(*shape, 24)
    before = layer(inputs)
    assert pretranspose_linears(layer, min_rows=2) == 24 * 40 * 4
    after = layer(inputs)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
    if inputs.numel() // 24 == 1:  # one row: the original weight, bit for bit
        assert torch.equal(after, before)


def test_copy_is_used_from_min_rows_on_and_calls_are_idempotent():
    torch.manual_seed(0)
    layer = nn.Linear(8, 6)
    assert pretranspose_linears(layer, min_rows=3) > 0 and is_pretransposed(layer)
    assert pretranspose_linears(layer, min_rows=3) == 0  # already patched: no second copy
    layer._selfspec_weight_t.zero_()  # poison the copy: only passes of >= 3 rows read it
    rows = torch.randn(4, 8)
    assert torch.equal(layer(rows[:1]), nn.functional.linear(rows[:1], layer.weight, layer.bias))
    assert torch.equal(layer(rows[:2]), nn.functional.linear(rows[:2], layer.weight, layer.bias))
    assert torch.equal(layer(rows[:3]), layer.bias.expand(3, 6))
    pretranspose_linears(layer, min_rows=5)  # a later call moves the threshold
    assert torch.equal(layer(rows), nn.functional.linear(rows, layer.weight, layer.bias))


def test_layers_off_the_cpu_and_bad_thresholds():
    with torch.device("meta"):
        layer = nn.Linear(4, 4)
    assert pretranspose_linears(layer) == 0 and not is_pretransposed(layer)
    with pytest.raises(ValueError, match="min_rows must be >= 1, got 0"):
        pretranspose_linears(nn.Linear(2, 2), min_rows=0)


@pytest.mark.parametrize("tree", ["tree8", "oracle"])
def test_greedy_speculative_decoding_on_pretransposed_models_equals_plain(any_target, tree, rank_oracle):
    plain = generate(any_target, PROMPT, max_new_tokens=40).sequences
    target = copy.deepcopy(any_target)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=64)).eval()
    head.set_draft_vocab(torch.randperm(128)[:64])
    if tree == "oracle":  # ranks the true next token 1st-3rd: long accepted paths, many multi-row verifies
        with torch.no_grad():
            features = any_target(plain, output_hidden_states=True).hidden_states[-1][0]
        head = rank_oracle(plain[0].tolist(), 128, [1 / 3] * 3, features=features)
    else:
        assert pretranspose_linears(head, min_rows=2) > 0
    assert pretranspose_linears(target, min_rows=2) > 0
    out = generate(target, PROMPT, head, max_new_tokens=40, tree="tree8")
    assert out.sequences.tolist() == plain.tolist()
    if tree == "oracle":
        assert out.tau > 1.5


needs_mkl = pytest.mark.skipif(not can_pack(), reason="this torch build has no MKL packed sgemm")


@needs_mkl
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5,), (1, 5), (5, 1)], ids=str)  # 5 rows, 2-D and 3-D
def test_packed_linear_computes_the_same_product(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias)
    inputs = torch.randn(*shape, 24)
    before = layer(inputs)
    pretranspose_linears(layer, min_rows=2)
    held = pack_linears(layer, 5)
    assert held > 0 and packed_rows(layer) == 5
    after = layer(inputs)
    assert after.shape == before.shape
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)


@needs_mkl
def test_packed_weight_is_read_at_exactly_its_row_count_and_replaced_or_dropped():
    torch.manual_seed(0)
    layer = nn.Linear(8, 6)
    pretranspose_linears(layer, min_rows=2)
    pack_linears(layer, 3)
    # poison: the buffer of a zero weight (an opaque MKL format, so packed by MKL itself); only 3-row passes
    # read it
    layer._selfspec_packed = (3, torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros_like(layer.weight), 3))
    rows = torch.randn(4, 8)
    assert torch.equal(layer(rows[:3]), layer.bias.expand(3, 6))
    for n in (1, 2, 4):
        torch.testing.assert_close(layer(rows[:n]), nn.functional.linear(rows[:n], layer.weight, layer.bias))
    pack_linears(layer, 4)  # a new row count replaces the poisoned buffer
    assert packed_rows(layer) == 4
    torch.testing.assert_close(layer(rows[:3]), nn.functional.linear(rows[:3], layer.weight, layer.bias))
    torch.testing.assert_close(layer(rows), nn.functional.linear(rows, layer.weight, layer.bias))
    assert pack_linears(layer, None) == 0 and packed_rows(layer) is None


def test_pack_linears_skips_layers_that_were_not_pretransposed_and_checks_rows():
    layer = nn.Linear(4, 4)
    assert pack_linears(layer, 3) == 0 and packed_rows(layer) is None
    with pytest.raises(ValueError, match="rows must be >= 2"):
        pack_linears(layer, 1)


def test_verify_rows_counts_the_root():
    assert verify_rows(DynamicTree(depth=5, top_k=4, total_tokens=12)) == 13
    assert verify_rows("tree8") == len(DEFAULT_TREES["tree8"]) + 1
    assert verify_rows([(0,), (1,), (0, 0)]) == 4
    assert verify_rows(build_tree([(0,), (1,), (0, 0)])) == 4


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
def test_verify_cost_is_measured_packed_and_leaves_the_packing_as_it_was(build_target):
    target = copy.deepcopy(build_target("llama"))
    pretranspose_linears(target)
    pack_linears(target, 7)
    seen = []
    original = target.forward

    def spy(*args, **kwargs):
        seen.append((kwargs["input_ids"].shape[1], packed_rows(target)))
        return original(*args, **kwargs)

    target.forward = spy
    measure_verify_cost(target, PROMPT, [1, 3, 5], repeats=1)
    assert {rows: packed for rows, packed in seen[1:]} == {1: None, 3: 3, 5: 5}
    assert packed_rows(target) == 7


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


needs_fbgemm = pytest.mark.skipif(not can_int8(), reason="this torch build has no x86 quantized engine")


def _eagle3(target, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle3", draft_vocab_size=64)).eval()
    head.set_draft_vocab(torch.randperm(128)[:64])
    for param in head.parameters():  # a trained-looking head: weights well away from their init
        param.data.add_(0.05 * torch.randn_like(param))
    return head


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
