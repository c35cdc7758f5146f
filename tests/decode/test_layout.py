"""decode/layout.py: the transposed weight copy and the MKL-packed weights compute the same products, are used
only for the row counts they are meant for, are not saved, and speculative decoding on pretransposed models
still equals plain decoding token for token. The oneDNN reordered weights compute the same product for every
row count and give a row the same bits alone or among others. Every copy is read only while it holds the
layer's weight: a moved, cast or edited weight, an optimizer step (fused ones included), another input dtype,
autocast or a pass autograd records runs `F.linear`. Head-aware steps (int8 drafts, packing per tree) and
whole prepared models that are trained or loaded are tested in test_prepare.py.
"""

import copy

import pytest
import torch
from torch import nn

from decode import generate
from decode.layout import (
    _ONEDNN,
    _PACKED,
    can_int8,
    can_onednn,
    can_pack,
    drop_onednn,
    int8_linears,
    is_onednn,
    is_pretransposed,
    onednn_linears,
    onednn_weight,
    pack_linears,
    packed_rows,
    packed_weight,
    pretranspose_linears,
    steps_over,
    transpose_min_rows,
    transposed_weight,
)
from decode.tree import DynamicTree
from heads.eagle import EagleConfig, EagleHead

PROMPT = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1,), (1, 1), (3,), (5,), (2, 9)], ids=str)  # rows: 1, 1, 3, 5, 18
def test_patched_linear_computes_the_same_product(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias).requires_grad_(False)  # frozen, as a target is
    inputs = torch.randn(*shape, 24)
    before = layer(inputs)
    assert pretranspose_linears(layer, min_rows=2) == 24 * 40 * 4
    after = layer(inputs)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
    if inputs.numel() // 24 == 1:  # one row: the original weight, bit for bit
        assert torch.equal(after, before)


def test_copy_is_used_from_min_rows_on_and_calls_are_idempotent():
    torch.manual_seed(0)
    layer = nn.Linear(8, 6).requires_grad_(False)
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
    plain = generate(any_target, PROMPT, max_new_tokens=40).one.sequences
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
    out = generate(target, PROMPT, head, max_new_tokens=40, tree="tree8").one
    assert out.sequences.tolist() == plain.tolist()
    if tree == "oracle":
        assert out.tau > 1.5


needs_mkl = pytest.mark.skipif(not can_pack(), reason="this torch build has no MKL packed sgemm")


@needs_mkl
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5,), (1, 5), (5, 1)], ids=str)  # 5 rows, 2-D and 3-D
def test_packed_linear_computes_the_same_product(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40, bias=bias).requires_grad_(False)
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
    layer = nn.Linear(8, 6).requires_grad_(False)
    pretranspose_linears(layer, min_rows=2)
    pack_linears(layer, 3)
    poisoned = torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros(6, 8), 3)  # only 3-row passes read it
    layer.__dict__[_PACKED] = layer.__dict__[_PACKED]._replace(tensor=poisoned)
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
def test_copies_are_not_saved_and_a_cast_layer_runs_f_linear_until_given_new_ones():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4)).requires_grad_(False)
    keys = list(module.state_dict())
    pretranspose_linears(module, min_rows=2)
    pack_linears(module, 3)
    assert list(module.state_dict()) == keys and not list(module.named_buffers())  # nothing saved or moved
    module.to(torch.float64)  # new weights: every copy is stale, never read, and freed
    assert not is_pretransposed(module) and packed_rows(module) is None
    assert not any(key in layer.__dict__ for layer in module for key in (_PACKED, "_selfspec_weight_t"))
    inputs = torch.randn(5, 8, dtype=torch.float64)
    for rows in (1, 3, 5):  # the float64 weights through F.linear, at every row count
        hidden = torch.relu(nn.functional.linear(inputs[:rows], module[0].weight, module[0].bias))
        assert torch.equal(
            module(inputs[:rows]), nn.functional.linear(hidden, module[2].weight, module[2].bias)
        )
    assert pretranspose_linears(module) == 0 and pack_linears(module, 3) == 0  # not fp32: no copies
    module.to(torch.float32)
    assert (
        pretranspose_linears(module, min_rows=2) > 0
        and pack_linears(module, 3) > 0
        and packed_rows(module) == 3
    )


