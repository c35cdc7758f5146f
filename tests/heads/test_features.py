"""Tests for heads/features.py: decoder-layer lookup and hidden-state capture by hooks.

Convention under test: tap id i is the OUTPUT of decoder layer i (0-based) = `hidden_states[i + 1]` of
`output_hidden_states=True`; `LAST` is the final post-norm state = `hidden_states[-1]` (the lm_head input).
"""

import pytest
import torch
from torch import nn

from heads.features import (
    LAST,
    FeatureCapture,
    default_eagle3_layers,
    find_decoder_layers,
    from_input_convention,
    to_input_convention,
)

PROMPT = torch.tensor([[3, 17, 5, 99, 42, 8, 1]])


def _hidden_states(model: nn.Module) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(PROMPT, output_hidden_states=True).hidden_states


def _capture(model: nn.Module, layer_ids) -> torch.Tensor:
    with FeatureCapture(model, layer_ids) as capture, torch.no_grad():
        model(PROMPT)
        return capture.features()


def test_find_decoder_layers(any_target):
    layers = find_decoder_layers(any_target)
    assert layers is any_target.model.layers
    assert len(layers) == 4


def test_unknown_module_raises_naming_its_class():
    class Mystery(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(ValueError, match="Mystery"):
        find_decoder_layers(Mystery())
    with pytest.raises(ValueError, match="Sequential"):
        FeatureCapture(nn.Sequential(nn.Linear(2, 2)), [0])


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_capture_equals_hidden_states(any_target, layer):
    hidden = _hidden_states(any_target)
    features = _capture(any_target, (layer, LAST))  # (1, T, 2H)
    h = any_target.config.hidden_size
    assert features.shape == (1, PROMPT.shape[1], 2 * h)
    torch.testing.assert_close(features[..., :h], hidden[layer + 1], atol=0, rtol=0)
    torch.testing.assert_close(features[..., h:], hidden[-1], atol=0, rtol=0)


def test_capture_of_last_layer_is_its_raw_output(any_target):
    """hidden_states[-1] is AFTER the final norm, so tap id L-1 is the last layer's pre-norm output."""
    features = _capture(any_target, (3, LAST))
    h = any_target.config.hidden_size
    torch.testing.assert_close(any_target.model.norm(features[..., :h]), features[..., h:], atol=1e-6, rtol=0)
    assert (features[..., :h] - features[..., h:]).abs().max() > 0.1


def test_default_taps_follow_the_documented_convention(build_target):
    """Default EAGLE-3 taps avoid the last layer, so each equals hidden_states[i + 1] exactly."""
    model = build_target("llama")
    ids = default_eagle3_layers(4)
    assert 3 not in ids
    features = _capture(model, ids)
    hidden = _hidden_states(model)
    torch.testing.assert_close(features, torch.cat([hidden[i + 1] for i in ids], dim=-1), atol=1e-5, rtol=0)


def test_capture_order_duplicates_and_cleanup(build_target):
    model = build_target("llama")
    hidden = _hidden_states(model)  # transformers installs its own (permanent) capture hooks here
    hooks_before = [len(m._forward_hooks) for m in (model.model, *model.model.layers)]
    features = _capture(model, (2, 0, 2, LAST))
    expected = torch.cat([hidden[3], hidden[1], hidden[3], hidden[-1]], dim=-1)
    torch.testing.assert_close(features, expected, atol=0, rtol=0)
    assert [len(m._forward_hooks) for m in (model.model, *model.model.layers)] == hooks_before


def test_a_paused_capture_records_nothing_and_resumes_even_after_an_error(build_target):
    model = build_target("llama")
    hidden = _hidden_states(model)
    hooks = lambda: [len(m._forward_hooks) for m in (model.model, *model.model.layers)]
    idle = hooks()
    with FeatureCapture(model, (1, LAST)) as capture, torch.no_grad():
        active = hooks()
        with pytest.raises(KeyError), capture.paused():
            assert hooks() == idle  # off: another capture (decode.generate's) may run here
            raise KeyError("a failure inside the block")
        assert hooks() == active
        model(PROMPT)
        torch.testing.assert_close(capture.features(), torch.cat([hidden[2], hidden[-1]], -1), atol=0, rtol=0)
    assert hooks() == idle


def test_capture_errors(build_target):
    model = build_target("llama")
    with pytest.raises(ValueError, match="tap layer id 4 out of range.*4 decoder layers"):
        FeatureCapture(model, (1, 4))
    with FeatureCapture(model, (1,)) as capture, pytest.raises(RuntimeError, match=r"tap ids \[1\]"):
        capture.features()


def test_layer_conventions():
    assert default_eagle3_layers(30) == (1, 14, 26)  # SpecForge / ModelOpt "output of layer i"
    assert default_eagle3_layers(32) == (1, 15, 28)
    assert to_input_convention((1, 14, 26)) == [2, 15, 27]  # EAGLE official / vLLM "input to layer i"
    assert from_input_convention(to_input_convention((1, 14, 26))) == [1, 14, 26]
    assert to_input_convention(from_input_convention([2, 15, 27])) == [2, 15, 27]
    for n in (1, 2, 3, 4, 5, 8):
        taps = default_eagle3_layers(n)
        assert len(taps) == 3 and all(0 <= i < n for i in taps), (n, taps)
