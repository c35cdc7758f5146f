"""Medusa recipe on a tiny target: Medusa-1 and Medusa-2 (LoRA) train, export, resume and decode."""

from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file

from decode import generate
from heads import MedusaHeads, load_heads
from heads.target import load_target, merge_lora
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


def test_medusa1_init_from_starts_at_an_exported_head(tmp_path, overrides):
    run(overrides(tmp_path / "first", *FAST, "train.max_steps=2"))
    start = tmp_path / "first" / "head"
    # lr 1e-12: one Adam step moves each weight by ~1e-12, so the export must equal the heads it started from
    run(
        overrides(
            tmp_path / "second",
            *FAST,
            f"medusa.init_from='{start}'",
            "train.max_steps=1",
            "train.learning_rate=1e-12",
        )
    )
    first = load_file(start / "model.safetensors")
    second = load_file(tmp_path / "second" / "head" / "model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(second[key], first[key], rtol=0, atol=1e-8)
    assert any(first[k].abs().sum() > 0 for k in first if "linear.weight" in k)  # trained, not the zero init
    with pytest.raises(ValueError, match=r"does not match the medusa section: num_heads: 3 \(config\) vs 2"):
        run(
            overrides(
                tmp_path / "third",
                "train.eval_tau_prompts=0",
                "medusa.num_heads=3",
                f"medusa.init_from='{start}'",
                "train.max_steps=1",
            )
        )


def test_medusa2_trains_lora_after_heads_only_stage(tmp_path, overrides, tiny_target_dir):
    out = tmp_path / "m2"
    run(
        overrides(
            out,
            *FAST,
            "medusa.lora_r=4",
            "medusa.heads_only_steps=1",
            "train.max_steps=3",
            "train.save_every_steps=1",
            "train.keep_checkpoints=3",
        )
    )
    assert (out / "lora" / "adapter_model.safetensors").is_file()
    lora = {k: v for k, v in load_file(out / "lora" / "adapter_model.safetensors").items() if "lora_B" in k}
    assert lora and any(v.abs().sum() > 0 for v in lora.values()), "LoRA B matrices never moved"
    step1 = load_file(out / "state" / "step-1" / "model.safetensors")
    lora_b_step1 = [v for k, v in step1.items() if "lora_B" in k]
    assert lora_b_step1 and all(v.abs().sum() == 0 for v in lora_b_step1), (
        "LoRA moved in the heads-only stage"
    )
    # Decoding: the heads draft for the adapted target; output equals plain decoding of the merged target.
    base, _ = load_target(str(tiny_target_dir))
    merged = merge_lora(load_target(str(tiny_target_dir))[0], out / "lora")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert not torch.allclose(merged(ids).logits, base(ids).logits)  # the adapter changed the target
    heads = load_heads(out / "head", target=merged)
    plain = generate(merged, ids, max_new_tokens=16)
    assert torch.equal(generate(merged, ids, heads, max_new_tokens=16).sequences, plain.sequences)
    with pytest.raises(FileNotFoundError, match="not a safetensors LoRA adapter"):
        merge_lora(base, out / "head")


@pytest.mark.parametrize("bad", ["medusa.num_heads=two", "medusa.unknown=1"])
def test_bad_medusa_overrides_name_the_key(tmp_path, overrides, bad):
    with pytest.raises(ValueError, match=bad.split("=")[0].replace(".", r"\.")):
        load_config(MedusaRunConfig, TINY_YAML, overrides(tmp_path, bad))


def test_medusa2_refuses_offline_states_before_loading(tmp_path, overrides):
    with pytest.raises(ValueError, match="offline is for Medusa-1 only"):
        run(
            overrides(
                tmp_path, "medusa.lora_r=4", "data.hidden_states=offline", "data.offline_dir=/nonexistent"
            )
        )


def test_medusa1_offline_equals_online(tmp_path, overrides, tiny_target_dir, chat_file):
    """Medusa-1 reads the final states of any dump (here one written for EAGLE-3 taps) and trains the same
    heads as with the target online."""
    from train.data import build_dataset
    from train.offline import dump_hidden_states

    model, tokenizer = load_target(str(tiny_target_dir))
    dataset, _ = build_dataset([str(chat_file)], tokenizer, 64, 0.5)  # tiny_test.yaml's max_length
    dump_hidden_states(model, dataset, (0, 1, 2), tmp_path / "states", shard_size=8)
    fast = [*FAST, "data.eval_fraction=0", "train.max_steps=3"]  # the dump covers the whole file
    run(overrides(tmp_path / "online", *fast))
    run(
        overrides(
            tmp_path / "offline",
            *fast,
            "data.hidden_states=offline",
            f"data.offline_dir='{tmp_path / 'states'}'",
        )
    )
    online = load_file(tmp_path / "online" / "head" / "model.safetensors")
    offline = load_file(tmp_path / "offline" / "head" / "model.safetensors")
    assert online.keys() == offline.keys()
    for key in online:
        torch.testing.assert_close(offline[key], online[key], atol=1e-5, rtol=1e-4, msg=key)
    moved = [k for k in online if "blocks" in k and online[k].abs().sum() > 0]  # ResBlocks start at zero
    assert moved, "the heads never trained"
