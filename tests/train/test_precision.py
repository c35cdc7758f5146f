"""Mixed precision in both recipes: trainable weights and Adam states stay float32 whatever the target's
dtype, `train.mixed_precision=bf16` computes under autocast (it runs on the CPU too), and its losses stay
close to the float32 run's on the same batches. Combinations that cannot work are refused before any model
loads (DeepSpeed's and FSDP2's precision settings: test_distributed.py)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch
import yaml
from safetensors.torch import load_file

import train.distributed
import train.loader
import train.loop
from train.checkpoint import latest_state
from train.config import ConfigError, EagleRunConfig, MedusaRunConfig, TrainConfig, load_config
from train.distributed import resolve_cpu_precision

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml"

STEPS = ["train.max_steps=4", "train.eval_tau_prompts=0", "train.save_every_steps=0", "data.eval_fraction=0"]
# Measured here over the 4 steps of these tiny runs: relative loss differences of 4e-7 to 2.5e-5 (the random
# tiny target's near-uniform distributions damp bf16's ~0.4% rounding). 1e-3 is 40x the largest and still
# fails a run whose weights or optimizer drifted (e.g. AdamW on bf16 weights).
RELATIVE_TOLERANCE = 1e-3


class RecordingLogger(train.loop.StepLogger):
    """The recipe loop's step logger, also keeping every optimizer step's loss."""

    losses: ClassVar[list[float]] = []

    def step(self, step, last, lr, grad_norm) -> None:
        RecordingLogger.losses.append((self.sums["loss"] / self.micro).item())  # the step's mean
        super().step(step, last, lr, grad_norm)


def losses_of(run_recipe, recipe: str, args: list[str], monkeypatch) -> list[float]:
    """Every optimizer step's loss of train/<recipe>.py on tiny_test.yaml with `args` (in this process)."""
    monkeypatch.setattr(train.loop, "StepLogger", RecordingLogger)
    RecordingLogger.losses = []
    run_recipe(args, recipe)
    return list(RecordingLogger.losses)


def assert_fp32_weights_and_adam(out) -> None:
    """The resume state holds what trains: the module's weights and AdamW's moments, all float32."""
    state = latest_state(out)
    weights = load_file(state / "model.safetensors")
    trainable = {
        k: v
        for k, v in weights.items()
        if (k.startswith(("head.", "heads.")) or "lora_" in k) and v.is_floating_point()
    }
    assert trainable and {v.dtype for v in trainable.values()} == {torch.float32}
    optimizer = torch.load(state / "optimizer.bin", weights_only=True)
    moments = [t for s in optimizer["state"].values() for k, t in s.items() if k.startswith("exp_avg")]
    assert moments and {t.dtype for t in moments} == {torch.float32}


def assert_close_losses(bf16: list[float], fp32: list[float]) -> None:
    assert len(bf16) == len(fp32) == 4
    relative = [abs(a - b) / abs(b) for a, b in zip(bf16, fp32)]
    print(f"bf16 vs fp32 loss, relative difference per step: {[f'{r:.2e}' for r in relative]}")
    assert max(relative) < RELATIVE_TOLERANCE, (bf16, fp32)
    assert max(relative) > 0, "bf16 losses equal the fp32 ones bit for bit: autocast did not run"


@pytest.mark.parametrize("target_dtype", ["float32", "bfloat16"])
def test_eagle3_bf16_autocast_keeps_fp32_master_weights_and_tracks_fp32_loss(
    target_dtype, tmp_path, overrides, monkeypatch, run_recipe
):
    fp32 = losses_of(
        run_recipe, "eagle", overrides(tmp_path / "fp32", *STEPS, "eagle.draft_vocab_size=256"), monkeypatch
    )
    out = tmp_path / "bf16"
    bf16 = losses_of(
        run_recipe,
        "eagle",
        overrides(
            out,
            *STEPS,
            "eagle.draft_vocab_size=256",
            "train.mixed_precision=bf16",
            "train.cpu_bf16=always",  # autocast even on a CPU without bf16 kernels (the default falls back)
            f"model.dtype={target_dtype}",
        ),
        monkeypatch,
    )
    assert_fp32_weights_and_adam(out)
    assert_close_losses(bf16, fp32)


