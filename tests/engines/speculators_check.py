"""Runs INSIDE the speculators venv (see test_speculators_external.py), never imported by selfspec.

Loads a `speculators` export with the speculators package's own Eagle3DraftModel on CPU, runs one draft step
(ttt_steps=1) on the given inputs and writes its state dict and outputs for the test to compare with ours.
Usage: python speculators_check.py EXPORT_DIR INPUTS.safetensors OUTPUTS.safetensors
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(export_dir: str, inputs_file: str, outputs_file: str) -> None:
    config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "sdpa"  # its default, flex attention, wants a GPU
    model = Eagle3DraftModel.from_pretrained(export_dir, config=config).eval()
    inputs = load_file(inputs_file)
    captured = {}
    model.lm_head.register_forward_hook(lambda _m, args, out: captured.update(logits=out, hidden=args[0]))
    model.layers[0].register_forward_hook(lambda _m, _args, out: captured.update(layer_out=out))
    with torch.no_grad():
        draft_tokens = model(
            hidden_states=inputs["hidden_states"],
            input_ids=inputs["input_ids"],
            document_ids=torch.zeros_like(inputs["input_ids"]),
            position_ids=inputs["position_ids"],
            ttt_steps=1,
        )
    state = {
        f"state.{k}": v.contiguous() for k, v in model.state_dict().items() if not k.startswith("verifier_")
    }
    outputs = {
        "logits": captured["logits"],
        "layer_out": captured["layer_out"],
        "draft_tokens": draft_tokens[0],
        "tap_ids": torch.tensor(model.target_layer_ids),
        **state,
    }
    save_file({k: v.detach().contiguous() for k, v in outputs.items()}, outputs_file)


if __name__ == "__main__":
    main(*sys.argv[1:4])
