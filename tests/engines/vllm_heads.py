"""Head transforms the vLLM tests serve (test_vllm_external.py): the same drafts through another layout."""

import copy
import dataclasses

import torch

from heads import EagleHead, FeatureCapture


def reparametrised(head: EagleHead) -> EagleHead:
    """`head` with hidden_norm x 2 and the attention's weights on its output / 2: exact in floating point
    (powers of two), so the same drafts, with a norm far from ones."""
    twice = copy.deepcopy(head)
    with torch.no_grad():
        twice.midlayer.hidden_norm.weight.mul_(2)
        hidden = twice.config.hidden_size
        attention = twice.midlayer.self_attn
        for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
            proj.weight[:, hidden:].div_(2)  # its input is [input_layernorm(embeds), hidden_norm(feature)]
    return twice


def classic(head: EagleHead, model, prompt: list[int]) -> EagleHead:
    """The shipped EAGLE-3.1 head in the classic EAGLE-3 layout (no norm over the taps before fc, the raw
    output as the next step's feature): its weights, with the input norm folded into fc at the taps' typical
    RMS (exact for a token whose taps have that RMS), so the head still drafts right often."""
    assert head.config.norm_before_fc and head.config.norm_output
    plain = EagleHead(dataclasses.replace(head.config, norm_before_fc=False, norm_output=False))
    state = {key: value for key, value in head.state_dict().items() if key != "input_norm.weight"}
    plain.load_state_dict(state, strict=True)
    with torch.no_grad(), FeatureCapture(model, head.feature_layers) as capture:
        model(torch.tensor([prompt]))
        rms = capture.features().pow(2).mean(-1).sqrt().median()
        plain.fc.weight.mul_(head.input_norm.weight[None, :] / rms)
    return plain.eval()
