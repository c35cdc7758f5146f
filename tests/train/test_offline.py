"""Offline hidden states: a dump + offline training equals online training; a stale dump is refused."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from heads.target import load_target
from train.config import EagleRunConfig, load_config
from train.data import build_dataset
from train.offline import OfflineStates, dump_hidden_states, estimate_bytes

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml"
FAST = ["train.eval_tau_prompts=0", "eagle.draft_vocab_size=256", "data.eval_fraction=0", "train.max_steps=3"]


def _dump(tiny_target_dir, chat_file, out, layer_ids):
    model, tokenizer = load_target(str(tiny_target_dir))
    dataset, _ = build_dataset([str(chat_file)], tokenizer, 64, 0.5)
    dump_hidden_states(model, dataset, layer_ids, out, shard_size=8)
    return model, dataset


def _assert_same_head(a: Path, b: Path) -> None:
    first, second = load_file(a / "head" / "model.safetensors"), load_file(b / "head" / "model.safetensors")
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(second[key], first[key], atol=1e-5, rtol=1e-4, msg=key)


def test_offline_training_equals_online(tmp_path, overrides, run_recipe, tiny_target_dir, chat_file, capsys):
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(tmp_path / "x", *FAST))
    model, _ = load_target(str(tiny_target_dir))
    from heads import EagleConfig
    taps = EagleConfig.from_target(model.config, "eagle3").aux_layer_ids
    _, dataset = _dump(tiny_target_dir, chat_file, tmp_path / "states", taps)
    assert "MiB to write" in capsys.readouterr().out  # the size is printed before writing
    assert len(list((tmp_path / "states").glob("shard-*.safetensors"))) == -(-len(dataset) // 8)
    run_recipe(overrides(tmp_path / "online", *FAST))
    run_recipe(overrides(tmp_path / "offline", *FAST, "data.hidden_states=offline",
                         f"data.offline_dir='{tmp_path / 'states'}'"))
    _assert_same_head(tmp_path / "online", tmp_path / "offline")
    assert cfg.data.hidden_states == "online"


def test_eagle1_trains_offline_from_an_eagle3_dump(tmp_path, overrides, run_recipe, tiny_target_dir, chat_file):
    """EAGLE-1's feature is the final state, which every dump holds: an EAGLE-3 dump serves it too."""
    model, _ = load_target(str(tiny_target_dir))
    from heads import EagleConfig

    _dump(tiny_target_dir, chat_file, tmp_path / "states", EagleConfig.from_target(model.config, "eagle3").aux_layer_ids)
    eagle1 = [*FAST[:1], *FAST[2:], "eagle.head_type=eagle1"]  # no draft vocabulary for EAGLE-1
    run_recipe(overrides(tmp_path / "online", *eagle1))
    run_recipe(overrides(tmp_path / "offline", *eagle1, "data.hidden_states=offline",
                         f"data.offline_dir='{tmp_path / 'states'}'"))
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
    """A dump written from other data (same length, other tokens; or another length) is never used in silence."""
    model, dataset = _dump(tiny_target_dir, chat_file, tmp_path / "states", (0, 1))
    states = OfflineStates(tmp_path / "states", (0, 1))
    states.check_matches(dataset)  # the data it was written from passes
    changed = dataset.map(lambda row, i: {"input_ids": [row["input_ids"][0], *row["input_ids"][1:-1], 7]
                                          if i == 3 else row["input_ids"]}, with_indices=True)  # fmt: skip
    assert changed[3]["input_ids"] != dataset[3]["input_ids"]
    with pytest.raises(ValueError, match=r"shard-00000.safetensors: example 3 holds other tokens"):
        states.check_matches(changed)
    with pytest.raises(ValueError, match=rf"holds {len(dataset)} examples but the training set has {len(dataset) - 1}"):
        states.check_matches(dataset.select(range(len(dataset) - 1)))
    with pytest.raises(ValueError, match="example 3 holds other tokens"):  # resuming into it with other data
        dump_hidden_states(model, changed, (0, 1), tmp_path / "states", shard_size=8)


def test_resume_refuses_other_taps_or_target_and_a_killed_dump_is_not_trained_on(tmp_path, tiny_target_dir,
                                                                                  chat_file, monkeypatch):
    model, dataset = _dump(tiny_target_dir, chat_file, tmp_path / "states", (0, 1))
    with pytest.raises(ValueError, match=r"other settings \(layer_ids \[0, 1\] -> \[0, 2\]\)"):
        dump_hidden_states(model, dataset, (0, 2), tmp_path / "states", shard_size=8)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)  # a fine-tune of the same architecture
    with pytest.raises(ValueError, match=r"other settings \(target_digest '\w+' -> '\w+'\)"):
        dump_hidden_states(model, dataset, (0, 1), tmp_path / "states", shard_size=8)

    calls = []

    def killed(self, *args, **kwargs):  # the target dies on the second example
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    fresh, _ = load_target(str(tiny_target_dir))
    original = type(fresh).forward
    monkeypatch.setattr(type(fresh), "forward", killed)
    with pytest.raises(KeyboardInterrupt):
        dump_hidden_states(fresh, dataset, (0, 1), tmp_path / "killed", shard_size=8)
    with pytest.raises(ValueError, match="stopped before it finished"):
        OfflineStates(tmp_path / "killed", (0, 1))
    monkeypatch.setattr(type(fresh), "forward", original)
    dump_hidden_states(fresh, dataset, (0, 1), tmp_path / "killed", shard_size=8)  # the rerun completes it
    OfflineStates(tmp_path / "killed", (0, 1)).check_matches(dataset)


def test_batches_take_the_training_sets_loss_masks_over_the_dumps(tmp_path, tiny_target_dir, chat_file):
    """A masking change (e.g. a cut reply's end-of-turn marker) needs no new dump: the set's masks are used."""
    _, dataset = _dump(tiny_target_dir, chat_file, tmp_path / "states", (0, 1))
    states = OfflineStates(tmp_path / "states", (0, 1))
    stored = states.batch([0, 1], pad_id=0, lm_head=None)
    assert stored["loss_mask"][0, : len(dataset[0]["loss_mask"])].tolist() == dataset[0]["loss_mask"]
    masks = [[0] * (len(dataset[0]["input_ids"]) - 1) + [1], [1] * len(dataset[1]["input_ids"])]
    batch = states.batch([0, 1], pad_id=0, lm_head=None, loss_masks=masks)
    assert batch["loss_mask"][0].sum() == 1 and batch["loss_mask"][1].sum() == len(masks[1])
    assert torch.equal(batch["last"], stored["last"]) and torch.equal(batch["input_ids"], stored["input_ids"])
