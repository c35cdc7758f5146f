"""Medusa recipe on a tiny target: Medusa-1 and Medusa-2 (LoRA) train, export, resume and decode."""

from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file

from decode import generate
from heads import MedusaHeads, load_heads
from heads.target import load_target
from train.config import MedusaRunConfig, load_config
from train.medusa import main

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml"
FAST = ["train.eval_tau_prompts=0", "medusa.num_heads=2"]


def run(args: list[str]) -> None:
    cfg = load_config(MedusaRunConfig, TINY_YAML, args)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        main(cfg)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_medusa1_trains_exports_and_decodes_losslessly(tmp_path, overrides, tiny_target_dir):
    out = tmp_path / "m1"
    run(overrides(out, *FAST))
    assert sorted(p.name for p in (out / "head").iterdir()) == ["config.json", "model.safetensors"]
    model, _ = load_target(str(tiny_target_dir))
    heads = load_heads(out / "head", target=model)
    assert isinstance(heads, MedusaHeads) and heads.config.num_heads == 2
    state = load_file(out / "state" / "step-2" / "model.safetensors")
    for key, value in heads.state_dict().items():
        assert torch.equal(value, state[f"heads.{key}"]), key
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    plain = generate(model, ids, max_new_tokens=16)
    assert torch.equal(generate(model, ids, heads, max_new_tokens=16).sequences, plain.sequences)


def test_medusa1_resume_equals_uninterrupted(tmp_path, overrides):
    run(overrides(tmp_path / "a", *FAST, "train.max_steps=4"))
    run(overrides(tmp_path / "b", *FAST, "train.max_steps=2"))
    run(overrides(tmp_path / "b", *FAST, "train.max_steps=4"))
    a = load_file(tmp_path / "a" / "head" / "model.safetensors")
    b = load_file(tmp_path / "b" / "head" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_medusa2_trains_lora_after_heads_only_stage(tmp_path, overrides):
    out = tmp_path / "m2"
    run(overrides(out, *FAST, "medusa.lora_r=4", "medusa.heads_only_steps=1", "train.max_steps=3",
                  "train.save_every_steps=1", "train.keep_checkpoints=3"))
    assert (out / "lora" / "adapter_model.safetensors").is_file()
    lora = {k: v for k, v in load_file(out / "lora" / "adapter_model.safetensors").items() if "lora_B" in k}
    assert lora and any(v.abs().sum() > 0 for v in lora.values()), "LoRA B matrices never moved"
    step1 = load_file(out / "state" / "step-1" / "model.safetensors")
    lora_b_step1 = [v for k, v in step1.items() if "lora_B" in k]
    assert lora_b_step1 and all(v.abs().sum() == 0 for v in lora_b_step1), "LoRA moved in the heads-only stage"


@pytest.mark.parametrize("bad", ["medusa.num_heads=two", "medusa.unknown=1"])
def test_bad_medusa_overrides_name_the_key(tmp_path, overrides, bad):
    with pytest.raises(ValueError, match=bad.split("=")[0].replace(".", r"\.")):
        load_config(MedusaRunConfig, TINY_YAML, overrides(tmp_path, bad))


def test_offline_states_are_refused_before_loading(tmp_path, overrides):
    with pytest.raises(ValueError, match="offline is implemented for train/eagle.py only"):
        run(overrides(tmp_path, "data.hidden_states=offline", "data.offline_dir=/nonexistent"))
