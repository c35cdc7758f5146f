"""Offline hidden states (train/offline.py): a dump + offline training equals online training; a stale dump is
refused; a run config's dump (scripts/dump_hidden_states.py) holds the taps its head reads."""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train.offline
from targets import load_target
from train.config import EagleRunConfig, load_config
from train.data import build_dataset
from train.offline import (
    INDEX_FILE,
    OfflineStates,
    dump_for_run,
    dump_hidden_states,
    estimate_bytes,
    weights_digest,
)

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml"
FAST = ["train.eval_tau_prompts=0", "eagle.draft_vocab_size=256", "data.eval_fraction=0", "train.max_steps=3"]


def _dump(tiny_target_dir, chat_file, out, layer_ids, **kwargs):
    model, tokenizer = load_target(str(tiny_target_dir))
    dataset, _ = build_dataset([str(chat_file)], tokenizer, 64, 0.5)
    dump_hidden_states(model, dataset, layer_ids, out, shard_size=8, **kwargs)
    return model, dataset


def _assert_same_head(a: Path, b: Path) -> None:
    first, second = load_file(a / "head" / "model.safetensors"), load_file(b / "head" / "model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(second[key], first[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("distill", ["soft_ce", "forward_kl"])  # forward_kl: the outside-mass column too
def test_offline_training_equals_online(
    tmp_path, overrides, run_recipe, tiny_target_dir, chat_file, capsys, distill
):
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(tmp_path / "x", *FAST))
    model, _ = load_target(str(tiny_target_dir))
    from heads import EagleConfig

    taps = EagleConfig.from_target(model.config, "eagle3").aux_layer_ids
    _, dataset = _dump(tiny_target_dir, chat_file, tmp_path / "states", taps)
    assert "MiB to write" in capsys.readouterr().out  # the size is printed before writing
    assert len(list((tmp_path / "states").glob("shard-*.safetensors"))) == -(-len(dataset) // 8)
    run_recipe(overrides(tmp_path / "online", *FAST, f"eagle.distill_loss={distill}"))
    run_recipe(
        overrides(
            tmp_path / "offline",
            *FAST,
            f"eagle.distill_loss={distill}",
            "data.hidden_states=offline",
            f"data.offline_dir='{tmp_path / 'states'}'",
        )
    )
    _assert_same_head(tmp_path / "online", tmp_path / "offline")
    assert cfg.data.hidden_states == "online"


def test_eagle1_trains_offline_from_an_eagle3_dump(
    tmp_path, overrides, run_recipe, tiny_target_dir, chat_file
):
    """EAGLE-1's feature is the final state, which every dump holds: an EAGLE-3 dump serves it too."""
    model, _ = load_target(str(tiny_target_dir))
    from heads import EagleConfig

    taps = EagleConfig.from_target(model.config, "eagle3").aux_layer_ids
    _dump(tiny_target_dir, chat_file, tmp_path / "states", taps)
    eagle1 = [*FAST[:1], *FAST[2:], "eagle.head_type=eagle1"]  # no draft vocabulary for EAGLE-1
    run_recipe(overrides(tmp_path / "online", *eagle1))
    run_recipe(
        overrides(
            tmp_path / "offline",
            *eagle1,
            "data.hidden_states=offline",
            f"data.offline_dir='{tmp_path / 'states'}'",
        )
    )
    _assert_same_head(tmp_path / "online", tmp_path / "offline")


def test_offline_states_refuse_other_taps_and_missing_dump(tmp_path, tiny_target_dir, chat_file):
    _dump(tiny_target_dir, chat_file, tmp_path / "states", (0, 1))
    with pytest.raises(ValueError, match=r"holds taps \[0, 1\], the head needs \[0, 2\]"):
        OfflineStates(tmp_path / "states", (0, 2))
    with pytest.raises(FileNotFoundError, match="no offline hidden states"):
        OfflineStates(tmp_path / "nothing", (0, 1))


def test_size_estimate_counts_taps_and_final_state():
    from datasets import Dataset

    rows = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]]})
    assert estimate_bytes(rows, (0, 1, 2), 8, torch.float32) == 5 * ((3 + 1) * 8 * 4 + 9)
    assert estimate_bytes(rows, (-1,), 8, torch.float32) == 5 * (1 * 8 * 4 + 9)


