"""Recipe settings GPU users rely on: `model.revision` reaches the loads (not just the export), Medusa-1's
online pass runs the decoder only, and Medusa-2's `train.gradient_checkpointing` changes memory, not
results."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train.common
import train.medusa
from train.config import EagleRunConfig, MedusaRunConfig, load_config

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml"
SHORT = ["train.max_steps=2", "train.eval_tau_prompts=0", "data.eval_fraction=0", "train.save_every_steps=0"]


@pytest.mark.parametrize("recipe, cls", [("eagle", EagleRunConfig), ("medusa", MedusaRunConfig)])
def test_model_revision_reaches_the_target_load(recipe, cls, tmp_path, overrides, monkeypatch, run_recipe):
    seen = {}

    class Stop(Exception):
        pass

    def recording_load(name, **kwargs):
        seen.update(kwargs, name=name)
        raise Stop

    monkeypatch.setattr(train.common, "load_target", recording_load)
    with pytest.raises(Stop):
        run_recipe(overrides(tmp_path, *SHORT, "model.revision=v1.2-pinned"), recipe)
    assert seen["revision"] == "v1.2-pinned" and seen["name"] == str(
        load_config(cls, TINY_YAML, overrides(tmp_path)).model.target
    )


def test_medusa1_online_pass_never_computes_the_target_lm_head(tmp_path, overrides, monkeypatch, run_recipe):
    calls = []
    original = torch.nn.Linear.forward

    def counting(self, x):
        if self.out_features > 40_000:  # the 49k-vocabulary lm_head of the tiny target (real tokenizer)
            calls.append(tuple(x.shape))
        return original(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counting)
    run_recipe(
        overrides(tmp_path / "m1", *SHORT, "medusa.share_lm_head=false", "medusa.num_heads=2"), "medusa"
    )
    # the heads' own projections (also 49k wide) run on the masked hidden rows only: (M, H), never (B, T, H)
    assert calls and all(len(shape) == 2 for shape in calls), calls[:4]


def test_medusa2_gradient_checkpointing_trains_the_same_weights(tmp_path, overrides, run_recipe):
    lora = ["medusa.lora_r=4", "medusa.lora_dropout=0.0", "medusa.num_heads=2"]
    run_recipe(overrides(tmp_path / "plain", *SHORT, *lora), "medusa")
    run_recipe(overrides(tmp_path / "ckpt", *SHORT, *lora, "train.gradient_checkpointing=true"), "medusa")
    for name in ("head/model.safetensors", "lora/adapter_model.safetensors"):
        plain, ckpt = load_file(tmp_path / "plain" / name), load_file(tmp_path / "ckpt" / name)
        assert sorted(plain) == sorted(ckpt)
        for key in plain:  # recomputation repeats the same float ops: equal up to summation order
            torch.testing.assert_close(ckpt[key], plain[key], rtol=0, atol=1e-6)


def test_gradient_checkpointing_is_enabled_on_the_adapted_target(
    tmp_path, overrides, monkeypatch, run_recipe
):
    seen = {}
    original = train.medusa.frozen_or_lora_target

    def spy(cfg, accelerator):
        target, tokenizer = original(cfg, accelerator)
        seen["on"] = target.get_base_model().is_gradient_checkpointing
        return target, tokenizer

    monkeypatch.setattr(train.medusa, "frozen_or_lora_target", spy)
    run_recipe(
        overrides(
            tmp_path, *SHORT, "medusa.lora_r=4", "medusa.num_heads=2", "train.gradient_checkpointing=true"
        ),
        "medusa",
    )
    assert seen["on"] is True
