"""train/eagle.py end to end on a tiny target (conftest.py): the export and its round trip through
`load_heads` and `decode.generate`, starting from an exported head, and config / data errors that stop a run
early. The loop it shares with the Medusa recipe (resume, SIGKILL, NaN guard, trackers): test_loop.py."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from decode import generate
from heads import load_heads
from targets import load_target
from train.checkpoint import latest_state
from train.config import ConfigError, EagleRunConfig, load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]
TINY_YAML = ROOT / "configs" / "tiny_test.yaml"
FAST = ["train.eval_tau_prompts=0", "eagle.draft_vocab_size=256"]  # cheap steps: no generate, small lm_head


@pytest.mark.parametrize(
    "head_type, extra",
    [
        ("eagle3", ["eagle.aux_layer_ids=[0,2,3]", "eagle.draft_vocab_size=512"]),
        ("eagle3", ["eagle.aux_layer_ids=[0,2,3]", "eagle.norm_before_fc=true", "eagle.norm_output=true"]),
        ("eagle1", []),
        (
            "eagle3",
            ["eagle.aux_layer_ids=[0,2,3]", "eagle.draft_vocab_size=512", "eagle.distill_loss=lk_hybrid"],
        ),
        (
            "dflash",
            [
                "eagle.draft_vocab_size=512",
                "eagle.block_size=4",
                "eagle.draft_layers=2",
                "eagle.distill_loss=lk_nla",
            ],
        ),
        (
            "peagle",
            [
                "eagle.aux_layer_ids=[0,2,3]",
                "eagle.draft_vocab_size=512",
                "eagle.parallel_depths=3",
                "eagle.norm_before_fc=true",
                "eagle.distill_loss=lk_hybrid",
            ],
        ),
    ],
    ids=["eagle3", "eagle3.1", "eagle1", "eagle3-lk_hybrid", "dflash-lk_nla", "peagle-lk_hybrid"],
)
def test_smoke_export_round_trips_and_decodes_losslessly(
    head_type, extra, tmp_path, overrides, run_recipe, tiny_target_dir, ckpt
):
    out = tmp_path / "run"
    args = overrides(out, f"eagle.head_type={head_type}", *extra)  # tiny_test: 2 steps, eval + tau every step
    run_recipe(args)
    cfg = load_config(EagleRunConfig, TINY_YAML, args)

    export = out / "head"
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((export / "config.json").read_text())
    assert config["head_type"] == head_type
    assert config["base_model"] == str(tiny_target_dir)
    assert (config["hidden_size"], config["vocab_size"]) == (32, 49152)
    assert config["head_config"]["target_hidden_size"] == 32
    assert (config["base_model_type"], config["base_num_hidden_layers"]) == ("llama", 4)
    norms = "eagle.norm_output=true" in extra
    if head_type == "dflash":  # 2 layers, 2 taps spread over the tiny target's 4 layers, its own vocabulary
        head_config = config["head_config"]
        assert (head_config["num_hidden_layers"], head_config["block_size"]) == (2, 4)
        assert (head_config["aux_layer_ids"], head_config["draft_vocab_size"]) == ([0, 3], 512)
        assert 0 <= head_config["mask_token_id"] < 49152
    elif head_type == "peagle":  # EAGLE-3's head with 3.1's norm before fc, 3 depths per forward
        head_config = config["head_config"]
        assert (head_config["parallel_depths"], head_config["draft_vocab_size"]) == (3, 512)
        assert (head_config["norm_before_fc"], head_config["aux_layer_ids"]) == (True, [0, 2, 3])
        assert 0 <= head_config["mask_token_id"] < 49152
    else:
        assert (config["head_config"]["norm_before_fc"], config["head_config"]["norm_output"]) == (
            norms,
            norms,
        )
    if head_type == "eagle3":
        assert config["head_config"]["aux_layer_ids"] == [0, 2, 3]
        assert config["head_config"]["draft_vocab_size"] == (49152 if norms else 512)
    elif head_type == "eagle1":
        assert config["head_config"]["aux_layer_ids"] is None
    assert config["train_step"] == 2
    assert config["training"] == to_dict(cfg)
    assert load_config(EagleRunConfig, out / "config.yaml") == cfg  # the resolved config is saved

    # resume state: keep_checkpoints=1 leaves only the last one; it holds the exported weights
    assert sorted(p.name for p in (out / "state").iterdir()) == ["step-2"]
    state = latest_state(out)
    assert state == out / "state" / "step-2" and ckpt.state_step(state) == 2
    in_state = load_file(state / "model.safetensors")
    assert all(key.startswith("head.") for key in in_state)  # the frozen target is never saved with the head
    exported = ckpt.head_weights(out)
    ckpt.assert_same_weights({k.removeprefix("head."): v for k, v in in_state.items()}, exported)

    target, tokenizer = load_target(str(tiny_target_dir))
    head = load_heads(export, target=target)
    ckpt.assert_same_weights(head.state_dict(), exported)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Question 3: what is 3 plus 3?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = tokenizer(text, return_tensors="pt").input_ids
    plain = generate(target, prompt, None, max_new_tokens=12, eos_token_id=[]).one
    drafted = generate(target, prompt, head, max_new_tokens=12, eos_token_id=[]).one
    assert plain.new_tokens == 12
    assert drafted.sequences.tolist() == plain.sequences.tolist()


@pytest.mark.parametrize(
    "head_type, extra",
    [
        ("dflash", ["eagle.block_size=4", "eagle.draft_layers=1"]),
        ("peagle", ["eagle.aux_layer_ids=[0,2,3]", "eagle.parallel_depths=3"]),
    ],
)
def test_evaluating_draws_nothing_from_the_training_rng(
    head_type, extra, tmp_path, overrides, run_recipe, ckpt
):
    """DFlash's held-out loss samples block anchors, P-EAGLE's its chains (2 per row here: fewer than the
    rows' candidates, so the draw matters): evaluated after every step or never, a run trains the same
    weights (the evaluation drew from the training RNG, so the next step drew other anchors)."""
    extra = [*extra, "eagle.anchors=2", "eagle.draft_vocab_size=256", "train.eval_tau_prompts=0"]
    runs = {}
    for every in (1, 0):
        out = tmp_path / f"every-{every}"
        args = [
            f"eagle.head_type={head_type}",
            *extra,
            "train.max_steps=3",
            f"train.eval_every_steps={every}",
        ]
        run_recipe(overrides(out, *args))
        runs[every] = out
    ckpt.assert_same_weights(ckpt.head_weights(runs[1]), ckpt.head_weights(runs[0]))


def test_init_from_starts_at_an_exported_head_and_keeps_its_draft_vocab(
    tmp_path, overrides, run_recipe, ckpt
):
    first, second = tmp_path / "first", tmp_path / "second"
    run_recipe(overrides(first, *FAST, "train.max_steps=2"))
    # lr 1e-12: one Adam step moves each weight by ~1e-12, so the export must equal the head it started from;
    # draft_vocab_size=512 is overridden by the loaded head's own vocabulary (256)
    run_recipe(
        overrides(
            second,
            *FAST,
            "eagle.draft_vocab_size=512",
            f"eagle.init_from='{first / 'head'}'",
            "train.max_steps=1",
            "train.learning_rate=1e-12",
        )
    )
    config = json.loads((second / "head" / "config.json").read_text())
    assert config["head_config"]["draft_vocab_size"] == 256
    ckpt.assert_same_weights(ckpt.head_weights(second), ckpt.head_weights(first), atol=1e-8)

    with pytest.raises(ValueError, match=r"holds a eagle3 head, but eagle.head_type is eagle1"):
        run_recipe(
            overrides(
                tmp_path / "third",
                "train.eval_tau_prompts=0",
                "eagle.head_type=eagle1",
                f"eagle.init_from='{first / 'head'}'",
                "train.max_steps=1",
            )
        )


def test_redraw_vocab_draws_from_the_run_data_and_keeps_the_rows_it_had(
    tmp_path, overrides, run_recipe, ckpt, tiny_target_dir
):
    first, second = tmp_path / "first", tmp_path / "second"
    run_recipe(overrides(first, *FAST, "train.max_steps=2"))
    common = [*FAST, f"eagle.init_from='{first / 'head'}'", "train.max_steps=1", "train.learning_rate=1e-12"]
    run_recipe(overrides(second, *common, "eagle.redraw_vocab=true", "eagle.draft_vocab_size=512"))
    config = json.loads((second / "head" / "config.json").read_text())
    assert config["head_config"]["draft_vocab_size"] == 512
    old, new = ckpt.head_weights(first), ckpt.head_weights(second)
    old_ids = (old["d2t"] + torch.arange(256)).tolist()
    new_ids = (new["d2t"] + torch.arange(512)).tolist()
    assert set(old_ids) < set(new_ids)  # the same data, a larger draw: the 256 most frequent and more
    target = load_target(str(tiny_target_dir))[0].lm_head.weight.detach()
    for row, token in enumerate(new_ids):  # lr 1e-12: the rows it started from
        start = old["lm_head.weight"][old_ids.index(token)] if token in old_ids else target[token]
        torch.testing.assert_close(new["lm_head.weight"][row], start, atol=1e-8, rtol=0)
    for key in set(old) - {"lm_head.weight", "d2t", "t2d"}:
        torch.testing.assert_close(new[key], old[key], atol=1e-8, rtol=0)


def test_unknown_override_fails_before_any_model_loads(tmp_path, overrides, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr("targets.load_target", no_model)  # what train/eagle.py imports when it runs
    out = tmp_path / "run"
    monkeypatch.setattr(
        sys, "argv", ["train/eagle.py", str(TINY_YAML), *overrides(out), "train.lerning_rate=1e-3"]
    )
    with pytest.raises(ConfigError, match=r"unknown key train\.lerning_rate in override 'train\.lerning_"):
        runpy.run_path(str(ROOT / "train" / "eagle.py"), run_name="__main__")  # its `if __name__` block
    assert not out.exists()


def test_mostly_bad_training_file_fails_naming_it(tmp_path, overrides, run_recipe):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    no_reply = {"messages": [{"role": "user", "content": "Hi"}]}
    lines = [json.dumps(good)] * 10 + ["{not json"] * 15 + [json.dumps(no_reply)] * 15
    bad = tmp_path / "mostly_bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape(f"{bad}: 30 of 40 rows skipped")):
        run_recipe(overrides(out, train_file=bad))  # tiny_test tolerates max_bad_fraction=0.5
    assert not (out / "state").exists() and not (out / "head").exists()
