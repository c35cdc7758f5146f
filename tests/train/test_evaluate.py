"""Periodic evaluation (train/evaluate.py): the held-out loss over at most `max_batches` batches in eval mode,
the simulated tau of a real greedy decode, and what `evaluate` logs and when it asks for tau."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from torch import nn

from heads import EagleConfig, EagleHead
from targets import load_target
from train.config import EagleRunConfig, load_config
from train.data import build_dataset
from train.distributed import make_accelerator
from train.evaluate import eval_loss, evaluate, simulated_tau

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml"


def rows(count: int) -> Dataset:
    return Dataset.from_dict(
        {"input_ids": [[i + 1, i + 2] for i in range(count)], "loss_mask": [[1, 1]] * count}
    )


@pytest.fixture
def run(tmp_path, overrides, fresh_accelerate):
    """(accelerator, cfg) of tiny_test.yaml: 2 rows per batch."""
    cfg = load_config(EagleRunConfig, TINY_YAML, overrides(tmp_path))
    return make_accelerator(cfg.train), cfg


def test_eval_loss_is_the_mean_over_at_most_max_batches(run):
    accelerator, cfg = run
    first_ids = []

    def loss_of(batch):  # the loss of a batch: its first token id
        first_ids.append(int(batch["input_ids"][0, 0]))
        return batch["input_ids"][0, 0].float()

    assert eval_loss(accelerator, None, cfg, 0, loss_of) is None
    every = eval_loss(accelerator, rows(6), cfg, 0, loss_of)  # 3 batches
    assert every == pytest.approx(sum(first_ids) / 3)
    first_ids.clear()
    two = eval_loss(accelerator, rows(6), cfg, 0, loss_of, max_batches=2)
    assert len(first_ids) == 2 and two == pytest.approx(sum(first_ids) / 2)


def test_evaluate_logs_loss_and_tau_in_eval_mode_and_asks_tau_only_when_configured(run, capsys):
    accelerator, cfg = run
    module = nn.Linear(1, 1).train()
    modes, taus = [], []

    def loss_of(batch):
        modes.append(module.training)
        return torch.tensor(2.0)

    def tau():
        taus.append(1)
        return 3.0

    logs = evaluate(accelerator, module, rows(4), cfg, 0, step=7, loss_of=loss_of, tau=tau)
    assert logs == {"eval_loss": 2.0, "eval_tau": 3.0}
    assert "step 7: eval_loss 2.0000, eval_tau 3.0000" in capsys.readouterr().out
    assert modes == [False, False] and module.training and taus == [1]
    cfg.train.eval_tau_prompts = 0
    assert evaluate(accelerator, module, rows(4), cfg, 0, step=8, loss_of=loss_of, tau=tau) == {
        "eval_loss": 2.0
    }
    assert taus == [1]
    assert evaluate(accelerator, module, None, cfg, 0, step=9, loss_of=loss_of, tau=tau) == {}
    assert capsys.readouterr().out.count("step ") == 1  # nothing measured at step 9: nothing printed


def test_simulated_tau_decodes_the_first_prompts_and_leaves_the_head_as_it_was(tiny_target_dir, chat_file):
    target, tokenizer = load_target(str(tiny_target_dir))
    eval_set, _ = build_dataset([str(chat_file)], tokenizer, 64, 0.5)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.from_target(target.config, "eagle1")).train()
    assert simulated_tau(target, head, None, 2, 8) is None
    assert simulated_tau(target, head, eval_set, 0, 8) is None
    tau = simulated_tau(target, head, eval_set, 2, 8)
    assert 1.0 <= tau <= 8.0  # at least the target's own token per pass
    assert head.training
    prompts = min(3, len(eval_set))
    alone = simulated_tau(target, head, eval_set, prompts, 8)
    assert simulated_tau(target, head, eval_set, prompts, 8, batch_size=2) == pytest.approx(alone)  # batched
    assert head.training
    bf16 = target.to(torch.bfloat16)  # the head is decoded in the target's dtype, from a copy
    assert simulated_tau(bf16, head, eval_set, 1, 4) >= 1.0
    assert next(head.parameters()).dtype == torch.float32
