"""decode/layout.py: the transposed weight copy and the MKL-packed weights compute the same products, are
used only for the row counts they are meant for, live in non-persistent buffers that follow `.to()` (a packed
weight moved off the CPU or cast refuses, naming the layer), and speculative decoding on pretransposed models
still equals plain decoding token for token. Head-aware steps (int8 drafts, packing per tree) are tested in
test_prepare.py.
"""

import copy

import pytest
import torch
from torch import nn

from decode import generate
from decode.layout import (
    can_pack,
    is_pretransposed,
    pack_linears,
    packed_rows,
    packed_weight,
    pretranspose_linears,
    transpose_min_rows,
    transposed_weight,
)
from heads.eagle import EagleConfig, EagleHead

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
    assert transpose_min_rows(layer) == 3 and transposed_weight(layer).t().is_contiguous()  # stored (in, out)
    transposed_weight(layer).zero_()  # poison the copy: only passes of >= 3 rows read it
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
    # poison: pack a zero weight, then restore the weight (the packed copy does not follow later changes);
    # only 3-row passes read it
    weight = layer.weight.detach().clone()
    with torch.no_grad():
        layer.weight.zero_()
        pack_linears(layer, 3)
        layer.weight.copy_(weight)
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


@needs_mkl
def test_copies_are_non_persistent_buffers_that_follow_to():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    keys = list(module.state_dict())
    pretranspose_linears(module, min_rows=2)
    pack_linears(module, 3)
    assert list(module.state_dict()) == keys  # nothing new is saved
    assert [name for name, _ in module.named_buffers()] == ["0._selfspec_weight_t", "2._selfspec_weight_t"]
    inputs = torch.randn(5, 8, dtype=torch.float64)
    module.to(torch.float64)  # the copies are cast with the weights
    assert (
        transposed_weight(module[0]).dtype == torch.float64
        and transposed_weight(module[0]).t().is_contiguous()
    )
    hidden = torch.relu(nn.functional.linear(inputs, module[0].weight, module[0].bias))
    expected = nn.functional.linear(hidden, module[2].weight, module[2].bias)
    torch.testing.assert_close(module(inputs), expected)  # 5 rows: the (float64) transposed copies
    assert torch.equal(module(inputs[:1]), expected[:1])  # 1 row: the weight itself
    refused = (
        r"Linear layer '0' holds an MKL-packed weight for 3-row inputs, valid on the CPU in float32 only, "
        r"but it is now on cpu / float64; .* call decode.prepare\(model, heads, tree\) again"
    )
    with pytest.raises(RuntimeError, match=refused):
        module(inputs[:3])
    assert pack_linears(module, 3) == 0 and packed_rows(module) is None  # a float64 layer is not packed
    torch.testing.assert_close(module(inputs[:3]), expected[:3])


@needs_mkl
def test_a_packed_layer_moved_to_another_device_refuses_its_packed_row_count():
    torch.manual_seed(0)
    layer = nn.Linear(8, 6)
    pretranspose_linears(layer, min_rows=2)
    pack_linears(layer, 4)
    layer.to("meta")  # the transposed copy follows; the packed weight (mkldnn) cannot, and stays behind
    assert transposed_weight(layer).device.type == "meta" and packed_weight(layer).device.type == "cpu"
    assert layer(torch.randn(5, 8, device="meta")).shape == (5, 6)  # other row counts run where it is
    with pytest.raises(RuntimeError, match="Linear layer 'Linear' .* 4-row inputs.* now on meta / float32"):
        layer(torch.randn(4, 8, device="meta"))
    pack_linears(layer, 4)  # off the CPU: the packed weight is dropped, not rebuilt
    assert packed_rows(layer) is None and layer(torch.randn(4, 8, device="meta")).shape == (4, 6)
