"""What a run loads (train/loader.py): the target at the configured revision, the data files a pattern names,
the steps of an epoch, and each epoch's batches in an order a resumed run repeats."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from datasets import Dataset

import train.loader
from decode.layout import can_onednn, is_onednn
from targets import load_target
from train.config import EagleRunConfig, MedusaRunConfig, ModelConfig, TrainConfig, load_config
from train.distributed import make_accelerator
from train.loader import epoch_loader, expand_files, steps_per_epoch, total_steps

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

    monkeypatch.setattr(train.loader, "load_target", recording_load)
    with pytest.raises(Stop):
        run_recipe(overrides(tmp_path, *SHORT, "model.revision=v1.2-pinned"), recipe)
    assert seen["revision"] == "v1.2-pinned" and seen["name"] == str(
        load_config(cls, TINY_YAML, overrides(tmp_path)).model.target
    )


def test_expand_files_sorts_each_pattern_and_names_one_that_matches_nothing(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (tmp_path / name).write_text("")
    plain = str(tmp_path / "c.txt")
    assert expand_files([str(tmp_path / "*.jsonl"), plain]) == [
        str(tmp_path / "a.jsonl"),
        str(tmp_path / "b.jsonl"),
        plain,
    ]
    with pytest.raises(FileNotFoundError, match=r"pattern '.*/\*\.json' matches no file"):
        expand_files([str(tmp_path / "*.json")])


def test_steps_drop_the_last_partial_global_batch(tmp_path):
    train = TrainConfig(output_dir=str(tmp_path), per_device_batch_size=2, gradient_accumulation_steps=3)
    rows = Dataset.from_dict({"input_ids": [[1]] * 13})
    assert steps_per_epoch(rows, train, num_processes=1) == 2  # 13 // (2 x 3)
    assert steps_per_epoch(rows, train, num_processes=2) == 1
    with pytest.raises(ValueError, match="13 training rows are fewer than one global batch of 18"):
        steps_per_epoch(rows, train, num_processes=3)
    assert total_steps(train, per_epoch=2) == 2  # num_epochs 1
    assert total_steps(TrainConfig(output_dir=str(tmp_path), max_steps=7), per_epoch=2) == 7


def test_epoch_order_is_seeded_per_epoch_and_a_resumed_epoch_skips_what_was_done(
    tmp_path, overrides, fresh_accelerate
):
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(tmp_path))
    accelerator = make_accelerator(cfg.train)
    rows = Dataset.from_dict({"input_ids": [[i] for i in range(10)], "loss_mask": [[1]] * 10})

    def order(epoch: int, skip: int = 0) -> list[int]:
        loader = epoch_loader(rows, cfg.train, cfg.data, epoch, 0, accelerator, skip_batches=skip)
        return [int(i) for batch in loader for i in batch["input_ids"][:, 0]]

    first = order(0)
    assert sorted(first) == list(range(10)) and first != list(range(10))  # shuffled, every row once
    assert order(0) == first and order(1) != first  # the same order again; another one next epoch
    assert order(0, skip=2) == first[4:]  # batches of 2: a run resumed after 2 batches sees the rest


def test_length_grouped_order_keeps_every_row_and_cuts_padding():
    import random

    from train.data import length_grouped_order

    rng = random.Random(0)
    lengths = [rng.randint(40, 384) for _ in range(1003)]
    order = length_grouped_order(lengths, batch=4, seed=0)
    assert sorted(order) == list(range(1003))  # a permutation: every row once
    assert order == length_grouped_order(lengths, 4, seed=0) and order != length_grouped_order(
        lengths, 4, seed=1
    )

    def padding(rows: list[int]) -> float:
        batches = [rows[i : i + 4] for i in range(0, len(rows) - 3, 4)]
        total = sum(4 * max(lengths[i] for i in b) for b in batches)
        return 1 - sum(lengths[i] for b in batches for i in b) / total

    assert padding(list(range(1003))) > 0.25 and padding(order) < 0.03  # random batches pad a third
    # batches never cross a megabatch (50 x 4 rows): the shuffle still decides which rows train together
    megabatch = {i: i // 200 for i in range(1003)}
    assert all(len({megabatch[i] for i in order[k : k + 4]}) == 1 for k in range(0, 1000, 4))
    assert order[-3:] == sorted(order[-3:], key=lambda i: -lengths[i])  # the short tail batch comes last


def test_group_by_length_batches_rows_of_similar_lengths_in_a_resumable_order(
    tmp_path, overrides, fresh_accelerate
):
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(tmp_path, "data.group_by_length=true"))
    accelerator = make_accelerator(cfg.train)
    lengths = [1 + (7 * i) % 23 for i in range(40)]
    rows = Dataset.from_dict(
        {"input_ids": [[i] * n for i, n in enumerate(lengths)], "loss_mask": [[1] * n for n in lengths]}
    )

    def batches(skip: int = 0) -> list[list[int]]:
        loader = epoch_loader(rows, cfg.train, cfg.data, 0, 0, accelerator, skip_batches=skip)
        return [[int(i) for i in batch["input_ids"][:, 0]] for batch in loader]

    got = batches()
    assert sorted(i for b in got for i in b) == list(range(40)) and batches() == got and batches(3) == got[3:]
    plain = load_config(EagleRunConfig, TINY_YAML, overrides(tmp_path)).data
    ungrouped = epoch_loader(rows, cfg.train, plain, 0, 0, accelerator)
    width = sum(batch["input_ids"].shape[1] for batch in ungrouped)
    assert sum(max(lengths[i] for i in b) for b in got) < width  # less padding than the plain order


@pytest.mark.parametrize("whole", [True, False])
def test_a_frozen_fp32_cpu_target_gets_onednn_weights_and_a_trained_one_does_not(tiny_target_dir, whole):
    cfg = ModelConfig(target=str(tiny_target_dir), dtype="float32")
    target, _ = train.loader.load_frozen_target(
        cfg, make_accelerator(TrainConfig(output_dir="unused")), whole
    )
    assert is_onednn(target) == (whole and can_onednn())  # Medusa-2's LoRA target (whole=False): untouched
    assert list(target.state_dict()) == list(load_target(str(tiny_target_dir))[0].state_dict())


def test_a_file_named_twice_is_refused_naming_both_patterns(tmp_path):
    """Read twice, a shard's rows counted twice and could sit on both sides of the eval split."""
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("")
    twice = str(tmp_path / "a.jsonl")
    with pytest.raises(
        ValueError, match=re.escape(f"a.jsonl is named twice: by '{tmp_path}/*.jsonl' and by")
    ):
        expand_files([str(tmp_path / "*.jsonl"), twice])
    with pytest.raises(ValueError, match="is named twice"):
        expand_files([twice, str(tmp_path / "." / "a.jsonl")])


def test_eval_files_that_are_training_files_are_refused(tmp_path):
    """The eval loss would be measured on rows the head trains on."""
    (tmp_path / "a.jsonl").write_text("")
    cfg = load_config(
        EagleRunConfig,
        None,
        [
            f"data.train_files=[{tmp_path}/*.jsonl]",
            f"data.eval_files=[{tmp_path}/a.jsonl]",
            "train.output_dir=o",
        ],
    )
    with pytest.raises(
        ValueError, match=re.escape(f"data.eval_files and data.train_files both name ['{tmp_path}")
    ):
        train.loader.load_datasets(cfg.data, None, make_accelerator(TrainConfig(output_dir="unused")))
