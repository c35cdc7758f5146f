"""Training throughput: each recipe's online step (target pass, head loss, backward, AdamW) timed against the
frozen target's forward alone, the floor every online recipe pays. Used by `scripts/bench_train.py`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from datasets import Dataset
from torch import nn

from decode.timing import synchronize
from heads import FeatureCapture
from train.config import EagleTrainConfig, MedusaTrainConfig
from train.eagle import EagleStep, draft_vocab_logits, new_head, target_pass
from train.losses import needs_outside_mass
from train.medusa import MedusaStep, new_heads


def synthetic_batches(
    vocab_size: int, batch_size: int, seq_len: int, count: int, seed: int = 0
) -> list[dict]:
    """`count` batches of (batch_size, seq_len) token ids from the first 8k ids, every position trained."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, min(vocab_size, 8192), (batch_size, seq_len), generator=generator)
        batches.append(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        )
    return batches


def timed(fn: Callable[[dict], object], batches: Sequence[dict], device="cpu") -> list[float]:
    """Seconds of `fn` on each batch after the first (a warm-up), the work on `device` finished (CUDA)."""
    fn(batches[0])
    times = []
    for batch in batches[1:]:
        synchronize(device)
        start = time.perf_counter()
        fn(batch)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def step_times(
    target: nn.Module,
    batches: Sequence[dict],
    eagle: Sequence[EagleTrainConfig],
    medusa: MedusaTrainConfig,
) -> list[tuple[str, list[float]]]:
    """(name, seconds per batch) of the target's forward alone (first), then of one training step of each
    EAGLE head in `eagle` and of the Medusa-1 heads of `medusa`, all on the same batches.

    EAGLE-3's draft vocabulary comes from the batches' most frequent tokens, as the recipe takes it from its
    training data.
    """

    @torch.no_grad()
    def floor(batch: dict) -> None:
        target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    rows = [("target forward alone (floor)", timed(floor, batches, target.device))]
    token_rows = Dataset.from_dict(
        {key: [row.tolist() for batch in batches for row in batch[key]] for key in ("input_ids", "loss_mask")}
    )
    for cfg in eagle:
        head = new_head(cfg, target, token_rows)
        step = EagleStep(head, cfg, target.get_input_embeddings(), target.get_output_embeddings())
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
        draft_logits = draft_vocab_logits(head, target, other=needs_outside_mass(cfg.distill_loss))
        with FeatureCapture(target, head.feature_layers) as capture:

            def eagle_step(batch, step=step, optimizer=optimizer, capture=capture, draft_logits=draft_logits):
                features, logits = target_pass(target, capture, batch, draft_logits)
                loss, _ = step(features, batch["input_ids"], logits, batch["loss_mask"])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

            if cfg.head_type == "eagle3":
                name = f"EAGLE-3 online (TTT {cfg.ttt_steps}, Vd {head.config.draft_vocab_size})"
            else:
                name = "EAGLE-1 online"
            rows.append((name, timed(eagle_step, batches, target.device)))
    heads = new_heads(medusa, target)
    step = MedusaStep(heads, target, medusa)  # Medusa-1: the decoder alone, no grad; the heads' loss
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-3)

    def medusa_step(batch: dict) -> None:
        loss, _ = step(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    lm_heads = "shared lm_head" if medusa.share_lm_head else "own lm_heads"
    rows.append(
        (
            f"Medusa-1 online ({medusa.num_heads} heads, {lm_heads})",
            timed(medusa_step, batches, target.device),
        )
    )
    return rows


def table(rows: Sequence[tuple[str, list[float]]], tokens_per_batch: int) -> str:
    """Markdown table of median seconds, tokens/s and the fraction of the first row's (the floor's)."""
    floor = tokens_per_batch / statistics.median(rows[0][1])
    lines = ["| step | median s | tokens/s | fraction of floor |", "|---|---|---|---|"]
    for name, times in rows:
        seconds = statistics.median(times)
        speed = tokens_per_batch / seconds
        lines.append(f"| {name} | {seconds:.3f} | {speed:.0f} | {speed / floor:.2f} |")
    return "\n".join(lines)
