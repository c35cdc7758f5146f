"""decode/layout.py: the transposed weight copy computes the same products, is used only from `min_rows` rows on,
and speculative decoding on pretransposed models still equals plain decoding token for token."""

import copy

import pytest
import torch
from torch import nn

from decode import generate
from decode.layout import is_pretransposed, pretranspose_linears
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