def test_medusa2_bf16_autocast_keeps_heads_and_lora_fp32_and_tracks_fp32_loss(
    tmp_path, overrides, monkeypatch, run_recipe
):
    lora = ["medusa.lora_r=4", "medusa.lora_dropout=0.0", "medusa.num_heads=2"]
    fp32 = losses_of(run_recipe, "medusa", overrides(tmp_path / "fp32", *STEPS, *lora), monkeypatch)
    out = tmp_path / "bf16"
    bf16 = losses_of(
        run_recipe,
        "medusa",
        overrides(
            out, *STEPS, *lora, "train.mixed_precision=bf16", "train.cpu_bf16=always", "model.dtype=bfloat16"
        ),
        monkeypatch,
    )
    assert_fp32_weights_and_adam(out)
    weights = load_file(latest_state(out) / "model.safetensors")
    assert any("lora_A" in k for k in weights)
    assert {v.dtype for k, v in weights.items() if "base_layer" in k} == {
        torch.bfloat16
    }  # the target stays bf16
    assert_close_losses(bf16, fp32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for CPU-only machines")
def test_bf16_on_a_cpu_without_bf16_kernels_trains_in_fp32_and_says_so(
    tmp_path, overrides, monkeypatch, run_recipe, capsys
):
    """`train.cpu_bf16: native` (the default): where oneDNN has no bf16 kernels (an AVX2 CPU), bf16 autocast
    would run every matmul on a reference path ~100x slower, so an fp32 target's run computes in fp32, says
    so, and its config.yaml records it; a bf16 target keeps its autocast (it cannot train without it)."""
    monkeypatch.setattr(train.distributed, "native_cpu_bf16", lambda: False)
    args = [*STEPS, "eagle.draft_vocab_size=256"]
    fp32 = losses_of(run_recipe, "eagle", overrides(tmp_path / "fp32", *args), monkeypatch)
    capsys.readouterr()
    out = tmp_path / "bf16"
    fell_back = losses_of(
        run_recipe, "eagle", overrides(out, *args, "train.mixed_precision=bf16"), monkeypatch
    )
    assert fell_back == fp32  # bit for bit: no autocast ran
    assert "WARNING: train.mixed_precision=bf16 -> no: this CPU" in capsys.readouterr().out
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["mixed_precision"] == "no"
    config = TrainConfig(output_dir="x", mixed_precision="bf16")
    assert "kept (model.dtype=bfloat16)" in resolve_cpu_precision(config, "bfloat16", deepspeed=False)
    assert "kept (DeepSpeed)" in resolve_cpu_precision(config, "float32", deepspeed=True)
    assert config.mixed_precision == "bf16"
    config.cpu_bf16 = "always"
    assert "kept (train.cpu_bf16=always)" in resolve_cpu_precision(config, "float32", deepspeed=False)
    monkeypatch.setattr(train.distributed, "native_cpu_bf16", lambda: True)  # AVX512 / AMX: nothing to say
    assert (
        resolve_cpu_precision(TrainConfig(output_dir="x", mixed_precision="bf16"), "float32", False) is None
    )
    with pytest.raises(ConfigError, match=r"cpu_bf16 must be one of"):
        load_config(EagleRunConfig, TINY_YAML, overrides(tmp_path, "train.cpu_bf16=sometimes"))


@pytest.mark.parametrize("cls", [EagleRunConfig, MedusaRunConfig])
@pytest.mark.parametrize("dtype, precision", [("bfloat16", "no"), ("float16", "bf16"), ("bfloat16", "fp16")])
def test_half_precision_target_without_its_autocast_is_refused(cls, dtype, precision, tmp_path, overrides):
    with pytest.raises(ConfigError, match=rf"model.dtype={dtype} needs train.mixed_precision="):
        load_config(
            cls,
            TINY_YAML,
            overrides(tmp_path, f"model.dtype={dtype}", f"train.mixed_precision='{precision}'"),
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused only where there is no CUDA")
def test_fp16_without_cuda_is_refused_before_any_model_loads(tmp_path, overrides, monkeypatch, run_recipe):
    loaded = []
    monkeypatch.setattr(train.loader, "load_target", lambda *a, **k: loaded.append(1))
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        run_recipe(overrides(tmp_path, "train.mixed_precision=fp16"), "medusa")
    assert not loaded