@needs_mkl
def test_a_packed_layer_moved_to_another_device_runs_there_at_every_row_count():
    torch.manual_seed(0)
    layer = nn.Linear(8, 6).requires_grad_(False)
    pretranspose_linears(layer, min_rows=2)
    pack_linears(layer, 4)
    layer.to("meta")  # the copies cannot follow: stale, not read
    for rows in (1, 4, 5):
        assert layer(torch.randn(rows, 8, device="meta")).shape == (rows, 6)
    assert transposed_weight(layer) is None and packed_weight(layer) is None


_OPTIMIZERS = {
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=0.1, fused=True),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.5, fused=True),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, lr=0.1, foreach=True),
    "sgd_for_loop": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9, foreach=False),
}


def _copies(layer: nn.Linear) -> tuple:
    """The layer's valid oneDNN, transposed and packed copies (None where it has none)."""
    return onednn_weight(layer), transposed_weight(layer), packed_weight(layer)


@pytest.mark.parametrize("kind", ["onednn", "mkl"])
@pytest.mark.parametrize("optimizer", list(_OPTIMIZERS))
def test_copies_see_every_optimizer_step_and_only_over_the_weights_it_holds(kind, optimizer):
    if not (can_onednn() if kind == "onednn" else can_pack()):
        pytest.skip(f"this torch build has no {kind} kernels")
    torch.manual_seed(0)
    trained, frozen = nn.Linear(16, 12), nn.Linear(16, 12).requires_grad_(False)
    for layer in (trained, frozen):
        if kind == "onednn":
            onednn_linears(layer)
        else:
            pretranspose_linears(layer, min_rows=2)
            pack_linears(layer, 5)
    kept = _copies(frozen)
    step = _OPTIMIZERS[optimizer](trained.parameters())  # the frozen layer's weight is not held
    inputs = torch.randn(5, 16)
    trained(inputs).square().sum().backward()
    version = trained.weight._version
    step.step()
    assert (trained.weight._version == version) == optimizer.endswith("fused")  # fused: no version bump
    with torch.no_grad():  # 5 rows: the oneDNN, packed or (4 rows) transposed copy, if still held
        for rows in (4, 5):
            expected = nn.functional.linear(inputs[:rows], trained.weight, trained.bias)
            torch.testing.assert_close(trained(inputs[:rows]), expected, rtol=1e-6, atol=1e-6)
    assert _copies(trained) == (None, None, None)  # stale: dropped
    assert steps_over(trained.weight) == 1 and steps_over(frozen.weight) == 0
    assert all(a is b for a, b in zip(_copies(frozen), kept))  # an optimizer that never wrote it: still valid


needs_onednn = pytest.mark.skipif(not can_onednn(), reason="this torch build has no oneDNN linear kernels")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_computes_the_same_product_and_a_row_the_same_bits_alone(bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias).requires_grad_(False)  # frozen, as a target is
    inputs = torch.randn(17, 96)
    expected = nn.functional.linear(inputs, layer.weight, layer.bias)
    keys = list(layer.state_dict())
    assert onednn_linears(layer) == 96 * 200 * 4 and is_onednn(layer)
    record = layer.__dict__[_ONEDNN]  # poison the copy: a pass that reads it returns the bias alone
    layer.__dict__[_ONEDNN] = record._replace(
        tensor=torch.ops.mkldnn._reorder_linear_weight(torch.zeros(200, 96), 64)
    )
    assert torch.equal(
        layer(inputs[:3]), torch.zeros(3, 200) if layer.bias is None else layer.bias.expand(3, 200)
    )
    layer.__dict__[_ONEDNN] = record
    assert list(layer.state_dict()) == keys  # the copy is not saved
    for rows in (1, 2, 5, 13, 17):
        torch.testing.assert_close(layer(inputs[:rows]), expected[:rows])
    torch.testing.assert_close(layer(inputs.view(1, 17, 96)), expected[None])  # leading dims kept
    alone = torch.cat([layer(inputs[i : i + 1]) for i in range(17)])
    assert torch.equal(alone, layer(inputs))  # what lets verification score a node as plain decoding does
    assert layer(torch.randn(0, 96)).shape == (0, 200)


