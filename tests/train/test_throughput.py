"""Training throughput (train/throughput.py, scripts/bench_train.py): synthetic batches, the timing of each
recipe's step on the same batches, and the table. Times are only checked to exist, never compared."""

from __future__ import annotations

import pytest
import torch

from targets import load_target
from train.config import EagleTrainConfig, MedusaTrainConfig
from train.throughput import step_times, synthetic_batches, table, timed


def test_synthetic_batches_are_seeded_and_train_every_position():
    first = synthetic_batches(vocab_size=100, batch_size=2, seq_len=5, count=3, seed=1)
    assert len(first) == 3 and all(b["input_ids"].shape == (2, 5) for b in first)
    assert all(int(b["input_ids"].max()) < 100 and bool(b["loss_mask"].all()) for b in first)
    again = synthetic_batches(vocab_size=100, batch_size=2, seq_len=5, count=3, seed=1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again))


def test_timed_skips_the_warm_up():
    seen = []
    assert len(timed(seen.append, [{"n": 0}, {"n": 1}, {"n": 2}])) == 2 and len(seen) == 3


def test_every_recipe_step_is_timed_and_tabled(tiny_target_dir):
    target, _ = load_target(str(tiny_target_dir))
    batches = synthetic_batches(target.config.vocab_size, batch_size=2, seq_len=16, count=2)
    eagle = [EagleTrainConfig(ttt_steps=2, draft_vocab_size=256), EagleTrainConfig(head_type="eagle1")]
    rows = step_times(target, batches, eagle, MedusaTrainConfig(num_heads=2))
    names = [name for name, _ in rows]
    assert names == [
        "target forward alone (floor)",
        "EAGLE-3 online (TTT 2, Vd 256)",
        "EAGLE-1 online",
        "Medusa-1 online (2 heads, own lm_heads)",
    ]
    assert all(len(times) == 1 and times[0] > 0 for _, times in rows)
    lines = table(rows, tokens_per_batch=32).splitlines()
    assert lines[0] == "| step | median s | tokens/s | fraction of floor |" and len(lines) == 2 + len(rows)
    assert lines[2].startswith("| target forward alone (floor) |") and lines[2].endswith("| 1.00 |")


def test_table_divides_by_the_floor():
    rows = [("floor", [0.5, 1.0, 2.0]), ("step", [2.0])]  # medians 1.0 and 2.0 s
    assert table(rows, tokens_per_batch=10).splitlines()[2:] == [
        "| floor | 1.000 | 10 | 1.00 |",
        "| step | 2.000 | 5 | 0.50 |",
    ]


@pytest.mark.parametrize("share", [True, False])
def test_medusa_row_names_its_lm_heads(tiny_target_dir, share):
    target, _ = load_target(str(tiny_target_dir))
    batches = synthetic_batches(target.config.vocab_size, batch_size=1, seq_len=8, count=2)
    rows = step_times(target, batches, [], MedusaTrainConfig(num_heads=1, share_lm_head=share))
    assert rows[-1][0] == f"Medusa-1 online (1 heads, {'shared lm_head' if share else 'own lm_heads'})"