def test_stale_dump_is_refused_for_training_and_on_resume(tmp_path, tiny_target_dir, chat_file):
    """A dump written from other data (same length, other tokens; or another length) is never used in
    silence."""
    model, dataset = _dump(tiny_target_dir, chat_file, tmp_path / "states", (0, 1))
    states = OfflineStates(tmp_path / "states", (0, 1))
    states.check_matches(dataset)  # the data it was written from passes
    changed = dataset.map(
        lambda row, i: {
            "input_ids": [row["input_ids"][0], *row["input_ids"][1:-1], 7] if i == 3 else row["input_ids"]
        },
        with_indices=True,
    )
    assert changed[3]["input_ids"] != dataset[3]["input_ids"]
    with pytest.raises(ValueError, match=r"shard-00000.safetensors: example 3 holds other tokens"):
        states.check_matches(changed)
    fewer = rf"holds {len(dataset)} examples but the training set has {len(dataset) - 1}"
    with pytest.raises(ValueError, match=fewer):
        states.check_matches(dataset.select(range(len(dataset) - 1)))
    with pytest.raises(ValueError, match="example 3 holds other tokens"):  # resuming into it with other data
        dump_hidden_states(model, changed, (0, 1), tmp_path / "states", shard_size=8)


def test_resume_refuses_other_taps_or_target_and_a_killed_dump_is_not_trained_on(
    tmp_path, tiny_target_dir, chat_file, monkeypatch
):
    model, dataset = _dump(tiny_target_dir, chat_file, tmp_path / "states", (0, 1))
    with pytest.raises(ValueError, match=r"other settings \(layer_ids \[0, 1\] -> \[0, 2\]\)"):
        dump_hidden_states(model, dataset, (0, 2), tmp_path / "states", shard_size=8)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)  # a fine-tune of the same architecture
    with pytest.raises(ValueError, match=r"other settings \(target_digest '\w+' -> '\w+'\)"):
        dump_hidden_states(model, dataset, (0, 1), tmp_path / "states", shard_size=8)
    # training reads the digest too (only a resume did): the fine-tune's run refuses the original's states
    states = OfflineStates(tmp_path / "states", (0, 1))
    with pytest.raises(ValueError, match="written from another target"):
        states.check_target(model)
    states.check_target(load_target(str(tiny_target_dir))[0])  # the original target's states: fine
    middle = load_target(str(tiny_target_dir))[0]
    with torch.no_grad():  # a change in a middle layer only: the digest read the first and last three tensors
        middle.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    assert weights_digest(middle) != weights_digest(load_target(str(tiny_target_dir))[0])
    assert weights_digest(copy.deepcopy(middle).to(torch.bfloat16)) == weights_digest(middle)  # (a bf16 copy)

    calls = []

    def killed(self, *args, **kwargs):  # the target dies in its second forward (the second shard's batch)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    fresh, _ = load_target(str(tiny_target_dir))
    decoder = type(fresh.get_decoder())  # the dump runs the decoder alone: no logits needed
    original = decoder.forward
    monkeypatch.setattr(decoder, "forward", killed)
    with pytest.raises(KeyboardInterrupt):
        dump_hidden_states(fresh, dataset, (0, 1), tmp_path / "killed", shard_size=8)
    assert [p.name for p in (tmp_path / "killed").glob("shard-*")] == ["shard-00000.safetensors"]
    with pytest.raises(ValueError, match="stopped before it finished"):
        OfflineStates(tmp_path / "killed", (0, 1))
    monkeypatch.setattr(decoder, "forward", original)
    dump_hidden_states(fresh, dataset, (0, 1), tmp_path / "killed", shard_size=8)  # the rerun completes it
    OfflineStates(tmp_path / "killed", (0, 1)).check_matches(dataset)


def test_batches_take_the_training_sets_loss_masks_over_the_dumps(tmp_path, tiny_target_dir, chat_file):
    """A masking change (e.g. a cut reply's end-of-turn marker) needs no new dump: the set's masks are
    used."""
    _, dataset = _dump(tiny_target_dir, chat_file, tmp_path / "states", (0, 1))
    states = OfflineStates(tmp_path / "states", (0, 1))
    stored = states.batch([0, 1], pad_id=0, lm_head=None)
    assert stored["loss_mask"][0, : len(dataset[0]["loss_mask"])].tolist() == dataset[0]["loss_mask"]
    masks = [[0] * (len(dataset[0]["input_ids"]) - 1) + [1], [1] * len(dataset[1]["input_ids"])]
    batch = states.batch([0, 1], pad_id=0, lm_head=None, loss_masks=masks)
    assert batch["loss_mask"][0].sum() == 1 and batch["loss_mask"][1].sum() == len(masks[1])
    assert torch.equal(batch["last"], stored["last"]) and torch.equal(batch["input_ids"], stored["input_ids"])