def _frozen_onednn_layer() -> tuple[nn.Linear, torch.Tensor]:
    """A frozen (16 -> 12) layer with its oneDNN copy, and 5 input rows."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 12).requires_grad_(False)
    onednn_linears(layer)
    return layer, torch.randn(5, 16)


@needs_onednn
def test_onednn_copy_is_read_only_while_it_holds_the_weight():
    layer, inputs = _frozen_onednn_layer()
    copy_before = onednn_weight(layer)
    assert onednn_linears(layer) == 16 * 12 * 4 and onednn_weight(layer) is copy_before  # idempotent
    with torch.no_grad():
        layer.weight.mul_(-1)  # edited in place: the copy is stale and must not be read
    assert onednn_weight(layer) is None and not is_onednn(layer)
    torch.testing.assert_close(layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias))
    onednn_linears(layer)  # a new copy of the edited weight
    assert onednn_weight(layer) is not None and onednn_weight(layer) is not copy_before
    torch.testing.assert_close(layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: bf16 like any Linear
        assert layer(inputs).dtype == torch.bfloat16
    wanted = inputs.clone().requires_grad_(True)  # autograd records the pass: F.linear, gradients flow
    layer(wanted).sum().backward()
    torch.testing.assert_close(wanted.grad, layer.weight.sum(0).expand(5, 16))
    layer.weight.requires_grad_(True)
    layer(inputs).sum().backward()
    assert layer.weight.grad is not None
    layer.weight.requires_grad_(False)
    layer.to(torch.float64)  # cast: the copy (fp32, opaque) stays behind, unused
    assert onednn_weight(layer) is None
    torch.testing.assert_close(
        layer(inputs.double()), nn.functional.linear(inputs.double(), layer.weight, layer.bias)
    )
    assert onednn_linears(layer) == 0  # not fp32: nothing new
    layer.to(torch.float32)
    onednn_linears(layer)
    assert drop_onednn(layer) == 1 and not is_onednn(layer) and drop_onednn(layer) == 0
    torch.testing.assert_close(layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias))


@needs_onednn
def test_onednn_copy_sees_a_weight_cast_away_and_back_and_is_freed_once_stale():
    layer, inputs = _frozen_onednn_layer()
    layer.to(torch.bfloat16).to(torch.float32)  # new storage, rounded values, the same version counter
    assert _ONEDNN in layer.__dict__
    torch.testing.assert_close(
        layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias), rtol=0, atol=1e-6
    )  # the rounded weight, not the unrounded copy (which differs by about 1e-3)
    assert _ONEDNN not in layer.__dict__  # the stale copy was dropped at that call


@needs_onednn
def test_onednn_copy_after_writes_through_data_needs_force():
    layer, inputs = _frozen_onednn_layer()
    layer.weight.data.mul_(-1)  # no version bump: documented as unseen
    onednn_linears(layer, force=True)
    torch.testing.assert_close(layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias))


@needs_onednn
def test_onednn_lets_a_trainable_bias_of_a_frozen_weight_get_its_gradient():
    layer = nn.Linear(16, 12)
    layer.weight.requires_grad_(False)
    onednn_linears(layer)
    layer(torch.randn(5, 16)).sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((12,), 5.0))


@needs_onednn
@pytest.mark.skipif(not can_int8(), reason="this torch build has no x86 quantized engine")
def test_onednn_leaves_int8_layers_alone():
    module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    int8_linears(module, skip=("1",))
    assert onednn_linears(module) == 8 * 4 * 4  # the fp32 layer only
    assert onednn_weight(module[1]) is not None and module(torch.randn(3, 8)).shape == (3, 4)


@needs_onednn
@pytest.mark.parametrize("tree", ["tree8", "dynamic"])
def test_greedy_speculative_decoding_on_onednn_models_equals_plain(any_target, tree, rank_oracle):
    tree = DynamicTree(depth=4, top_k=3, total_tokens=9) if tree == "dynamic" else tree
    plain = generate(any_target, PROMPT, max_new_tokens=48).one.sequences  # the oracle knows 8 tokens more
    target = copy.deepcopy(any_target)
    assert onednn_linears(target) > 0
    assert generate(target, PROMPT, max_new_tokens=40).one.sequences.tolist() == plain[:, :47].tolist()
    head = rank_oracle(plain[0].tolist(), 128, [1 / 3] * 3)
    out = generate(target, PROMPT, head, max_new_tokens=40, tree=tree).one
    assert out.sequences.tolist() == plain[:, : PROMPT.shape[1] + 40].tolist() and out.tau > 1.5
