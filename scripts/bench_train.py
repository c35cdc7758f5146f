"""Training throughput of each recipe's step against the frozen target's forward alone (the floor).

    python scripts/bench_train.py [--model M] [--batch-size 4] [--seq-len 256] [--steps 5]

Same batches for every row; medians over steps after one warm-up. The EAGLE-3 online step should reach
at least 0.6 of the floor (the issue's goal): the target forward is work every online recipe must do.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from datasets import Dataset

from heads import FeatureCapture, MedusaConfig, MedusaHeads
from heads.target import DEFAULT_TARGET, load_target
from train.config import EagleRunConfig, MedusaRunConfig, load_config
from train.eagle import EagleStep, draft_vocab_rows, new_head, target_pass
from train.losses import medusa_loss_from_hidden

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def batches(vocab: int, batch_size: int, seq_len: int, count: int, seed: int = 0) -> list[dict]:
    """Synthetic batches (token ids drawn from the first 8k ids, all positions trained)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, min(vocab, 8192), (batch_size, seq_len), generator=g)
        out.append(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        )
    return out


def timed(fn, items) -> list[float]:
    fn(items[0])  # warm-up
    times = []
    for item in items[1:]:
        start = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    target, _ = load_target(args.model)
    vocab = target.config.get_text_config().vocab_size
    data = batches(vocab, args.batch_size, args.seq_len, args.steps + 1)
    tokens = args.batch_size * args.seq_len
    token_rows = Dataset.from_dict(
        {
            "input_ids": [row.tolist() for b in data for row in b["input_ids"]],
            "loss_mask": [row.tolist() for b in data for row in b["loss_mask"]],
        }
    )

    def floor(batch):
        with torch.no_grad():
            target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    rows = [("target forward alone (floor)", timed(floor, data))]
    eagle3 = load_config(EagleRunConfig, CONFIGS / "eagle3_smollm2.yaml").eagle  # the shipped CPU defaults
    eagle1 = load_config(EagleRunConfig, CONFIGS / "eagle1_smollm2.yaml").eagle
    for name, cfg in [
        (f"EAGLE-3 online (TTT {eagle3.ttt_steps}, Vd {eagle3.draft_vocab_size})", eagle3),
        ("EAGLE-1 online", eagle1),
    ]:
        head = new_head(cfg, target, token_rows)  # EAGLE-3's draft vocab: the batches' most frequent tokens
        step = EagleStep(head, cfg, target.get_input_embeddings(), target.get_output_embeddings())
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
        draft_rows = draft_vocab_rows(head, target)
        with FeatureCapture(target, head.feature_layers) as capture:

            def train_step(batch, step=step, optimizer=optimizer, capture=capture, rows=draft_rows):
                features, logits = target_pass(target, capture, batch, rows)
                loss, _ = step(features, batch["input_ids"], logits, batch["loss_mask"])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

            rows.append((name, timed(train_step, data)))
    text = target.config.get_text_config()
    medusa_cfg = load_config(MedusaRunConfig, CONFIGS / "medusa1_smollm2.yaml").medusa
    heads = MedusaHeads(
        MedusaConfig(
            text.hidden_size, vocab, num_heads=medusa_cfg.num_heads, share_lm_head=medusa_cfg.share_lm_head
        )
    )
    heads.init_from_lm_head(target.get_output_embeddings().weight)
    shared = target.get_output_embeddings() if medusa_cfg.share_lm_head else None
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-3)

    def medusa_step(batch):
        with torch.no_grad():
            hidden = target(input_ids=batch["input_ids"], output_hidden_states=True).hidden_states[-1]
        loss, _ = medusa_loss_from_hidden(
            heads, hidden, batch["input_ids"], batch["loss_mask"], lm_head=shared
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    lm_heads = "shared lm_head" if medusa_cfg.share_lm_head else "own lm_heads"
    rows.append((f"Medusa-1 online ({medusa_cfg.num_heads} heads, {lm_heads})", timed(medusa_step, data)))
    floor_tps = tokens / statistics.median(rows[0][1])
    print(
        f"\nbatch {args.batch_size} x {args.seq_len} tokens, {args.steps} timed steps, "
        f"{torch.get_num_threads()} "
        f"threads, medians\n"
    )
    print("| step | median s | tokens/s | fraction of floor |")
    print("|---|---|---|---|")
    for name, times in rows:
        tps = tokens / statistics.median(times)
        print(f"| {name} | {statistics.median(times):.3f} | {tps:.0f} | {tps / floor_tps:.2f} |")


if __name__ == "__main__":
    main()