def test_batched_states_equal_batch_one_states(tmp_path, tiny_target_dir, chat_file):
    """Right-padded batches (3 per forward, longest first) store each example's own rows, as one at a time."""
    _, dataset = _dump(tiny_target_dir, chat_file, tmp_path / "one", (0, 1), batch_size=1)
    _dump(tiny_target_dir, chat_file, tmp_path / "three", (0, 1), batch_size=3)
    assert len({len(ids) for ids in dataset["input_ids"]}) > 1  # the batches are padded
    for shard in sorted((tmp_path / "one").glob("shard-*.safetensors")):
        single, batched = load_file(shard), load_file(tmp_path / "three" / shard.name)
        assert single.keys() == batched.keys()
        for key in single:
            assert single[key].shape == batched[key].shape, key  # unpadded rows
            if key.startswith(("ids.", "mask.")):
                assert torch.equal(single[key], batched[key]), key
            else:  # fp32 products over other batch shapes may round differently; identical here so far
                torch.testing.assert_close(batched[key], single[key], atol=1e-5, rtol=1e-5, msg=key)


def test_bf16_dump_stores_bf16_refuses_an_fp32_resume_and_trains(
    tmp_path, overrides, run_recipe, cli, tiny_target_dir, chat_file
):
    """The script loads the target and stores the states in model.dtype; training reads them as float32
    features (the head's input) under a bf16 run and a float32 run alike."""
    states = tmp_path / "states"
    bf16 = ["model.dtype=bfloat16", "train.mixed_precision=bf16"]
    args = overrides(tmp_path / "unused", *bf16, "data.eval_fraction=0", f"data.offline_dir='{states}'")
    cli.run(cli.command("scripts/dump_hidden_states.py", [*args, "--shard-size", "8"]), tmp_path / "log", 120)
    assert json.loads((states / "index.json").read_text())["dtype"] == "bfloat16"
    stored = load_file(states / "shard-00000.safetensors")
    assert {stored[f"{kind}.0"].dtype for kind in ("features", "last")} == {torch.bfloat16}

    taps = tuple(json.loads((states / "index.json").read_text())["layer_ids"])  # EAGLE-3's: the script's
    _, fp32 = _dump(tiny_target_dir, chat_file, tmp_path / "fp32", taps)
    reference = load_file(tmp_path / "fp32" / "shard-00000.safetensors")
    for key in ("features.0", "last.0"):  # the same states, rounded once per layer to bf16
        torch.testing.assert_close(stored[key].float(), reference[key], atol=0.1, rtol=0.05, msg=key)
    model, _ = load_target(str(tiny_target_dir))
    # (the same target in another dtype: one digest, `weights_digest` reads bf16-rounded values)
    with pytest.raises(ValueError, match=r"other settings \(dtype 'bfloat16' -> 'float32'\)"):
        dump_hidden_states(model, fp32, taps, states, shard_size=8)

    batch = OfflineStates(states, taps).batch([0, 1], pad_id=0, lm_head=model.lm_head)
    assert batch["features"].dtype == torch.float32 and batch["logits"].dtype == model.lm_head.weight.dtype
    offline = ["data.hidden_states=offline", f"data.offline_dir='{states}'"]
    for name, precision in (("bf16_run", bf16), ("fp32_run", [])):
        run_recipe(overrides(tmp_path / name, *FAST, *precision, *offline))
        head = load_file(tmp_path / name / "head" / "model.safetensors")
        assert all(torch.isfinite(tensor.float()).all() for tensor in head.values()), name


@pytest.mark.parametrize("head_type", ["eagle1", "eagle3"])
def test_a_run_configs_dump_holds_its_heads_taps_for_all_its_examples(
    head_type, tmp_path, overrides, tiny_target_dir, fresh_accelerate
):
    from heads import EagleConfig

    states = tmp_path / "states"
    args = overrides(tmp_path / "run", "data.eval_fraction=0", f"eagle.head_type={head_type}")
    cfg = load_config(EagleRunConfig, TINY_YAML, [*args, f"data.offline_dir='{states}'"])
    assert dump_for_run(cfg, batch_size=4, shard_size=16) == states
    index = json.loads((states / INDEX_FILE).read_text())
    model, _ = load_target(str(tiny_target_dir))
    taps = (
        [-1] if head_type == "eagle1" else list(EagleConfig.from_target(model.config, "eagle3").aux_layer_ids)
    )
    assert index["layer_ids"] == taps and index["complete"] and index["dtype"] == "float32"
    assert index["shard_size"] == 16 and len(index["shards"]) == -(-index["examples"] // 16)


def test_a_run_config_without_offline_dir_is_refused_before_loading(tmp_path, overrides, monkeypatch):
    monkeypatch.setattr(train.offline, "make_accelerator", lambda *a: pytest.fail("started before the check"))
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(tmp_path))
    with pytest.raises(ValueError, match=r"set data.offline_dir=<folder>"):
        dump_for_run(cfg)
