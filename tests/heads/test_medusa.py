"""Tests for heads/medusa.py: K residual heads, zero-initialised ResBlocks, lm_head initialisation."""

import pytest
import torch
from torch import nn

from heads.medusa import MedusaConfig, MedusaHeads, ResBlock

H, V = 32, 128


def _heads(num_heads: int = 3, num_layers: int = 2, **kwargs) -> MedusaHeads:
    torch.manual_seed(0)
    return MedusaHeads(
        MedusaConfig(hidden_size=H, vocab_size=V, num_heads=num_heads, num_layers=num_layers, **kwargs)
    )


def _lm_head() -> nn.Linear:
    torch.manual_seed(1)
    return nn.Linear(H, V, bias=False)


def test_output_shape_and_feature_tap():
    heads = _heads(num_heads=3)
    out = heads(torch.randn(2, 5, H))
    assert out.shape == (3, 2, 5, V)  # (K, B, T, V)
    assert heads.feature_layers == (-1,)  # LAST: the target's final (post-norm) hidden state
    assert heads.head_type == "medusa"


def test_shared_lm_head_needs_the_target_projection():
    heads = _heads(share_lm_head=True)
    assert heads.lm_heads is None
    hidden = torch.randn(1, 4, H)
    with pytest.raises(ValueError, match="lm_head="):
        heads(hidden)
    lm_head = _lm_head()
    with torch.no_grad():  # heads that differ from one another (fresh blocks are all the identity)
        for block in heads.blocks:
            block[0].linear.weight.normal_(0, 0.1)
    out = heads(hidden, lm_head=lm_head)  # one K-row pass of the shared lm_head
    assert out.shape == (3, 1, 4, V)
    for k in range(3):
        torch.testing.assert_close(out[k], lm_head(heads.blocks[k](hidden)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[k], heads.head_logits(k, hidden, lm_head), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[0], out[1])
    heads.init_from_lm_head(lm_head.weight)  # a no-op without own projections, not an error


def test_resblock_weight_is_zero_initialised():
    block = ResBlock(H)
    assert torch.count_nonzero(block.linear.weight) == 0
    x = torch.randn(3, H)
    torch.testing.assert_close(block(x), x + nn.functional.silu(block.linear.bias), atol=0, rtol=0)


def test_fresh_heads_equal_lm_head_after_init():
    heads, lm_head = _heads(num_heads=2, num_layers=1), _lm_head()
    heads.init_from_lm_head(lm_head.weight)
    hidden = torch.randn(1, 6, H)
    expected = lm_head(hidden)
    for k in range(2):
        torch.testing.assert_close(heads(hidden)[k], expected, atol=1e-6, rtol=0)


def test_init_from_lm_head_copies_into_every_head():
    heads, lm_head = _heads(), _lm_head()
    heads.init_from_lm_head(lm_head.weight)
    for proj in heads.lm_heads:
        assert torch.equal(proj.weight, lm_head.weight)
        # a copy: training must not touch the target
        assert proj.weight.data_ptr() != lm_head.weight.data_ptr()
    with pytest.raises(ValueError, match=r"\(64, 32\)"):
        heads.init_from_lm_head(torch.zeros(64, H))


def test_no_parameter_is_shared():
    heads = _heads(num_heads=3, num_layers=2)
    params = list(heads.parameters())
    assert len(params) == 3 * 2 * 2 + 3  # K*L ResBlocks (weight, bias) + K projections
    assert len({p.data_ptr() for p in params}) == len(params)
    blocks = [block for head in heads.blocks for block in head]
    assert len({id(block) for block in blocks}) == 6
    # training one ResBlock must not move another: they start equal (zero weights) but are separate tensors
    with torch.no_grad():
        blocks[0].linear.weight.fill_(1.0)
    assert all(torch.count_nonzero(b.linear.weight) == 0 for b in blocks[1:])


def test_heads_differ_only_through_their_parameters():
    heads, lm_head = _heads(num_heads=2, num_layers=1), _lm_head()
    heads.init_from_lm_head(lm_head.weight)
    with torch.no_grad():
        heads.blocks[1][0].linear.bias.copy_(heads.blocks[0][0].linear.bias)
    out = heads(torch.randn(1, 3, H))
    torch.testing.assert_close(out[0], out[1], atol=0, rtol=0)
