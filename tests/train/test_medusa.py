"""train/medusa.py on a tiny target: Medusa-1 and Medusa-2 (LoRA) train, export, resume and decode;
Medusa-1's online pass runs the decoder only; Medusa-2's `train.gradient_checkpointing` changes memory, not
results."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train.medusa
from decode import generate
from decode.layout import can_onednn, onednn_linears
from heads import MedusaHeads, load_heads
from targets import load_target, merge_lora
from train.config import MedusaRunConfig, load_config

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml"
FAST = ["train.eval_tau_prompts=0", "medusa.num_heads=2"]
SHORT = ["train.max_steps=2", "train.eval_tau_prompts=0", "data.eval_fraction=0", "train.save_every_steps=0"]


def test_medusa1_trains_exports_and_decodes_losslessly(tmp_path, overrides, tiny_target_dir, run_recipe):
    out = tmp_path / "m1"
    run_recipe(overrides(out, *FAST), "medusa")
    assert sorted(p.name for p in (out / "head").iterdir()) == ["config.json", "model.safetensors"]
    model, _ = load_target(str(tiny_target_dir))
    heads = load_heads(out / "head", target=model)
    assert isinstance(heads, MedusaHeads) and heads.config.num_heads == 2
    state = load_file(out / "state" / "step-2" / "model.safetensors")
    for key, value in heads.state_dict().items():
        assert torch.equal(value, state[f"heads.{key}"]), key
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    plain = generate(model, ids, max_new_tokens=16).one
    assert torch.equal(generate(model, ids, heads, max_new_tokens=16).one.sequences, plain.sequences)


def test_medusa1_resume_equals_uninterrupted(tmp_path, overrides, run_recipe):
    run_recipe(overrides(tmp_path / "a", *FAST, "train.max_steps=4"), "medusa")
    run_recipe(overrides(tmp_path / "b", *FAST, "train.max_steps=2"), "medusa")
    run_recipe(overrides(tmp_path / "b", *FAST, "train.max_steps=4"), "medusa")
    a = load_file(tmp_path / "a" / "head" / "model.safetensors")
    b = load_file(tmp_path / "b" / "head" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_medusa1_init_from_starts_at_an_exported_head(tmp_path, overrides, run_recipe):
    run_recipe(overrides(tmp_path / "first", *FAST, "train.max_steps=2"), "medusa")
    start = tmp_path / "first" / "head"
    # lr 1e-12: one Adam step moves each weight by ~1e-12, so the export must equal the heads it started from
    run_recipe(
        overrides(
            tmp_path / "second",
            *FAST,
            f"medusa.init_from='{start}'",
            "train.max_steps=1",
            "train.learning_rate=1e-12",
        ),
        "medusa",
    )
    first = load_file(start / "model.safetensors")
    second = load_file(tmp_path / "second" / "head" / "model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(second[key], first[key], rtol=0, atol=1e-8)
    assert any(first[k].abs().sum() > 0 for k in first if "linear.weight" in k)  # trained, not the zero init
    with pytest.raises(ValueError, match=r"does not match the medusa section: num_heads: 3 \(config\) vs 2"):
        run_recipe(
            overrides(
                tmp_path / "third",
                "train.eval_tau_prompts=0",
                "medusa.num_heads=3",
                f"medusa.init_from='{start}'",
                "train.max_steps=1",
            ),
            "medusa",
        )


def test_medusa2_trains_lora_after_heads_only_stage(tmp_path, overrides, tiny_target_dir, run_recipe):
    out = tmp_path / "m2"
    run_recipe(
        overrides(
            out,
            *FAST,
            "medusa.lora_r=4",
            "medusa.heads_only_steps=1",
            "train.max_steps=3",
            "train.save_every_steps=1",
            "train.keep_checkpoints=3",
        ),
        "medusa",
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
    plain = generate(merged, ids, max_new_tokens=16).one
    assert torch.equal(generate(merged, ids, heads, max_new_tokens=16).one.sequences, plain.sequences)
    if can_onednn():  # a target already holding oneDNN copies: the merge is seen, the old copies never read
        prepared = load_target(str(tiny_target_dir))[0]
        onednn_linears(prepared)
        with torch.no_grad():
            torch.testing.assert_close(merge_lora(prepared, out / "lora")(ids).logits, merged(ids).logits)
    with pytest.raises(FileNotFoundError, match="not a safetensors LoRA adapter"):
        merge_lora(base, out / "head")


@pytest.mark.parametrize("bad", ["medusa.num_heads=two", "medusa.unknown=1"])
def test_bad_medusa_overrides_name_the_key(tmp_path, overrides, bad):
    with pytest.raises(ValueError, match=bad.split("=")[0].replace(".", r"\.")):
        load_config(MedusaRunConfig, TINY_YAML, overrides(tmp_path, bad))


def test_medusa2_refuses_offline_states_before_loading(tmp_path, overrides, run_recipe):
    with pytest.raises(ValueError, match="offline is for Medusa-1 only"):
        run_recipe(
            overrides(
                tmp_path, "medusa.lora_r=4", "data.hidden_states=offline", "data.offline_dir=/nonexistent"
            ),
            "medusa",
        )


def test_medusa1_offline_equals_online(tmp_path, overrides, tiny_target_dir, chat_file, run_recipe):
    """Medusa-1 reads the final states of any dump (here one written for EAGLE-3 taps) and trains the same
    heads as with the target online."""
    from train.data import build_dataset
    from train.offline import dump_hidden_states

    model, tokenizer = load_target(str(tiny_target_dir))
    dataset, _ = build_dataset([str(chat_file)], tokenizer, 64, 0.5)  # tiny_test.yaml's max_length
    dump_hidden_states(model, dataset, (0, 1, 2), tmp_path / "states", shard_size=8)
    fast = [*FAST, "data.eval_fraction=0", "train.max_steps=3"]  # the dump covers the whole file
    run_recipe(overrides(tmp_path / "online", *fast), "medusa")
    run_recipe(
        overrides(
            tmp_path / "offline",
            *fast,
            "data.hidden_states=offline",
            f"data.offline_dir='{tmp_path / 'states'}'",
        ),
        "medusa",
    )
    online = load_file(tmp_path / "online" / "head" / "model.safetensors")
    offline = load_file(tmp_path / "offline" / "head" / "model.safetensors")
    assert online.keys() == offline.keys()
    for key in online:
        torch.testing.assert_close(offline[key], online[key], atol=1e-5, rtol=1e-4, msg=key)
    moved = [k for k in online if "blocks" in k and online[k].abs().sum() > 0]  # ResBlocks start at zero
    assert moved, "the heads never trained"


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
